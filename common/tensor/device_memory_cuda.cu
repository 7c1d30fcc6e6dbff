// The CUDA device memory behind detail::cuda_allocate (part of shardkit::cuda; Note [cuda component]).
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "common/base/check.h"
#include "common/tensor/device_memory.h"

namespace shardkit::detail::cuda_impl {

// Note [device memory from the stream-ordered pool]
// cudaMalloc / cudaFree per tensor would make every free wait for the whole device (a training step frees hundreds
// of activations), so memory comes from each device's default memory pool (cudaMallocAsync), told to keep what it
// has (release threshold: all of it) instead of returning it to the driver at every synchronisation. Both calls go
// on the legacy default stream, which is ordered after the work already queued on every thread's per-thread
// stream and before the work queued there later: a tensor freed by another thread than the one whose kernels used
// it (a collective's worker, the last handle dropped elsewhere) is not reused before those kernels finish. NCCL's
// own non-blocking stream is not ordered this way; its Work keeps the call's tensors until the collective has
// finished (NcclWork's destructor). Devices without memory pools fall back to cudaMalloc / cudaFree.
namespace {

// Whether each visible device supports memory pools; configures their default pools on first use (an immutable
// table after that).
const std::vector<bool>& PoolDevices() {
  static const std::vector<bool> pools = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    std::vector<bool> supported(static_cast<std::size_t>(n), false);
    for (int d = 0; d < n; ++d) {
      int yes = 0;
      if (cudaDeviceGetAttribute(&yes, cudaDevAttrMemoryPoolsSupported, d) != cudaSuccess || yes == 0) continue;
      cudaMemPool_t pool = nullptr;
      if (cudaDeviceGetDefaultMemPool(&pool, d) != cudaSuccess) continue;
      std::uint64_t keep = UINT64_MAX;
      if (cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) != cudaSuccess) continue;
      supported[static_cast<std::size_t>(d)] = true;
    }
    return supported;
  }();
  return pools;
}

bool HasPool(Device device) {
  const std::vector<bool>& pools = PoolDevices();
  return device.index >= 0 && static_cast<std::size_t>(device.index) < pools.size() &&
         pools[static_cast<std::size_t>(device.index)];
}

}  // namespace

void* cuda_allocate(Device device, std::size_t nbytes) {
  SK_CHECK(device.is_cuda());
  cudaError_t err = cudaSetDevice(device.index);
  SK_CHECK(err == cudaSuccess) << "cannot use " << device.str() << ": cudaSetDevice: " << cudaGetErrorString(err);
  void* p = nullptr;
  const bool pool = HasPool(device);
  err = pool ? cudaMallocAsync(&p, nbytes, cudaStreamLegacy) : cudaMalloc(&p, nbytes);
  SK_CHECK(err == cudaSuccess) << (pool ? "cudaMallocAsync(" : "cudaMalloc(") << nbytes << " bytes on "
                               << device.str() << "): " << cudaGetErrorString(err);
  return p;
}

void cuda_free(Device device, void* ptr) noexcept {
  if (ptr == nullptr) return;
  cudaSetDevice(device.index);
  if (HasPool(device)) {
    cudaFreeAsync(ptr, cudaStreamLegacy);  // Note [device memory from the stream-ordered pool]
  } else {
    cudaFree(ptr);
  }
}

void* cuda_host_alloc(std::size_t nbytes) noexcept {
  void* p = nullptr;
  if (cudaHostAlloc(&p, nbytes, cudaHostAllocPortable) != cudaSuccess) {
    cudaGetLastError();  // the caller falls back to pageable memory; leave no sticky error behind
    return nullptr;
  }
  return p;
}

void cuda_host_free(void* ptr) noexcept {
  if (ptr != nullptr) cudaFreeHost(ptr);
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
