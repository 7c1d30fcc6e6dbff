// Helpers shared by the .cu files of common/kernels/cuda (internal).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/base/check.h"
#include "common/tensor/device.h"

#define SK_CUDA_CHECK(expr)                                                                      \
  do {                                                                                           \
    const cudaError_t sk_err_ = (expr);                                                          \
    SK_CHECK(sk_err_ == cudaSuccess) << #expr << ": " << cudaGetErrorString(sk_err_);            \
  } while (0)

namespace shardkit::kernels::cuda {

// Makes `device` current for a scope and restores the caller's device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(Device device) {
    SK_CHECK(device.is_cuda()) << "CUDA kernel on " << device.str();
    SK_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device.index) {
      SK_CUDA_CHECK(cudaSetDevice(device.index));
      changed_ = true;
    }
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

inline constexpr int kThreads = 256;

// Blocks for a grid-stride loop over n elements (capped: each thread then loops).
inline unsigned GridFor(std::int64_t n, std::int64_t cap = 4096) {
  std::int64_t blocks = (n + kThreads - 1) / kThreads;
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;
  return static_cast<unsigned>(blocks);
}

// Whether p is a multiple of `bytes` (vector loads and stores need their width's alignment).
inline bool Aligned(const void* p, std::size_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

// `numel` elements of T from the device's stream-ordered pool on the calling thread's default stream, freed on that
// stream when the scope ends (so after the work queued before the free); numel 0 holds none.
template <typename T>
class StreamScratch {
 public:
  explicit StreamScratch(std::int64_t numel) {
    if (numel > 0) {
      SK_CUDA_CHECK(cudaMallocAsync(&p_, static_cast<std::size_t>(numel) * sizeof(T), cudaStreamPerThread));
    }
  }
  ~StreamScratch() {
    if (p_ != nullptr) cudaFreeAsync(p_, cudaStreamPerThread);
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  T* get() const { return p_; }

 private:
  T* p_ = nullptr;
};

// Reports a failed launch (bad configuration, no device) right after the launch.
inline void CheckLaunch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  SK_CHECK(err == cudaSuccess) << what << " launch: " << cudaGetErrorString(err);
}

}  // namespace shardkit::kernels::cuda
