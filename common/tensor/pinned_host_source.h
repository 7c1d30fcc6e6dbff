// PinnedHostSource: a HostBlockSource (host_block_source.h) whose blocks are page-locked host memory
// (detail::cuda_host_alloc) when the program can pin memory, and the heap's otherwise: a program without the CUDA
// component, or a driver that refuses, gets the same bytes unpinned (Storage::pinned() tells which). Copies between
// pinned memory and a device run by DMA at the link's speed, without the driver's staging copy. Installed with a
// HostBlockSourceScope around the allocation of host buffers that move to or from a device often (FSDP's
// offloaded shards, Note [cpu offload] in fsdp/param_group.cc). Pinning is costly to set up and to free (freeing
// pinned memory waits for the device): for long-lived buffers.
//
// Thread-safety: allocate, free and pinned may be called from any thread.
#pragma once

#include <cstddef>
#include <mutex>
#include <set>

#include "common/tensor/host_block_source.h"

namespace shardkit {

class PinnedHostSource final : public HostBlockSource {
 public:
  void* allocate(std::size_t nbytes) override;
  void free(void* data, std::size_t nbytes) override;
  bool pinned(const void* data) const override;

 private:
  mutable std::mutex mu_;
  std::set<const void*> pinned_;  // the blocks cuda_host_alloc gave (the others came from the heap)
};

}  // namespace shardkit
