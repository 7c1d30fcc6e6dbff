#include "common/tensor/storage.h"

#include <cstdlib>

#include "common/base/check.h"
#include "common/tensor/device_memory.h"
#include "common/tensor/rank_context.h"

namespace shardkit {
namespace {
std::size_t host_bytes(std::size_t nbytes) { return (nbytes + 63) / 64 * 64; }
}  // namespace

Storage::Storage(std::size_t nbytes, Device device, MemoryCategory category)
    : nbytes_(nbytes), device_(device), category_(category) {}

std::shared_ptr<Storage> Storage::allocate(std::size_t nbytes, Device device, MemoryCategory category) {
  std::shared_ptr<Storage> s(new Storage(nbytes, device, category));
  s->tracker_ = current_rank_context().memory;
  s->allocate_bytes();
  return s;
}

std::shared_ptr<Storage> Storage::allocate_released(std::size_t nbytes, Device device, MemoryCategory category) {
  std::shared_ptr<Storage> s(new Storage(nbytes, device, category));
  s->tracker_ = current_rank_context().memory;
  return s;
}

std::shared_ptr<Storage> Storage::borrow(void* data, std::size_t nbytes, Device device) {
  std::shared_ptr<Storage> s(new Storage(nbytes, device, MemoryCategory::other));
  s->data_ = data;
  s->borrowed_ = true;
  return s;
}

void Storage::allocate_bytes() {
  if (nbytes_ == 0) return;
  if (device_.is_cpu()) {
    const std::size_t rounded = host_bytes(nbytes_);
    if (const std::shared_ptr<HostBlockSource>& source = current_host_block_source()) {
      data_ = source->allocate(rounded);
      source_ = source;
    } else {
      data_ = std::aligned_alloc(64, rounded);
    }
    SK_CHECK(data_ != nullptr) << "out of host memory allocating " << nbytes_ << " bytes";
  } else {
    data_ = detail::cuda_allocate(device_, nbytes_);
  }
  tracker_->charge(category_, static_cast<std::int64_t>(nbytes_), location());
}

void Storage::release() {
  SK_CHECK(!borrowed_) << "release() of borrowed storage";
  if (data_ == nullptr) return;
  if (source_) {
    source_->free(data_, host_bytes(nbytes_));
    source_.reset();
  } else if (device_.is_cpu()) {
    std::free(data_);
  } else {
    detail::cuda_free(device_, data_);
  }
  data_ = nullptr;
  tracker_->credit(category_, static_cast<std::int64_t>(nbytes_), location());
}

void Storage::reallocate() {
  SK_CHECK(!borrowed_) << "reallocate() of borrowed storage";
  if (data_ != nullptr || nbytes_ == 0) return;
  allocate_bytes();
}

void Storage::recategorize(MemoryCategory category) {
  if (category == category_) return;
  if (data_ != nullptr && !borrowed_) {
    tracker_->credit(category_, static_cast<std::int64_t>(nbytes_), location());
    tracker_->charge(category, static_cast<std::int64_t>(nbytes_), location());
  }
  category_ = category;
}

Storage::~Storage() {
  if (!borrowed_) release();
}

}  // namespace shardkit
