#include "common/tensor/pinned_host_source.h"

#include <cstdlib>

#include "common/base/check.h"
#include "common/tensor/device_memory.h"

namespace shardkit {

void* PinnedHostSource::allocate(std::size_t nbytes) {
  if (void* p = detail::cuda_host_alloc(nbytes)) {  // page-aligned, so 64-byte aligned
    std::lock_guard<std::mutex> lock(mu_);
    pinned_.insert(p);
    return p;
  }
  void* p = std::aligned_alloc(64, nbytes);
  SK_CHECK(p != nullptr) << "out of host memory allocating " << nbytes << " bytes";
  return p;
}

void PinnedHostSource::free(void* data, std::size_t) {
  bool was_pinned = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    was_pinned = pinned_.erase(data) > 0;
  }
  if (was_pinned) {
    detail::cuda_host_free(data);
  } else {
    std::free(data);
  }
}

bool PinnedHostSource::pinned(const void* data) const {
  std::lock_guard<std::mutex> lock(mu_);
  return pinned_.count(data) > 0;
}

}  // namespace shardkit
