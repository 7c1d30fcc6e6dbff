#include "common/kernels/cuda/bf16_gemm_plan.h"

#include <algorithm>
#include <limits>

#include "common/tensor/matmul_precision.h"

namespace shardkit::kernels::cuda {

PackShape pack_shape(std::int64_t rows, std::int64_t cols, std::int64_t ld, std::int64_t stride, std::int64_t batches) {
  PackShape s;
  s.rows = rows;
  s.cols = cols;
  s.ld = ld;
  s.stride = batches > 1 ? stride : 0;
  s.batches = batches;
  s.pad_rows = round_up_to_pad(rows);
  s.pad_cols = round_up_to_pad(cols);
  return s;
}

bool medium_gemm_runs_on_bf16_copies(std::int64_t m, std::int64_t n, std::int64_t k) {
  return medium_gemm_uses_bf16(m, n) && round_up_to_pad(std::max({m, n, k})) <= std::numeric_limits<int>::max();
}

bool attention_runs_on_softmax_copies(std::int64_t t, std::int64_t hs) {
  return t >= 1 && hs >= 1 && !medium_gemm_runs_on_bf16_copies(t, hs, t) && medium_gemm_runs_on_bf16_copies(t, t, hs);
}

Bf16GemmPlan plan_bf16_gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                            std::int64_t lda, std::int64_t stride_a, std::int64_t ldb, std::int64_t stride_b,
                            std::int64_t ldc, std::int64_t stride_c, std::int64_t batches, bool c_aligned) {
  Bf16GemmPlan p;
  p.a = trans_a ? pack_shape(k, m, lda, stride_a, batches) : pack_shape(m, k, lda, stride_a, batches);
  p.b = trans_b ? pack_shape(n, k, ldb, stride_b, batches) : pack_shape(k, n, ldb, stride_b, batches);
  p.k = round_up_to_pad(k);
  p.staged = !c_aligned || ldc % 4 != 0 || (batches > 1 && stride_c % 4 != 0);
  p.n = p.staged ? round_up_to_pad(n) : n;  // the B copy's padding holds the extra columns (zeros)
  p.ldc = p.staged ? p.n : ldc;
  p.stride_c = p.staged ? m * p.ldc : (batches > 1 ? stride_c : 0);
  return p;
}

}  // namespace shardkit::kernels::cuda
