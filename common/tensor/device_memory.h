// Raw device allocation behind Storage. The CUDA implementation (device_memory_cuda.cu) is compiled
// when the build has CUDA; otherwise device_memory_nocuda.cc reports that CUDA is absent.
#pragma once

#include <cstddef>

#include "common/tensor/device.h"

namespace shardkit::detail {

// Throws InternalError with the CUDA error text on failure (or when the build has no CUDA).
void* cuda_allocate(Device device, std::size_t nbytes);
void cuda_free(Device device, void* ptr) noexcept;
// Number of CUDA devices visible at run time (0 without CUDA or without a GPU).
int cuda_device_count() noexcept;

}  // namespace shardkit::detail
