// The kernels::cuda functions in the CPU library: each forwards to the implementation that shardkit::cuda
// registers (Note [cuda component] in common/cuda/cuda_component.h), or throws InternalError saying why CUDA
// is absent from this program.
#include <algorithm>
#include <limits>
#include <string>

#include "common/base/check.h"
#include "common/kernels/cuda/bf16_gemm_plan.h"
#include "common/kernels/cuda/cuda_kernels.h"
#include "common/tensor/device_memory.h"
#include "common/tensor/startup_registry.h"

namespace shardkit::kernels::cuda {
namespace {

constinit detail::StartupRegistry<CudaKernelOps> g_cuda_kernels;  // written once, at static-init time

const CudaKernelOps& Ops(const char* what) {
  const CudaKernelOps* ops = g_cuda_kernels.get();
  if (ops == nullptr) throw InternalError(std::string(what) + ": " + detail::cuda_unavailable_reason());
  return *ops;
}

}  // namespace

void register_cuda_kernels(const CudaKernelOps* ops) { g_cuda_kernels.set(ops, "CUDA kernels"); }

void gemm(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
          const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
          std::int64_t ldc, MatmulPrecision precision) {
  Ops("cuda::gemm").gemm(device, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, precision);
}
// These two check their contracts here, before the call is queued on a stream, so a bad call throws where it is made.
void pack_bf16(Device device, const float* src, std::int64_t rows, std::int64_t cols, std::int64_t ld, void* dst) {
  SK_CHECK(rows >= 0 && cols >= 0 && ld >= std::max<std::int64_t>(1, cols))
      << "cuda::pack_bf16: rows=" << rows << " cols=" << cols << " ld=" << ld;
  Ops("cuda::pack_bf16").pack_bf16(device, src, rows, cols, ld, dst);
}
void gemm_on_bf16_copies(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                         float alpha, const void* a16, const void* b16, float beta, float* c, std::int64_t ldc) {
  SK_CHECK(m >= 1 && n >= 1 && k >= 1 && medium_gemm_runs_on_bf16_copies(m, n, k) && ldc >= n &&
           ldc <= std::numeric_limits<int>::max())
      << "cuda::gemm_on_bf16_copies: m=" << m << " n=" << n << " k=" << k << " ldc=" << ldc
      << " is not a product that runs on bf16 copies (medium_gemm_runs_on_bf16_copies)";
  Ops("cuda::gemm_on_bf16_copies")
      .gemm_on_bf16_copies(device, trans_a, trans_b, m, n, k, alpha, a16, b16, beta, c, ldc);
}
void gemm_strided_batched_on_bf16_a(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n,
                                    std::int64_t k, float alpha, const void* a16, const float* b, std::int64_t ldb,
                                    std::int64_t stride_b, float beta, float* c, std::int64_t ldc,
                                    std::int64_t stride_c, std::int64_t batches) {
  constexpr std::int64_t kMax = std::numeric_limits<int>::max();
  SK_CHECK(m >= 1 && n >= 1 && k >= 1 && batches >= 1 && round_up_to_pad(std::max({m, n, k})) <= kMax &&
           ldb >= (trans_b ? k : n) && ldb <= kMax && ldc >= n && ldc <= kMax && batches <= kMax &&
           (batches == 1 || (stride_b >= 0 && stride_c >= 0)))
      << "cuda::gemm_strided_batched_on_bf16_a: m=" << m << " n=" << n << " k=" << k << " ldb=" << ldb
      << " stride_b=" << stride_b << " ldc=" << ldc << " stride_c=" << stride_c << " batches=" << batches;
  Ops("cuda::gemm_strided_batched_on_bf16_a")
      .gemm_strided_batched_on_bf16_a(device, trans_a, trans_b, m, n, k, alpha, a16, b, ldb, stride_b, beta, c, ldc,
                                      stride_c, batches);
}
std::string cublas_load_error() {
  const CudaKernelOps* ops = g_cuda_kernels.get();
  return ops != nullptr ? ops->cublas_load_error() : detail::cuda_unavailable_reason();
}
double sum(Device device, const void* x, DType dtype, std::int64_t n) {
  return Ops("cuda::sum").sum(device, x, dtype, n);
}
double sum_squares(Device device, const void* x, DType dtype, std::int64_t n) {
  return Ops("cuda::sum_squares").sum_squares(device, x, dtype, n);
}
double max_abs(Device device, const void* x, DType dtype, std::int64_t n) {
  return Ops("cuda::max_abs").max_abs(device, x, dtype, n);
}
void add(Device device, const float* a, const float* b, float* out, std::int64_t n) {
  Ops("cuda::add").add(device, a, b, out, n);
}
void sub(Device device, const float* a, const float* b, float* out, std::int64_t n) {
  Ops("cuda::sub").sub(device, a, b, out, n);
}
void mul(Device device, const float* a, const float* b, float* out, std::int64_t n) {
  Ops("cuda::mul").mul(device, a, b, out, n);
}
void scale(Device device, float s, const float* a, float* out, std::int64_t n) {
  Ops("cuda::scale").scale(device, s, a, out, n);
}
void axpy(Device device, float alpha, const float* x, float* y, std::int64_t n) {
  Ops("cuda::axpy").axpy(device, alpha, x, y, n);
}
void axpby(Device device, float alpha, const float* x, float beta, float* y, std::int64_t n) {
  Ops("cuda::axpby").axpby(device, alpha, x, beta, y, n);
}
void fill(Device device, float* x, std::int64_t n, float value) { Ops("cuda::fill").fill(device, x, n, value); }
void cast(Device device, const void* src, DType src_dtype, void* dst, DType dst_dtype, std::int64_t n) {
  Ops("cuda::cast").cast(device, src, src_dtype, dst, dst_dtype, n);
}
void copy_bytes(const void* src, Device src_device, void* dst, Device dst_device, std::size_t nbytes) {
  Ops("cuda::copy_bytes").copy_bytes(src, src_device, dst, dst_device, nbytes);
}

void broadcast_rows(Device device, RowOp op, const float* a, const float* b, float* out, std::int64_t rows,
                    std::int64_t n) {
  Ops("cuda::broadcast_rows").broadcast_rows(device, op, a, b, out, rows, n);
}
void sum_rows(Device device, const float* x, float* out, std::int64_t rows, std::int64_t n, bool accumulate) {
  Ops("cuda::sum_rows").sum_rows(device, x, out, rows, n, accumulate);
}
void gelu(Device device, bool tanh_approx, const float* x, float* y, std::int64_t n) {
  Ops("cuda::gelu").gelu(device, tanh_approx, x, y, n);
}
void gelu_backward(Device device, bool tanh_approx, const float* x, const float* gy, float* gx, std::int64_t n) {
  Ops("cuda::gelu_backward").gelu_backward(device, tanh_approx, x, gy, gx, n);
}
void layer_norm(Device device, const float* x, const float* w, const float* b, float* y, float* mean, float* rstd,
                std::int64_t rows, std::int64_t c, float eps) {
  Ops("cuda::layer_norm").layer_norm(device, x, w, b, y, mean, rstd, rows, c, eps);
}
void layer_norm_backward(Device device, const float* x, const float* gy, const float* w, const float* mean,
                         const float* rstd, float* gx, float* gw, float* gb, std::int64_t rows, std::int64_t c) {
  Ops("cuda::layer_norm_backward").layer_norm_backward(device, x, gy, w, mean, rstd, gx, gw, gb, rows, c);
}
void causal_softmax(Device device, float* s, std::int64_t matrices, std::int64_t t, void* out16) {
  Ops("cuda::causal_softmax").causal_softmax(device, s, matrices, t, out16);
}
void causal_softmax_backward(Device device, const float* p, float* dp, std::int64_t matrices, std::int64_t t,
                             void* out16) {
  Ops("cuda::causal_softmax_backward").causal_softmax_backward(device, p, dp, matrices, t, out16);
}
void gemm_strided_batched(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n,
                          std::int64_t k, float alpha, const float* a, std::int64_t lda, std::int64_t stride_a,
                          const float* b, std::int64_t ldb, std::int64_t stride_b, float beta, float* c,
                          std::int64_t ldc, std::int64_t stride_c, std::int64_t batches, MatmulPrecision precision) {
  Ops("cuda::gemm_strided_batched")
      .gemm_strided_batched(device, trans_a, trans_b, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c,
                            ldc, stride_c, batches, precision);
}
bool flash_attention_supported(Device device, std::int64_t hs) {
  const CudaKernelOps* ops = g_cuda_kernels.get();
  return ops != nullptr && ops->flash_attention_supported(device, hs);
}
void flash_attention(Device device, const float* qkv, float* y, float* lse, std::int64_t b_n, std::int64_t t,
                     std::int64_t heads, std::int64_t hs, float scale) {
  Ops("cuda::flash_attention").flash_attention(device, qkv, y, lse, b_n, t, heads, hs, scale);
}
void flash_attention_backward(Device device, const float* qkv, const float* y, const float* dy, const float* lse,
                              float* dqkv, std::int64_t b_n, std::int64_t t, std::int64_t heads, std::int64_t hs,
                              float scale) {
  Ops("cuda::flash_attention_backward")
      .flash_attention_backward(device, qkv, y, dy, lse, dqkv, b_n, t, heads, hs, scale);
}
std::int64_t cross_entropy(Device device, const float* logits, const std::int64_t* targets, float* lse, float* loss,
                           float* count, std::int64_t rows, std::int64_t v, std::int64_t ignore_index) {
  return Ops("cuda::cross_entropy").cross_entropy(device, logits, targets, lse, loss, count, rows, v, ignore_index);
}
void cross_entropy_backward(Device device, const float* logits, const std::int64_t* targets, const float* lse,
                            const float* gloss, const float* count, float* gx, std::int64_t rows, std::int64_t v,
                            std::int64_t ignore_index) {
  Ops("cuda::cross_entropy_backward")
      .cross_entropy_backward(device, logits, targets, lse, gloss, count, gx, rows, v, ignore_index);
}
std::int64_t embedding(Device device, const float* weight, const std::int64_t* indices, float* y, std::int64_t n,
                       std::int64_t c, std::int64_t vocab) {
  return Ops("cuda::embedding").embedding(device, weight, indices, y, n, c, vocab);
}
void embedding_backward(Device device, const std::int64_t* indices, const float* gy, float* gw, std::int64_t n,
                        std::int64_t c) {
  Ops("cuda::embedding_backward").embedding_backward(device, indices, gy, gw, n, c);
}
void copy_2d(Device device, const void* src, std::size_t src_pitch, void* dst, std::size_t dst_pitch,
             std::size_t width, std::int64_t height) {
  Ops("cuda::copy_2d").copy_2d(device, src, src_pitch, dst, dst_pitch, width, height);
}

}  // namespace shardkit::kernels::cuda
