// The per-rank memory ledger (DESIGN.md sections 2 and 6).
//
// Every Storage allocation is charged to a MemoryTracker under a MemoryCategory, and credited back to
// the same tracker when freed. The tracker keeps, per category and in total, the bytes currently held
// and the peak since the last reset_peaks(). Figures are exact byte counts of what was requested
// (alignment padding of the allocator is not counted), so tests can assert them exactly.
//
// Thread-safety: all methods may be called concurrently (a rank's communication thread charges the
// same tracker as its compute thread).
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>

namespace shardkit {

enum class MemoryCategory : std::uint8_t {
  parameter = 0,
  gradient,
  optimizer_state,
  activation,
  communication_buffer,
  other,
};
inline constexpr int kNumMemoryCategories = 6;

std::string_view memory_category_name(MemoryCategory c);

struct MemorySnapshot {
  std::array<std::int64_t, kNumMemoryCategories> current{};
  std::array<std::int64_t, kNumMemoryCategories> peak{};
  std::int64_t total_current = 0;
  std::int64_t total_peak = 0;

  std::int64_t current_of(MemoryCategory c) const { return current[static_cast<int>(c)]; }
  std::int64_t peak_of(MemoryCategory c) const { return peak[static_cast<int>(c)]; }
  // One line per category: "parameter  current=...  peak=...".
  std::string to_string() const;
};

class MemoryTracker {
 public:
  MemoryTracker() = default;
  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;

  void charge(MemoryCategory c, std::int64_t bytes);
  void credit(MemoryCategory c, std::int64_t bytes);

  std::int64_t current(MemoryCategory c) const;
  std::int64_t peak(MemoryCategory c) const;
  std::int64_t total_current() const;
  std::int64_t total_peak() const;
  MemorySnapshot snapshot() const;

  // Peaks restart from the current figures (e.g. to measure one training step).
  void reset_peaks();

 private:
  mutable std::mutex mu_;
  MemorySnapshot s_;
};

}  // namespace shardkit
