// train_bench's compiled_* cases (issue 16 acceptance): one training step of GPT "gpt-10m" replayed by
// capture::compile (common/capture/compile.h) against the eager strategy it replaces, both measured in the same
// run, interleaved, on N simulated ranks (threads), as train_bench.cc's cases measure a strategy against DDP.
//
//   build/bench/train_bench --benchmark_filter=compiled
//
//   compiled_single/n1         no parallel mode, against the eager step (forward, backward, AdamW)
//   compiled_replicate/nN      sddp::ReplicateMode (buckets of 4 MiB, as train_bench's DDP), against eager
//                              sddp::DistributedDataParallel with the same buckets
//   compiled_fully_shard/nN    fsdp::FullyShardMode (gather buckets of 4 MiB, one ahead, the last forward bucket
//                              kept for backward; calls up to 128 KiB coalesced), against eager fsdp::fully_shard as train_bench's fsdp case builds it
//                              (every MLP, every TransformerBlock, the root; implicit prefetch)
// Each round runs one eager step, a barrier, one compiled step, a barrier (rank 0's wall time of each is the
// world's). Two unmeasured warm-up rounds: the first captures (the step runs eagerly once, dry), the second is
// the first replay. The reported time is the compiled step; counters (per measured step, rank 0):
//   vs_eager               compiled step time / eager step time (goal for fully_shard: <= 0.9)
//   eager_step_ms          the eager step
//   host_overhead_ms       the replay's time outside kernels and collectives (ReplayStats: total - kernel -
//                          collective)
//   kernel_ms / collective_ms   the replay's time inside op kernels / issuing and waiting for collectives
//   collectives            collective calls of the compiled step (ProcessGroup counters), and by kind:
//                          all_gathers, reduce_scatters, all_reduces
//   eager_collectives      the same count for the eager step
//   nodes                  nodes of the replayed graph
//   arena_B / heap_allocs  the step arena's size, and the last replay's allocations served outside it (Note [step
//                          arena]: a range still busy, a value held past the step); spare_reuses: of those, blocks
//                          reused from an earlier replay (Note [arena spares])
//   peak_B / eager_peak_B  rank 0's ledger peak (all categories) during the compiled / the eager steps
//
// Measured (Zen 3, 2 cores shared with other work, load 3.2-3.8; medians of 5 repetitions of 5 steps):
//   build/bench/train_bench --benchmark_filter=compiled --benchmark_repetitions=5
//   vs_eager: single 1.01; replicate N = 2 0.99, N = 4 0.99; fully_shard N = 2 1.01, N = 4 0.92 (goal <= 0.9);
//   host_overhead_ms 1.1 (single), 2.8 / 5.4 (replicate), 2.7 / 3.8 (fully_shard) of steps of 179-715 ms;
//   fully_shard calls per step 180 (119 all_gathers, 61 reduce_scatters) against eager fsdp's 220, ledger peak
//   108.4 / 77.0 MB against eager's 106.7 / 74.6 MB. On 2 cores the collectives' copies run on the same cores as
//   the kernels (the in-process group's workers), so overlap hides little: the replay does the eager step's work
//   (kernel_ms is most of the step) and wins only the autograd and hook bookkeeping.
// With the step arena (102f67a; load 3-6, medians of 3, --benchmark_filter=compiled_fully_shard): N = 2 0.87-0.93,
//   N = 4 0.85-0.95; the same session with CompileOptions::arena = false: 0.94-0.95.
// Quiet (load 2-4), after fast_exp vectorised (9406a72) and with the arena's spares (cc3d7d1), two runs of
//   --benchmark_filter=compiled_fully_shard --benchmark_repetitions=3: N = 2 0.945, 0.947; N = 4 0.90, 0.87. At N = 2
//   kernels are ~85% of the replay and eager fsdp's bookkeeping ~5% of its step (README, "Whole-step capture").
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/autograd/engine.h"
#include "common/base/check.h"
#include "common/capture/compile.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "common/tensor/memory_tracker.h"
#include "common/tensor/rank_context.h"
#include "fsdp/fully_shard.h"
#include "fsdp/fully_shard_mode.h"
#include "sddp/data_parallel.h"
#include "sddp/replicate_mode.h"

namespace shardkit {
namespace {

enum class Mode { single, replicate, fully_shard };

constexpr std::int64_t kBatchPerRank = 2;
constexpr std::int64_t kSeq = 64;
// Gradient buckets of 1 Mi elements (4 MiB), for eager DDP and the replicate mode alike (train_step.cc's choice).
constexpr std::int64_t kBucketNumel = 1 << 20;
// The fully-shard mode's gather buckets (Note [gather buckets] in fsdp/fully_shard_mode.h), one ahead, and compile's
// coalescing bound: calls of at most 128 KiB (biases, layer norms, wpe) are merged into one per bucket, larger ones
// (the weights) stay calls of their own, gathered straight into their buffers with no pack / unpack copy. Measured
// at N = 2 / 4, vs_eager medians of 3 (load 5-8): buckets 4 MiB + coalesce 128 KiB 0.96 / 1.00; 1 MiB + 128 KiB
// 1.04 / 1.04; 4 MiB + 128 KiB without prefetch 1.03 / 1.02; a bucket per parameter 1.10 / 1.07; 4 MiB + coalesce
// 4 MiB (every call packed) 1.31 / 1.12.
constexpr std::int64_t kGatherBucketBytes = 4 << 20;
constexpr std::int64_t kCoalesceBytes = 128 << 10;

std::vector<Tensor> Batch(const nn::GPTConfig& c, int rank, int step) {
  Generator gen(5, static_cast<std::uint64_t>(step * 64 + rank));
  std::vector<std::int64_t> x(kBatchPerRank * kSeq), y(kBatchPerRank * kSeq);
  for (auto& t : x) t = static_cast<std::int64_t>(gen.next_below(static_cast<std::uint64_t>(c.vocab_size)));
  for (auto& t : y) t = static_cast<std::int64_t>(gen.next_below(static_cast<std::uint64_t>(c.vocab_size)));
  return {Tensor::from_int64(x, {kBatchPerRank, kSeq}), Tensor::from_int64(y, {kBatchPerRank, kSeq})};
}

std::int64_t Calls(const comm::CommCounters& c) {
  std::int64_t calls = 0;
  for (const comm::KindCounters& k : c.by_kind) calls += k.calls;
  return calls;
}

// What rank 0 measured over the measured rounds.
struct CompiledCaseResult {
  double compiled_seconds = 0;
  double eager_seconds = 0;
  std::int64_t iterations = 0;
  capture::ReplayStats replay;      // sums over measured rounds
  comm::CommCounters compiled_comm;  // the last measured compiled step
  comm::CommCounters eager_comm;     // the last measured eager step
  int nodes = 0;
  capture::StepArena::Stats arena;  // after the last measured replay
  MemorySnapshot compiled_memory, eager_memory;
};

// One rank's part of a case: builds the eager model and strategy and the compiled one, then the rounds (rank 0
// drives them with a broadcast flag, as train_step.cc does).
absl::Status RunCompiledRank(comm::RankEnv& env, Mode mode, benchmark::State* state, CompiledCaseResult& result) {
  const int rank = env.rank;
  const int world = env.world_size;
  comm::ProcessGroup& group = env.group;
  const nn::GPTConfig config = *nn::GPTConfig::named("gpt-10m");
  RankContext eager_ctx{rank, world, std::make_shared<MemoryTracker>(), Generator(1)};
  RankContext compiled_ctx{rank, world, std::make_shared<MemoryTracker>(), Generator(1)};

  std::unique_ptr<nn::GPT> eager_model, compiled_model;
  std::unique_ptr<optim::Optimizer> eager_opt, compiled_opt;
  std::unique_ptr<sddp::DataParallel> ddp;
  std::optional<capture::CompiledStep> compiled;
  {
    RankContextScope scope(eager_ctx);
    {
      MemoryCategoryScope params(MemoryCategory::parameter);
      eager_model = std::make_unique<nn::GPT>(config, 1);
    }
    if (mode == Mode::replicate) {
      auto w = sddp::DistributedDataParallel::create(*eager_model, env.group_ptr, {.reduce_buffer_size = kBucketNumel});
      if (!w.ok()) return w.status();
      ddp = std::move(*w);
    } else if (mode == Mode::fully_shard) {
      const fsdp::FullyShardOptions options{.implicit_prefetch = true};
      for (const char* type : {"MLP", "TransformerBlock"}) {
        for (nn::Module* m : fsdp::modules_of_type(*eager_model, type)) {
          if (auto u = fsdp::fully_shard(*m, env.group_ptr, options); !u.ok()) return u.status();
        }
      }
      if (auto root = fsdp::fully_shard(*eager_model, env.group_ptr, options); !root.ok()) return root.status();
    }
    MemoryCategoryScope cat(MemoryCategory::optimizer_state);
    auto o = optim::AdamW::factory()({{eager_model->parameters(), optim::AdamW::default_hyper()}});
    if (!o.ok()) return o.status();
    eager_opt = std::move(*o);
  }
  {
    RankContextScope scope(compiled_ctx);
    {
      MemoryCategoryScope params(MemoryCategory::parameter);
      compiled_model = std::make_unique<nn::GPT>(config, 1);
    }
    MemoryCategoryScope cat(MemoryCategory::optimizer_state);
    auto o = optim::AdamW::factory()({{compiled_model->parameters(), optim::AdamW::default_hyper()}});
    if (!o.ok()) return o.status();
    compiled_opt = std::move(*o);
    std::shared_ptr<capture::ParallelMode> parallel;
    if (mode == Mode::replicate) {
      parallel = std::make_shared<sddp::ReplicateMode>(
          env.group_ptr, sddp::ReplicateModeOptions{.bucket_cap_bytes = kBucketNumel * 4});
    } else if (mode == Mode::fully_shard) {
      parallel = std::make_shared<fsdp::FullyShardMode>(
          env.group_ptr, fsdp::FullyShardModeOptions{
              .bucket_bytes = kGatherBucketBytes, .prefetch = 1, .reshard_last_bucket_after_forward = false});
    }
    nn::GPT& m = *compiled_model;
    optim::Optimizer& opt = *compiled_opt;
    compiled.emplace(capture::compile(
        [&m, &opt](const std::vector<Tensor>& batch) {
          MemoryCategoryScope activations(MemoryCategory::activation);
          Tensor loss = m.loss(batch[0], batch[1]);
          autograd::backward(loss);
          MemoryCategoryScope state_cat(MemoryCategory::optimizer_state);
          SK_CHECK(opt.step().ok());
          opt.zero_grad();
          return loss;
        },
        m, opt, {.parallel_mode = parallel, .coalesce_bytes = mode == Mode::fully_shard ? kCoalesceBytes : 0}));
  }

  Tensor go = Tensor::zeros({1}, TensorOptions{}.with_dtype(DType::i64));
  auto more = [&](bool value) -> absl::StatusOr<bool> {
    if (rank == 0) go.fill_(value ? 1 : 0);
    if (absl::Status s = group.broadcast(go)->wait(); !s.ok()) return s;
    return go.item() != 0;
  };
  auto one_round = [&](int step, bool measured) -> absl::Status {
    using clock = std::chrono::steady_clock;
    const std::vector<Tensor> batch = Batch(config, rank, step);
    const comm::CommCounters c0 = group.counters();
    auto t0 = clock::now();
    {
      RankContextScope scope(eager_ctx);
      eager_opt->zero_grad();
      {
        MemoryCategoryScope activations(MemoryCategory::activation);
        if (absl::Status s = autograd::try_backward(eager_model->loss(batch[0], batch[1])); !s.ok()) return s;
      }
      MemoryCategoryScope cat(MemoryCategory::optimizer_state);
      if (absl::Status s = eager_opt->step(); !s.ok()) return s;
    }
    const comm::CommCounters c1 = group.counters();
    if (absl::Status s = group.barrier()->wait(); !s.ok()) return s;
    auto t1 = clock::now();
    const comm::CommCounters c2 = group.counters();
    {
      RankContextScope scope(compiled_ctx);
      absl::StatusOr<Tensor> loss = (*compiled)(batch);
      if (!loss.ok()) return loss.status();
    }
    const comm::CommCounters c3 = group.counters();
    if (absl::Status s = group.barrier()->wait(); !s.ok()) return s;
    auto t2 = clock::now();
    if (rank == 0 && measured) {
      const double compiled_s = std::chrono::duration<double>(t2 - t1).count();
      result.eager_seconds += std::chrono::duration<double>(t1 - t0).count();
      result.compiled_seconds += compiled_s;
      const capture::ReplayStats& r = *compiled->last_stats();
      result.replay.kernel_seconds += r.kernel_seconds;
      result.replay.collective_seconds += r.collective_seconds;
      result.replay.total_seconds += r.total_seconds;
      result.eager_comm = c1.since(c0);
      result.compiled_comm = c3.since(c2);
      state->SetIterationTime(compiled_s);
    }
    return absl::OkStatus();
  };
  for (int warm = 0; warm < 2; ++warm) {
    if (absl::Status s = one_round(warm, false); !s.ok()) return s;
  }
  eager_ctx.memory->reset_peaks();
  compiled_ctx.memory->reset_peaks();
  if (rank == 0) {
    int step = 2;
    for (auto _ : *state) {
      if (auto m = more(true); !m.ok()) return m.status();
      if (absl::Status s = one_round(step++, true); !s.ok()) return s;
      ++result.iterations;
    }
    if (auto m = more(false); !m.ok()) return m.status();
    result.nodes = static_cast<int>(compiled->graph()->nodes().size());
    result.arena = compiled->arena_stats();
    result.compiled_memory = compiled_ctx.memory->snapshot();
    result.eager_memory = eager_ctx.memory->snapshot();
  } else {
    for (int step = 2;; ++step) {
      absl::StatusOr<bool> m = more(false);
      if (!m.ok()) return m.status();
      if (!*m) break;
      if (absl::Status s = one_round(step, false); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

void BM_CompiledStep(benchmark::State& state, int world, Mode mode) {
  CompiledCaseResult r;
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    return RunCompiledRank(env, mode, env.rank == 0 ? &state : nullptr, r);
  });
  if (!st.ok()) {
    state.SkipWithError(std::string(st.message()).c_str());
    return;
  }
  const double n = static_cast<double>(std::max<std::int64_t>(r.iterations, 1));
  state.counters["vs_eager"] = r.compiled_seconds / r.eager_seconds;
  state.counters["eager_step_ms"] = 1e3 * r.eager_seconds / n;
  state.counters["host_overhead_ms"] =
      1e3 * (r.replay.total_seconds - r.replay.kernel_seconds - r.replay.collective_seconds) / n;
  state.counters["kernel_ms"] = 1e3 * r.replay.kernel_seconds / n;
  state.counters["collective_ms"] = 1e3 * r.replay.collective_seconds / n;
  state.counters["collectives"] = static_cast<double>(Calls(r.compiled_comm));
  state.counters["all_gathers"] = static_cast<double>(r.compiled_comm.of(comm::CollectiveKind::all_gather).calls);
  state.counters["reduce_scatters"] =
      static_cast<double>(r.compiled_comm.of(comm::CollectiveKind::reduce_scatter).calls);
  state.counters["all_reduces"] = static_cast<double>(r.compiled_comm.of(comm::CollectiveKind::all_reduce).calls);
  state.counters["eager_collectives"] = static_cast<double>(Calls(r.eager_comm));
  state.counters["nodes"] = r.nodes;
  state.counters["arena_B"] = static_cast<double>(r.arena.arena_bytes);
  state.counters["heap_allocs"] = static_cast<double>(r.arena.from_heap);
  state.counters["spare_reuses"] = static_cast<double>(r.arena.from_spares);
  state.counters["peak_B"] = static_cast<double>(r.compiled_memory.total_peak);
  state.counters["eager_peak_B"] = static_cast<double>(r.eager_memory.total_peak);
}

void RegisterCompiled() {
  struct Case {
    Mode mode;
    const char* label;
    std::vector<int> worlds;
  };
  const Case cases[] = {{Mode::single, "compiled_single", {1}},
                        {Mode::replicate, "compiled_replicate", {2, 4}},
                        {Mode::fully_shard, "compiled_fully_shard", {2, 4}}};
  for (const Case& c : cases) {
    for (int world : c.worlds) {
      const std::string name = std::string(c.label) + "/gpt-10m/n" + std::to_string(world);
      benchmark::RegisterBenchmark(name.c_str(), BM_CompiledStep, world, c.mode)
          ->UseManualTime()
          ->Iterations(5)
          ->Unit(benchmark::kMillisecond);
    }
  }
}

const int kRegistered = (RegisterCompiled(), 0);

}  // namespace
}  // namespace shardkit
