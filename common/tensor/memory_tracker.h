// The per-rank memory ledger (DESIGN.md sections 2 and 6).
//
// Every Storage allocation is charged to a MemoryTracker under a MemoryCategory, and credited back to
// the same tracker when freed. The tracker keeps, per category and in total, the bytes currently held
// and the peak since the last reset_peaks(). Figures are exact byte counts of what was requested
// (alignment padding of the allocator is not counted), so tests can assert them exactly.
// Each charge also says where the bytes live, host or device (a CUDA device's memory: a rank has at most one),
// and the tracker keeps the same figures per location (issue 14: the ZeRO formulas proven on device memory, and
// offloaded state told apart from what stays on the device); each location's peak is its own (the host's and the
// device's peaks need not fall at the same moment, nor at the all-locations peak).
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

enum class MemoryLocation : std::uint8_t { host = 0, device };
inline constexpr int kNumMemoryLocations = 2;

// Current and peak bytes per category and in total.
struct MemoryFigures {
  std::array<std::int64_t, kNumMemoryCategories> current{};
  std::array<std::int64_t, kNumMemoryCategories> peak{};
  std::int64_t total_current = 0;
  std::int64_t total_peak = 0;

  std::int64_t current_of(MemoryCategory c) const { return current[static_cast<int>(c)]; }
  std::int64_t peak_of(MemoryCategory c) const { return peak[static_cast<int>(c)]; }
};

// The figures of every location together (the base), and of each location on its own.
struct MemorySnapshot : MemoryFigures {
  std::array<MemoryFigures, kNumMemoryLocations> by_location{};
  const MemoryFigures& at(MemoryLocation where) const { return by_location[static_cast<int>(where)]; }
  // One line per category: "parameter  current=...  peak=..." (all locations), then "device ..." lines for the
  // categories holding device bytes, if any.
  std::string to_string() const;
};

class MemoryTracker {
 public:
  MemoryTracker() = default;
  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;

  void charge(MemoryCategory c, std::int64_t bytes, MemoryLocation where = MemoryLocation::host);
  void credit(MemoryCategory c, std::int64_t bytes, MemoryLocation where = MemoryLocation::host);

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
