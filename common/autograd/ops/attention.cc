#include "common/autograd/ops/attention.h"

#include <cmath>

#include "common/autograd/ops/fast_math.h"
#include "common/autograd/ops/gemm_timing.h"
#include "common/autograd/ops/op_utils.h"
#include "common/kernels/cuda/bf16_gemm_plan.h"
#include "common/kernels/cuda/cuda_kernels.h"
#include "common/tensor/rank_context.h"

namespace shardkit::autograd {
namespace {

// Row-wise causal softmax of s [T, T] in place: row i keeps columns 0..i.
void CausalSoftmax(float* s, std::int64_t t) {
  for (std::int64_t i = 0; i < t; ++i) {
    float* __restrict row = s + i * t;
    // Max and sum in lanes (Note [lane sums] in fast_math.h), so the exp loop vectorises.
    const float mx = detail::lane_max(row, i + 1);
    for (std::int64_t j = 0; j <= i; ++j) row[j] = detail::fast_exp(row[j] - mx);
    const float sum = detail::lane_sum(row, i + 1);
    const float inv = 1.f / sum;
    for (std::int64_t j = 0; j <= i; ++j) row[j] *= inv;
    for (std::int64_t j = i + 1; j < t; ++j) row[j] = 0.f;
  }
}

// Note [softmax writes the bf16 copy]
// At matmul precision medium, attention's products whose n is the head size (Y = P V, dV = P^T dY, dQ = scale dS K,
// dK = scale dS^T Q: m = k = T, n = hs) fail medium_gemm_runs_on_bf16_copies: copying the T x T operand to bf16 (a
// read of 4 T^2 bytes and a write of 2 T^2) costs more than bf16 tensor cores save on 2 T^2 hs flops. So they ran
// TF32: on an H200 (Nsight Compute), 5.6 ms of a 26.8 ms GPT-2 small training step (T = 1024, hs = 64, 12 heads,
// fused_attention off). But P and dS are written by our own softmax kernels, which hold each value in a register
// when they store it: storing its bf16 copy too costs 2 bytes a value and no pass of its own. With that copy only
// the T x hs operand (V, K or Q) is copied, inside gemm_strided_batched_on_bf16_a, and the product runs on bf16
// tensor cores with fp32 accumulation: the rounding "medium" applies to every other GEMM of the step. The forward's
// copy of P lives only until Y = P V is queued (the fp32 P stays the saved activation, as before: keeping the copy
// as well would hold B H T^2 bf16 more from forward to backward); the backward's copy of dS is per batch element,
// like dS. dV = P^T dY stays as it is: it would need P re-packed from the saved fp32 P, the pass that did not pay.
// Which sizes take this path is attention_runs_on_softmax_copies (bf16_gemm_plan.h): where the head-wide products
// would otherwise run TF32 and the T x T ones (S, dP) already run on bf16.

// Causal attention on a CUDA device (Note [ops on devices]): per batch element, one strided-batched GEMM over the
// heads for each product, and the causal softmax over all score matrices at once. The scores [B, H, T, T] are
// materialised and saved for the backward, as on the CPU.
Tensor AttentionOnDevice(const Tensor& qkv, std::int64_t b_n, std::int64_t t, std::int64_t c, std::int64_t num_heads,
                         std::int64_t hs, float scale) {
  namespace kc = kernels::cuda;
  const Device device = qkv.device();
  Tensor out = detail::new_activation({b_n, t, c}, DType::f32, device);
  Tensor att = detail::new_activation({b_n, num_heads, t, t}, DType::f32, device);
  const float* in = qkv.data<float>();
  float* y = out.data<float>();
  float* a = att.data<float>();
  // The backward multiplies at the forward's precision (Note [matmul precision]).
  const MatmulPrecision precision = current_rank_context().matmul_precision;
  // Note [softmax writes the bf16 copy]: the softmax writes P's bf16 copy, and Y = P V runs on it.
  const bool on_copies = precision == MatmulPrecision::medium && kc::attention_runs_on_softmax_copies(t, hs);
  const std::int64_t copy_numel = kc::packed_bf16_numel(t, t);  // one matrix's copy
  for (std::int64_t b = 0; b < b_n; ++b) {  // S = scale Q K^T
    const float* q = in + b * t * 3 * c;
    kc::gemm_strided_batched(device, false, true, t, t, hs, scale, q, 3 * c, hs, q + c, 3 * c, hs, 0.f,
                             a + b * num_heads * t * t, t, t * t, num_heads, precision);
  }
  const Tensor p16 = on_copies ? detail::new_activation({b_n * num_heads * copy_numel}, DType::bf16, device) : Tensor();
  kc::causal_softmax(device, a, b_n * num_heads, t, on_copies ? p16.raw_data() : nullptr);
  for (std::int64_t b = 0; b < b_n; ++b) {  // Y = P V
    const float* v = in + b * t * 3 * c + 2 * c;
    if (on_copies) {
      kc::gemm_strided_batched_on_bf16_a(device, false, false, t, hs, t, 1.f,
                                         p16.data<bf16_t>() + b * num_heads * copy_numel, v, 3 * c, hs, 0.f,
                                         y + b * t * c, c, hs, num_heads);
    } else {
      kc::gemm_strided_batched(device, false, false, t, hs, t, 1.f, a + b * num_heads * t * t, t, t * t, v, 3 * c,
                               hs, 0.f, y + b * t * c, c, hs, num_heads, precision);
    }
  }
  if (should_record({&qkv})) {
    detail::record("CausalAttentionBackward", {&qkv}, {&out},
                   [qkv, att, b_n, t, c, num_heads, hs, scale, precision, on_copies,
                    copy_numel](TensorList&& g) -> TensorList {
                     const Device device = qkv.device();
                     Tensor gqkv = detail::new_activation(qkv.shape(), DType::f32, device);
                     Tensor ds_t = detail::new_activation({num_heads, t, t}, DType::f32, device);
                     // dS's bf16 copy, for dQ and dK (Note [softmax writes the bf16 copy]).
                     const Tensor ds16 = on_copies ? detail::new_activation({num_heads * copy_numel}, DType::bf16,
                                                                            device)
                                                   : Tensor();
                     const float* in = qkv.data<float>();
                     const float* gy = g[0].data<float>();
                     const float* a = att.data<float>();
                     float* gin = gqkv.data<float>();
                     float* ds = ds_t.data<float>();
                     for (std::int64_t b = 0; b < b_n; ++b) {
                       const float* q = in + b * t * 3 * c;
                       const float* k = q + c;
                       const float* v = q + 2 * c;
                       float* dq = gin + b * t * 3 * c;
                       float* dk = dq + c;
                       float* dv = dq + 2 * c;
                       const float* p = a + b * num_heads * t * t;
                       const float* dy = gy + b * t * c;
                       // dV = P^T dY; dP = dY V^T; dS = P * (dP - rowsum(P * dP)); dQ = scale dS K; dK = scale dS^T Q
                       kc::gemm_strided_batched(device, true, false, t, hs, t, 1.f, p, t, t * t, dy, c, hs, 0.f, dv,
                                                3 * c, hs, num_heads, precision);
                       kc::gemm_strided_batched(device, false, true, t, t, hs, 1.f, dy, c, hs, v, 3 * c, hs, 0.f, ds,
                                                t, t * t, num_heads, precision);
                       kc::causal_softmax_backward(device, p, ds, num_heads, t, on_copies ? ds16.raw_data() : nullptr);
                       if (on_copies) {
                         kc::gemm_strided_batched_on_bf16_a(device, false, false, t, hs, t, scale, ds16.raw_data(), k,
                                                            3 * c, hs, 0.f, dq, 3 * c, hs, num_heads);
                         kc::gemm_strided_batched_on_bf16_a(device, true, false, t, hs, t, scale, ds16.raw_data(), q,
                                                            3 * c, hs, 0.f, dk, 3 * c, hs, num_heads);
                       } else {
                         kc::gemm_strided_batched(device, false, false, t, hs, t, scale, ds, t, t * t, k, 3 * c, hs,
                                                  0.f, dq, 3 * c, hs, num_heads, precision);
                         kc::gemm_strided_batched(device, true, false, t, hs, t, scale, ds, t, t * t, q, 3 * c, hs,
                                                  0.f, dk, 3 * c, hs, num_heads, precision);
                       }
                     }
                     return {gqkv};
                   });
  }
  return out;
}

// At matmul precision medium, on a device that runs it, one fused kernel each way (Note [flash attention] in
// common/kernels/cuda/flash_attention.cu): its products take bf16 operands with fp32 accumulation, as medium's GEMMs
// do, and no [B, H, T, T] matrix is ever in memory. Saves the result and each row's log-sum-exp for the backward.
Tensor FlashAttentionOnDevice(const Tensor& qkv, std::int64_t b_n, std::int64_t t, std::int64_t c,
                              std::int64_t num_heads, std::int64_t hs, float scale) {
  namespace kc = kernels::cuda;
  const Device device = qkv.device();
  Tensor out = detail::new_activation({b_n, t, c}, DType::f32, device);
  Tensor lse = detail::new_activation({b_n, num_heads, t}, DType::f32, device);
  kc::flash_attention(device, qkv.data<float>(), out.data<float>(), lse.data<float>(), b_n, t, num_heads, hs, scale);
  if (should_record({&qkv})) {
    detail::record("CausalAttentionBackward", {&qkv}, {&out},
                   [qkv, y = out.detach(), lse, b_n, t, num_heads, hs, scale](TensorList&& g) -> TensorList {
                     const Device device = qkv.device();
                     Tensor gqkv = detail::new_activation(qkv.shape(), DType::f32, device);
                     kc::flash_attention_backward(device, qkv.data<float>(), y.data<float>(), g[0].data<float>(),
                                                  lse.data<float>(), gqkv.data<float>(), b_n, t, num_heads, hs,
                                                  scale);
                     return {gqkv};
                   });
  }
  return out;
}

}  // namespace

Tensor causal_attention_compute(const Tensor& qkv, std::int64_t num_heads) {
  detail::check_f32("causal_attention", qkv);
  SK_CHECK(qkv.dim() == 3 && qkv.size(2) % 3 == 0) << "causal_attention: expected qkv [B, T, 3C], found "
                                                   << qkv.describe();
  const std::int64_t b_n = qkv.size(0), t = qkv.size(1), c = qkv.size(2) / 3;
  SK_CHECK(num_heads > 0 && c % num_heads == 0) << "causal_attention: width " << c << " is not divisible by "
                                                << num_heads << " heads";
  const std::int64_t hs = c / num_heads;
  const float scale = 1.f / std::sqrt(static_cast<float>(hs));
  if (qkv.device().is_cuda()) {
    const RankContext& ctx = current_rank_context();
    if (ctx.matmul_precision == MatmulPrecision::medium && ctx.fused_attention &&
        kernels::cuda::flash_attention_supported(qkv.device(), hs)) {
      return FlashAttentionOnDevice(qkv, b_n, t, c, num_heads, hs, scale);
    }
    return AttentionOnDevice(qkv, b_n, t, c, num_heads, hs, scale);
  }
  Tensor out = detail::new_activation({b_n, t, c});
  Tensor att = detail::new_activation({b_n, num_heads, t, t});
  const float* in = qkv.data<float>();
  float* y = out.data<float>();
  float* a = att.data<float>();
  for (std::int64_t b = 0; b < b_n; ++b) {
    for (std::int64_t h = 0; h < num_heads; ++h) {
      const float* q = in + b * t * 3 * c + h * hs;
      const float* k = q + c;
      const float* v = q + 2 * c;
      float* s = a + (b * num_heads + h) * t * t;
      detail::timed_gemm(false, true, t, t, hs, scale, q, 3 * c, k, 3 * c, 0.f, s, t);
      CausalSoftmax(s, t);
      detail::timed_gemm(false, false, t, hs, t, 1.f, s, t, v, 3 * c, 0.f, y + b * t * c + h * hs, c);
    }
  }
  if (should_record({&qkv})) {
    detail::record("CausalAttentionBackward", {&qkv}, {&out},
                   [qkv, att, b_n, t, c, num_heads, hs, scale](TensorList&& g) -> TensorList {
                     Tensor gqkv = detail::new_activation(qkv.shape());
                     Tensor datt_t = detail::new_activation({t, t});
                     const float* in = qkv.data<float>();
                     const float* gy = g[0].data<float>();
                     const float* a = att.data<float>();
                     float* gin = gqkv.data<float>();
                     float* datt = datt_t.data<float>();
                     for (std::int64_t b = 0; b < b_n; ++b) {
                       for (std::int64_t h = 0; h < num_heads; ++h) {
                         const std::int64_t off = b * t * 3 * c + h * hs;
                         const float* q = in + off;
                         const float* k = q + c;
                         const float* v = q + 2 * c;
                         float* dq = gin + off;
                         float* dk = dq + c;
                         float* dv = dq + 2 * c;
                         const float* p = a + (b * num_heads + h) * t * t;
                         const float* dy = gy + b * t * c + h * hs;
                         // dV = P^T dY; dP = dY V^T
                         detail::timed_gemm(true, false, t, hs, t, 1.f, p, t, dy, c, 0.f, dv, 3 * c);
                         detail::timed_gemm(false, true, t, t, hs, 1.f, dy, c, v, 3 * c, 0.f, datt, t);
                         // dS = P * (dP - rowsum(P * dP)), causal rows.
                         for (std::int64_t i = 0; i < t; ++i) {
                           const float* __restrict pr = p + i * t;
                           float* __restrict dr = datt + i * t;
                           const float dot = detail::lane_dot(pr, dr, i + 1);
                           for (std::int64_t j = 0; j <= i; ++j) dr[j] = pr[j] * (dr[j] - dot);
                           for (std::int64_t j = i + 1; j < t; ++j) dr[j] = 0.f;
                         }
                         // dQ = scale dS K; dK = scale dS^T Q
                         detail::timed_gemm(false, false, t, hs, t, scale, datt, t, k, 3 * c, 0.f, dq, 3 * c);
                         detail::timed_gemm(true, false, t, hs, t, scale, datt, t, q, 3 * c, 0.f, dk, 3 * c);
                       }
                     }
                     return {gqkv};
                   });
  }
  return out;
}

Tensor causal_attention(const Tensor& qkv, std::int64_t num_heads) {
  return detail::traced("causal_attention", {qkv}, [num_heads](const TensorList& a) { return causal_attention_compute(a[0], num_heads); });
}

}  // namespace shardkit::autograd
