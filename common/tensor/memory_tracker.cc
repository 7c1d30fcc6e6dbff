#include "common/tensor/memory_tracker.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "common/base/check.h"

namespace shardkit {

std::string_view memory_category_name(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::parameter: return "parameter";
    case MemoryCategory::gradient: return "gradient";
    case MemoryCategory::optimizer_state: return "optimizer_state";
    case MemoryCategory::activation: return "activation";
    case MemoryCategory::communication_buffer: return "communication_buffer";
    case MemoryCategory::other: return "other";
  }
  return "?";
}

std::string MemorySnapshot::to_string() const {
  std::string out;
  for (int i = 0; i < kNumMemoryCategories; ++i) {
    absl::StrAppendFormat(&out, "%-21s current=%d peak=%d\n",
                          memory_category_name(static_cast<MemoryCategory>(i)), current[i], peak[i]);
  }
  absl::StrAppendFormat(&out, "%-21s current=%d peak=%d\n", "total", total_current, total_peak);
  const MemoryFigures& d = at(MemoryLocation::device);
  for (int i = 0; i < kNumMemoryCategories; ++i) {
    if (d.peak[i] == 0) continue;
    absl::StrAppendFormat(&out, "device %-14s current=%d peak=%d\n",
                          memory_category_name(static_cast<MemoryCategory>(i)), d.current[i], d.peak[i]);
  }
  return out;
}

namespace {

void Add(MemoryFigures& f, int i, std::int64_t bytes) {
  f.current[i] += bytes;
  f.peak[i] = std::max(f.peak[i], f.current[i]);
  f.total_current += bytes;
  f.total_peak = std::max(f.total_peak, f.total_current);
}

void Subtract(MemoryFigures& f, int i, std::int64_t bytes) {
  f.current[i] -= bytes;
  f.total_current -= bytes;
}

void RestartPeaks(MemoryFigures& f) {
  f.peak = f.current;
  f.total_peak = f.total_current;
}

}  // namespace

void MemoryTracker::charge(MemoryCategory c, std::int64_t bytes, MemoryLocation where) {
  const int i = static_cast<int>(c);
  std::lock_guard<std::mutex> lock(mu_);
  Add(s_, i, bytes);
  Add(s_.by_location[static_cast<int>(where)], i, bytes);
}

void MemoryTracker::credit(MemoryCategory c, std::int64_t bytes, MemoryLocation where) {
  const int i = static_cast<int>(c);
  std::lock_guard<std::mutex> lock(mu_);
  MemoryFigures& at = s_.by_location[static_cast<int>(where)];
  SK_CHECK_GE(at.current[i], bytes) << "credit of more " << memory_category_name(c) << " bytes than charged"
                                    << (where == MemoryLocation::device ? " on the device" : " on the host");
  Subtract(s_, i, bytes);
  Subtract(at, i, bytes);
}

std::int64_t MemoryTracker::current(MemoryCategory c) const {
  std::lock_guard<std::mutex> lock(mu_);
  return s_.current[static_cast<int>(c)];
}
std::int64_t MemoryTracker::peak(MemoryCategory c) const {
  std::lock_guard<std::mutex> lock(mu_);
  return s_.peak[static_cast<int>(c)];
}
std::int64_t MemoryTracker::total_current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return s_.total_current;
}
std::int64_t MemoryTracker::total_peak() const {
  std::lock_guard<std::mutex> lock(mu_);
  return s_.total_peak;
}
MemorySnapshot MemoryTracker::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return s_;
}
void MemoryTracker::reset_peaks() {
  std::lock_guard<std::mutex> lock(mu_);
  RestartPeaks(s_);
  for (MemoryFigures& f : s_.by_location) RestartPeaks(f);
}

}  // namespace shardkit
