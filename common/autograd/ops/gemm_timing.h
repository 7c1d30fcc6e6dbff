// GEMM time accounting for the autograd ops (used by bench/model_bench's gemm_frac counter).
//
// Every matrix multiply an op issues goes through timed_gemm(), which calls kernels::gemm and adds
// the elapsed wall time, the call count and the flop count to the calling thread's counters. The
// counters are per thread (per simulated rank), never process-global. Overhead: two steady_clock
// reads per call (tens of ns against GEMMs of microseconds or more).
#pragma once

#include <cstdint>

#include "common/tensor/device.h"

namespace shardkit::autograd {

struct GemmStats {
  std::int64_t calls = 0;
  double seconds = 0;
  double flops = 0;  // 2 * m * n * k per call
};

// The calling thread's totals since the last reset.
GemmStats gemm_stats();
void reset_gemm_stats();

namespace detail {
// kernels::gemm with accounting (same contract: row-major C = alpha op(A) op(B) + beta C).
void timed_gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                std::int64_t ldc);

// The same GEMM on the device that holds the pointers: timed_gemm on the CPU, cuBLAS on a CUDA device
// (asynchronous on the calling thread's stream; calls and flops are counted, its time is not).
void gemm_on(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
             float alpha, const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
             std::int64_t ldc);

// kernels::cuda::gemm_on_bf16_copies with the same accounting as gemm_on's CUDA path.
void gemm_on_bf16_copies(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                         float alpha, const void* a16, const void* b16, float beta, float* c, std::int64_t ldc);
}  // namespace detail

}  // namespace shardkit::autograd
