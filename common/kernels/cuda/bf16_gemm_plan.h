// How a "medium" GEMM runs on bf16 copies of its fp32 operands (Note [bf16 operand copies] in gemm.cu): which
// copies, padded how, and the cuBLAS call on them. Pure functions, compiled for the host and (under nvcc) the
// device, so the layout arithmetic is unit-tested on the CPU (tests/common/kernels/bf16_gemm_plan_test.cc) by
// running the plan with the CPU GEMM; only the copy kernel's loads and conversions and the cuBLAS call itself
// need a GPU.
//
// Note [padded bf16 copies]
// cuBLAS's fastest bf16 kernels load 16 bytes at a time along each operand's contiguous dimension and store C the
// same way; where a leading dimension, k, or C's row stride is not a multiple of 16 bytes, it falls back to
// alignment-1 kernels. On an H200 (stop 32) two of GPT-2's three logits GEMMs did (the vocabulary's 50257): 3.3 and
// 2.5 ms against 0.64 ms for the aligned third. So each copy's matrices are padded to a multiple of 8 rows and 8
// columns with zeros, the product runs over k rounded up to a multiple of 8 (the padding's products are 0 * 0,
// which leave every fp32 sum unchanged), and when C's rows are not 16-byte aligned the product goes to a staging
// buffer with aligned rows and is copied into C afterwards (C copied in first when beta != 0). That buffer is as
// large as C (1.6 GB for GPT-2's logits at B T = 8192) and, like the copies, scratch outside the memory ledger.
// Aligned rows alone are not enough: cuBLAS also wants C's contiguous extent, n, a multiple of 8. On the H200 (stop
// 36) the forward logits GEMM, staged with rows of 50260, still ran an alignment-1 kernel (3.3 ms of a 35 ms step).
// So a staged product runs over n padded to a multiple of 8 as well: the B copy already holds those columns (zeros),
// the staging rows hold them, and only the first n are copied back.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SK_HOST_DEVICE __host__ __device__
#else
#define SK_HOST_DEVICE
#endif

namespace shardkit::kernels::cuda {

inline constexpr std::int64_t kBf16PadTo = 8;  // elements: 16 bytes of bf16

SK_HOST_DEVICE inline std::int64_t round_up_to_pad(std::int64_t x) { return (x + kBf16PadTo - 1) / kBf16PadTo * kBf16PadTo; }

// A packed copy of `batches` matrices of rows x cols (row i of matrix b at b * stride + i * ld in the source):
// matrix b of the copy starts at b * pad_rows * pad_cols, row i at i * pad_cols; zero beyond rows and cols.
struct PackShape {
  std::int64_t rows = 0, cols = 0, ld = 0, stride = 0, batches = 1;
  std::int64_t pad_rows = 0, pad_cols = 0;

  SK_HOST_DEVICE std::int64_t copy_stride() const { return pad_rows * pad_cols; }
  SK_HOST_DEVICE std::int64_t numel() const { return batches * copy_stride(); }
  // The copy is written in groups of 8 consecutive elements of a row (one 16-byte store each).
  SK_HOST_DEVICE std::int64_t groups() const { return numel() / kBf16PadTo; }
};

PackShape pack_shape(std::int64_t rows, std::int64_t cols, std::int64_t ld, std::int64_t stride, std::int64_t batches);

// Group g of a copy: the copy's elements [dst, dst + 8) take the source's [src, src + valid) and zeros after.
struct PackGroup {
  std::int64_t dst = 0, src = 0;
  int valid = 0;
};

SK_HOST_DEVICE inline PackGroup pack_group(const PackShape& s, std::int64_t g) {
  const std::int64_t per_row = s.pad_cols / kBf16PadTo;
  const std::int64_t r = g / per_row;  // the copy's row, counted over every matrix
  const std::int64_t j = (g - r * per_row) * kBf16PadTo;
  const std::int64_t b = r / s.pad_rows, i = r - b * s.pad_rows;
  std::int64_t valid = i < s.rows ? s.cols - j : 0;
  valid = valid < 0 ? 0 : (valid > kBf16PadTo ? kBf16PadTo : valid);
  return {r * s.pad_cols + j, b * s.stride + i * s.ld + j, static_cast<int>(valid)};
}

// Elements of the packed copy of one rows x cols matrix (pack_shape(rows, cols, ...).numel() for one matrix).
SK_HOST_DEVICE inline std::int64_t packed_bf16_numel(std::int64_t rows, std::int64_t cols) {
  return round_up_to_pad(rows) * round_up_to_pad(cols);
}

// Whether a "medium" GEMM of op(A) [m, k] by op(B) [k, n] runs on bf16 copies rather than as "high": where the copies
// pay (medium_gemm_uses_bf16 in common/tensor/matmul_precision.h) and the padded sizes still fit cuBLAS's int
// arguments (sizes within 7 of INT_MAX run as "high"). gemm.cu decides by it, and so does a caller that hands
// gemm_on_bf16_copies copies of its own (Note [bf16 copies kept across a linear's GEMMs] in
// common/autograd/ops/linalg.cc). A pure function.
bool medium_gemm_runs_on_bf16_copies(std::int64_t m, std::int64_t n, std::int64_t k);

// Whether causal attention's materialised path at "medium" runs its head-wide products (Y = P V, dQ = scale dS K,
// dK = scale dS^T Q: m = k = t, n = hs) on the bf16 copies of P and dS that its softmax kernels write (Note [softmax
// writes the bf16 copy] in common/autograd/ops/attention.cc): where those products would otherwise run as "high"
// (copying the t x t operand would not pay) while the t x t products (S = scale Q K^T, dP = dY V^T) run on bf16.
// A pure function.
bool attention_runs_on_softmax_copies(std::int64_t t, std::int64_t hs);

// Row-major C_b = alpha op(A_b) op(B_b) + beta C_b for b < batches (op(A) [m, k], op(B) [k, n], C [m, n] with
// leading dimension ldc, matrices stride_c apart) on the copies, as the column-major cuBLAS call makes it (Note
// [row-major through column-major cuBLAS] in gemm.cu: the operands swapped, dimensions (n, m, k)).
struct Bf16GemmPlan {
  PackShape a, b;               // the copies of A and B (as stored: A is m x k, or k x m when transposed)
  std::int64_t k = 0;           // the product's inner size, padded
  bool staged = false;          // C's rows are not 16-byte aligned: the product goes to a staging buffer first
  std::int64_t n = 0;           // the product's columns as cuBLAS makes them: padded to 8 when staged, else n
  std::int64_t ldc = 0, stride_c = 0;  // of C, or of the staging buffer when staged (row-major, m x ldc each)
};

// c_aligned: C's first element is 16-byte aligned. Arguments as gemm / gemm_strided_batched (cuda_kernels.h);
// stride_a / stride_b / stride_c are unused when batches == 1.
Bf16GemmPlan plan_bf16_gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                            std::int64_t lda, std::int64_t stride_a, std::int64_t ldb, std::int64_t stride_b,
                            std::int64_t ldc, std::int64_t stride_c, std::int64_t batches, bool c_aligned);

}  // namespace shardkit::kernels::cuda
