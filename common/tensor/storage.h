// Storage: a block of bytes on one device, charged to a rank's memory ledger.
//
// Several tensors may view one Storage (flat buffers, buckets, shards). The bytes can be released
// (the ledger is credited; every view then sees released() == true and must not touch data()) and
// later reallocated (charged again). This is how FSDP frees unsharded parameters between uses.
//
// Ownership: a Storage frees its bytes in its destructor, crediting the tracker it charged (it keeps
// that tracker alive). Borrowed storage wraps caller-owned memory: never charged, never freed.
// CPU bytes come from the HostBlockSource installed on the allocating thread (host_block_source.h), else the
// heap; they go back to where they came from. The ledger is charged the same either way.
// Thread-safety: none; a Storage belongs to one rank, whose threads synchronise through that rank's
// own collectives and work handles.
#pragma once

#include <cstddef>
#include <memory>

#include "common/tensor/device.h"
#include "common/tensor/host_block_source.h"
#include "common/tensor/memory_tracker.h"

namespace shardkit {

class Storage {
 public:
  // Allocates `nbytes` (uninitialised, 64-byte aligned) on `device`, charged to the calling thread's
  // rank tracker under `category`. A CUDA device in a build without CUDA throws InternalError.
  static std::shared_ptr<Storage> allocate(std::size_t nbytes, Device device, MemoryCategory category);
  // The same, released from the start (no bytes until reallocate()): for buffers that live released most of
  // the time (FSDP's unsharded parameters), so creating them never charges the ledger.
  static std::shared_ptr<Storage> allocate_released(std::size_t nbytes, Device device, MemoryCategory category);
  // Wraps memory owned by the caller (not charged, never freed here).
  static std::shared_ptr<Storage> borrow(void* data, std::size_t nbytes, Device device);

  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  std::size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  // Where the memory tracker counts these bytes.
  MemoryLocation location() const { return device_.is_cpu() ? MemoryLocation::host : MemoryLocation::device; }
  MemoryCategory category() const { return category_; }
  bool released() const { return data_ == nullptr && nbytes_ > 0; }
  bool borrowed() const { return borrowed_; }
  // Page-locked host memory (from a PinnedHostSource that could pin it: pinned_host_source.h).
  bool pinned() const { return data_ != nullptr && source_ != nullptr && source_->pinned(data_); }
  const std::shared_ptr<MemoryTracker>& tracker() const { return tracker_; }

  // Frees the bytes and credits the ledger. Idempotent. Not allowed on borrowed storage.
  void release();
  // After release(): allocates nbytes() again (uninitialised) and charges the same tracker and category.
  void reallocate();
  // Moves the charged bytes to another ledger category (e.g. a buffer that becomes a gradient).
  void recategorize(MemoryCategory category);

 private:
  Storage(std::size_t nbytes, Device device, MemoryCategory category);
  void allocate_bytes();

  void* data_ = nullptr;
  std::size_t nbytes_ = 0;
  Device device_;
  MemoryCategory category_;
  bool borrowed_ = false;
  std::shared_ptr<MemoryTracker> tracker_;
  std::shared_ptr<HostBlockSource> source_;  // where data_ came from; nullptr: the heap (or a device)
};

}  // namespace shardkit
