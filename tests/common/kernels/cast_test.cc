#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "common/kernels/elementwise.h"
#include "common/tensor/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/kernels/test_util.h"

namespace shardkit::kernels {
namespace {

using testing::TestSizes;

// Independent reference for rounding to a binary format with `mbits` explicit mantissa bits, minimum
// normal exponent `emin` and largest finite value `max_finite`, written in double arithmetic (no bit
// tricks): the value's quantum is 2^(max(ilogb(v), emin) - mbits); nearbyint rounds to nearest, ties to
// even (the default rounding mode); beyond the largest finite value (after rounding) gives infinity.
double RoundTo(double v, int mbits, int emin, double max_finite) {
  if (std::isnan(v) || std::isinf(v) || v == 0) return v;
  const int e = std::max(std::ilogb(v), emin);
  const double quantum = std::ldexp(1.0, e - mbits);
  const double r = std::nearbyint(v / quantum) * quantum;
  if (std::abs(r) > max_finite) return std::copysign(std::numeric_limits<double>::infinity(), v);
  return r;
}

double Reference(double v, DType to) {
  switch (to) {
    case DType::f32: return static_cast<float>(v);  // a single rounding of a double: correct
    case DType::bf16: return RoundTo(v, 7, -126, 0x1.fep127);
    case DType::f16: return RoundTo(v, 10, -14, 65504.0);
    case DType::i64: return std::trunc(v);
  }
  return 0;
}

// Values over a wide range of magnitudes (f16 subnormals up to f16 overflow) plus special values; for an
// i64 source, integers below 2^24 (exact in f32, so the reference needs one rounding only).
std::vector<float> CastInputs(std::int64_t n, std::uint64_t seed, DType src) {
  std::vector<float> v = testing::RandomFloats(n, seed, -1.f, 1.f);
  std::vector<float> e = testing::RandomFloats(n, seed + 1000, -28.f, 18.f);
  for (std::size_t i = 0; i < v.size(); ++i) {
    v[i] = src == DType::i64 ? std::round(v[i] * 1.6e7f) : std::ldexp(v[i], static_cast<int>(e[i]));
  }
  const float specials[] = {0.f, -0.f, 65504.f, 65519.f, 65520.f, -1e30f, 1.f + 0x1p-8f, 1.f + 0x1p-11f, 3.f * 0x1p-25f,
                            std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  if (src != DType::i64) {
    for (std::size_t i = 0; i < v.size() && i < std::size(specials); ++i) v[i] = specials[i];
  }
  return v;
}

class CastTest : public ::testing::TestWithParam<std::tuple<DType, DType>> {};

TEST_P(CastTest, MatchesDoubleReferenceAtEverySize) {
  const auto [from, to] = GetParam();
  std::uint64_t seed = 7;
  for (std::int64_t n : TestSizes()) {
    SCOPED_TRACE(::testing::Message() << dtype_name(from) << " -> " << dtype_name(to) << " n=" << n);
    std::vector<float> v = CastInputs(n, seed++, from);
    Tensor src;
    if (from == DType::i64) {
      std::vector<std::int64_t> iv(v.begin(), v.end());
      src = Tensor::from_int64(iv, {n});
    } else {
      src = Tensor::from_vector(v, {n}, TensorOptions{}.with_dtype(from));
    }
    if (to == DType::i64 && from != DType::i64) {
      // float -> i64 is only defined for finite values in range: clamp the source to +-60000 (finite in
      // every source dtype) and drop NaN.
      std::vector<float> s = src.to_vector();
      for (float& x : s) x = std::isnan(x) ? 0.f : std::clamp(x, -6e4f, 6e4f);
      src = Tensor::from_vector(s, {n}, TensorOptions{}.with_dtype(from));
    }
    Tensor dst = Tensor::empty({n}, TensorOptions{}.with_dtype(to));
    cast(src, dst);
    // Bulk reads (item_at per element is slow at 2^20 elements): every source value is exact in fp32
    // (i64 sources are below 2^24), every destination value is exact in double.
    const std::vector<float> in_values = src.to_vector();
    std::vector<double> out_values(static_cast<std::size_t>(n));
    if (to == DType::i64) {
      for (std::int64_t i = 0; i < n; ++i) out_values[i] = static_cast<double>(dst.data<std::int64_t>()[i]);
    } else {
      const std::vector<float> f = dst.to_vector();
      out_values.assign(f.begin(), f.end());
    }
    for (std::int64_t i = 0; i < n; ++i) {
      const double in = in_values[static_cast<std::size_t>(i)];
      const double got = out_values[static_cast<std::size_t>(i)];
      const double want = Reference(in, to);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(got)) << "element " << i << " = " << in;
      } else {
        ASSERT_EQ(got, want) << "element " << i << " = " << in;
        if (to != DType::i64) {  // integers have no -0
          ASSERT_EQ(std::signbit(got), std::signbit(want)) << "element " << i << " = " << in;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllPairs, CastTest,
                         ::testing::Combine(::testing::Values(DType::f32, DType::bf16, DType::f16, DType::i64),
                                            ::testing::Values(DType::f32, DType::bf16, DType::f16, DType::i64)),
                         [](const auto& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) + "_to_" +
                                  std::string(dtype_name(std::get<1>(info.param)));
                         });

TEST(CastBitsTest, EveryF16PatternWidensLikeTheScalarConversion) {
  // convert_elements widens f16 with branch-free code so the loop vectorises: it must agree with
  // f16_to_f32 bit for bit on all 65536 patterns (NaN payloads included), and so must f16 -> bf16.
  Tensor h = Tensor::empty({65536}, TensorOptions{}.with_dtype(DType::f16));
  for (std::uint32_t i = 0; i < 65536; ++i) h.data<f16_t>()[i] = f16_t{static_cast<std::uint16_t>(i)};
  Tensor f = Tensor::empty({65536});
  Tensor b = Tensor::empty({65536}, TensorOptions{}.with_dtype(DType::bf16));
  cast(h, f);
  cast(h, b);
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const float want = f16_to_f32(f16_t{static_cast<std::uint16_t>(i)});
    ASSERT_EQ(std::bit_cast<std::uint32_t>(f.data<float>()[i]), std::bit_cast<std::uint32_t>(want)) << std::hex << i;
    ASSERT_EQ(b.data<bf16_t>()[i].bits, f32_to_bf16(want).bits) << std::hex << i;
  }
}

TEST(CastErrorsTest, SizeMismatchThrows) {
  try {
    cast(Tensor::zeros({3}), Tensor::zeros({4}, TensorOptions{}.with_dtype(DType::bf16)));
    FAIL() << "expected InternalError";
  } catch (const InternalError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("cast: sizes differ: f32[3] cpu to bf16[4] cpu"));
  }
}

}  // namespace
}  // namespace shardkit::kernels
