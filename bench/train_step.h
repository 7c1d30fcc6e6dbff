// The per-rank part of a train_bench case, shared by the in-process benchmark (train_bench.cc: ranks are
// threads of comm::RunRanks) and the TCP one (train_bench_tcp.cc: ranks are processes over a
// TcpProcessGroup). A case is one strategy at one world size, on GPT "gpt-10m"; every round runs one DDP step
// and then one step of the strategy under test (same model, same data) on every rank, each closed by a
// barrier, so rank 0's wall time of a step is the world's. train_bench.cc's header comment lists the
// strategies and what each counter means.
//
// Rank 0 drives the loop: one measured round per iteration of its benchmark::State, after one unmeasured
// warm-up round (first-step state allocation); a broadcast flag before every round tells the other ranks
// whether another round follows. Only rank 0 records (TrainCaseResult) and reports (ReportTrainCounters).
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "benchmark/benchmark.h"
#include "common/comm/process_group.h"
#include "common/tensor/memory_tracker.h"

namespace shardkit::bench {

enum class TrainStrategy { oss_greedy, oss_flat, sddp_greedy, sddp_flat, fsdp, fsdp_no_prefetch, fsdp_bf16 };

// Every strategy with its case label ("oss_greedy", ...), in the order the benchmarks register them.
absl::Span<const std::pair<TrainStrategy, const char*>> TrainStrategies();
// The strategy labelled `label`; InvalidArgument naming the label and the known ones otherwise.
absl::StatusOr<TrainStrategy> TrainStrategyNamed(std::string_view label);

// What rank 0 measured over the measured rounds (other ranks leave it as it was).
struct TrainCaseResult {
  double strategy_seconds = 0;      // sum over measured rounds of the strategy's step
  double ddp_seconds = 0;           // the same for the DDP step
  std::int64_t iterations = 0;      // measured rounds
  double overlap_sum = 0;           // sum of the strategy's per-step overlap_frac
  std::int64_t sent_per_step = 0;   // bytes rank 0 sent in the last measured strategy step
  std::int64_t psi = 0;             // model parameters
  MemorySnapshot strategy_memory;   // rank 0's ledger of the strategy (peaks since the warm-up round)
  MemorySnapshot ddp_memory;        // the same for DDP
};

// Runs this rank's part of the case on `group` (world size group->size()): builds both models and wrappers,
// then the rounds. `state` is rank 0's benchmark state (each iteration is one measured round, its manual time
// the strategy's step) and must be null on the other ranks. Every rank of the group calls it at once.
// Errors: the first failing construction, step or collective, as its Status (the caller's group is then
// unusable: the other ranks see their collectives fail).
absl::Status RunTrainRank(const std::shared_ptr<comm::ProcessGroup>& group, TrainStrategy strategy,
                          benchmark::State* state, TrainCaseResult& result);

// Sets rank 0's counters from `result`: vs_ddp, ddp_step_ms, overlap_frac, <category>_peak_B,
// ddp_optimizer_state_peak_B, sent_B_per_rank and the ZeRO formulas (train_bench.cc's header comment).
void ReportTrainCounters(benchmark::State& state, TrainStrategy strategy, int world, const TrainCaseResult& result);

}  // namespace shardkit::bench
