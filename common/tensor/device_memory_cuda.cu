// The CUDA device memory behind detail::cuda_allocate (part of shardkit::cuda; Note [cuda component]).
#include <cuda_runtime.h>

#include "common/base/check.h"
#include "common/tensor/device_memory.h"

namespace shardkit::detail::cuda_impl {

void* cuda_allocate(Device device, std::size_t nbytes) {
  SK_CHECK(device.is_cuda());
  cudaError_t err = cudaSetDevice(device.index);
  SK_CHECK(err == cudaSuccess) << "cannot use " << device.str() << ": cudaSetDevice: " << cudaGetErrorString(err);
  void* p = nullptr;
  err = cudaMalloc(&p, nbytes);
  SK_CHECK(err == cudaSuccess) << "cudaMalloc(" << nbytes << " bytes on " << device.str()
                               << "): " << cudaGetErrorString(err);
  return p;
}

void cuda_free(Device device, void* ptr) noexcept {
  if (ptr == nullptr) return;
  cudaSetDevice(device.index);
  cudaFree(ptr);
}

void cuda_zero(Device device, void* ptr, std::size_t nbytes) {
  SK_CHECK(device.is_cuda());
  cudaError_t err = cudaSetDevice(device.index);
  SK_CHECK(err == cudaSuccess) << "cannot use " << device.str() << ": cudaSetDevice: " << cudaGetErrorString(err);
  // On the calling thread's stream, like the kernels (cuda_kernels.h), then waited for: the bytes are zero when
  // this returns, whichever stream reads them next.
  err = cudaMemsetAsync(ptr, 0, nbytes, cudaStreamPerThread);
  if (err == cudaSuccess) err = cudaStreamSynchronize(cudaStreamPerThread);
  SK_CHECK(err == cudaSuccess) << "cudaMemsetAsync(" << nbytes << " bytes on " << device.str()
                               << "): " << cudaGetErrorString(err);
}

void cuda_synchronize(Device device) {
  SK_CHECK(device.is_cuda());
  cudaError_t err = cudaSetDevice(device.index);
  if (err == cudaSuccess) err = cudaStreamSynchronize(cudaStreamPerThread);
  SK_CHECK(err == cudaSuccess) << "synchronizing " << device.str() << ": " << cudaGetErrorString(err);
}

int cuda_device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

}  // namespace shardkit::detail::cuda_impl
