#include "common/autograd/ops/activation.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/autograd/ops/fast_math.h"
#include "common/autograd/ops/op_utils.h"
#include "common/kernels/cuda/cuda_kernels.h"
#include "common/tensor/rank_context.h"

namespace shardkit::autograd {
namespace {

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;  // 1 / sqrt(2 pi)

std::int64_t LastDim(const Tensor& x) { return x.dim() == 0 ? 1 : x.size(-1); }

// Row softmax (or log-softmax) of [rows, n].
void SoftmaxRows(const float* x, float* y, std::int64_t rows, std::int64_t n, bool log) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* __restrict xr = x + r * n;
    float* __restrict yr = y + r * n;
    // Row max and sum in lanes (Note [lane sums] in fast_math.h): the exp loop on its own vectorises.
    const float mx = detail::lane_max(xr, n);
    for (std::int64_t j = 0; j < n; ++j) yr[j] = detail::fast_exp(xr[j] - mx);
    const float s = detail::lane_sum(yr, n);
    if (log) {
      const float lse = mx + std::log(s);
      for (std::int64_t j = 0; j < n; ++j) yr[j] = xr[j] - lse;
    } else {
      const float inv = 1.f / s;
      for (std::int64_t j = 0; j < n; ++j) yr[j] *= inv;
    }
  }
}

// GPT-2's form (the expression and its derivative, not the exact GELU's gradient).
Tensor GeluTanh(const Tensor& x) {
  Tensor out = detail::new_activation(x.shape());
  const std::int64_t n = x.numel();
  const float* __restrict xp = x.data<float>();
  float* __restrict y = out.data<float>();
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = xp[i];
    const float t = detail::fast_tanh(kGeluC * (v + kGeluA * v * v * v));
    y[i] = 0.5f * v * (1.f + t);
  }
  if (should_record({&x})) {
    detail::record("GeluBackward", {&x}, {&out}, [x](TensorList&& g) -> TensorList {
      Tensor gx = detail::new_activation(x.shape());
      const std::int64_t n = gx.numel();
      const float* __restrict xp = x.data<float>();
      const float* __restrict gp = g[0].data<float>();
      float* __restrict o = gx.data<float>();
      for (std::int64_t i = 0; i < n; ++i) {
        const float v = xp[i];
        const float u = kGeluC * (v + kGeluA * v * v * v);
        const float t = detail::fast_tanh(u);
        const float du = kGeluC * (1.f + 3.f * kGeluA * v * v);
        o[i] = gp[i] * (0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * du);
      }
      return {gx};
    });
  }
  return out;
}

// x Phi(x); gradient Phi(x) + x phi(x).
Tensor GeluExact(const Tensor& x) {
  Tensor out = detail::new_activation(x.shape());
  const std::int64_t n = x.numel();
  const float* __restrict xp = x.data<float>();
  float* __restrict y = out.data<float>();
  for (std::int64_t i = 0; i < n; ++i) y[i] = xp[i] * detail::fast_normal_cdf(xp[i]);
  if (should_record({&x})) {
    detail::record("GeluBackward", {&x}, {&out}, [x](TensorList&& g) -> TensorList {
      Tensor gx = detail::new_activation(x.shape());
      const std::int64_t n = gx.numel();
      const float* __restrict xp = x.data<float>();
      const float* __restrict gp = g[0].data<float>();
      float* __restrict o = gx.data<float>();
      for (std::int64_t i = 0; i < n; ++i) {
        const float v = xp[i];
        const float density = kInvSqrt2Pi * detail::fast_exp(-0.5f * (v * v));
        o[i] = gp[i] * (detail::fast_normal_cdf(v) + v * density);
      }
      return {gx};
    });
  }
  return out;
}

// Either GELU form on a CUDA device (Note [ops on devices]).
Tensor GeluOnDevice(const Tensor& x, bool tanh_approx) {
  const Device device = x.device();
  Tensor out = detail::new_activation(x.shape(), DType::f32, device);
  kernels::cuda::gelu(device, tanh_approx, x.data<float>(), out.data<float>(), x.numel());
  if (should_record({&x})) {
    detail::record("GeluBackward", {&x}, {&out}, [x, tanh_approx](TensorList&& g) -> TensorList {
      Tensor gx = detail::new_activation(x.shape(), DType::f32, x.device());
      kernels::cuda::gelu_backward(x.device(), tanh_approx, x.data<float>(), g[0].data<float>(), gx.data<float>(),
                                   x.numel());
      return {gx};
    });
  }
  return out;
}

}  // namespace

Tensor relu_compute(const Tensor& x) {
  detail::check_f32_cpu("relu", x);
  Tensor out = detail::new_activation(x.shape());
  const std::int64_t n = x.numel();
  const float* __restrict xp = x.data<float>();
  float* __restrict y = out.data<float>();
  for (std::int64_t i = 0; i < n; ++i) y[i] = xp[i] > 0.f ? xp[i] : 0.f;
  if (should_record({&x})) {
    detail::record("ReluBackward", {&x}, {&out}, [y_saved = out.detach()](TensorList&& g) -> TensorList {
      Tensor gx = detail::new_activation(y_saved.shape());
      const std::int64_t n = gx.numel();
      const float* __restrict yp = y_saved.data<float>();
      const float* __restrict gp = g[0].data<float>();
      float* __restrict o = gx.data<float>();
      for (std::int64_t i = 0; i < n; ++i) o[i] = yp[i] > 0.f ? gp[i] : 0.f;
      return {gx};
    });
  }
  return out;
}

Tensor gelu_compute(const Tensor& x, GeluApproximation approximate) {
  detail::check_f32("gelu", x);
  const bool on_device = x.device().is_cuda();
  switch (approximate) {
    case GeluApproximation::none:
      return on_device ? GeluOnDevice(x, false) : GeluExact(x);
    case GeluApproximation::tanh:
      return on_device ? GeluOnDevice(x, true) : GeluTanh(x);
  }
  SK_CHECK(false) << "gelu: unknown GeluApproximation " << static_cast<int>(approximate);
  return Tensor();
}

Tensor softmax_compute(const Tensor& x) {
  detail::check_f32_cpu("softmax", x);
  const std::int64_t n = LastDim(x);
  const std::int64_t rows = n == 0 ? 0 : x.numel() / n;
  Tensor out = detail::new_activation(x.shape());
  SoftmaxRows(x.data<float>(), out.data<float>(), rows, n, false);
  if (should_record({&x})) {
    detail::record("SoftmaxBackward", {&x}, {&out}, [y = out.detach(), rows, n](TensorList&& g) -> TensorList {
      Tensor gx = detail::new_activation(y.shape());
      const float* yp = y.data<float>();
      const float* gp = g[0].data<float>();
      float* o = gx.data<float>();
      for (std::int64_t r = 0; r < rows; ++r) {
        const float* __restrict yr = yp + r * n;
        const float* __restrict gr = gp + r * n;
        float* __restrict orow = o + r * n;
        const float dot = detail::lane_dot(yr, gr, n);
        for (std::int64_t j = 0; j < n; ++j) orow[j] = yr[j] * (gr[j] - dot);
      }
      return {gx};
    });
  }
  return out;
}

Tensor log_softmax_compute(const Tensor& x) {
  detail::check_f32_cpu("log_softmax", x);
  const std::int64_t n = LastDim(x);
  const std::int64_t rows = n == 0 ? 0 : x.numel() / n;
  Tensor out = detail::new_activation(x.shape());
  SoftmaxRows(x.data<float>(), out.data<float>(), rows, n, true);
  if (should_record({&x})) {
    detail::record("LogSoftmaxBackward", {&x}, {&out}, [y = out.detach(), rows, n](TensorList&& g) -> TensorList {
      // dx = g - softmax * sum(g)
      Tensor gx = detail::new_activation(y.shape());
      const float* yp = y.data<float>();
      const float* gp = g[0].data<float>();
      float* o = gx.data<float>();
      for (std::int64_t r = 0; r < rows; ++r) {
        const float* __restrict yr = yp + r * n;
        const float* __restrict gr = gp + r * n;
        float* __restrict orow = o + r * n;
        const float s = detail::lane_sum(gr, n);
        for (std::int64_t j = 0; j < n; ++j) orow[j] = gr[j] - detail::fast_exp(yr[j]) * s;
      }
      return {gx};
    });
  }
  return out;
}

Tensor dropout_compute(const Tensor& x, float p, bool training) {
  SK_CHECK(p >= 0.f && p < 1.f) << "dropout: expected 0 <= p < 1, found " << p;
  if (!training || p == 0.f) return x;
  detail::check_f32_cpu("dropout", x);
  const std::int64_t n = x.numel();
  // The mask as the scale factor per element (0 or 1 / (1 - p)), kept for backward.
  Tensor mask = detail::new_activation(x.shape());
  float* m = mask.data<float>();
  current_rank_context().generator.fill_uniform(m, n);
  const float keep_scale = 1.f / (1.f - p);
  for (std::int64_t i = 0; i < n; ++i) m[i] = m[i] < p ? 0.f : keep_scale;
  Tensor out = detail::new_activation(x.shape());
  const float* __restrict xp = x.data<float>();
  float* __restrict y = out.data<float>();
  for (std::int64_t i = 0; i < n; ++i) y[i] = xp[i] * m[i];
  if (should_record({&x})) {
    detail::record("DropoutBackward", {&x}, {&out}, [mask](TensorList&& g) -> TensorList {
      Tensor gx = detail::new_activation(mask.shape());
      const std::int64_t n = gx.numel();
      const float* __restrict mp = mask.data<float>();
      const float* __restrict gp = g[0].data<float>();
      float* __restrict o = gx.data<float>();
      for (std::int64_t i = 0; i < n; ++i) o[i] = gp[i] * mp[i];
      return {gx};
    });
  }
  return out;
}

Tensor relu(const Tensor& x) {
  return detail::traced("relu", {x}, [](const TensorList& a) { return relu_compute(a[0]); });
}

Tensor gelu(const Tensor& x, GeluApproximation approximate) {
  return detail::traced("gelu", {x}, [approximate](const TensorList& a) { return gelu_compute(a[0], approximate); });
}

Tensor softmax(const Tensor& x) {
  return detail::traced("softmax", {x}, [](const TensorList& a) { return softmax_compute(a[0]); });
}

Tensor log_softmax(const Tensor& x) {
  return detail::traced("log_softmax", {x}, [](const TensorList& a) { return log_softmax_compute(a[0]); });
}

Tensor dropout(const Tensor& x, float p, bool training) {
  return detail::traced("dropout", {x}, [p, training](const TensorList& a) { return dropout_compute(a[0], p, training); });
}

}  // namespace shardkit::autograd
