// Raw-pointer CUDA kernels behind the device-dispatching functions of gemm.h, reduce.h and
// elementwise.h, and behind the autograd ops on CUDA tensors. Other folders call the Tensor-level functions,
// except common/autograd/ops, which calls the section "the kernels behind the autograd ops" and gemm directly
// (Note [ops on devices] in common/autograd/ops/op_utils.h).
//
// Pointers are device pointers on `device`. Every function makes `device` current for the call (and
// restores the caller's device), and launches on cudaStreamPerThread, the calling thread's default
// stream (so simulated ranks on different threads do not serialise on one stream). Launches are
// asynchronous except where a result comes back to the host (the reductions, which synchronise).
// These functions dispatch (cuda_kernels_dispatch.cc) to the implementation that shardkit::cuda registers
// (Note [cuda component] in common/cuda/cuda_component.h). In a program without it each throws InternalError
// naming detail::cuda_unavailable_reason(); no CUDA tensor can exist there, so the Tensor-level API never
// reaches them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/tensor/device.h"
#include "common/tensor/dtype.h"
#include "common/tensor/matmul_precision.h"

namespace shardkit::kernels::cuda {

// Row-major C = alpha * op(A) * op(B) + beta * C (see gemm.h for the contract): cublasSgemm at
// MatmulPrecision::highest, else cublasGemmEx with the operands rounded to TF32 / bf16 on tensor cores and fp32
// accumulation (Note [matmul precision]).
void gemm(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
          const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
          std::int64_t ldc, MatmulPrecision precision);

// The packed bf16 copy (Note [padded bf16 copies] in bf16_gemm_plan.h) of the rows x cols fp32 matrix at src (row i
// at src + i * ld) into dst: packed_bf16_numel(rows, cols) bf16 elements, zeros beyond rows and cols.
void pack_bf16(Device device, const float* src, std::int64_t rows, std::int64_t cols, std::int64_t ld, void* dst);
// gemm at MatmulPrecision::medium on operands given as their packed copies (pack_bf16 of A as stored: m x k, or
// k x m when trans_a; of B: k x n, or n x k when trans_b): the same bits as gemm on the fp32 operands. Only where
// medium_gemm_runs_on_bf16_copies(m, n, k) (bf16_gemm_plan.h), with m, n, k >= 1; InternalError otherwise.
void gemm_on_bf16_copies(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                         float alpha, const void* a16, const void* b16, float beta, float* c, std::int64_t ldc);
// Row-major C_i = alpha op(A_i) op(B_i) + beta C_i for i < batches on bf16 tensor cores with fp32 accumulation, A given
// as its packed bf16 copy (the `batches` matrices of pack_bf16 of A as stored, m x k or k x m when trans_a, one after
// another, each packed_bf16_numel apart), B as fp32 (B_i = b + i * stride_b, copied to bf16 here, as
// gemm_strided_batched at medium copies it) and C as there. Runs on bf16 whatever medium_gemm_runs_on_bf16_copies
// says: the caller decides (Note [softmax writes the bf16 copy] in common/autograd/ops/attention.cc). m, n, k,
// batches >= 1 with m, n, k padded to 8 in cuBLAS's int range; InternalError otherwise.
void gemm_strided_batched_on_bf16_a(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n,
                                    std::int64_t k, float alpha, const void* a16, const float* b, std::int64_t ldb,
                                    std::int64_t stride_b, float beta, float* c, std::int64_t ldc,
                                    std::int64_t stride_c, std::int64_t batches);

// Loads cuBLAS if not yet loaded (Note [cuBLAS loaded on first use] in gemm.cu; needs no GPU) and returns
// why it cannot be used, or "" when it can (without the CUDA component: detail::cuda_unavailable_reason()).
std::string cublas_load_error();

// Reductions of n elements of a floating dtype; fp32 per thread, double across blocks (see reduce.h).
double sum(Device device, const void* x, DType dtype, std::int64_t n);
double sum_squares(Device device, const void* x, DType dtype, std::int64_t n);
double max_abs(Device device, const void* x, DType dtype, std::int64_t n);

// fp32 elementwise (see elementwise.h).
void add(Device device, const float* a, const float* b, float* out, std::int64_t n);
void sub(Device device, const float* a, const float* b, float* out, std::int64_t n);
void mul(Device device, const float* a, const float* b, float* out, std::int64_t n);
void scale(Device device, float s, const float* a, float* out, std::int64_t n);
void axpy(Device device, float alpha, const float* x, float* y, std::int64_t n);
void axpby(Device device, float alpha, const float* x, float beta, float* y, std::int64_t n);
void fill(Device device, float* x, std::int64_t n, float value);

// dst[i] = src[i] converted (both on `device`; any dtype pair; bf16/f16 round to nearest even).
void cast(Device device, const void* src, DType src_dtype, void* dst, DType dst_dtype, std::int64_t n);

// Copies bytes between any two of host / device memory, on the source device's per-thread stream (the
// destination's when the source is the host), and waits for it.
void copy_bytes(const void* src, Device src_device, void* dst, Device dst_device, std::size_t nbytes);

// ---- the kernels behind the autograd ops on CUDA (nn_ops.cu): fp32, contiguous row-major ------------------
// Row-broadcast binary ops: out[r, j] = a[r, j] op b[j] for r < rows, j < n (assign: out[r, j] = b[j], a unused).
enum class RowOp : unsigned char { add, sub, mul, assign };
void broadcast_rows(Device device, RowOp op, const float* a, const float* b, float* out, std::int64_t rows,
                    std::int64_t n);
// out[j] = sum over r of x[r, j] (plus out[j] when accumulate), in a fixed order (Note [deterministic column
// sums] in nn_ops.cu).
void sum_rows(Device device, const float* x, float* out, std::int64_t rows, std::int64_t n, bool accumulate);
// GELU, GPT-2's tanh form or the exact x Phi(x), and its gradient gx = gy * GELU'(x).
void gelu(Device device, bool tanh_approx, const float* x, float* y, std::int64_t n);
void gelu_backward(Device device, bool tanh_approx, const float* x, const float* gy, float* gx, std::int64_t n);
// LayerNorm over the last dimension c of [rows, c]; w / b may be null (no affine part). Saves each row's mean
// and 1 / std for the backward, which writes any of gx, gw, gb that is not null (gw, gb overwritten, not added).
void layer_norm(Device device, const float* x, const float* w, const float* b, float* y, float* mean, float* rstd,
                std::int64_t rows, std::int64_t c, float eps);
void layer_norm_backward(Device device, const float* x, const float* gy, const float* w, const float* mean,
                         const float* rstd, float* gx, float* gw, float* gb, std::int64_t rows, std::int64_t c);
// In place over `matrices` [t, t] score matrices: row i becomes the softmax of its columns 0..i, zero after.
// The backward overwrites dp with dS = P * (dP - rowsum(P * dP)) (zero above the diagonal). Where out16 is not
// null, each also writes its result's packed bf16 copy there: `matrices` copies of t x t, packed_bf16_numel(t, t)
// apart, the bits pack_bf16 of the fp32 result gives (Note [softmax writes the bf16 copy] in
// common/autograd/ops/attention.cc).
void causal_softmax(Device device, float* s, std::int64_t matrices, std::int64_t t, void* out16);
void causal_softmax_backward(Device device, const float* p, float* dp, std::int64_t matrices, std::int64_t t,
                             void* out16);
// Row-major C_i = alpha op(A_i) op(B_i) + beta C_i for i < batches, X_i = x + i * stride_x (elements), through
// cublasSgemmStridedBatched (cublasGemmStridedBatchedEx below MatmulPrecision::highest, as gemm).
void gemm_strided_batched(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n,
                          std::int64_t k, float alpha, const float* a, std::int64_t lda, std::int64_t stride_a,
                          const float* b, std::int64_t ldb, std::int64_t stride_b, float beta, float* c,
                          std::int64_t ldc, std::int64_t stride_c, std::int64_t batches, MatmulPrecision precision);
// Fused causal attention on bf16 tensor cores (Note [flash attention] in flash_attention.cu): qkv [B, T, 3C] as
// causal_attention takes it (C = heads * hs), y [B, T, C] the result, lse [B, heads, T] each row's log-sum-exp of
// its scaled scores (saved for the backward). Only where flash_attention_supported(device, hs) (sm_80 or newer and
// code built for it; 1 <= hs <= 128).
bool flash_attention_supported(Device device, std::int64_t hs);
void flash_attention(Device device, const float* qkv, float* y, float* lse, std::int64_t b_n, std::int64_t t,
                     std::int64_t heads, std::int64_t hs, float scale);
// Writes every element of dqkv [B, T, 3C] from the forward's qkv, y and lse and the gradient dy [B, T, C].
void flash_attention_backward(Device device, const float* qkv, const float* y, const float* dy, const float* lse,
                              float* dqkv, std::int64_t b_n, std::int64_t t, std::int64_t heads, std::int64_t hs,
                              float scale);
// Mean cross-entropy of logits [rows, v] against i64 targets (rows equal to ignore_index left out): writes each
// kept row's log-sum-exp to lse (0 for an ignored row), the loss to loss[0] and the number of kept rows to
// count[0]. Synchronous; returns the first row whose target is outside [0, v), or -1.
std::int64_t cross_entropy(Device device, const float* logits, const std::int64_t* targets, float* lse, float* loss,
                           float* count, std::int64_t rows, std::int64_t v, std::int64_t ignore_index);
// gx = gloss[0] / count[0] * (softmax(logits) - onehot(target)), zero on ignored rows.
void cross_entropy_backward(Device device, const float* logits, const std::int64_t* targets, const float* lse,
                            const float* gloss, const float* count, float* gx, std::int64_t rows, std::int64_t v,
                            std::int64_t ignore_index);
// y[i, :] = weight[indices[i], :] for i < n, rows of c. Synchronous; returns the first position whose index is
// outside [0, vocab) (its row of y is zero), or -1.
std::int64_t embedding(Device device, const float* weight, const std::int64_t* indices, float* y, std::int64_t n,
                       std::int64_t c, std::int64_t vocab);
// gw[indices[i], :] += gy[i, :] (atomics: the order of a repeated index's adds is not fixed).
void embedding_backward(Device device, const std::int64_t* indices, const float* gy, float* gw, std::int64_t n,
                        std::int64_t c);
// `height` rows of `width` bytes from src (rows src_pitch bytes apart) to dst (dst_pitch apart), on `device`.
void copy_2d(Device device, const void* src, std::size_t src_pitch, void* dst, std::size_t dst_pitch,
             std::size_t width, std::int64_t height);

// ---- the seam (Note [cuda component]) -----------------------------------------------------------------
struct CudaKernelOps {
  decltype(&cuda::gemm) gemm;
  decltype(&cuda::pack_bf16) pack_bf16;
  decltype(&cuda::gemm_on_bf16_copies) gemm_on_bf16_copies;
  // Defaulted until common/cuda/cuda_component.cc registers it (the dispatch refuses a null entry).
  decltype(&cuda::gemm_strided_batched_on_bf16_a) gemm_strided_batched_on_bf16_a;
  decltype(&cuda::cublas_load_error) cublas_load_error;
  decltype(&cuda::sum) sum;
  decltype(&cuda::sum_squares) sum_squares;
  decltype(&cuda::max_abs) max_abs;
  decltype(&cuda::add) add;
  decltype(&cuda::sub) sub;
  decltype(&cuda::mul) mul;
  decltype(&cuda::scale) scale;
  decltype(&cuda::axpy) axpy;
  decltype(&cuda::axpby) axpby;
  decltype(&cuda::fill) fill;
  decltype(&cuda::cast) cast;
  decltype(&cuda::copy_bytes) copy_bytes;
  decltype(&cuda::broadcast_rows) broadcast_rows;
  decltype(&cuda::sum_rows) sum_rows;
  decltype(&cuda::gelu) gelu;
  decltype(&cuda::gelu_backward) gelu_backward;
  decltype(&cuda::layer_norm) layer_norm;
  decltype(&cuda::layer_norm_backward) layer_norm_backward;
  decltype(&cuda::causal_softmax) causal_softmax;
  decltype(&cuda::causal_softmax_backward) causal_softmax_backward;
  decltype(&cuda::gemm_strided_batched) gemm_strided_batched;
  decltype(&cuda::flash_attention_supported) flash_attention_supported;
  decltype(&cuda::flash_attention) flash_attention;
  decltype(&cuda::flash_attention_backward) flash_attention_backward;
  decltype(&cuda::cross_entropy) cross_entropy;
  decltype(&cuda::cross_entropy_backward) cross_entropy_backward;
  decltype(&cuda::embedding) embedding;
  decltype(&cuda::embedding_backward) embedding_backward;
  decltype(&cuda::copy_2d) copy_2d;
};

// Called once by shardkit::cuda's static initialiser; `ops` must outlive the program (a constant).
void register_cuda_kernels(const CudaKernelOps* ops);

// The CUDA implementation, defined in elementwise.cu, flash_attention.cu, gemm.cu, nn_ops.cu and reduce.cu (part of shardkit::cuda only;
// nothing in the CPU libraries refers to these).
namespace cuda_impl {
decltype(cuda::gemm) gemm;
decltype(cuda::pack_bf16) pack_bf16;
decltype(cuda::gemm_on_bf16_copies) gemm_on_bf16_copies;
decltype(cuda::gemm_strided_batched_on_bf16_a) gemm_strided_batched_on_bf16_a;
decltype(cuda::cublas_load_error) cublas_load_error;
decltype(cuda::sum) sum;
decltype(cuda::sum_squares) sum_squares;
decltype(cuda::max_abs) max_abs;
decltype(cuda::add) add;
decltype(cuda::sub) sub;
decltype(cuda::mul) mul;
decltype(cuda::scale) scale;
decltype(cuda::axpy) axpy;
decltype(cuda::axpby) axpby;
decltype(cuda::fill) fill;
decltype(cuda::cast) cast;
decltype(cuda::copy_bytes) copy_bytes;
decltype(cuda::broadcast_rows) broadcast_rows;
decltype(cuda::sum_rows) sum_rows;
decltype(cuda::gelu) gelu;
decltype(cuda::gelu_backward) gelu_backward;
decltype(cuda::layer_norm) layer_norm;
decltype(cuda::layer_norm_backward) layer_norm_backward;
decltype(cuda::causal_softmax) causal_softmax;
decltype(cuda::causal_softmax_backward) causal_softmax_backward;
decltype(cuda::gemm_strided_batched) gemm_strided_batched;
decltype(cuda::flash_attention_supported) flash_attention_supported;
decltype(cuda::flash_attention) flash_attention;
decltype(cuda::flash_attention_backward) flash_attention_backward;
decltype(cuda::cross_entropy) cross_entropy;
decltype(cuda::cross_entropy_backward) cross_entropy_backward;
decltype(cuda::embedding) embedding;
decltype(cuda::embedding_backward) embedding_backward;
decltype(cuda::copy_2d) copy_2d;
}  // namespace cuda_impl

}  // namespace shardkit::kernels::cuda
