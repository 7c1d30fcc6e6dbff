// Matrix products with gradients: matmul, bmm, linear (DESIGN.md section 2). GEMMs go through
// kernels::gemm (CBLAS, one BLAS thread per rank) and are timed (gemm_timing.h).
#pragma once

#include "common/tensor/tensor.h"

namespace shardkit::autograd {

// op(a) @ op(b) for 2-D tensors: a [m, k] (or [k, m] with trans_a), b [k, n] (or [n, k] with trans_b).
Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);

// Batched: a [B, m, k], b [B, k, n] (same transposition rules per batch) -> [B, m, n].
Tensor bmm(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);

// x [..., in] @ weight[out, in]^T + bias[out] -> [..., out]. bias may be undefined.
// Backward: dx = dy W, dW = dy^T x, db = column sums of dy (three GEMM-sized steps, no copies).
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());

}  // namespace shardkit::autograd
