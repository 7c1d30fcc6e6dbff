// Fused single-pass optimizer kernels (CPU).
//
// Each kernel makes one pass over n elements: it reads the fp32 weights w (the parameter, or its fp32
// master), the gradient g (f32, bf16 or f16, converted to fp32 in registers) and the state buffers, and
// writes w, the state buffers and, when the parameter is bf16/f16, the parameter rounded to nearest even.
// For fp32 AdamW that is 4 streams read and 3 written, 28 bytes per element, which is all the memory
// traffic the algorithm needs (DESIGN.md section 9). A bf16/f16 parameter is written 64 elements behind
// the update, from w read back from L1 (Note [rounding lag] in fused_kernels.cc): the same memory
// traffic, with the rounding off the critical path. The Adam loop runs in 32-element blocks and
// prefetches w, m, v and the gradient 256 elements ahead (Note [software prefetch]). The loops are
// written so gcc vectorises them with -fno-math-errno (Note [no-math-errno] in
// cmake/ShardkitHelpers.cmake) and, for the f16 conversions, -fno-trapping-math (Note [no-trapping-math]
// in common/optim/CMakeLists.txt). Checked with
// -fopt-info-vec-optimized: the Adam and SGD loops for every (parameter, gradient) dtype pair and the
// bf16/f16 rounding loops vectorise, with AVX2 only and with AVX-512.
//
// Arithmetic is fp32; the coefficients are computed once per call in double (coeffs functions below) and
// rounded to fp32. Pointers must not overlap (except as documented). Thread-safety: pure functions.
#pragma once

#include <bit>
#include <cstdint>

#include "common/optim/param_group.h"
#include "common/tensor/dtype.h"

namespace shardkit::optim::fused {

// Adam / AdamW, following torch.optim.Adam / AdamW (bias-corrected, eps added after the square root):
//   g  = sign * grad + l2 * w                  (sign = -1 when maximize; l2 = weight_decay for Adam, 0 for AdamW)
//   w  = w * decay                             (decay = 1 - lr * weight_decay for AdamW, 1 for Adam)
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g * g
//   w -= step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps)   (step_size = lr / (1 - beta1^t),
//                                                           inv_sqrt_bc2 = 1 / sqrt(1 - beta2^t))
struct AdamCoeffs {
  float sign = 1.0f;
  float l2 = 0.0f;
  float decay = 1.0f;
  float beta1 = 0.9f, one_minus_beta1 = 0.1f;
  float beta2 = 0.999f, one_minus_beta2 = 0.001f;
  float step_size = 0.0f;
  float inv_sqrt_bc2 = 1.0f;
  float eps = 1e-8f;
};
// `step` is the 1-based step count after incrementing. decoupled = AdamW.
AdamCoeffs adam_coeffs(const HyperParams& h, std::int64_t step, bool decoupled);

// w, m, v: fp32, n elements. grad: n elements of grad_dtype (f32/bf16/f16). param_out: nullptr when the
// parameter is the fp32 tensor w itself; else n elements of param_dtype (bf16/f16) to receive round(w).
void adam_step(float* w, void* param_out, DType param_dtype, const void* grad, DType grad_dtype, float* m, float* v,
               std::int64_t n, const AdamCoeffs& c);

// SGD, following torch.optim.SGD:
//   g = sign * grad + weight_decay * w
//   with momentum: b = keep * b + take * g     (first step: keep = 0, take = 1, i.e. b = g;
//                                               later: keep = momentum, take = 1 - dampening)
//                  g = nesterov ? g + momentum * b : b
//   w -= lr * g
struct SgdCoeffs {
  float sign = 1.0f;
  float weight_decay = 0.0f;
  float lr = 0.0f;
  bool has_momentum = false;
  bool nesterov = false;
  float momentum = 0.0f;
  float keep = 0.0f;
  float take = 1.0f;
};
// first_momentum_step: the momentum buffer is new (b = g).
SgdCoeffs sgd_coeffs(const HyperParams& h, bool first_momentum_step);

// buf: the momentum buffer (fp32, n elements), or nullptr when !c.has_momentum. Other arguments as adam_step.
void sgd_step(float* w, void* param_out, DType param_dtype, const void* grad, DType grad_dtype, float* buf,
              std::int64_t n, const SgdCoeffs& c);

// fp32 -> bf16 round to nearest even, branch-free; bit-identical to f32_to_bf16 (dtype.h), NaN included
// (a NaN keeps its sign and payload and gets the quiet bit).
// Note [bf16 rounding shape]: the select is made on the 32-bit values and only its result is shifted and
// narrowed. Written as one expression, or with the NaN arm narrowed on its own, gcc 12 narrows the arms
// separately and packs three times instead of once: 8-10 more vector instructions per 16 elements, and the
// rounding loop 40-90% slower on Zen 3. The NaN test is a float compare (one instruction); an integer test
// on the magnitude takes three with AVX2, which has no unsigned compare.
#if defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__
#error "round_to_bf16_bits tests for NaN with f != f; do not build it with -ffinite-math-only (-ffast-math)"
#endif
inline std::uint16_t round_to_bf16_bits(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1u);  // carries into bit 16 past the half way
  const std::uint32_t r = f != f ? (x | 0x00400000u) : rounded;
  return static_cast<std::uint16_t>(r >> 16);
}

// fp32 -> f16 round to nearest even (subnormals, overflow to infinity), branch-free; bit-identical to
// f32_to_f16 (dtype.h), NaN included (a quiet NaN with the sign kept).
inline std::uint16_t round_to_f16_bits(float f) {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  // Normal results: rebias the exponent 127 -> 15 and round to nearest even (wraps mod 2^32 on purpose).
  const std::uint32_t normal = (x + 0xc8000fffu + ((x >> 13) & 1u)) >> 13;
  // Subnormal results: the fp32 addition of 0.5 rounds to the half's unit (2^-24) for us.
  const std::uint32_t sub = std::bit_cast<std::uint32_t>(std::bit_cast<float>(x) + 0.5f) - 0x3f000000u;
  std::uint32_t r = x < 0x38800000u ? sub : normal;
  r = x >= 0x477ff000u ? 0x7c00u : r;  // >= 65520 and infinity
  r = x > 0x7f800000u ? 0x7e00u : r;   // NaN
  return static_cast<std::uint16_t>(sign | r);
}

// f16 -> fp32 (exact), branch-free; bit-identical to f16_to_f32 (dtype.h).
inline float f16_bits_to_f32(std::uint16_t h) {
  const std::uint32_t sign = (std::uint32_t{h} & 0x8000u) << 16;
  const std::uint32_t em = std::uint32_t{h} & 0x7fffu;
  const std::uint32_t normal = (em << 13) + 0x38000000u;                    // rebias exponent 15 -> 127
  const std::uint32_t inf_nan = 0x7f800000u | ((em & 0x3ffu) << 13);
  const std::uint32_t sub = std::bit_cast<std::uint32_t>(static_cast<float>(em) * 5.9604644775390625e-8f);  // em * 2^-24
  const std::uint32_t r = em >= 0x7c00u ? inf_nan : (em < 0x400u ? sub : normal);
  return std::bit_cast<float>(sign | r);
}

// dst[i] = round_to_*_bits(src[i]) for i < n, vectorised: what the kernels write a bf16/f16 parameter
// with. src and dst must not overlap.
void round_to_bf16(const float* src, bf16_t* dst, std::int64_t n);
void round_to_f16(const float* src, f16_t* dst, std::int64_t n);

}  // namespace shardkit::optim::fused
