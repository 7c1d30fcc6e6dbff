// optim::find_non_finite / all_finite / found_non_finite_grads / scale_and_find_non_finite: every bf16 and
// f16 bit pattern against std::isfinite of its fp32 value, the first index across chunk boundaries, the
// largest finite values, and the grad scaler's fused scale + check.
#include "common/optim/finite.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::optim {
namespace {

using ::testing::ElementsAre;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

TEST(FiniteTest, EveryHalfBitPatternAgreesWithIsfinite) {
  for (const DType dt : {DType::bf16, DType::f16}) {
    Tensor all = Tensor::empty({65536}, TensorOptions{}.with_dtype(dt));
    auto* u = static_cast<std::uint16_t*>(all.raw_data());
    for (std::uint32_t b = 0; b < 65536; ++b) u[b] = static_cast<std::uint16_t>(b);
    const std::vector<float> as_f32 = all.to_vector();
    for (std::uint32_t b = 0; b < 65536; ++b) {
      Tensor one = all.view(b, {1});
      ASSERT_EQ(find_non_finite(one) == -1, std::isfinite(as_f32[b])) << dtype_name(dt) << " bits " << b;
    }
    // The first non-finite pattern: bf16 0x7f80 (+inf), f16 0x7c00 (+inf).
    EXPECT_EQ(find_non_finite(all), dt == DType::bf16 ? 0x7f80 : 0x7c00);
  }
}

TEST(FiniteTest, FindsTheFirstNonFiniteAcrossChunks) {
  for (const DType dt : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    std::vector<float> v(5000, 1.5f);
    EXPECT_EQ(find_non_finite(Tensor::from_vector(v, {50, 100}, TensorOptions{}.with_dtype(dt))), -1);
    v[4999] = -kInf;
    EXPECT_EQ(find_non_finite(Tensor::from_vector(v, {5000}, TensorOptions{}.with_dtype(dt))), 4999);
    v[2047] = kNaN;  // last element of the second chunk
    EXPECT_EQ(find_non_finite(Tensor::from_vector(v, {5000}, TensorOptions{}.with_dtype(dt))), 2047);
    v[1024] = kInf;  // first element of the second chunk
    EXPECT_EQ(find_non_finite(Tensor::from_vector(v, {5000}, TensorOptions{}.with_dtype(dt))), 1024);
  }
  EXPECT_EQ(find_non_finite(Tensor::zeros({0})), -1);
  EXPECT_EQ(find_non_finite(Tensor::from_int64({std::numeric_limits<std::int64_t>::max(), -1}, {2})), -1);
}

TEST(FiniteTest, LargestFiniteValuesAreFiniteAndOverflowIsNot) {
  const float f32_max = std::numeric_limits<float>::max();
  EXPECT_TRUE(all_finite({Tensor::from_vector({f32_max, -f32_max, 1e-45f, 0.f, -0.f}, {5})}));
  EXPECT_TRUE(all_finite({Tensor::from_vector({65504.f, -65504.f, 6e-8f}, {3}, TensorOptions{}.with_dtype(DType::f16))}));
  EXPECT_TRUE(all_finite({Tensor::from_vector({3.38e38f, -3.38e38f}, {2}, TensorOptions{}.with_dtype(DType::bf16))}));
  // 70000 does not fit in f16: it rounds to inf.
  EXPECT_EQ(find_non_finite(Tensor::from_vector({1.f, 70000.f}, {2}, TensorOptions{}.with_dtype(DType::f16))), 1);
}

TEST(FiniteTest, AllFiniteSkipsUndefinedTensorsAndGradsAreChecked) {
  Tensor good = Tensor::full({3}, 2.0), bad = Tensor::from_vector({0.f, kNaN}, {2});
  EXPECT_TRUE(all_finite({}));
  EXPECT_TRUE(all_finite({good, Tensor(), good.to(DType::bf16)}));
  EXPECT_FALSE(all_finite({good, Tensor(), bad}));

  Tensor p = Tensor::zeros({2}), q = Tensor::zeros({3});
  EXPECT_FALSE(found_non_finite_grads({p, q}));  // no gradients yet
  q.set_grad(Tensor::full({3}, 1.0));
  EXPECT_FALSE(found_non_finite_grads({p, q}));
  p.set_grad(bad);
  EXPECT_TRUE(found_non_finite_grads({p, q}));
}

TEST(FiniteTest, ScaleAndFindNonFiniteScalesEveryElementInOnePass) {
  for (const DType dt : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    std::vector<float> v(3000);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 64) * 4.f;
    Tensor t = Tensor::from_vector(v, {3000}, TensorOptions{}.with_dtype(dt));
    EXPECT_FALSE(scale_and_find_non_finite(t, 0.25f));
    const std::vector<float> got = t.to_vector();
    for (std::size_t i = 0; i < v.size(); ++i) ASSERT_EQ(got[i], v[i] * 0.25f) << i;

    v[2500] = kNaN;
    Tensor u = Tensor::from_vector(v, {3000}, TensorOptions{}.with_dtype(dt));
    EXPECT_TRUE(scale_and_find_non_finite(u, 0.5f));
    EXPECT_EQ(u.item_at(4), 8.0);  // still scaled
  }
  // The check reads the values before the scaling: a finite value that overflows when scaled is not flagged.
  Tensor big = Tensor::from_vector({3e38f}, {1});
  EXPECT_FALSE(scale_and_find_non_finite(big, 4.f));
  EXPECT_THAT(big.to_vector(), ElementsAre(kInf));
}

}  // namespace
}  // namespace shardkit::optim
