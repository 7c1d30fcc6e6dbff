#include "common/kernels/reduce.h"

#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "common/kernels/widen.h"
#include "common/tensor/tensor.h"
#include "gtest/gtest.h"
#include "tests/common/kernels/test_util.h"

namespace shardkit::kernels {
namespace {

using testing::RandomFloats;
using testing::TestSizes;

struct Reference {
  double sum = 0, sum_abs = 0, sum_squares = 0, max_abs = 0;
};

// Double-precision reference over the values as stored (after rounding to the tensor's dtype).
Reference ReferenceOf(const Tensor& t) {
  Reference r;
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const double v = t.item_at(i);
    r.sum += v;
    r.sum_abs += std::abs(v);
    r.sum_squares += v * v;
    r.max_abs = std::max(r.max_abs, std::abs(v));
  }
  return r;
}

// Tolerance (Note [reduction accuracy] in reduce.h): each fp32 lane adds at most kReduceBlock / 16 = 64
// terms, so its rounding error is at most 64 * 2^-24 * (sum of the |terms| it added); squaring adds one
// more rounding per term. Lanes and blocks are combined in double (error ~2^-53, negligible). Hence
// |got - ref| <= 66 * 2^-24 * sum|term|, about 3.9e-6 relative to sum|term|, for every n.
double Tolerance(double sum_abs_terms) { return 66.0 * 0x1p-24 * sum_abs_terms + 1e-300; }

class ReduceDtypeTest : public ::testing::TestWithParam<DType> {};

TEST_P(ReduceDtypeTest, MatchesDoubleReferenceAtEverySize) {
  const DType dtype = GetParam();
  std::uint64_t seed = 100;
  for (std::int64_t n : TestSizes()) {
    SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " n=" << n);
    // Offset data (mean 0.25) so the sum does not cancel to ~0 and relative checks stay meaningful.
    const std::vector<float> v = RandomFloats(n, seed++, -0.75f, 1.25f);
    const Tensor t = Tensor::from_vector(v, {n}, TensorOptions{}.with_dtype(dtype));
    const Reference r = ReferenceOf(t);
    EXPECT_NEAR(sum(t), r.sum, Tolerance(r.sum_abs));
    EXPECT_NEAR(sum_squares(t), r.sum_squares, Tolerance(r.sum_squares));
    EXPECT_EQ(max_abs(t), r.max_abs);  // a max is exact
  }
}

TEST_P(ReduceDtypeTest, NaNPropagatesThroughMaxAbsAndSums) {
  const DType dtype = GetParam();
  const std::int64_t n = 1023;
  for (std::int64_t pos : {std::int64_t{0}, std::int64_t{500}, n - 1}) {
    std::vector<float> v = RandomFloats(n, 7);
    v[static_cast<std::size_t>(pos)] = std::numeric_limits<float>::quiet_NaN();
    const Tensor t = Tensor::from_vector(v, {n}, TensorOptions{}.with_dtype(dtype));
    EXPECT_TRUE(std::isnan(max_abs(t))) << "NaN at " << pos;
    EXPECT_TRUE(std::isnan(sum(t))) << "NaN at " << pos;
    EXPECT_TRUE(std::isnan(sum_squares(t))) << "NaN at " << pos;
  }
}

TEST_P(ReduceDtypeTest, InfinityIsTheLargestMagnitude) {
  std::vector<float> v = RandomFloats(100, 8);
  v[37] = -std::numeric_limits<float>::infinity();
  const Tensor t = Tensor::from_vector(v, {100}, TensorOptions{}.with_dtype(GetParam()));
  EXPECT_EQ(max_abs(t), std::numeric_limits<double>::infinity());
  EXPECT_EQ(sum(t), -std::numeric_limits<double>::infinity());
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ReduceDtypeTest, ::testing::Values(DType::f32, DType::bf16, DType::f16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(ReduceTest, F16ValuesWhoseSquaresOverflowF16) {
  // 60000 is exact in f16 (max 65504) but 60000^2 = 3.6e9 is far beyond it: squares are formed in fp32.
  const std::int64_t n = 1023;
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = i % 2 == 0 ? 60000.f : -60000.f;
  const Tensor t = Tensor::from_vector(v, {n}, TensorOptions{}.with_dtype(DType::f16));
  const double expect_sq = static_cast<double>(n) * 3.6e9;
  EXPECT_NEAR(sum_squares(t), expect_sq, Tolerance(expect_sq));
  EXPECT_TRUE(std::isfinite(sum_squares(t)));
  EXPECT_EQ(sum(t), 60000.0);  // 512 positives, 511 negatives, all exact in fp32
  EXPECT_EQ(max_abs(t), 60000.0);
  EXPECT_EQ(max_abs(t.to(DType::bf16)), 59904.0);  // 60000 rounds to 59904 in bf16 (8-bit mantissa)
}

TEST(ReduceTest, RawPointerOverloadsAgreeWithTensorOverloads) {
  const std::vector<float> v = RandomFloats(1023, 9);
  const Tensor t = Tensor::from_vector(v, {1023});
  EXPECT_EQ(sum(v.data(), 1023), sum(t));
  EXPECT_EQ(sum_squares(v.data(), 1023), sum_squares(t));
  EXPECT_EQ(max_abs(v.data(), 1023), max_abs(t));
  const Tensor h = t.to(DType::f16);
  EXPECT_EQ(sum_squares(h.data<f16_t>(), 1023), sum_squares(h));
  const Tensor b = t.to(DType::bf16);
  EXPECT_EQ(max_abs(b.data<bf16_t>(), 1023), max_abs(b));
  EXPECT_EQ(sum(v.data(), 0), 0.0);
  EXPECT_EQ(max_abs(static_cast<const f16_t*>(nullptr), 0), 0.0);
}

TEST(ReduceTest, ViewsReduceOnlyTheirElements) {
  const Tensor t = Tensor::from_vector({1, -2, 3, -40, 5}, {5});
  const Tensor mid = t.view(1, {3});
  EXPECT_EQ(sum(mid), -39.0);
  EXPECT_EQ(sum_squares(mid), 4.0 + 9.0 + 1600.0);
  EXPECT_EQ(max_abs(mid), 40.0);
}

TEST(ReduceTest, IntegerTensorsAreRejected) {
  EXPECT_THROW(sum(Tensor::from_int64({1, 2}, {2})), InternalError);
}

TEST(WidenTest, MatchesScalarConversionsForEveryBitPattern) {
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const auto b16 = static_cast<std::uint16_t>(bits);
    ASSERT_EQ(std::bit_cast<std::uint32_t>(widen(f16_t{b16})), std::bit_cast<std::uint32_t>(f16_to_f32(f16_t{b16})))
        << "f16 bits 0x" << std::hex << bits;
    ASSERT_EQ(std::bit_cast<std::uint32_t>(widen(bf16_t{b16})), std::bit_cast<std::uint32_t>(bf16_to_f32(bf16_t{b16})))
        << "bf16 bits 0x" << std::hex << bits;
  }
}

}  // namespace
}  // namespace shardkit::kernels
