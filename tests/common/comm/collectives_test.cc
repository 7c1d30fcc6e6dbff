// Every collective x op x dtype against a scalar reference, in process, at n = 1, 2, 3, 4, 8 and sizes
// 0, 1, 7, 1,000,003, with a tiny reduction chunk so the multi-chunk paths run.
//
// The in-process backend reduces in rank order and rounds bf16/f16 once, so the reference (same order,
// same f32 arithmetic) must match bit for bit.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/comm/process_group.h"
#include "common/comm/testing/run_ranks.h"
#include "gtest/gtest.h"

namespace shardkit::comm {
namespace {

std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Input element i of `rank` in case `c`, rounded to dtype, as a float (or an integer for i64).
float value_f(int c, int rank, std::int64_t i, DType dt) {
  const std::uint64_t h = mix((static_cast<std::uint64_t>(c) << 48) ^ (static_cast<std::uint64_t>(rank) << 40) ^
                              static_cast<std::uint64_t>(i));
  const float v = static_cast<float>(h >> 40) * (1.0f / 8388608.0f) - 1.0f;  // [-1, 1), full mantissa
  switch (dt) {
    case DType::bf16: return bf16_to_f32(f32_to_bf16(v));
    case DType::f16: return f16_to_f32(f32_to_f16(v));
    default: return v;
  }
}
std::int64_t value_i(int c, int rank, std::int64_t i) {
  const std::uint64_t h = mix((static_cast<std::uint64_t>(c) << 48) ^ (static_cast<std::uint64_t>(rank) << 40) ^
                              static_cast<std::uint64_t>(i));
  return static_cast<std::int64_t>(h % 2000001) - 1000000;
}

Tensor make_input(int c, int rank, std::int64_t numel, DType dt) {
  if (dt == DType::i64) {
    std::vector<std::int64_t> v(static_cast<std::size_t>(numel));
    for (std::int64_t i = 0; i < numel; ++i) v[i] = value_i(c, rank, i);
    return Tensor::from_int64(v, {numel}, TensorOptions{}.with_dtype(dt));
  }
  std::vector<float> v(static_cast<std::size_t>(numel));
  for (std::int64_t i = 0; i < numel; ++i) v[i] = value_f(c, rank, i, dt);
  return Tensor::from_vector(v, {numel}, TensorOptions{}.with_dtype(dt));
}

float round_to(float v, DType dt) {
  switch (dt) {
    case DType::bf16: return bf16_to_f32(f32_to_bf16(v));
    case DType::f16: return f16_to_f32(f32_to_f16(v));
    default: return v;
  }
}

// Reference reduction of element i (of the case's inputs) over n ranks: ranks in order, f32 accumulation.
double reference(const ReduceOp& op, int c, int n, std::int64_t i, DType dt) {
  if (dt == DType::i64) {
    std::uint64_t acc = 0;
    std::int64_t mn = 0, mx = 0;
    const auto f = static_cast<std::uint64_t>(static_cast<std::int64_t>(op.factor));
    for (int r = 0; r < n; ++r) {
      const std::int64_t x = value_i(c, r, i);
      acc += op.kind == ReduceKind::premul_sum ? f * static_cast<std::uint64_t>(x) : static_cast<std::uint64_t>(x);
      mn = r == 0 ? x : std::min(mn, x);
      mx = r == 0 ? x : std::max(mx, x);
    }
    switch (op.kind) {
      case ReduceKind::min: return static_cast<double>(mn);
      case ReduceKind::max: return static_cast<double>(mx);
      case ReduceKind::avg: return static_cast<double>(static_cast<std::int64_t>(acc) / n);
      default: return static_cast<double>(static_cast<std::int64_t>(acc));
    }
  }
  const float f = static_cast<float>(op.factor);
  float acc = 0.f;
  for (int r = 0; r < n; ++r) {
    const float x = value_f(c, r, i, dt);
    switch (op.kind) {
      case ReduceKind::sum:
      case ReduceKind::avg: acc = r == 0 ? x : acc + x; break;
      case ReduceKind::premul_sum: acc = r == 0 ? f * x : acc + f * x; break;
      case ReduceKind::min: acc = r == 0 ? x : (x < acc ? x : acc); break;
      case ReduceKind::max: acc = r == 0 ? x : (x > acc ? x : acc); break;
    }
  }
  if (op.kind == ReduceKind::avg) acc = acc / static_cast<float>(n);
  return round_to(acc, dt);
}

double got_at(const Tensor& t, std::int64_t i) {
  switch (t.dtype()) {
    case DType::f32: return t.data<float>()[i];
    case DType::bf16: return bf16_to_f32(t.data<bf16_t>()[i]);
    case DType::f16: return f16_to_f32(t.data<f16_t>()[i]);
    case DType::i64: return static_cast<double>(t.data<std::int64_t>()[i]);
  }
  return 0;
}

// Checks t[i] == expect(i) for i in [0, numel) with the given stride; reports the first mismatch.
template <typename F>
void expect_all(const Tensor& t, std::int64_t numel, std::int64_t stride, F expect, const std::string& what) {
  std::int64_t bad = 0, first = -1;
  double want0 = 0, got0 = 0;
  for (std::int64_t i = 0; i < numel; i += stride) {
    const double want = expect(i), got = got_at(t, i);
    if (want != got) {
      if (bad++ == 0) {
        first = i;
        want0 = want;
        got0 = got;
      }
    }
  }
  EXPECT_EQ(bad, 0) << what << ": first mismatch at " << first << ": expected " << want0 << ", found " << got0;
}

struct Param {
  int n;
  DType dtype;
  std::int64_t size;
};

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return absl::StrCat("n", info.param.n, "_", std::string(dtype_name(info.param.dtype)), "_size", info.param.size);
}

class CollectivesTest : public ::testing::TestWithParam<Param> {};

TEST_P(CollectivesTest, MatchesScalarReference) {
  const auto [n, dt, size] = GetParam();
  const bool big = size > 1000;
  RunRanksOptions options;
  options.timeout = absl::Seconds(120);
  options.chunk_bytes = big ? 1000 : 12;  // 250 / 3 f32 elements per reduction step
  const std::vector<ReduceOp> ops = {ReduceOp::sum(), ReduceOp::avg(), ReduceOp::min(), ReduceOp::max(),
                                     ReduceOp::premul_sum(dt == DType::i64 ? 3.0 : 0.37)};
  // Per-rank shard for all_gather / reduce_scatter: `size` itself, except the big size is split (so the
  // total stays ~1M elements and odd).
  const std::int64_t shard = big ? (size + n - 1) / n : size;

  absl::Status st = RunRanks(
      n,
      [&](RankEnv& env) -> absl::Status {
        ProcessGroup& pg = env.group;
        const int r = env.rank;
        int c = 0;
        // Big tensors: in each case one rank (c % n) checks every element, the others every 13th (the
        // reference costs n hashes per element; this keeps the test a few seconds).
        auto stride_for = [&](int cc) -> std::int64_t { return !big || cc % n == r ? 1 : 13; };
        for (const ReduceOp& op : ops) {
          const std::string opname = op.to_string();
          {  // all_reduce
            ++c;
            Tensor t = make_input(c, r, size, dt);
            if (absl::Status s = pg.all_reduce(t, {.op = op})->wait(); !s.ok()) return s;
            expect_all(t, size, stride_for(c), [&](std::int64_t i) { return reference(op, c, n, i, dt); },
                       absl::StrCat("all_reduce ", opname, " rank ", r));
          }
          {  // reduce to a root other than 0 when possible
            ++c;
            const int root = n - 1;
            Tensor t = make_input(c, r, size, dt);
            if (absl::Status s = pg.reduce(t, {.root = root, .op = op})->wait(); !s.ok()) return s;
            if (r == root) {
              expect_all(t, size, stride_for(c + 1) == 1 ? 1 : 3, [&](std::int64_t i) { return reference(op, c, n, i, dt); },
                         absl::StrCat("reduce ", opname, " root ", root));
            }
          }
          for (bool in_place : {false, true}) {  // reduce_scatter
            ++c;
            Tensor in = make_input(c, r, shard * n, dt);
            Tensor out = in_place ? in.view(r * shard, {shard}) : Tensor::empty({shard}, TensorOptions{}.with_dtype(dt));
            if (absl::Status s = pg.reduce_scatter(out, in, {.op = op})->wait(); !s.ok()) return s;
            expect_all(out, shard, stride_for(c), [&](std::int64_t i) { return reference(op, c, n, r * shard + i, dt); },
                       absl::StrCat("reduce_scatter ", opname, in_place ? " in place" : "", " rank ", r));
          }
        }
        for (bool in_place : {false, true}) {  // all_gather
          ++c;
          Tensor out = Tensor::empty({shard * n}, TensorOptions{}.with_dtype(dt));
          Tensor in = make_input(c, r, shard, dt);
          if (in_place) {
            out.view(r * shard, {shard}).copy_(in);
            in = out.view(r * shard, {shard});
          }
          if (absl::Status s = pg.all_gather(out, in)->wait(); !s.ok()) return s;
          expect_all(
              out, shard * n, stride_for(c),
              [&](std::int64_t i) {
                const int src = static_cast<int>(i / std::max<std::int64_t>(shard, 1));
                return dt == DType::i64 ? static_cast<double>(value_i(c, src, i % shard))
                                        : static_cast<double>(value_f(c, src, i % shard, dt));
              },
              absl::StrCat("all_gather", in_place ? " in place" : "", " rank ", r));
        }
        {  // broadcast from the middle rank
          ++c;
          const int root = n / 2;
          Tensor t = make_input(c, r, size, dt);
          if (absl::Status s = pg.broadcast(t, {.root = root})->wait(); !s.ok()) return s;
          expect_all(
              t, size, stride_for(c),
              [&](std::int64_t i) {
                return dt == DType::i64 ? static_cast<double>(value_i(c, root, i))
                                        : static_cast<double>(value_f(c, root, i, dt));
              },
              absl::StrCat("broadcast rank ", r));
        }
        return pg.barrier()->wait();
      },
      options);
  EXPECT_TRUE(st.ok()) << st;
}

std::vector<Param> all_params() {
  std::vector<Param> out;
  for (int n : {1, 2, 3, 4, 8}) {
    for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::i64}) {
      for (std::int64_t size : {0, 1, 7, 1000003}) out.push_back({n, dt, size});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(InProcess, CollectivesTest, ::testing::ValuesIn(all_params()), param_name);

}  // namespace
}  // namespace shardkit::comm
