// Gradient clipping against a double-precision reference, including f16/bf16 gradients whose squares
// overflow f16. The reference sums exact squares in double; the library accumulates fp32 blocks into a
// double total (kernels/reduce.h Note [reduction accuracy]), so relative agreement to 1e-6 is expected.
#include "common/optim/clip_grad.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace shardkit::optim {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

std::vector<Tensor> MakeParams(DType grad_dtype, float scale) {
  Generator gen(11);
  std::vector<Tensor> params;
  for (std::int64_t n : {1, 7, 1023, 5000}) {
    Tensor p = Tensor::zeros({n});
    p.set_grad(Tensor::normal({n}, gen, 0.f, scale, TensorOptions{}.with_dtype(grad_dtype)));
    params.push_back(p);
  }
  params.push_back(Tensor::zeros({4}));  // no gradient: skipped
  return params;
}

double RefNorm(const std::vector<Tensor>& params, double norm_type) {
  double acc = 0;
  for (const Tensor& p : params) {
    if (!p.grad().defined()) continue;
    for (float g : p.grad().to_vector()) {
      if (norm_type == kInf) acc = std::max(acc, std::fabs(static_cast<double>(g)));
      else acc += static_cast<double>(g) * g;
    }
  }
  return norm_type == kInf ? acc : std::sqrt(acc);
}

struct Case {
  DType dtype;
  float scale;
  double norm_type;
};

class ClipGradTest : public ::testing::TestWithParam<Case> {};

TEST_P(ClipGradTest, MatchesReferenceAndClips) {
  const Case c = GetParam();
  std::vector<Tensor> params = MakeParams(c.dtype, c.scale);
  std::vector<std::vector<float>> before;
  for (const Tensor& p : params) before.push_back(p.grad().defined() ? p.grad().to_vector() : std::vector<float>{});
  const double ref = RefNorm(params, c.norm_type);
  ASSERT_TRUE(std::isfinite(ref));

  // Above the norm: unchanged.
  EXPECT_NEAR(clip_grad_norm(params, ref * 2, c.norm_type), ref, ref * 1e-6);
  for (std::size_t k = 0; k < 4; ++k) EXPECT_EQ(params[k].grad().to_vector(), before[k]);

  // Below: every gradient scaled by max_norm / (norm + 1e-6), rounded to its dtype.
  const double max_norm = ref / 4;
  EXPECT_NEAR(clip_grad_norm(params, max_norm, c.norm_type), ref, ref * 1e-6);
  const double coef = max_norm / (ref + 1e-6);
  for (std::size_t k = 0; k < 4; ++k) {
    const std::vector<float> after = params[k].grad().to_vector();
    for (std::size_t i = 0; i < after.size(); ++i) {
      const float expect = Tensor::from_vector({before[k][i] * static_cast<float>(coef)}, {1},
                                               TensorOptions{}.with_dtype(c.dtype)).to_vector()[0];
      ASSERT_NEAR(after[i], expect, std::fabs(expect) * 1e-6) << "param " << k << " element " << i;
    }
  }
  EXPECT_NEAR(RefNorm(params, c.norm_type), max_norm, max_norm * (c.dtype == DType::f32 ? 1e-5 : 1e-2));
}

INSTANTIATE_TEST_SUITE_P(All, ClipGradTest,
                         ::testing::Values(Case{DType::f32, 1.f, 2.0}, Case{DType::f32, 1.f, kInf},
                                           Case{DType::bf16, 1.f, 2.0}, Case{DType::bf16, 3000.f, 2.0},
                                           // f16 values around 1000: squares (~1e6) overflow f16 (max 65504)
                                           Case{DType::f16, 1000.f, 2.0}, Case{DType::f16, 1000.f, kInf}));

TEST(ClipGradTest, F16SquaresOverflowingF16AreExact) {
  Tensor p = Tensor::zeros({3});
  p.set_grad(Tensor::from_vector({300.f, -1000.f, 60000.f}, {3}, TensorOptions{}.with_dtype(DType::f16)));
  const double expect = std::sqrt(300.0 * 300 + 1000.0 * 1000 + 60000.0 * 60000);
  EXPECT_NEAR(grad_norm_from_partial(grad_norm_partial({p}, 2.0), 2.0), expect, expect * 1e-7);
  EXPECT_EQ(grad_norm_partial({p}, kInf), 60000.0);
  // Clipping to 1: the scaled gradients are representable again.
  EXPECT_NEAR(clip_grad_norm({p}, 1.0), expect, expect * 1e-7);
  EXPECT_NEAR(p.grad().item_at(2), 60000.0 / expect, 1e-3);
}

TEST(ClipGradTest, PiecesComposeAsShardsWould) {
  std::vector<Tensor> all = MakeParams(DType::f32, 1.f);
  const std::vector<Tensor> a(all.begin(), all.begin() + 2), b(all.begin() + 2, all.end());
  const double sq = grad_norm_partial(a, 2.0) + grad_norm_partial(b, 2.0);
  EXPECT_NEAR(grad_norm_from_partial(sq, 2.0), RefNorm(all, 2.0), 1e-6 * RefNorm(all, 2.0));
  const double mx = std::max(grad_norm_partial(a, kInf), grad_norm_partial(b, kInf));
  EXPECT_EQ(mx, RefNorm(all, kInf));
  EXPECT_EQ(clip_coefficient(1.0, 2.0), 1.0);
  EXPECT_DOUBLE_EQ(clip_coefficient(4.0, 2.0), 2.0 / (4.0 + 1e-6));
  EXPECT_TRUE(std::isnan(clip_coefficient(std::nan(""), 1.0)));
}

}  // namespace
}  // namespace shardkit::optim
