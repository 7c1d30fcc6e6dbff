#include "common/optim/fused_kernels.h"

#include <cmath>
#include <type_traits>

#include "common/base/check.h"

namespace shardkit::optim::fused {
namespace {

// The parameter is the fp32 weight array itself: nothing to write back.
struct NoParamOut {};

template <typename G>
inline float load(const G* g, std::int64_t i) {
  if constexpr (std::is_same_v<G, float>) return g[i];
  else if constexpr (std::is_same_v<G, bf16_t>) return bf16_to_f32(g[i]);
  else return f16_bits_to_f32(g[i].bits);
}

template <typename P>
inline void store(P* p, std::int64_t i, float x) {
  if constexpr (std::is_same_v<P, bf16_t>) p[i] = bf16_t{round_to_bf16_bits(x)};
  else if constexpr (std::is_same_v<P, f16_t>) p[i] = f16_t{round_to_f16_bits(x)};
}

// Note [fused loop shape]
// One loop, every value loaded once into a register and every result stored once; coefficients are
// locals (not loads through the struct) and all pointers are __restrict, so gcc vectorises the loop
// without runtime alias checks. sqrtf vectorises because the project builds with -fno-math-errno.
template <typename P, typename G>
void AdamLoop(float* __restrict w, P* __restrict p, const G* __restrict g, float* __restrict m, float* __restrict v,
              std::int64_t n, const AdamCoeffs& c) {
  const float sign = c.sign, l2 = c.l2, decay = c.decay, b1 = c.beta1, omb1 = c.one_minus_beta1, b2 = c.beta2,
              omb2 = c.one_minus_beta2, step_size = c.step_size, inv_sqrt_bc2 = c.inv_sqrt_bc2, eps = c.eps;
  for (std::int64_t i = 0; i < n; ++i) {
    float wi = w[i];
    const float gi = sign * load(g, i) + l2 * wi;
    wi *= decay;
    const float mi = b1 * m[i] + omb1 * gi;
    const float vi = b2 * v[i] + omb2 * (gi * gi);
    const float denom = std::sqrt(vi) * inv_sqrt_bc2 + eps;
    wi -= step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
    w[i] = wi;
    if constexpr (!std::is_same_v<P, NoParamOut>) store(p, i, wi);
  }
}

template <typename P, typename G, bool kMomentum, bool kNesterov>
void SgdLoop(float* __restrict w, P* __restrict p, const G* __restrict g, float* __restrict b, std::int64_t n,
             const SgdCoeffs& c) {
  const float sign = c.sign, wd = c.weight_decay, lr = c.lr, mu = c.momentum, keep = c.keep, take = c.take;
  for (std::int64_t i = 0; i < n; ++i) {
    float wi = w[i];
    float gi = sign * load(g, i) + wd * wi;
    if constexpr (kMomentum) {
      const float bi = keep * b[i] + take * gi;
      b[i] = bi;
      if constexpr (kNesterov) gi = gi + mu * bi;
      else gi = bi;
    }
    wi -= lr * gi;
    w[i] = wi;
    if constexpr (!std::is_same_v<P, NoParamOut>) store(p, i, wi);
  }
}

template <typename P, typename G>
void Sgd(float* w, P* p, const G* g, float* b, std::int64_t n, const SgdCoeffs& c) {
  if (!c.has_momentum) return SgdLoop<P, G, false, false>(w, p, g, nullptr, n, c);
  SK_CHECK(b != nullptr) << "SGD with momentum needs a buffer";
  if (c.nesterov) return SgdLoop<P, G, true, true>(w, p, g, b, n, c);
  return SgdLoop<P, G, true, false>(w, p, g, b, n, c);
}

// Calls fn(P* param_out, const G* grad) with the static types behind the dtypes.
template <typename Fn>
void Dispatch(void* param_out, DType param_dtype, const void* grad, DType grad_dtype, Fn&& fn) {
  auto with_grad = [&](auto* p) {
    switch (grad_dtype) {
      case DType::f32: return fn(p, static_cast<const float*>(grad));
      case DType::bf16: return fn(p, static_cast<const bf16_t*>(grad));
      case DType::f16: return fn(p, static_cast<const f16_t*>(grad));
      case DType::i64: break;
    }
    SK_CHECK(false) << "gradient dtype " << dtype_name(grad_dtype) << " is not floating point";
  };
  if (param_out == nullptr) {
    SK_CHECK(param_dtype == DType::f32) << "a " << dtype_name(param_dtype) << " parameter needs an output";
    return with_grad(static_cast<NoParamOut*>(nullptr));
  }
  switch (param_dtype) {
    case DType::bf16: return with_grad(static_cast<bf16_t*>(param_out));
    case DType::f16: return with_grad(static_cast<f16_t*>(param_out));
    default: break;
  }
  SK_CHECK(false) << "parameter output of dtype " << dtype_name(param_dtype);
}

}  // namespace

AdamCoeffs adam_coeffs(const HyperParams& h, std::int64_t step, bool decoupled) {
  SK_CHECK_GE(step, 1);
  AdamCoeffs c;
  c.sign = h.maximize ? -1.0f : 1.0f;
  c.l2 = decoupled ? 0.0f : static_cast<float>(h.weight_decay);
  c.decay = decoupled ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  const double t = static_cast<double>(step);
  const double bc1 = 1.0 - std::pow(h.beta1, t);
  const double bc2 = 1.0 - std::pow(h.beta2, t);
  c.step_size = static_cast<float>(h.lr / bc1);
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.eps = static_cast<float>(h.eps);
  return c;
}

void adam_step(float* w, void* param_out, DType param_dtype, const void* grad, DType grad_dtype, float* m, float* v,
               std::int64_t n, const AdamCoeffs& c) {
  if (n == 0) return;
  Dispatch(param_out, param_dtype, grad, grad_dtype, [&](auto* p, auto* g) { AdamLoop(w, p, g, m, v, n, c); });
}

SgdCoeffs sgd_coeffs(const HyperParams& h, bool first_momentum_step) {
  SgdCoeffs c;
  c.sign = h.maximize ? -1.0f : 1.0f;
  c.weight_decay = static_cast<float>(h.weight_decay);
  c.lr = static_cast<float>(h.lr);
  c.has_momentum = h.momentum != 0.0;
  c.nesterov = h.nesterov;
  c.momentum = static_cast<float>(h.momentum);
  c.keep = first_momentum_step ? 0.0f : static_cast<float>(h.momentum);
  c.take = first_momentum_step ? 1.0f : static_cast<float>(1.0 - h.dampening);
  return c;
}

void sgd_step(float* w, void* param_out, DType param_dtype, const void* grad, DType grad_dtype, float* buf,
              std::int64_t n, const SgdCoeffs& c) {
  if (n == 0) return;
  Dispatch(param_out, param_dtype, grad, grad_dtype, [&](auto* p, auto* g) { Sgd(w, p, g, buf, n, c); });
}

}  // namespace shardkit::optim::fused
