// Raw-pointer CUDA kernels behind the device-dispatching functions of gemm.h, reduce.h and
// elementwise.h. Internal to common/kernels: other folders call the Tensor-level functions.
//
// Pointers are device pointers on `device`. Every function makes `device` current for the call (and
// restores the caller's device), and launches on cudaStreamPerThread, the calling thread's default
// stream (so simulated ranks on different threads do not serialise on one stream). Launches are
// asynchronous except where a result comes back to the host (the reductions, which synchronise).
// In builds without CUDA these are stubs that throw InternalError (cuda_kernels_stub.cc); a CUDA
// tensor cannot exist in such a build, so they are never reached through the Tensor-level API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/tensor/device.h"
#include "common/tensor/dtype.h"

namespace shardkit::kernels::cuda {

// Row-major C = alpha * op(A) * op(B) + beta * C through cublasSgemm (see gemm.h for the contract).
void gemm(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
          const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
          std::int64_t ldc);

// Loads cuBLAS if not yet loaded (Note [cuBLAS loaded on first use] in gemm.cu; needs no GPU) and returns
// why it cannot be used, or "" when it can.
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

}  // namespace shardkit::kernels::cuda
