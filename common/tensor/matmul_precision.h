// How much precision a float32 matrix multiply on a CUDA device may trade for tensor-core speed, per rank
// (RankContext::matmul_precision), after torch.set_float32_matmul_precision.
//
// Note [matmul precision]
// fp32 tensors stay fp32 in memory and every product accumulates in fp32; what changes is how the operands enter
// the multiply:
//   highest  full fp32 (cublasSgemm): the default, and what the equivalence tests use.
//   high     operands rounded to TF32 (10-bit mantissa, to nearest) on tensor cores (cublasGemmEx,
//            CUBLAS_COMPUTE_32F_FAST_TF32). That compute type only allows TF32: on an H200 cuBLAS ran most shapes in
//            TF32 and some (a 600 x 520 x 131 product) in full fp32.
//   medium   operands rounded to bf16 (7-bit mantissa, to nearest even) into scratch copies and multiplied on
//            tensor cores, bf16 x bf16 -> fp32 (Note [bf16 operand copies] in common/kernels/cuda/gemm.cu): the
//            GEMMs of bf16 autocast, with fp32 outputs. Under bf16 mixed precision, where parameters and inputs
//            already hold bf16 values, the rounding changes nothing and only the order of the fp32 sums differs.
//            Where the copies would cost more than the faster multiply saves (medium_gemm_uses_bf16 below), the
//            product runs as under high, the fallback torch.set_float32_matmul_precision("medium") documents too.
// It applies to every GEMM the autograd ops and kernels::matmul run on CUDA tensors (linear layers, attention's
// batched products). CPU GEMMs ignore it: OpenBLAS's sgemm is always full fp32. A setting, not a dtype: the
// caller chooses it for its rank's thread; code that needs exact fp32 sets highest in a scope of its own.
#pragma once

#include <cstdint>
#include <string_view>

namespace shardkit {

enum class MatmulPrecision { highest, high, medium };

inline std::string_view matmul_precision_name(MatmulPrecision p) {
  switch (p) {
    case MatmulPrecision::highest: return "highest";
    case MatmulPrecision::high: return "high";
    case MatmulPrecision::medium: return "medium";
  }
  return "unknown";
}

// Whether a "medium" GEMM of op(A) [m, k] by op(B) [k, n] (each matrix of a batch) runs on bf16 copies: when it
// does at least 512 flops per copied element, 2 m n k >= 512 (m k + k n), i.e. m n >= 256 (m + n) (k cancels). A
// copy costs about 6 bytes of memory traffic per element, roughly what 1000 flops save on Hopper tensor cores in
// bf16 instead of TF32. GPT-2's linear layers (m = B T, n >= 768) and attention's Q K^T and dY V^T (m = n = T >=
// 512) qualify; products with the head width as a side (P V and the gradients through P, with T x T operands)
// do not: copying P costs several times what bf16 saves there. A pure function.
inline bool medium_gemm_uses_bf16(std::int64_t m, std::int64_t n) { return m * n >= 256 * (m + n); }

}  // namespace shardkit
