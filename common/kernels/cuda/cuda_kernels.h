// Raw-pointer CUDA kernels behind the device-dispatching functions of gemm.h, reduce.h and
// elementwise.h. Internal to common/kernels: other folders call the Tensor-level functions.
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

namespace shardkit::kernels::cuda {

// Row-major C = alpha * op(A) * op(B) + beta * C through cublasSgemm (see gemm.h for the contract).
void gemm(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
          const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
          std::int64_t ldc);

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

// ---- the seam (Note [cuda component]) -----------------------------------------------------------------
struct CudaKernelOps {
  decltype(&cuda::gemm) gemm;
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
};

// Called once by shardkit::cuda's static initialiser; `ops` must outlive the program (a constant).
void register_cuda_kernels(const CudaKernelOps* ops);

// The CUDA implementation, defined in elementwise.cu, gemm.cu and reduce.cu (part of shardkit::cuda only;
// nothing in the CPU libraries refers to these).
namespace cuda_impl {
decltype(cuda::gemm) gemm;
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
}  // namespace cuda_impl

}  // namespace shardkit::kernels::cuda
