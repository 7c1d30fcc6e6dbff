// Timing helpers shared by the single-threaded kernel benchmarks (optim_bench, activation_bench).
#pragma once

#include <time.h>

#include <algorithm>
#include <vector>

namespace shardkit::bench {

// CPU time of the calling thread: unlike wall time it does not count time the thread was descheduled, which matters
// on a 2-core machine shared with other work.
inline double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The upper median of `v` (non-empty).
inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace shardkit::bench
