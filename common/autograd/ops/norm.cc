#include "common/autograd/ops/norm.h"

#include <cmath>

#include "common/autograd/ops/fast_math.h"
#include "common/autograd/ops/op_utils.h"
#include "common/kernels/cuda/cuda_kernels.h"

namespace shardkit::autograd {
namespace {

void CheckParam(const char* op, const Tensor& p, std::int64_t c, const char* what, Device device = Device::cpu()) {
  if (!p.defined()) return;
  if (device.is_cpu()) {
    detail::check_f32_cpu(op, p);
  } else {
    detail::check_f32(op, p);
    detail::check_on(op, p, device);
  }
  SK_CHECK(p.dim() == 1 && p.size(0) == c) << op << ": expected " << what << " [" << c << "], found " << p.describe();
}

// layer_norm on a CUDA device (Note [ops on devices]); arguments checked by the caller.
Tensor LayerNormOnDevice(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps, std::int64_t rows,
                         std::int64_t c) {
  const Device device = x.device();
  Tensor out = detail::new_activation(x.shape(), DType::f32, device);
  Tensor mean_t = detail::new_activation({rows}, DType::f32, device);
  Tensor rstd_t = detail::new_activation({rows}, DType::f32, device);
  kernels::cuda::layer_norm(device, x.data<float>(), detail::ptr_or_null<float>(weight),
                            detail::ptr_or_null<float>(bias), out.data<float>(), mean_t.data<float>(),
                            rstd_t.data<float>(), rows, c, eps);
  if (should_record({&x, &weight, &bias})) {
    detail::record("LayerNormBackward", {&x, &weight, &bias}, {&out},
                   [x, weight, mean_t, rstd_t, rows, c, need_x = detail::needs_grad(x),
                    need_w = detail::needs_grad(weight),
                    need_b = detail::needs_grad(bias)](TensorList&& g) -> TensorList {
                     const Device device = x.device();
                     Tensor gx, gw, gb;
                     if (need_x) gx = detail::new_activation(x.shape(), DType::f32, device);
                     if (need_w) gw = detail::new_activation({c}, DType::f32, device);
                     if (need_b) gb = detail::new_activation({c}, DType::f32, device);
                     kernels::cuda::layer_norm_backward(
                         device, x.data<float>(), g[0].data<float>(), detail::ptr_or_null<float>(weight),
                         mean_t.data<float>(), rstd_t.data<float>(), detail::ptr_or_null<float>(gx),
                         detail::ptr_or_null<float>(gw), detail::ptr_or_null<float>(gb), rows, c);
                     return {gx, gw, gb};
                   });
  }
  return out;
}

}  // namespace

Tensor layer_norm_compute(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps) {
  detail::check_f32("layer_norm", x);
  SK_CHECK_GE(x.dim(), 1) << "layer_norm of a 0-d tensor";
  const std::int64_t c = x.size(-1);
  const std::int64_t rows = c == 0 ? 0 : x.numel() / c;
  CheckParam("layer_norm", weight, c, "weight", x.device());
  CheckParam("layer_norm", bias, c, "bias", x.device());
  if (x.device().is_cuda()) return LayerNormOnDevice(x, weight, bias, eps, rows, c);
  Tensor out = detail::new_activation(x.shape());
  Tensor mean_t = detail::new_activation({rows});
  Tensor rstd_t = detail::new_activation({rows});
  const float* xp = x.data<float>();
  const float* w = weight.defined() ? weight.data<float>() : nullptr;
  const float* b = bias.defined() ? bias.data<float>() : nullptr;
  float* y = out.data<float>();
  float* mp = mean_t.data<float>();
  float* rp = rstd_t.data<float>();
  const float inv_c = 1.f / static_cast<float>(c);
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* __restrict xr = xp + r * c;
    float* __restrict yr = y + r * c;
    // Row sums in lanes (Note [lane sums] in fast_math.h).
    const float mean = detail::lane_sum(xr, c) * inv_c;
    const float v = detail::lane_sum_of(c, [xr, mean](std::int64_t j) { return (xr[j] - mean) * (xr[j] - mean); });
    const float rstd = 1.f / std::sqrt(v * inv_c + eps);
    mp[r] = mean;
    rp[r] = rstd;
    if (w != nullptr && b != nullptr) {
      for (std::int64_t j = 0; j < c; ++j) yr[j] = (xr[j] - mean) * rstd * w[j] + b[j];
    } else {
      for (std::int64_t j = 0; j < c; ++j) {
        float t = (xr[j] - mean) * rstd;
        if (w != nullptr) t *= w[j];
        if (b != nullptr) t += b[j];
        yr[j] = t;
      }
    }
  }
  if (should_record({&x, &weight, &bias})) {
    detail::record(
        "LayerNormBackward", {&x, &weight, &bias}, {&out},
        [x, weight, mean_t, rstd_t, rows, c, need_x = detail::needs_grad(x), need_w = detail::needs_grad(weight),
         need_b = detail::needs_grad(bias)](TensorList&& g) -> TensorList {
          Tensor gx, gw, gb;
          if (need_x) gx = detail::new_activation(x.shape());
          if (need_w) gw = detail::zeros_activation({c});
          if (need_b) gb = detail::zeros_activation({c});
          const float* xp = x.data<float>();
          const float* gp = g[0].data<float>();
          const float* w = weight.defined() ? weight.data<float>() : nullptr;
          const float* mp = mean_t.data<float>();
          const float* rp = rstd_t.data<float>();
          float* gxp = need_x ? gx.data<float>() : nullptr;
          float* gwp = need_w ? gw.data<float>() : nullptr;
          float* gbp = need_b ? gb.data<float>() : nullptr;
          const float inv_c = 1.f / static_cast<float>(c);
          for (std::int64_t r = 0; r < rows; ++r) {
            const float* __restrict xr = xp + r * c;
            const float* __restrict gr = gp + r * c;
            const float mean = mp[r], rstd = rp[r];
            if (gwp != nullptr) {
              for (std::int64_t j = 0; j < c; ++j) gwp[j] += gr[j] * (xr[j] - mean) * rstd;
            }
            if (gbp != nullptr) {
              for (std::int64_t j = 0; j < c; ++j) gbp[j] += gr[j];
            }
            if (gxp == nullptr) continue;
            // dxhat = g * w; dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
            auto dxhat = [gr, w](std::int64_t j) { return w != nullptr ? gr[j] * w[j] : gr[j]; };
            const float s1 = detail::lane_sum_of(c, dxhat) * inv_c;
            const float s2 =
                detail::lane_sum_of(c, [&](std::int64_t j) { return dxhat(j) * (xr[j] - mean) * rstd; }) * inv_c;
            float* __restrict gxr = gxp + r * c;
            for (std::int64_t j = 0; j < c; ++j) {
              const float xh = (xr[j] - mean) * rstd;
              gxr[j] = rstd * (dxhat(j) - s1 - xh * s2);
            }
          }
          return {gx, gw, gb};
        });
  }
  return out;
}

Tensor batch_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                  const Tensor& running_var, bool training, float momentum, float eps) {
  // Not replayable yet: it updates the running statistics in place, which the trace hook's kernels do not
  // describe. A captured step that uses it fails naming it.
  if (trace::Tracer* t = trace::active_tracer()) t->on_unsupported("batch_norm (updates running statistics in place)");
  detail::check_f32_cpu("batch_norm", x);
  SK_CHECK_EQ(x.dim(), 2) << "batch_norm: expected x [N, C], found " << x.describe();
  const std::int64_t n = x.size(0), c = x.size(1);
  CheckParam("batch_norm", weight, c, "weight");
  CheckParam("batch_norm", bias, c, "bias");
  CheckParam("batch_norm", running_mean, c, "running_mean");
  CheckParam("batch_norm", running_var, c, "running_var");
  if (!training) {
    SK_CHECK(running_mean.defined() && running_var.defined()) << "batch_norm: evaluation needs running statistics";
  } else {
    SK_CHECK_GT(n, 1) << "batch_norm: training needs more than one sample per feature, found x " << x.describe();
  }
  Tensor mean_t = detail::new_activation({c});
  Tensor rstd_t = detail::new_activation({c});
  float* mp = mean_t.data<float>();
  float* rp = rstd_t.data<float>();
  const float* xp = x.data<float>();
  if (training) {
    std::vector<double> s(static_cast<std::size_t>(c), 0.0), sq(static_cast<std::size_t>(c), 0.0);
    for (std::int64_t i = 0; i < n; ++i) {
      for (std::int64_t j = 0; j < c; ++j) s[static_cast<std::size_t>(j)] += xp[i * c + j];
    }
    for (std::int64_t j = 0; j < c; ++j) mp[j] = static_cast<float>(s[static_cast<std::size_t>(j)] / static_cast<double>(n));
    for (std::int64_t i = 0; i < n; ++i) {
      for (std::int64_t j = 0; j < c; ++j) {
        const double d = xp[i * c + j] - mp[j];
        sq[static_cast<std::size_t>(j)] += d * d;
      }
    }
    for (std::int64_t j = 0; j < c; ++j) {
      const double var = sq[static_cast<std::size_t>(j)] / static_cast<double>(n);
      rp[j] = static_cast<float>(1.0 / std::sqrt(var + eps));
      if (running_mean.defined()) {
        float* rm = running_mean.data<float>();
        rm[j] = (1.f - momentum) * rm[j] + momentum * mp[j];
      }
      if (running_var.defined()) {
        float* rv = running_var.data<float>();
        const double unbiased = sq[static_cast<std::size_t>(j)] / static_cast<double>(n - 1);
        rv[j] = (1.f - momentum) * rv[j] + momentum * static_cast<float>(unbiased);
      }
    }
  } else {
    const float* rm = running_mean.data<float>();
    const float* rv = running_var.data<float>();
    for (std::int64_t j = 0; j < c; ++j) {
      mp[j] = rm[j];
      rp[j] = 1.f / std::sqrt(rv[j] + eps);
    }
  }
  Tensor out = detail::new_activation(x.shape());
  float* y = out.data<float>();
  const float* w = weight.defined() ? weight.data<float>() : nullptr;
  const float* b = bias.defined() ? bias.data<float>() : nullptr;
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = 0; j < c; ++j) {
      float t = (xp[i * c + j] - mp[j]) * rp[j];
      if (w != nullptr) t *= w[j];
      if (b != nullptr) t += b[j];
      y[i * c + j] = t;
    }
  }
  if (should_record({&x, &weight, &bias})) {
    detail::record(
        "BatchNormBackward", {&x, &weight, &bias}, {&out},
        [x, weight, mean_t, rstd_t, n, c, training, need_x = detail::needs_grad(x),
         need_w = detail::needs_grad(weight), need_b = detail::needs_grad(bias)](TensorList&& g) -> TensorList {
          const float* xp = x.data<float>();
          const float* gp = g[0].data<float>();
          const float* w = weight.defined() ? weight.data<float>() : nullptr;
          const float* mp = mean_t.data<float>();
          const float* rp = rstd_t.data<float>();
          std::vector<float> sum_dy(static_cast<std::size_t>(c), 0.f), sum_dy_xh(static_cast<std::size_t>(c), 0.f);
          for (std::int64_t i = 0; i < n; ++i) {
            for (std::int64_t j = 0; j < c; ++j) {
              const float dy = gp[i * c + j];
              sum_dy[static_cast<std::size_t>(j)] += dy;
              sum_dy_xh[static_cast<std::size_t>(j)] += dy * (xp[i * c + j] - mp[j]) * rp[j];
            }
          }
          Tensor gx, gw, gb;
          if (need_w) {
            gw = detail::new_activation({c});
            for (std::int64_t j = 0; j < c; ++j) gw.data<float>()[j] = sum_dy_xh[static_cast<std::size_t>(j)];
          }
          if (need_b) {
            gb = detail::new_activation({c});
            for (std::int64_t j = 0; j < c; ++j) gb.data<float>()[j] = sum_dy[static_cast<std::size_t>(j)];
          }
          if (need_x) {
            gx = detail::new_activation(x.shape());
            float* o = gx.data<float>();
            const float inv_n = 1.f / static_cast<float>(n);
            for (std::int64_t i = 0; i < n; ++i) {
              for (std::int64_t j = 0; j < c; ++j) {
                const float scale = (w != nullptr ? w[j] : 1.f) * rp[j];
                const float dy = gp[i * c + j];
                if (!training) {
                  o[i * c + j] = dy * scale;
                } else {
                  const float xh = (xp[i * c + j] - mp[j]) * rp[j];
                  o[i * c + j] = scale * (dy - sum_dy[static_cast<std::size_t>(j)] * inv_n -
                                          xh * sum_dy_xh[static_cast<std::size_t>(j)] * inv_n);
                }
              }
            }
          }
          return {gx, gw, gb};
        });
  }
  return out;
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps) {
  return detail::traced("layer_norm", {x, weight, bias}, [eps](const TensorList& t) { return layer_norm_compute(t[0], t[1], t[2], eps); });
}

}  // namespace shardkit::autograd
