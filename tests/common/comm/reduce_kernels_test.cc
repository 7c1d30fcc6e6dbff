// reduce_into (reduce_kernels.h) against a plain scalar reference written here: sources combined one after the
// other in the order given, every destination written. f32 takes the block fast path (Note [f32 reduction fast
// path]) for the whole blocks and the scratch path for the tail, so the lengths straddle the block size and the
// comparison is bitwise (NaN, signed zeros and infinities included: min / max keep the earlier source's value
// unless the later one compares less / greater). Also in place (a destination is one of the sources) and with
// several destinations.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/comm/reduce_kernels.h"
#include "gtest/gtest.h"

namespace shardkit::comm {
namespace {

// The reference: dst = s0 (op) s1 (op) ... in that order; avg divides the sum by the number of sources,
// premul_sum multiplies every source by the factor before adding it.
std::vector<float> reference(const ReduceOp& op, const std::vector<std::vector<float>>& srcs) {
  const float f = static_cast<float>(op.factor);
  std::vector<float> out(srcs[0].size());
  for (std::size_t i = 0; i < out.size(); ++i) {
    float a = op.kind == ReduceKind::premul_sum ? f * srcs[0][i] : srcs[0][i];
    for (std::size_t s = 1; s < srcs.size(); ++s) {
      const float x = srcs[s][i];
      switch (op.kind) {
        case ReduceKind::sum:
        case ReduceKind::avg: a = a + x; break;
        case ReduceKind::premul_sum: a = a + f * x; break;
        case ReduceKind::min: a = x < a ? x : a; break;
        case ReduceKind::max: a = x > a ? x : a; break;
      }
    }
    if (op.kind == ReduceKind::avg) a = a / static_cast<float>(srcs.size());
    out[i] = a;
  }
  return out;
}

std::vector<float> random_floats(std::int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> mantissa(-10.f, 10.f);
  std::uniform_int_distribution<int> exponent(-8, 8), special(0, 60);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) {
    x = std::ldexp(mantissa(rng), exponent(rng));
    switch (special(rng)) {
      case 0: x = std::numeric_limits<float>::quiet_NaN(); break;
      case 1: x = 0.f; break;
      case 2: x = -0.f; break;
      case 3: x = std::numeric_limits<float>::infinity(); break;
      case 4: x = -std::numeric_limits<float>::infinity(); break;
      default: break;
    }
  }
  return v;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(ReduceKernels, F32EqualsTheScalarReferenceBitwise) {
  std::mt19937 rng(7);
  const std::vector<ReduceOp> ops = {ReduceOp::sum(), ReduceOp::avg(), ReduceOp::min(), ReduceOp::max(),
                                     ReduceOp::premul_sum(0.37)};
  for (const ReduceOp& op : ops) {
    for (std::size_t ns = 1; ns <= 5; ++ns) {
      for (std::int64_t count : {1, 15, 16, 17, 31, 32, 33, 100, 1000, 4099}) {
        for (const bool in_place : {false, true}) {
          const std::string where = absl::StrCat(std::string(reduce_kind_name(op.kind)), " of ", ns, " sources, ", count,
                                                 " elements", in_place ? ", in place" : "");
          std::vector<std::vector<float>> srcs;
          for (std::size_t s = 0; s < ns; ++s) srcs.push_back(random_floats(count, rng));
          const std::vector<float> want = reference(op, srcs);
          // Two destinations: a separate buffer, and either a second one or (in place) the last source.
          std::vector<float> d0(static_cast<std::size_t>(count), 1.f), d1(static_cast<std::size_t>(count), 2.f);
          std::vector<const void*> sp;
          for (const auto& s : srcs) sp.push_back(s.data());
          std::vector<void*> dp = {d0.data(), in_place ? static_cast<void*>(srcs.back().data()) : d1.data()};
          ReduceScratch scratch(64);  // 16-element chunks: the tail path runs in several chunks too
          reduce_into(DType::f32, op, sp, dp, count, scratch);
          EXPECT_TRUE(bitwise_equal(d0, want)) << where;
          EXPECT_TRUE(bitwise_equal(in_place ? srcs.back() : d1, want)) << where << " (second destination)";
        }
      }
    }
  }
}

TEST(ReduceKernels, F32InPlaceIntoEverySourceAtOnce) {
  // all_reduce between threads: every rank's buffer is both a source and a destination.
  std::mt19937 rng(11);
  for (std::int64_t count : {16, 40, 1027}) {
    std::vector<std::vector<float>> bufs;
    for (int s = 0; s < 3; ++s) bufs.push_back(random_floats(count, rng));
    const std::vector<float> want = reference(ReduceOp::sum(), bufs);
    std::vector<const void*> sp;
    std::vector<void*> dp;
    for (auto& b : bufs) {
      sp.push_back(b.data());
      dp.push_back(b.data());
    }
    ReduceScratch scratch(1 << 10);
    reduce_into(DType::f32, ReduceOp::sum(), sp, dp, count, scratch);
    for (int s = 0; s < 3; ++s) EXPECT_TRUE(bitwise_equal(bufs[static_cast<std::size_t>(s)], want)) << count << " " << s;
  }
}

}  // namespace
}  // namespace shardkit::comm
