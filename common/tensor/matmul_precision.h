// How much precision a float32 matrix multiply on a CUDA device may trade for tensor-core speed, per rank
// (RankContext::matmul_precision), after torch.set_float32_matmul_precision.
//
// Note [matmul precision]
// fp32 tensors stay fp32 in memory and every product accumulates in fp32; what changes is how the operands enter
// the multiply:
//   highest  full fp32 (cublasSgemm): the default, and what the equivalence tests use.
//   high     operands rounded to TF32 (10-bit mantissa) on tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32).
//   medium   operands rounded to bf16 (7-bit mantissa) on tensor cores (CUBLAS_COMPUTE_32F_FAST_16BF): the
//            GEMMs of bf16 autocast, with fp32 outputs. Under bf16 mixed precision, where parameters and inputs
//            already hold bf16 values, the rounding changes nothing and only the order of the fp32 sums differs.
// It applies to every GEMM the autograd ops and kernels::matmul run on CUDA tensors (linear layers, attention's
// batched products). CPU GEMMs ignore it: OpenBLAS's sgemm is always full fp32. A setting, not a dtype: the
// caller chooses it for its rank's thread; code that needs exact fp32 sets highest in a scope of its own.
#pragma once

#include <optional>
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

// "highest", "high" or "medium"; nullopt for anything else.
inline std::optional<MatmulPrecision> parse_matmul_precision(std::string_view name) {
  for (MatmulPrecision p : {MatmulPrecision::highest, MatmulPrecision::high, MatmulPrecision::medium}) {
    if (name == matmul_precision_name(p)) return p;
  }
  return std::nullopt;
}

}  // namespace shardkit
