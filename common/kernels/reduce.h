// Full reductions over a tensor's elements: sum, sum of squares, max |x| (DESIGN.md section 2).
//
// Note [reduction accuracy]: elements are read in their storage dtype (f32, bf16 or f16), widened to fp32,
// and accumulated in fp32 over blocks of kReduceBlock elements (16 independent lanes, so the loop
// vectorises and the order is fixed: the same input gives the same bits on any CPU). Each block's
// partial is added to a double total. The error is thus bounded by about (kReduceBlock / 16) * 2^-24 *
// sum|x_i| (fp32 rounding within a lane) rather than growing with n. Squares are formed in fp32, so f16 or
// bf16 values whose squares overflow their storage type (|x| = 60000 in f16) are fine; only f32 values with
// |x| > ~1.8e19 overflow (to +inf) in sum_squares.
//
// max_abs propagates NaN: if any element is NaN the result is NaN. Empty input: sum = sum_squares =
// max_abs = 0.
//
// CPU tensors are reduced on the calling thread; CUDA tensors on their device, ordered after earlier
// work on the calling thread's default stream (cudaStreamPerThread; work on other streams, e.g. NCCL's,
// must be synchronised by the caller first), and the call waits for the result. i64 tensors are rejected (InternalError). Thread-safe (no shared state).
#pragma once

#include <cstdint>

#include "common/tensor/tensor.h"

namespace shardkit::kernels {

inline constexpr std::int64_t kReduceBlock = 1024;

double sum(const Tensor& x);
double sum_squares(const Tensor& x);
double max_abs(const Tensor& x);

// Raw CPU pointers, n elements.
double sum(const float* x, std::int64_t n);
double sum_squares(const float* x, std::int64_t n);
double max_abs(const float* x, std::int64_t n);
double sum(const bf16_t* x, std::int64_t n);
double sum_squares(const bf16_t* x, std::int64_t n);
double max_abs(const bf16_t* x, std::int64_t n);
double sum(const f16_t* x, std::int64_t n);
double sum_squares(const f16_t* x, std::int64_t n);
double max_abs(const f16_t* x, std::int64_t n);

}  // namespace shardkit::kernels
