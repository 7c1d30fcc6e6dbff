// HostBlockSource: where the calling thread's CPU Storage bytes come from while one is installed (default: the
// heap, std::aligned_alloc). capture::StepArena (common/capture/step_arena.h) is the one implementation: a replayed
// step's values carved out of one planned block.
//
// Ownership: a Storage that took its bytes from a source keeps the source alive (shared_ptr) until it gives them
// back, so a value may outlive the scope and the source's owner.
// Thread-safety: allocate() is called on the thread that installed the source; free() may come from any thread
// (the last reference to a tensor can be dropped by a communication thread), so sources synchronise it.
#pragma once

#include <cstddef>
#include <memory>

namespace shardkit {

class HostBlockSource {
 public:
  virtual ~HostBlockSource() = default;
  // `nbytes` (a multiple of 64) of uninitialised, 64-byte aligned memory; never null (a source that cannot serve
  // takes the bytes from the heap itself).
  virtual void* allocate(std::size_t nbytes) = 0;
  // Gives back `data`, which allocate(nbytes) returned.
  virtual void free(void* data, std::size_t nbytes) = 0;
  // Whether `data` (from allocate) is page-locked host memory (pinned_host_source.h).
  virtual bool pinned(const void* data) const { return false; }
};

// The source installed on the calling thread; nullptr: the heap.
const std::shared_ptr<HostBlockSource>& current_host_block_source();

// Installs `source` on the calling thread until destruction (nests; restores the previous one).
class HostBlockSourceScope {
 public:
  explicit HostBlockSourceScope(std::shared_ptr<HostBlockSource> source);
  ~HostBlockSourceScope();
  HostBlockSourceScope(const HostBlockSourceScope&) = delete;
  HostBlockSourceScope& operator=(const HostBlockSourceScope&) = delete;

 private:
  std::shared_ptr<HostBlockSource> previous_;
};

}  // namespace shardkit
