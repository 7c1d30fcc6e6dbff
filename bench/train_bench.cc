// train_bench: one training step of GPT "gpt-10m" (10.6 M parameters) on N simulated ranks (threads),
// sharded strategy against the DDP baseline, measured interleaved in the same run so both see the same
// machine state.
//
//   build/bench/train_bench [--benchmark_filter=sddp]
//
// The same cases with ranks as processes over TCP: train_bench_tcp.cc. Both run one rank's part of a case
// through train_step.h (RunTrainRank), so they measure the same step. The compiled_* cases of this binary (a
// step replayed by capture::compile against the eager strategy it replaces) are in train_bench_compiled.cc.
//
// Each benchmark iteration runs one DDP step (sddp::DistributedDataParallel: bucketed all_reduce during
// backward, then a full AdamW step on every rank) and one step of the strategy under test (same model, same
// data) on every rank:
//   oss_greedy / oss_flat     DistributedDataParallel + oss::Oss (ZeRO-1)
//   sddp_greedy / sddp_flat   ShardedDataParallel + oss::Oss (ZeRO-2: reduce to owner / reduce-scatter)
//   fsdp                      fsdp::fully_shard, nested units (every MLP, every TransformerBlock, the root),
//                             AdamW over model.parameters() (the shards), implicit prefetch (ZeRO-3)
//   fsdp_no_prefetch          the same with implicit_prefetch off (each unit gathers when it runs)
//   fsdp_bf16                 fsdp with MixedPrecisionPolicy{bf16 params, bf16 reduce} (sent_B_per_rank: half)
// The reported time is the strategy's step (rank 0's wall time; every rank is synchronised by the
// collectives); counters:
//   vs_ddp              strategy step time / DDP step time (goals: OSS <= 1.05, ShardedDDP <= 1.0)
//   overlap_frac        DDP-class: share of gradient bytes whose reduction was issued before the backward's
//                       last gradient was ready (sddp ReductionStats; goal >= 0.7); fsdp: share of all-gather and
//                       reduce-scatter bytes issued ahead of their use (fsdp CommOverlapStats; goal >= 0.8)
//   ddp_step_ms         the DDP step
//   <category>_peak_B   rank 0's peak bytes per ledger category during the strategy's steps
//   ddp_optimizer_state_peak_B   the same for DDP, to compare
//   sent_B_per_rank     bytes rank 0 sent per strategy step (ring-equivalent volume, comm_counters.h)
//   optimizer_state_formula_B    the ZeRO formula for the strategy (DESIGN.md section 6)
#include <benchmark/benchmark.h>

#include <string>

#include "bench/blas_context.h"
#include "bench/train_step.h"
#include "common/comm/testing/run_ranks.h"

namespace shardkit {
namespace {

using bench::TrainStrategy;

void BM_TrainStep(benchmark::State& state, int world, TrainStrategy strategy) {
  bench::TrainCaseResult result;
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    return bench::RunTrainRank(env.group_ptr, strategy, env.rank == 0 ? &state : nullptr, result);
  });
  if (!st.ok()) {
    state.SkipWithError(std::string(st.message()).c_str());
    return;
  }
  bench::ReportTrainCounters(state, strategy, world, result);
}

void RegisterAll() {
  for (int world : {2, 4}) {
    for (const auto& [strategy, label] : bench::TrainStrategies()) {
      const std::string name = std::string(label) + "/gpt-10m/n" + std::to_string(world);
      benchmark::RegisterBenchmark(name.c_str(), BM_TrainStep, world, strategy)
          ->UseManualTime()
          ->Iterations(5)
          ->Unit(benchmark::kMillisecond);
    }
  }
}

const int kRegistered = (RegisterAll(), 0);

}  // namespace
}  // namespace shardkit
