#include "common/autograd/ops/gemm_timing.h"

#include <chrono>

#include "common/kernels/cuda/cuda_kernels.h"
#include "common/kernels/gemm.h"
#include "common/tensor/rank_context.h"

namespace shardkit::autograd {
namespace {
thread_local GemmStats tl_stats;
}  // namespace

GemmStats gemm_stats() { return tl_stats; }
void reset_gemm_stats() { tl_stats = GemmStats{}; }

namespace detail {
void timed_gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                std::int64_t ldc) {
  const auto t0 = std::chrono::steady_clock::now();
  kernels::gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  const auto t1 = std::chrono::steady_clock::now();
  tl_stats.calls += 1;
  tl_stats.seconds += std::chrono::duration<double>(t1 - t0).count();
  tl_stats.flops += 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
}
void gemm_on(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
             float alpha, const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
             std::int64_t ldc) {
  if (device.is_cpu()) return timed_gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  kernels::cuda::gemm(device, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc,
                      current_rank_context().matmul_precision);
  tl_stats.calls += 1;
  tl_stats.flops += 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
}

void gemm_on_bf16_copies(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                         float alpha, const void* a16, const void* b16, float beta, float* c, std::int64_t ldc) {
  kernels::cuda::gemm_on_bf16_copies(device, trans_a, trans_b, m, n, k, alpha, a16, b16, beta, c, ldc);
  tl_stats.calls += 1;
  tl_stats.flops += 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
}

}  // namespace detail

}  // namespace shardkit::autograd
