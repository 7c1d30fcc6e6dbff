// The timed loop of the device benchmarks (model_bench_cuda, optim_bench_cuda): one step per iteration under
// manual timing, a failed step reported with SkipWithError.
#pragma once

#include <benchmark/benchmark.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardkit::bench {

// Runs `step` (returns absl::Status, and has finished its work when it returns) once per iteration; returns each
// step's wall seconds, or nullopt after a failed step (the benchmark is then skipped with its message).
template <class Step>
std::optional<std::vector<double>> TimedSteps(benchmark::State& state, Step step) {
  std::vector<double> seconds;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    const absl::Status s = step();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      return std::nullopt;
    }
    state.SetIterationTime(dt);
    seconds.push_back(dt);
  }
  return seconds;
}

}  // namespace shardkit::bench
