// Finite-difference gradient checks for every op, over several shapes, plus forward values against
// double-precision references where the forward is not trivial.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/autograd/ops.h"
#include "common/tensor/rank_context.h"
#include "common/autograd/function.h"
#include "common/autograd/ops/fast_math.h"
#include "gmock/gmock.h"
#include "gtest/gtest-spi.h"
#include "gtest/gtest.h"
#include "tests/common/autograd/gradcheck.h"

namespace shardkit::autograd {
namespace {

using testing_util::ExpectGradientsMatch;
using testing_util::RandomLeaf;
using TL = std::vector<Tensor>;

TEST(GradCheck, AddSubMulWithAndWithoutBroadcast) {
  for (const auto& [as, bs] : std::vector<std::pair<Shape, Shape>>{
           {{5}, {5}}, {{3, 4}, {3, 4}}, {{3, 4}, {4}}, {{2, 3, 4}, {3, 4}}, {{2, 3, 4}, {4}}}) {
    SCOPED_TRACE(shape_str(as) + " op " + shape_str(bs));
    Tensor a = RandomLeaf(as, 1), b = RandomLeaf(bs, 2);
    ExpectGradientsMatch([](const TL& in) { return add(in[0], in[1]); }, {a, b});
    ExpectGradientsMatch([](const TL& in) { return sub(in[0], in[1]); }, {a, b});
    ExpectGradientsMatch([](const TL& in) { return mul(in[0], in[1]); }, {a, b});
  }
}

TEST(GradCheck, ScaleSumMean) {
  for (const Shape& s : std::vector<Shape>{{1}, {7}, {3, 5}}) {
    Tensor a = RandomLeaf(s, 3);
    ExpectGradientsMatch([](const TL& in) { return scale(in[0], -2.5f); }, {a});
    ExpectGradientsMatch([](const TL& in) { return sum(in[0]); }, {a});
    ExpectGradientsMatch([](const TL& in) { return mean(in[0]); }, {a});
  }
}

TEST(GradCheck, ShapeOps) {
  Tensor x = RandomLeaf({2, 3, 4}, 4);
  ExpectGradientsMatch([](const TL& in) { return reshape(in[0], {4, -1}); }, {x});
  ExpectGradientsMatch([](const TL& in) { return transpose(in[0], 1, 2); }, {x});
  ExpectGradientsMatch([](const TL& in) { return permute(in[0], {2, 0, 1}); }, {x});
  ExpectGradientsMatch([](const TL& in) { return narrow(in[0], 1, 1, 2); }, {x});
  ExpectGradientsMatch([](const TL& in) { return narrow(in[0], 0, 1, 1); }, {x});
  for (std::int64_t dim : {0, 1, 2}) {
    ExpectGradientsMatch(
        [dim](const TL& in) {
          auto parts = split(in[0], dim == 0 ? std::vector<std::int64_t>{1, 1} : std::vector<std::int64_t>{1, in[0].size(dim) - 1}, dim);
          return concat({scale(parts[1], 2.f), parts[0]}, dim);
        },
        {x});
  }
  Tensor y = RandomLeaf({2, 2, 4}, 5);
  ExpectGradientsMatch([](const TL& in) { return concat({in[0], in[1]}, 1); }, {x, y});
}

TEST(GradCheck, CastRoundTripsGradient) {
  Tensor x = RandomLeaf({6}, 6);
  Tensor h = cast(x, DType::bf16);
  EXPECT_EQ(h.dtype(), DType::bf16);
  Tensor back = cast(h, DType::f32);
  backward(sum(scale(back, 3.f)));
  EXPECT_THAT(x.grad().to_vector(), ::testing::Each(3.f));
  EXPECT_EQ(x.grad().dtype(), DType::f32);
}

TEST(GradCheck, MatmulAllTranspositions) {
  const std::int64_t m = 3, k = 4, n = 5;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      SCOPED_TRACE(std::to_string(ta) + std::to_string(tb));
      Tensor a = RandomLeaf(ta ? Shape{k, m} : Shape{m, k}, 7);
      Tensor b = RandomLeaf(tb ? Shape{n, k} : Shape{k, n}, 8);
      ExpectGradientsMatch([ta, tb](const TL& in) { return matmul(in[0], in[1], ta, tb); }, {a, b});
      Tensor a3 = RandomLeaf(ta ? Shape{2, k, m} : Shape{2, m, k}, 9);
      Tensor b3 = RandomLeaf(tb ? Shape{2, n, k} : Shape{2, k, n}, 10);
      ExpectGradientsMatch([ta, tb](const TL& in) { return bmm(in[0], in[1], ta, tb); }, {a3, b3});
    }
  }
}

TEST(GradCheck, MatmulValuesMatchDoubleReference) {
  Tensor a = RandomLeaf({3, 4}, 11), b = RandomLeaf({5, 4}, 12);
  Tensor c = matmul(a, b, false, true);
  auto av = a.to_vector(), bv = b.to_vector(), cv = c.to_vector();
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 5; ++j) {
      double s = 0;
      for (int p = 0; p < 4; ++p) s += static_cast<double>(av[i * 4 + p]) * bv[j * 4 + p];
      EXPECT_NEAR(cv[i * 5 + j], s, 1e-5);
    }
  }
}

TEST(GradCheck, Linear) {
  for (const Shape& xs : std::vector<Shape>{{4, 3}, {2, 3, 3}, {1, 3}}) {
    SCOPED_TRACE(shape_str(xs));
    Tensor x = RandomLeaf(xs, 13), w = RandomLeaf({5, 3}, 14), b = RandomLeaf({5}, 15);
    ExpectGradientsMatch([](const TL& in) { return linear(in[0], in[1], in[2]); }, {x, w, b});
    ExpectGradientsMatch([](const TL& in) { return linear(in[0], in[1]); }, {x, w});
  }
  // Values: y = x W^T + b.
  Tensor x = Tensor::from_vector({1, 2}, {1, 2});
  Tensor w = Tensor::from_vector({1, 0, 0, 1, 1, 1}, {3, 2});
  Tensor b = Tensor::from_vector({10, 20, 30}, {3});
  EXPECT_THAT(linear(x, w, b).to_vector(), ::testing::ElementsAre(11, 22, 33));
}

TEST(GradCheck, Activations) {
  for (const Shape& s : std::vector<Shape>{{7}, {3, 6}, {2, 2, 5}}) {
    SCOPED_TRACE(shape_str(s));
    // relu: keep inputs away from the kink at 0.
    Tensor r = RandomLeaf(s, 16);
    float* p = r.data<float>();
    for (std::int64_t i = 0; i < r.numel(); ++i) p[i] = p[i] >= 0 ? p[i] + 0.1f : p[i] - 0.1f;
    ExpectGradientsMatch([](const TL& in) { return relu(in[0]); }, {r});
    Tensor x = RandomLeaf(s, 17, -3.f, 3.f);
    ExpectGradientsMatch([](const TL& in) { return gelu(in[0], GeluApproximation::none); }, {x});
    ExpectGradientsMatch([](const TL& in) { return gelu(in[0], GeluApproximation::tanh); }, {x});
    ExpectGradientsMatch([](const TL& in) { return softmax(in[0]); }, {x});
    ExpectGradientsMatch([](const TL& in) { return log_softmax(in[0]); }, {x});
  }
}

TEST(GradCheck, ActivationValuesMatchDoubleReference) {
  Tensor x = RandomLeaf({4, 9}, 18, -6.f, 6.f);
  auto xv = x.to_vector();
  auto gv = gelu(x, GeluApproximation::tanh).to_vector();
  auto ev = gelu(x, GeluApproximation::none).to_vector();
  auto sv = softmax(x).to_vector();
  auto lv = log_softmax(x).to_vector();
  for (int r = 0; r < 4; ++r) {
    double mx = -1e30, s = 0;
    for (int j = 0; j < 9; ++j) mx = std::max(mx, static_cast<double>(xv[r * 9 + j]));
    for (int j = 0; j < 9; ++j) s += std::exp(xv[r * 9 + j] - mx);
    for (int j = 0; j < 9; ++j) {
      const double v = xv[r * 9 + j];
      EXPECT_NEAR(gv[r * 9 + j], 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v))), 2e-6);
      EXPECT_NEAR(ev[r * 9 + j], 0.5 * v * (1 + std::erf(v / std::sqrt(2.0))), 1e-6);
      EXPECT_NEAR(sv[r * 9 + j], std::exp(v - mx) / s, 1e-6);
      EXPECT_NEAR(lv[r * 9 + j], v - mx - std::log(s), 2e-6);
    }
  }
}

// Values and slopes of both GELU forms at a few points, from an independent double-precision evaluation
// (Python's math.erf / math.tanh): exact x Phi(x) and Phi(x) + x phi(x); tanh form 0.5 x (1 + tanh(u)),
// u = sqrt(2/pi) (x + 0.044715 x^3), and its derivative.
TEST(GradCheck, GeluFormsMatchKnownValuesAndTheDefaultIsExact) {
  struct Point {
    float x;
    double exact, exact_slope, tanh, tanh_slope;
  };
  const std::vector<Point> points = {
      {1.f, 0.8413447460685429, 1.0833154705876864, 0.8411919906082768, 1.0829640838457826},
      {-1.f, -0.15865525393145707, -0.08331547058768629, -0.15880800939172324, -0.08296408384578255},
      {0.5f, 0.34573123063700656, 0.8674951246561629, 0.34571400982514394, 0.8673699035346424},
      {2.f, 1.9544997361036416, 1.085231801078197, 1.954597694087775, 1.0860992566236183},
      {-3.f, -0.00404969409489031, -0.011945647204183918, -0.0036373920817729943, -0.011584166630969516},
      {0.f, 0.0, 0.5, 0.0, 0.5},
  };
  std::vector<float> xs;
  for (const Point& p : points) xs.push_back(p.x);
  const auto n = static_cast<std::int64_t>(xs.size());
  for (GeluApproximation form : {GeluApproximation::none, GeluApproximation::tanh}) {
    const bool exact = form == GeluApproximation::none;
    SCOPED_TRACE(exact ? "none" : "tanh");
    Tensor x = Tensor::from_vector(xs, {n});
    x.set_requires_grad(true);
    Tensor y = gelu(x, form);
    backward(sum(y));
    const auto yv = y.to_vector(), gv = x.grad().to_vector();
    for (std::size_t i = 0; i < points.size(); ++i) {
      const Point& p = points[i];
      EXPECT_NEAR(yv[i], exact ? p.exact : p.tanh, 2e-7) << "x = " << p.x;
      EXPECT_NEAR(gv[i], exact ? p.exact_slope : p.tanh_slope, 5e-7) << "x = " << p.x;
    }
  }
  // The forms differ by more than the tolerance above at x = 1 (1.5e-4), and gelu(x) is the exact one.
  Tensor x = Tensor::from_vector(xs, {n});
  EXPECT_EQ(gelu(x).to_vector(), gelu(x, GeluApproximation::none).to_vector());
  EXPECT_NE(gelu(x).to_vector(), gelu(x, GeluApproximation::tanh).to_vector());
}

TEST(GradCheck, SquareAndPow) {
  for (const Shape& s : std::vector<Shape>{{7}, {3, 6}, {2, 2, 5}}) {
    SCOPED_TRACE(shape_str(s));
    Tensor x = RandomLeaf(s, 34, -2.f, 2.f);
    ExpectGradientsMatch([](const TL& in) { return square(in[0]); }, {x});
    // Every special-cased exponent and some that go through std::pow, on x in [0.5, 2] (away from 0,
    // where fractional and negative powers are steep or singular).
    Tensor pos = RandomLeaf(s, 35, 0.5f, 2.f);
    for (float p : {0.f, 1.f, 2.f, 3.f, 0.5f, -0.5f, -1.f, -2.f, 1.5f, -1.5f, 4.f, 0.3f, 2.5f}) {
      SCOPED_TRACE(absl::StrCat("exponent ", p));
      ExpectGradientsMatch([p](const TL& in) { return pow(in[0], p); }, {pos});
    }
    // Integer exponents are defined for negative x.
    Tensor neg = RandomLeaf(s, 36, -2.f, -0.5f);
    for (float p : {2.f, 3.f, -1.f, -2.f, 4.f, 5.f}) {
      SCOPED_TRACE(absl::StrCat("exponent ", p, " on negative x"));
      ExpectGradientsMatch([p](const TL& in) { return pow(in[0], p); }, {neg});
    }
  }
}

TEST(GradCheck, SquareAndPowValuesMatchDoubleReference) {
  Tensor x = RandomLeaf({40}, 37, -3.f, 3.f);
  Tensor pos = RandomLeaf({40}, 38, 0.01f, 5.f);
  const auto xv = x.to_vector(), pv = pos.to_vector();
  const auto sq = square(x).to_vector();
  for (std::size_t i = 0; i < xv.size(); ++i) EXPECT_EQ(sq[i], xv[i] * xv[i]);
  // Within 2 ulp (two roundings at most) of the double-precision power.
  auto expect_close = [](float got, double want, const std::string& what) {
    EXPECT_NEAR(got, want, 2.5e-7 * std::fabs(want)) << what;
  };
  for (float p : {0.f, 1.f, 2.f, 3.f, -1.f, 4.f, 5.f}) {
    const auto y = pow(x, p).to_vector();
    for (std::size_t i = 0; i < xv.size(); ++i) {
      expect_close(y[i], std::pow(static_cast<double>(xv[i]), static_cast<double>(p)),
                   absl::StrCat("pow(", xv[i], ", ", p, ")"));
    }
  }
  for (float p : {0.5f, -0.5f, -2.f, 1.5f, -1.5f, 0.3f, 2.5f}) {
    const auto y = pow(pos, p).to_vector();
    for (std::size_t i = 0; i < pv.size(); ++i) {
      expect_close(y[i], std::pow(static_cast<double>(pv[i]), static_cast<double>(p)),
                   absl::StrCat("pow(", pv[i], ", ", p, ")"));
    }
  }
}

// The gradient where p x^(p-1) is not an ordinary number, as PyTorch defines it (elementwise.h).
TEST(GradCheck, PowGradientAtZeroAndNegativeX) {
  auto value_and_slope = [](float x, float p) {
    Tensor t = Tensor::from_vector({x}, {1});
    t.set_requires_grad(true);
    Tensor y = pow(t, p);
    backward(sum(y));
    return std::pair<float, float>{y.to_vector()[0], t.grad().to_vector()[0]};
  };
  const float inf = std::numeric_limits<float>::infinity();
  // x^0 is the constant 1: slope 0 even at 0 (not 0 * inf) and for NaN.
  EXPECT_EQ(value_and_slope(0.f, 0.f), std::make_pair(1.f, 0.f));
  EXPECT_EQ(value_and_slope(-2.5f, 0.f), std::make_pair(1.f, 0.f));
  const auto [nan_value, nan_slope] = value_and_slope(std::nanf(""), 0.f);
  EXPECT_EQ(nan_value, 1.f);
  EXPECT_EQ(nan_slope, 0.f);
  // At 0: 0 for p > 1, 1 for p == 1, unbounded for p < 1.
  EXPECT_EQ(value_and_slope(0.f, 2.f), std::make_pair(0.f, 0.f));
  EXPECT_EQ(value_and_slope(0.f, 3.f), std::make_pair(0.f, 0.f));
  EXPECT_EQ(value_and_slope(0.f, 2.5f), std::make_pair(0.f, 0.f));
  EXPECT_EQ(value_and_slope(0.f, 1.f), std::make_pair(0.f, 1.f));
  EXPECT_EQ(value_and_slope(0.f, 0.5f), std::make_pair(0.f, inf));
  EXPECT_EQ(value_and_slope(0.f, 0.3f), std::make_pair(0.f, inf));
  EXPECT_EQ(value_and_slope(0.f, -1.f), std::make_pair(inf, -inf));
  // Negative x: integer exponents as the polynomial / reciprocal; non-integer ones NaN, value and slope.
  EXPECT_EQ(value_and_slope(-2.f, 3.f), std::make_pair(-8.f, 12.f));
  EXPECT_EQ(value_and_slope(-2.f, 2.f), std::make_pair(4.f, -4.f));
  EXPECT_EQ(value_and_slope(-2.f, -1.f), std::make_pair(-0.5f, -0.25f));
  EXPECT_EQ(value_and_slope(-2.f, 4.f), std::make_pair(16.f, -32.f));
  for (float p : {0.5f, 1.5f, -0.5f, 0.3f}) {
    SCOPED_TRACE(absl::StrCat("exponent ", p));
    const auto [value, slope] = value_and_slope(-2.f, p);
    EXPECT_TRUE(std::isnan(value));
    EXPECT_TRUE(std::isnan(slope));
  }
}

TEST(GradCheck, DropoutUsesTheRankGeneratorAndScales) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Tensor x = RandomLeaf({4, 8}, 19);
  auto f = [&ctx](const TL& in) {
    ctx.generator = Generator(99, 3);  // same mask on every evaluation
    return dropout(in[0], 0.25f, true);
  };
  ExpectGradientsMatch(f, {x});
  Tensor y = f({x});
  auto xv = x.to_vector(), yv = y.to_vector();
  int zeros = 0;
  for (std::size_t i = 0; i < xv.size(); ++i) {
    if (yv[i] == 0.f) {
      ++zeros;
    } else {
      EXPECT_FLOAT_EQ(yv[i], xv[i] / 0.75f);
    }
  }
  EXPECT_GT(zeros, 0);
  EXPECT_LT(zeros, 20);
  EXPECT_TRUE(dropout(x, 0.25f, false).is_same(x));
}

TEST(GradCheck, LayerNorm) {
  for (const Shape& s : std::vector<Shape>{{3, 5}, {2, 2, 8}, {1, 1}}) {
    SCOPED_TRACE(shape_str(s));
    const std::int64_t c = s.back();
    Tensor x = RandomLeaf(s, 20, -2.f, 2.f), w = RandomLeaf({c}, 21, 0.5f, 1.5f), b = RandomLeaf({c}, 22);
    if (c > 1) ExpectGradientsMatch([](const TL& in) { return layer_norm(in[0], in[1], in[2]); }, {x, w, b});
    ExpectGradientsMatch([](const TL& in) { return layer_norm(in[0], Tensor(), Tensor()); }, {x});
  }
  // Values: double reference.
  Tensor x = RandomLeaf({2, 6}, 23, -2.f, 2.f);
  auto xv = x.to_vector();
  auto yv = layer_norm(x, Tensor(), Tensor()).to_vector();
  for (int r = 0; r < 2; ++r) {
    double m = 0, v = 0;
    for (int j = 0; j < 6; ++j) m += xv[r * 6 + j] / 6.0;
    for (int j = 0; j < 6; ++j) v += (xv[r * 6 + j] - m) * (xv[r * 6 + j] - m) / 6.0;
    for (int j = 0; j < 6; ++j) EXPECT_NEAR(yv[r * 6 + j], (xv[r * 6 + j] - m) / std::sqrt(v + 1e-5), 1e-5);
  }
}

TEST(GradCheck, BatchNormTrainingAndEvaluation) {
  for (const Shape& s : std::vector<Shape>{{4, 3}, {7, 5}}) {
    SCOPED_TRACE(shape_str(s));
    const std::int64_t c = s[1];
    Tensor x = RandomLeaf(s, 24, -2.f, 2.f), w = RandomLeaf({c}, 25, 0.5f, 1.5f), b = RandomLeaf({c}, 26);
    ExpectGradientsMatch([](const TL& in) { return batch_norm(in[0], in[1], in[2], Tensor(), Tensor(), true); },
                         {x, w, b});
    Tensor rm = Tensor::from_vector(std::vector<float>(static_cast<std::size_t>(c), 0.3f), {c});
    Tensor rv = Tensor::from_vector(std::vector<float>(static_cast<std::size_t>(c), 2.0f), {c});
    ExpectGradientsMatch([&](const TL& in) { return batch_norm(in[0], in[1], in[2], rm, rv, false); }, {x, w, b});
  }
  // Running statistics: momentum update with the unbiased variance.
  Tensor x = Tensor::from_vector({1, 10, 3, 20}, {2, 2});
  Tensor rm = Tensor::zeros({2}), rv = Tensor::full({2}, 1.0);
  Tensor y = batch_norm(x, Tensor(), Tensor(), rm, rv, true, 0.5f, 0.f);
  EXPECT_THAT(rm.to_vector(), ::testing::ElementsAre(1.f, 7.5f));        // 0.5 * mean
  EXPECT_THAT(rv.to_vector(), ::testing::ElementsAre(1.5f, 25.5f));      // 0.5 + 0.5 * unbiased var
  EXPECT_THAT(y.to_vector(), ::testing::ElementsAre(-1, -1, 1, 1));
}

TEST(GradCheck, CrossEntropy) {
  for (const auto& [rows, v] : std::vector<std::pair<std::int64_t, std::int64_t>>{{1, 3}, {4, 7}, {6, 2}}) {
    Tensor logits = RandomLeaf({rows, v}, 27, -3.f, 3.f);
    std::vector<std::int64_t> t;
    for (std::int64_t r = 0; r < rows; ++r) t.push_back((r * 5 + 1) % v);
    Tensor targets = Tensor::from_int64(t, {rows});
    ExpectGradientsMatch([&](const TL& in) { return cross_entropy(in[0], targets); }, {logits});
    // Value against a double reference.
    auto lv = logits.to_vector();
    double ref = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      double mx = -1e30, s = 0;
      for (std::int64_t j = 0; j < v; ++j) mx = std::max(mx, static_cast<double>(lv[r * v + j]));
      for (std::int64_t j = 0; j < v; ++j) s += std::exp(lv[r * v + j] - mx);
      ref += mx + std::log(s) - lv[r * v + t[r]];
    }
    EXPECT_NEAR(cross_entropy(logits, targets).item(), ref / rows, 1e-5);
  }
  // ignore_index rows contribute nothing; 3-d logits.
  Tensor logits = RandomLeaf({2, 3, 4}, 28);
  Tensor targets = Tensor::from_int64({0, -100, 3, 2, -100, 1}, {2, 3});
  ExpectGradientsMatch([&](const TL& in) { return cross_entropy(in[0], targets); }, {logits});
  backward(cross_entropy(logits, targets));
  auto g = logits.grad().to_vector();
  for (int j = 0; j < 4; ++j) EXPECT_EQ(g[4 + j], 0.f);
}

TEST(GradCheck, EmbeddingAccumulatesRepeatedIndices) {
  Tensor w = RandomLeaf({5, 3}, 29);
  Tensor idx = Tensor::from_int64({1, 4, 1, 0, 1, 2}, {2, 3});
  ExpectGradientsMatch([&](const TL& in) { return embedding(in[0], idx); }, {w});
  w.set_grad(Tensor());
  backward(sum(embedding(w, idx)));
  EXPECT_THAT(w.grad().to_vector(), ::testing::ElementsAre(1, 1, 1, 3, 3, 3, 1, 1, 1, 0, 0, 0, 1, 1, 1));
  EXPECT_EQ(embedding(w, idx).shape(), (Shape{2, 3, 3}));
}

// Double-precision reference of causal attention.
std::vector<double> AttentionReference(const std::vector<float>& qkv, std::int64_t b_n, std::int64_t t,
                                       std::int64_t c, std::int64_t heads) {
  const std::int64_t hs = c / heads;
  std::vector<double> out(static_cast<std::size_t>(b_n * t * c));
  for (std::int64_t b = 0; b < b_n; ++b) {
    for (std::int64_t h = 0; h < heads; ++h) {
      for (std::int64_t i = 0; i < t; ++i) {
        std::vector<double> s(static_cast<std::size_t>(i + 1));
        double mx = -1e300;
        for (std::int64_t j = 0; j <= i; ++j) {
          double d = 0;
          for (std::int64_t e = 0; e < hs; ++e) {
            d += static_cast<double>(qkv[static_cast<std::size_t>((b * t + i) * 3 * c + h * hs + e)]) *
                 qkv[static_cast<std::size_t>((b * t + j) * 3 * c + c + h * hs + e)];
          }
          s[static_cast<std::size_t>(j)] = d / std::sqrt(static_cast<double>(hs));
          mx = std::max(mx, s[static_cast<std::size_t>(j)]);
        }
        double z = 0;
        for (double& v : s) z += (v = std::exp(v - mx));
        for (std::int64_t e = 0; e < hs; ++e) {
          double acc = 0;
          for (std::int64_t j = 0; j <= i; ++j) {
            acc += s[static_cast<std::size_t>(j)] / z *
                   qkv[static_cast<std::size_t>((b * t + j) * 3 * c + 2 * c + h * hs + e)];
          }
          out[static_cast<std::size_t>((b * t + i) * c + h * hs + e)] = acc;
        }
      }
    }
  }
  return out;
}

TEST(GradCheck, CausalAttention) {
  for (const auto& [b_n, t, c, heads] : std::vector<std::array<std::int64_t, 4>>{
           {1, 1, 4, 2}, {2, 3, 4, 1}, {1, 5, 6, 3}, {2, 4, 8, 2}}) {
    SCOPED_TRACE(absl::StrCat(b_n, "x", t, "x", c, " heads ", heads));
    Tensor qkv = RandomLeaf({b_n, t, 3 * c}, 30, -1.5f, 1.5f);
    ExpectGradientsMatch([heads](const TL& in) { return causal_attention(in[0], heads); }, {qkv},
                         {.max_elements_per_input = 96});
    const auto ref = AttentionReference(qkv.to_vector(), b_n, t, c, heads);
    const auto got = causal_attention(qkv, heads).to_vector();
    for (std::size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got[i], ref[i], 1e-5) << i;
  }
}

TEST(FastMath, ExpAndTanhMatchLibm) {
  double worst_exp = 0, worst_tanh = 0;
  for (float x = -87.f; x <= 88.f; x += 0.0137f) {
    const double ref = std::exp(static_cast<double>(x));
    worst_exp = std::max(worst_exp, std::fabs(detail::fast_exp(x) - ref) / ref);
  }
  for (float x = -12.f; x <= 12.f; x += 0.00731f) {
    worst_tanh = std::max(worst_tanh, std::fabs(detail::fast_tanh(x) - std::tanh(static_cast<double>(x))));
  }
  EXPECT_LT(worst_exp, 3e-7);   // ~2.5 ulp
  EXPECT_LT(worst_tanh, 3e-7);  // absolute
  EXPECT_EQ(detail::fast_exp(-1000.f), detail::fast_exp(-87.f));  // clamped, finite
  EXPECT_TRUE(std::isfinite(detail::fast_exp(1000.f)));
}

// Note [lane sums]: lane l adds elements l, l + 16, ... in order, then the lanes combine in a fixed tree. The
// reference spells that order out one element at a time; any other order (a single accumulator, a reassociating
// compiler flag) changes the bits of these sums, whose terms span nine orders of magnitude.
TEST(FastMath, LaneReductionsFollowTheirDocumentedOrder) {
  Generator gen(31, 0);
  for (std::int64_t n : {0, 1, 5, 15, 16, 17, 31, 33, 1000, 4097}) {
    SCOPED_TRACE(n);
    std::vector<float> x(static_cast<std::size_t>(n)), y(static_cast<std::size_t>(n));
    gen.fill_uniform(x.data(), n);
    gen.fill_uniform(y.data(), n);
    for (std::int64_t i = 0; i < n; ++i) x[i] = (x[i] - 0.5f) * std::pow(10.f, static_cast<float>(i % 10) - 4.f);
    auto reference = [&](bool dot) {
      float lanes[16] = {};
      for (std::int64_t i = 0; i < n; ++i) lanes[i % 16] += dot ? x[i] * y[i] : x[i];
      for (int w = 8; w >= 1; w /= 2) {
        for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
      }
      return lanes[0];
    };
    EXPECT_EQ(detail::lane_sum(x.data(), n), reference(false));
    EXPECT_EQ(detail::lane_dot(x.data(), y.data(), n), reference(true));
    double exact = 0;
    for (float v : x) exact += v;
    EXPECT_NEAR(detail::lane_sum(x.data(), n), exact, 1e-6 * 1e5 * static_cast<double>(std::max<std::int64_t>(n, 1)));
    EXPECT_EQ(detail::lane_max(x.data(), n), n == 0 ? -INFINITY : *std::max_element(x.begin(), x.end()));
  }
}

TEST(GradCheck, SoftmaxOfLongRowsMatchesDoubleReference) {
  // Rows longer than the reductions' 16 lanes (the short rows above use only their tails).
  for (std::int64_t n : {16, 37, 1024}) {
    SCOPED_TRACE(n);
    Tensor x = RandomLeaf({3, n}, 19, -8.f, 8.f);
    auto xv = x.to_vector();
    auto sv = softmax(x).to_vector();
    auto lv = log_softmax(x).to_vector();
    for (std::int64_t r = 0; r < 3; ++r) {
      double mx = -1e30, s = 0;
      for (std::int64_t j = 0; j < n; ++j) mx = std::max(mx, static_cast<double>(xv[r * n + j]));
      for (std::int64_t j = 0; j < n; ++j) s += std::exp(xv[r * n + j] - mx);
      for (std::int64_t j = 0; j < n; ++j) {
        const double v = xv[r * n + j];
        EXPECT_NEAR(sv[r * n + j], std::exp(v - mx) / s, 1e-6 * std::exp(v - mx) / s + 1e-9);
        EXPECT_NEAR(lv[r * n + j], v - mx - std::log(s), 4e-6);
      }
    }
    ExpectGradientsMatch([](const TL& in) { return softmax(in[0]); }, {x});
    ExpectGradientsMatch([](const TL& in) { return log_softmax(in[0]); }, {x});
  }
}

TEST(FastMath, NormalCdfMatchesLibm) {
  double worst = 0, worst_lower_tail = 0;
  for (float x = -13.f; x <= 13.f; x += 0.00731f) {
    const double ref = 0.5 * std::erfc(-static_cast<double>(x) / std::sqrt(2.0));
    const double err = std::fabs(detail::fast_normal_cdf(x) - ref);
    worst = std::max(worst, err);
    if (x <= 0.f && x >= -12.f) worst_lower_tail = std::max(worst_lower_tail, err / ref);
  }
  EXPECT_LT(worst, 1e-7);              // absolute
  EXPECT_LT(worst_lower_tail, 6e-6);  // relative, for x in [-12, 0] (Phi(-12) ~ 2e-33)
  EXPECT_EQ(detail::fast_normal_cdf(std::numeric_limits<float>::infinity()), 1.f);
  EXPECT_EQ(detail::fast_normal_cdf(-std::numeric_limits<float>::infinity()), 0.f);
}

// The checker itself: a function whose backward is off by 10% must be caught.
class WrongSquare : public Function {
 public:
  TensorList forward(const TensorList& in) override {
    save_for_backward({in[0]});
    return {mul(in[0], in[0])};
  }
  TensorList backward(const TensorList& g) override { return {mul(g[0], scale(saved_tensors()[0], 2.2f))}; }
};

TEST(GradCheck, CheckerCatchesAWrongGradient) {
  Tensor x = RandomLeaf({1}, 33, 1.f, 2.f);  // one element: exactly one failure
  EXPECT_NONFATAL_FAILURE(
      ExpectGradientsMatch([](const TL& in) { return apply_function(std::make_shared<WrongSquare>(), in)[0]; }, {x}),
      "input 0 element");
}

TEST(GradCheck, GemmTimeIsCounted) {
  reset_gemm_stats();
  Tensor a = RandomLeaf({8, 16}, 31), b = RandomLeaf({16, 4}, 32);
  backward(sum(matmul(a, b)));
  const GemmStats s = gemm_stats();
  EXPECT_EQ(s.calls, 3);  // forward + two gradients
  EXPECT_DOUBLE_EQ(s.flops, 3 * 2.0 * 8 * 16 * 4);
  EXPECT_GT(s.seconds, 0);
}

}  // namespace
}  // namespace shardkit::autograd
