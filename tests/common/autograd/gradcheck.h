// Finite-difference gradient checks for tests (autograd and nn).
//
// ExpectGradientsMatch(f, inputs): with fixed random weights R, loss(inputs) = sum(f(inputs) * R) is
// differentiated by the engine and by central differences, (loss(x + eps) - loss(x - eps)) / 2 eps,
// element by element (every element of small inputs, an even sample of large ones).
//
// Tolerance: the forward runs in fp32 and the loss is summed in double. Central differences have a
// truncation error of eps^2 / 6 * |f'''| (~2e-5 at eps = 1e-2 for the smooth ops here) and a rounding
// error of about |loss| * 2^-24 / eps (~1e-5 relative for the sizes used). The check allows
// 1e-2 * max(1, max |gradient|) absolute plus 1e-2 relative, well above both, and well below any real
// gradient mistake (a wrong term or factor changes gradients by O(1) relative). Inputs whose natural
// scale is much smaller than 1 (a GPT's residual stream at init) need a smaller eps: the truncation
// error grows like (eps / scale)^2.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>

#include "common/autograd/engine.h"
#include "common/autograd/grad_mode.h"
#include "common/autograd/ops.h"
#include "common/tensor/random.h"
#include "gtest/gtest.h"

namespace shardkit::testing_util {

struct GradCheckOptions {
  double eps = 1e-2;
  double tolerance = 1e-2;
  std::int64_t max_elements_per_input = 48;
  std::uint64_t seed = 1234;
};

inline double WeightedSum(const Tensor& out, const std::vector<float>& r) {
  const std::vector<float> v = out.to_vector();
  double s = 0;
  for (std::size_t i = 0; i < v.size(); ++i) s += static_cast<double>(v[i]) * static_cast<double>(r[i]);
  return s;
}

// `inputs` that require grad are checked; f must be deterministic (re-seed RNGs inside f).
inline void ExpectGradientsMatch(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                                 const std::vector<Tensor>& inputs, const GradCheckOptions& o = {}) {
  for (const Tensor& t : inputs) {
    if (t.requires_grad()) t.set_grad(Tensor());
  }
  Tensor out = f(inputs);
  ASSERT_TRUE(out.requires_grad()) << "f's output does not require grad";
  Generator gen(o.seed);
  std::vector<float> r(static_cast<std::size_t>(out.numel()));
  gen.fill_uniform(r.data(), out.numel(), -1.f, 1.f);
  Tensor rt = Tensor::from_vector(r, out.shape());
  autograd::backward(autograd::sum(autograd::mul(out, rt)));
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& x = inputs[i];
    if (!x.requires_grad()) continue;
    ASSERT_TRUE(x.grad().defined()) << "input " << i << " got no gradient";
    const std::vector<float> analytic = x.grad().to_vector();
    double max_abs = 1.0;
    for (float g : analytic) max_abs = std::max(max_abs, static_cast<double>(std::fabs(g)));
    const std::int64_t n = x.numel();
    const std::int64_t step = std::max<std::int64_t>(1, n / o.max_elements_per_input);
    float* p = x.data<float>();
    for (std::int64_t j = 0; j < n; j += step) {
      const float saved = p[j];
      double lp, lm;
      {
        autograd::NoGradGuard ng;
        p[j] = static_cast<float>(saved + o.eps);
        lp = WeightedSum(f(inputs), r);
        p[j] = static_cast<float>(saved - o.eps);
        lm = WeightedSum(f(inputs), r);
        p[j] = saved;
      }
      const double numeric = (lp - lm) / (2 * o.eps);
      const double a = analytic[static_cast<std::size_t>(j)];
      EXPECT_NEAR(a, numeric, o.tolerance * max_abs + o.tolerance * std::fabs(numeric))
          << "input " << i << " element " << j;
    }
  }
}

// A leaf requiring grad with U[lo, hi) values.
inline Tensor RandomLeaf(const Shape& shape, std::uint64_t seed, float lo = -1.f, float hi = 1.f) {
  Generator g(seed);
  Tensor t = Tensor::uniform(shape, g, lo, hi);
  t.set_requires_grad(true);
  return t;
}

}  // namespace shardkit::testing_util
