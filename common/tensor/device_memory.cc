// Dispatch to the CUDA device memory that shardkit::cuda registers (Note [cuda component]).
#include "common/tensor/device_memory.h"

#include "common/base/check.h"
#include "common/tensor/startup_registry.h"

namespace shardkit::detail {
namespace {

constinit StartupRegistry<CudaMemoryOps> g_cuda_memory;  // written once, at static-init time

}  // namespace

void register_cuda_memory(const CudaMemoryOps* ops) { g_cuda_memory.set(ops, "CUDA device memory"); }

std::string cuda_unavailable_reason() {
#if SHARDKIT_CUDA_COMPONENT_BUILT
  return "this program does not link shardkit::cuda (use find_package(shardkit COMPONENTS cuda) and "
         "target_link_libraries(... shardkit::cuda))";
#else
  return "shardkit was built without CUDA";
#endif
}

void* cuda_allocate(Device device, std::size_t nbytes) {
  const CudaMemoryOps* ops = g_cuda_memory.get();
  SK_CHECK(ops != nullptr) << "cannot allocate on " << device.str() << ": " << cuda_unavailable_reason();
  return ops->allocate(device, nbytes);
}

void cuda_free(Device device, void* ptr) noexcept {
  // Memory on a CUDA device can only come from a registered implementation.
  if (const CudaMemoryOps* ops = g_cuda_memory.get()) ops->free(device, ptr);
}

void cuda_zero(Device device, void* ptr, std::size_t nbytes) {
  const CudaMemoryOps* ops = g_cuda_memory.get();
  SK_CHECK(ops != nullptr) << "cannot zero memory on " << device.str() << ": " << cuda_unavailable_reason();
  ops->zero(device, ptr, nbytes);
}

void cuda_copy(const void* src, DType src_dtype, Device src_device, void* dst, DType dst_dtype, Device dst_device,
               std::int64_t n) {
  const CudaMemoryOps* ops = g_cuda_memory.get();
  SK_CHECK(ops != nullptr) << "cannot copy from " << src_device.str() << " to " << dst_device.str() << ": "
                           << cuda_unavailable_reason();
  ops->copy(src, src_dtype, src_device, dst, dst_dtype, dst_device, n);
}

void cuda_synchronize(Device device) {
  const CudaMemoryOps* ops = g_cuda_memory.get();
  SK_CHECK(ops != nullptr) << "cannot synchronize " << device.str() << ": " << cuda_unavailable_reason();
  ops->synchronize(device);
}

void* cuda_host_alloc(std::size_t nbytes) noexcept {
  const CudaMemoryOps* ops = g_cuda_memory.get();
  return ops != nullptr ? ops->host_alloc(nbytes) : nullptr;
}

void cuda_host_free(void* ptr) noexcept {
  // Pinned memory can only come from a registered implementation.
  if (const CudaMemoryOps* ops = g_cuda_memory.get()) ops->host_free(ptr);
}

int cuda_device_count() noexcept {
  const CudaMemoryOps* ops = g_cuda_memory.get();
  return ops != nullptr ? ops->device_count() : 0;
}

}  // namespace shardkit::detail
