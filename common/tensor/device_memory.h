// Raw device allocation behind Storage. The CPU library (this header, device_memory.cc) only dispatches: the
// CUDA implementation (device_memory_cuda.cu) lives in shardkit::cuda, which registers it at start-up when
// a program links it (Note [cuda component] in common/cuda/cuda_component.h). Without it, cuda_allocate()
// says why CUDA is absent and cuda_device_count() is 0.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/tensor/device.h"
#include "common/tensor/dtype.h"

namespace shardkit::detail {

// Throws InternalError with the CUDA error text on failure, or with cuda_unavailable_reason() when the
// program has no CUDA implementation.
void* cuda_allocate(Device device, std::size_t nbytes);
void cuda_free(Device device, void* ptr) noexcept;
// Sets nbytes at ptr (memory from cuda_allocate on `device`) to zero and waits for it (Tensor::zeros).
void cuda_zero(Device device, void* ptr, std::size_t nbytes);
// Number of CUDA devices visible at run time (0 without the CUDA component or without a GPU).
int cuda_device_count() noexcept;
// Copies n elements from src (src_dtype on src_device) to dst (dst_dtype on dst_device), converted as
// convert_elements does, where one side or both are CUDA memory (Tensor::copy_). Ordered after the kernels the
// calling thread queued earlier, and synchronous: dst holds the values when it returns.
void cuda_copy(const void* src, DType src_dtype, Device src_device, void* dst, DType dst_dtype, Device dst_device,
               std::int64_t n);
// Waits until every kernel the calling thread queued on `device` has finished.
void cuda_synchronize(Device device);
// Page-locked ("pinned") host memory (cudaHostAlloc): copies between it and a device run by DMA, without the
// driver's staging through pageable buffers. nullptr when the program has no CUDA implementation or the driver
// refuses; the caller then uses ordinary host memory. cuda_host_free gives back what cuda_host_alloc returned.
void* cuda_host_alloc(std::size_t nbytes) noexcept;
void cuda_host_free(void* ptr) noexcept;

// Why CUDA is not available in this program: "shardkit was built without CUDA", or (a build with CUDA)
// that the program does not link shardkit::cuda. Kernels and the NCCL backend use it in their errors.
std::string cuda_unavailable_reason();

// ---- the seam (Note [cuda component]) -----------------------------------------------------------------
struct CudaMemoryOps {
  decltype(&detail::cuda_allocate) allocate;
  decltype(&detail::cuda_free) free;
  decltype(&detail::cuda_zero) zero;
  decltype(&detail::cuda_device_count) device_count;
  decltype(&detail::cuda_copy) copy;
  decltype(&detail::cuda_synchronize) synchronize;
  decltype(&detail::cuda_host_alloc) host_alloc;
  decltype(&detail::cuda_host_free) host_free;
};

// Called once by shardkit::cuda's static initialiser; `ops` must outlive the program (a constant).
void register_cuda_memory(const CudaMemoryOps* ops);

// The CUDA implementation, defined in device_memory_cuda.cu and common/cuda/device_copy.cc (part of
// shardkit::cuda only; nothing in the CPU libraries refers to these).
namespace cuda_impl {
decltype(detail::cuda_allocate) cuda_allocate;
decltype(detail::cuda_free) cuda_free;
decltype(detail::cuda_zero) cuda_zero;
decltype(detail::cuda_device_count) cuda_device_count;
decltype(detail::cuda_copy) cuda_copy;
decltype(detail::cuda_synchronize) cuda_synchronize;
decltype(detail::cuda_host_alloc) cuda_host_alloc;
decltype(detail::cuda_host_free) cuda_host_free;
}  // namespace cuda_impl

}  // namespace shardkit::detail
