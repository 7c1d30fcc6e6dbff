#include "common/base/check.h"
#include "common/tensor/device_memory.h"

namespace shardkit::detail {

void* cuda_allocate(Device device, std::size_t) {
  SK_CHECK(false) << "cannot allocate on " << device.str() << ": shardkit was built without CUDA";
  return nullptr;
}
void cuda_free(Device, void*) noexcept {}
int cuda_device_count() noexcept { return 0; }

}  // namespace shardkit::detail
