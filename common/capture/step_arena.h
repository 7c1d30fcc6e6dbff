// StepArena: one block of host memory per rank out of which a replayed step's values are carved (issue 16 item 2:
// "a memory plan computed from value lifetimes, one arena per rank, slots reused"). The Executor installs it as the
// rank thread's HostBlockSource (common/tensor/host_block_source.h) for each replay.
//
// Note [step arena]
// A replay makes the same allocations in the same order every time on its rank's thread: the same kernels on
// tensors of the same shapes. The first replay records them: each block's size and the events at which it was
// taken and given back (one counter for both, so a lifetime is an interval of events). It includes what the
// slots' lifetimes alone would miss: activations a backward node saved, a kernel's scratch, an unsharded
// parameter gathered and resharded. Blocks still held when the replay ends (the loss, anything the step keeps)
// stay on the heap. plan_arena() places the others in one block, largest first, each at the lowest offset free of
// the blocks whose lifetimes overlap its own; later replays take their k-th allocation at its offset.
//
// Safety does not rest on the recording: the arena keeps the ranges in use, and an allocation whose range is still
// busy (a collective finished later than when recorded, so a value went back later), whose size differs from the
// recording, or that comes after the recorded ones, is served from the heap instead. A replay whose allocations
// departed from the recording (size or count) is recorded again the next time. So the arena changes where values
// live, never what a replay computes.
//
// The ledger is charged per value as without an arena (what is live); arena_bytes is what the rank holds on to
// between replays for them, as a caching allocator's reserved memory is to its allocated memory.
//
// Note [arena spares]
// The heap's blocks recur too: under a parallel mode with prefetch the same few collective buffers go back later
// than recorded every step, so their planned ranges are busy again and the same sizes fall back to the heap each
// replay (tens of blocks of up to megabytes per step at gpt-10m), paying malloc and fresh pages each time. So a heap
// block given back outside a recording is kept as a spare, by its exact size, and the next heap allocation of that
// size takes it; spares are held up to a quarter of the arena's size (the rest is freed at once) and all freed
// with the arena. Nothing else changes: a spare is a block nobody holds.
//
// Thread-safety: begin_replay / end_replay / allocate on the rank thread; free from any thread (a mutex).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/tensor/host_block_source.h"

namespace shardkit::capture {

// One recorded allocation: its bytes and the events at which it was taken and given back (-1: still held).
struct ArenaBlock {
  std::int64_t bytes = 0;
  std::int64_t taken = 0;
  std::int64_t given_back = -1;
};

struct ArenaPlan {
  std::vector<std::int64_t> offsets;  // per block; -1: not placed (held past the replay: from the heap)
  std::int64_t bytes = 0;             // the arena's size
};

// Note [step arena]: a pure function of the recording.
ArenaPlan plan_arena(const std::vector<ArenaBlock>& blocks);

class StepArena final : public HostBlockSource {
 public:
  struct Stats {
    std::int64_t arena_bytes = 0;  // the arena's size (0 while none is placed)
    std::int64_t from_arena = 0;   // the last replay's allocations served from the arena
    std::int64_t from_heap = 0;    // and from the heap (recording, held past the step, busy range, departures)
    std::int64_t from_spares = 0;  // of those, blocks given back to the heap before and reused (Note [arena spares])
    std::int64_t spare_bytes = 0;  // held as spares now
    int recordings = 0;            // replays recorded so far
  };

  StepArena() = default;
  ~StepArena() override;
  StepArena(const StepArena&) = delete;
  StepArena& operator=(const StepArena&) = delete;

  void begin_replay();
  void end_replay();
  void* allocate(std::size_t nbytes) override;
  void free(void* data, std::size_t nbytes) override;
  Stats stats() const;

 private:
  bool in_arena(const void* data) const;
  void* heap(std::size_t nbytes);

  mutable std::mutex mu_;
  bool recording_ = true;
  bool departed_ = false;
  std::int64_t next_ = 0;   // the replay's allocations so far
  std::int64_t event_ = 0;  // allocations and give-backs while recording
  std::vector<ArenaBlock> recorded_;
  absl::flat_hash_map<const void*, std::size_t> recording_index_;  // heap blocks of the recording, by address
  ArenaPlan plan_;
  std::byte* base_ = nullptr;
  std::int64_t capacity_ = 0;
  std::map<std::int64_t, std::int64_t> busy_;  // arena ranges in use: offset -> end
  std::multimap<std::size_t, void*> spares_;     // Note [arena spares]: heap blocks nobody holds, by size
  Stats stats_;
};

}  // namespace shardkit::capture
