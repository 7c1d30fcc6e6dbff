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
  return out;
}

void MemoryTracker::charge(MemoryCategory c, std::int64_t bytes) {
  const int i = static_cast<int>(c);
  std::lock_guard<std::mutex> lock(mu_);
  s_.current[i] += bytes;
  s_.peak[i] = std::max(s_.peak[i], s_.current[i]);
  s_.total_current += bytes;
  s_.total_peak = std::max(s_.total_peak, s_.total_current);
}

void MemoryTracker::credit(MemoryCategory c, std::int64_t bytes) {
  const int i = static_cast<int>(c);
  std::lock_guard<std::mutex> lock(mu_);
  SK_CHECK_GE(s_.current[i], bytes) << "credit of more " << memory_category_name(c) << " bytes than charged";
  s_.current[i] -= bytes;
  s_.total_current -= bytes;
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
  s_.peak = s_.current;
  s_.total_peak = s_.total_current;
}

}  // namespace shardkit
