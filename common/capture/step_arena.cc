#include "common/capture/step_arena.h"

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <utility>

#include "common/base/check.h"

namespace shardkit::capture {

ArenaPlan plan_arena(const std::vector<ArenaBlock>& blocks) {
  ArenaPlan plan;
  plan.offsets.assign(blocks.size(), -1);
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i].given_back >= 0 && blocks[i].bytes > 0) order.push_back(i);
  }
  // Largest first (then in order taken): the big values fix the layout and the small ones fill the gaps.
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return blocks[a].bytes > blocks[b].bytes; });
  std::vector<std::size_t> placed;
  std::vector<std::pair<std::int64_t, std::int64_t>> busy;
  for (std::size_t i : order) {
    const ArenaBlock& b = blocks[i];
    busy.clear();
    for (std::size_t j : placed) {
      const ArenaBlock& o = blocks[j];
      if (o.taken < b.given_back && b.taken < o.given_back) {
        busy.emplace_back(plan.offsets[j], plan.offsets[j] + o.bytes);
      }
    }
    std::sort(busy.begin(), busy.end());
    std::int64_t offset = 0;
    for (const auto& [begin, end] : busy) {
      if (offset + b.bytes <= begin) break;
      offset = std::max(offset, end);
    }
    plan.offsets[i] = offset;
    plan.bytes = std::max(plan.bytes, offset + b.bytes);
    placed.push_back(i);
  }
  return plan;
}

StepArena::~StepArena() {
  for (const auto& [bytes, data] : spares_) std::free(data);
  std::free(base_);
}

void StepArena::begin_replay() {
  std::lock_guard<std::mutex> lock(mu_);
  next_ = 0;
  departed_ = false;
  stats_.from_arena = stats_.from_heap = stats_.from_spares = 0;
  if (recording_) {
    event_ = 0;
    recorded_.clear();
    recording_index_.clear();
  }
}

void StepArena::end_replay() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!recording_) {
    // A replay that departed from the recording is recorded again (Note [step arena]).
    if (departed_ || next_ != static_cast<std::int64_t>(recorded_.size())) recording_ = true;
    return;
  }
  ++stats_.recordings;
  recording_index_.clear();  // blocks still held are the heap's: free() gives them back there
  ArenaPlan plan = plan_arena(recorded_);
  if (plan.bytes > capacity_) {
    if (!busy_.empty()) return;  // a value of the old arena is still held: keep recording until it is given back
    std::free(base_);
    base_ = static_cast<std::byte*>(std::aligned_alloc(64, static_cast<std::size_t>(plan.bytes)));
    SK_CHECK(base_ != nullptr) << "out of host memory allocating a step arena of " << plan.bytes << " bytes";
    capacity_ = plan.bytes;
  }
  plan_ = std::move(plan);
  stats_.arena_bytes = plan_.bytes;
  recording_ = false;
}

void* StepArena::heap(std::size_t nbytes) {
  ++stats_.from_heap;
  if (auto it = spares_.find(nbytes); it != spares_.end()) {  // Note [arena spares]
    void* data = it->second;
    spares_.erase(it);
    stats_.spare_bytes -= static_cast<std::int64_t>(nbytes);
    ++stats_.from_spares;
    return data;
  }
  void* data = std::aligned_alloc(64, nbytes);
  SK_CHECK(data != nullptr) << "out of host memory allocating " << nbytes << " bytes";
  return data;
}

void* StepArena::allocate(std::size_t nbytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::int64_t k = next_++;
  const auto bytes = static_cast<std::int64_t>(nbytes);
  if (recording_) {
    void* data = heap(nbytes);
    recording_index_[data] = recorded_.size();
    recorded_.push_back(ArenaBlock{bytes, event_++, -1});
    return data;
  }
  if (k >= static_cast<std::int64_t>(recorded_.size()) || recorded_[static_cast<std::size_t>(k)].bytes != bytes) {
    departed_ = true;
    return heap(nbytes);
  }
  const std::int64_t offset = plan_.offsets[static_cast<std::size_t>(k)];
  if (offset < 0) return heap(nbytes);  // held past the step when recorded
  // The range must be free now, whatever the recording said.
  auto next = busy_.lower_bound(offset);
  const bool busy = (next != busy_.end() && next->first < offset + bytes) ||
                    (next != busy_.begin() && std::prev(next)->second > offset);
  if (busy) return heap(nbytes);
  busy_.emplace_hint(next, offset, offset + bytes);
  ++stats_.from_arena;
  return base_ + offset;
}

bool StepArena::in_arena(const void* data) const {
  const auto* p = static_cast<const std::byte*>(data);
  return base_ != nullptr && p >= base_ && p < base_ + capacity_;
}

void StepArena::free(void* data, std::size_t nbytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (in_arena(data)) {
    const std::size_t erased = busy_.erase(static_cast<std::byte*>(data) - base_);
    SK_CHECK_EQ(erased, 1u) << "StepArena: a block given back twice";
    return;
  }
  if (auto it = recording_index_.find(data); it != recording_index_.end()) {
    recorded_[it->second].given_back = event_++;
    recording_index_.erase(it);
  } else if (stats_.spare_bytes + static_cast<std::int64_t>(nbytes) <= capacity_ / 4) {
    spares_.emplace(nbytes, data);  // Note [arena spares]
    stats_.spare_bytes += static_cast<std::int64_t>(nbytes);
    return;
  }
  std::free(data);
}

StepArena::Stats StepArena::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace shardkit::capture
