#include <cmath>
#include <cstring>
#include <limits>

#include "common/tensor/dtype.h"
#include "gtest/gtest.h"

namespace shardkit {
namespace {

// Reference rounding: the representable 16-bit value nearest to x (ties to the even bit pattern),
// found by comparing x against the decoded neighbours in double precision.
template <typename Decode>
std::uint16_t NearestByDecode(float x, Decode decode, std::uint16_t lo_bits, std::uint16_t hi_bits) {
  const double dx = x;
  const double lo = decode(lo_bits), hi = decode(hi_bits);
  const double dlo = std::abs(dx - lo), dhi = std::abs(hi - dx);
  if (dlo < dhi) return lo_bits;
  if (dhi < dlo) return hi_bits;
  return (lo_bits & 1) == 0 ? lo_bits : hi_bits;
}

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::f32), 4u);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::f16), 2u);
  EXPECT_EQ(dtype_size(DType::i64), 8u);
  EXPECT_EQ(dtype_name(DType::bf16), "bf16");
}

TEST(DTypeTest, Bf16RoundTripsEveryFiniteValue) {
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const bf16_t v{static_cast<std::uint16_t>(b)};
    const float f = bf16_to_f32(v);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(f))));
      continue;
    }
    EXPECT_EQ(f32_to_bf16(f).bits, b);
  }
}

TEST(DTypeTest, F16RoundTripsEveryValue) {
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const f16_t v{static_cast<std::uint16_t>(b)};
    const float f = f16_to_f32(v);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    EXPECT_EQ(f32_to_f16(f).bits, b) << "bits " << b << " value " << f;
  }
}

TEST(DTypeTest, F16DecodesKnownValues) {
  EXPECT_EQ(f16_to_f32(f16_t{0x3c00}), 1.0f);
  EXPECT_EQ(f16_to_f32(f16_t{0xc000}), -2.0f);
  EXPECT_EQ(f16_to_f32(f16_t{0x7bff}), 65504.0f);
  EXPECT_EQ(f16_to_f32(f16_t{0x0001}), std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::isinf(f16_to_f32(f16_t{0x7c00})));
}

// Midpoints and near-midpoints between every pair of adjacent positive values: round to nearest even.
TEST(DTypeTest, F16RoundsToNearestEven) {
  auto decode = [](std::uint16_t b) { return static_cast<double>(f16_to_f32(f16_t{b})); };
  for (std::uint32_t b = 0; b < 0x7bff; ++b) {
    const double lo = decode(static_cast<std::uint16_t>(b)), hi = decode(static_cast<std::uint16_t>(b + 1));
    for (double t : {0.5, 0.25, 0.75, 0.4999, 0.5001}) {
      const float x = static_cast<float>(lo + (hi - lo) * t);
      const std::uint16_t want = NearestByDecode(x, decode, static_cast<std::uint16_t>(b), static_cast<std::uint16_t>(b + 1));
      ASSERT_EQ(f32_to_f16(x).bits, want) << "x=" << x << " between bits " << b << " and " << b + 1;
      ASSERT_EQ(f32_to_f16(-x).bits, want | 0x8000) << "x=" << -x;
    }
  }
}

TEST(DTypeTest, Bf16RoundsToNearestEven) {
  auto decode = [](std::uint16_t b) { return static_cast<double>(bf16_to_f32(bf16_t{b})); };
  for (std::uint32_t b = 0; b < 0x7f7f; b += 7) {
    const double lo = decode(static_cast<std::uint16_t>(b)), hi = decode(static_cast<std::uint16_t>(b + 1));
    for (double t : {0.5, 0.25, 0.75}) {
      const float x = static_cast<float>(lo + (hi - lo) * t);
      const std::uint16_t want = NearestByDecode(x, decode, static_cast<std::uint16_t>(b), static_cast<std::uint16_t>(b + 1));
      ASSERT_EQ(f32_to_bf16(x).bits, want) << "x=" << x;
    }
  }
}

TEST(DTypeTest, OverflowAndSpecials) {
  EXPECT_EQ(f32_to_f16(65520.0f).bits, 0x7c00);  // rounds up to inf
  EXPECT_EQ(f32_to_f16(65519.0f).bits, 0x7bff);  // rounds down to max
  EXPECT_EQ(f32_to_f16(1e10f).bits, 0x7c00);
  EXPECT_EQ(f32_to_f16(-1e10f).bits, 0xfc00);
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()).bits, 0x7f80);  // rounds to inf
  EXPECT_EQ(f32_to_f16(1e-9f).bits, 0);                                     // underflow to zero
  EXPECT_EQ(f32_to_f16(-0.0f).bits, 0x8000);
}

}  // namespace
}  // namespace shardkit
