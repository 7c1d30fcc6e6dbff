// train_bench: one training step of GPT "gpt-10m" (10.6 M parameters) on N simulated ranks (threads),
// sharded strategy against the DDP baseline, measured interleaved in the same run so both see the same
// machine state.
//
//   build/bench/train_bench [--benchmark_filter=sddp]
//
// Each benchmark iteration runs one DDP step (sddp::DistributedDataParallel: bucketed all_reduce during
// backward, then a full AdamW step on every rank) and one step of the strategy under test (same model, same
// data) on every rank:
//   oss_greedy / oss_flat     DistributedDataParallel + oss::Oss (ZeRO-1)
//   sddp_greedy / sddp_flat   ShardedDataParallel + oss::Oss (ZeRO-2: reduce to owner / reduce-scatter)
//   fsdp                      fsdp::fully_shard, nested units (every MLP, every TransformerBlock, the root),
//                             AdamW over model.parameters() (the shards), implicit prefetch (ZeRO-3)
//   fsdp_no_prefetch          the same with implicit_prefetch off (each unit gathers when it runs)
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

#include <chrono>
#include <optional>

#include "common/autograd/engine.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "fsdp/fully_shard.h"
#include "oss/oss.h"
#include "sddp/data_parallel.h"

namespace shardkit {
namespace {

constexpr std::int64_t kBatchPerRank = 2;
constexpr std::int64_t kSeq = 64;
// 1 Mi elements (4 MiB) per gradient bucket, for every wrapper: the 8 Mi-element default would make only two
// buckets of this model, leaving little to overlap with the backward.
const sddp::DataParallelOptions kWrapperOptions{.reduce_buffer_size = 1 << 20};
// Flat policy: chunks of half a bucket (Note [flat chunks]). Measured sddp_flat vs_ddp at N = 4 (2 runs
// each): chunk 0 (one per group) 1.20-1.24, 4 Mi elements 1.17-1.22, 1 Mi 1.01-1.14, 512 Ki 0.94-0.97, 256 Ki
// 0.93-0.94, 128 Ki 0.91-0.93; the communication-buffer peak falls with the chunk (47 MB -> 8 MB).
constexpr std::int64_t kFlatChunk = 1 << 19;

std::pair<Tensor, Tensor> Batch(const nn::GPTConfig& c, int rank, int step) {
  Generator gen(5, static_cast<std::uint64_t>(step * 64 + rank));
  std::vector<std::int64_t> x(kBatchPerRank * kSeq), y(kBatchPerRank * kSeq);
  for (auto& t : x) t = static_cast<std::int64_t>(gen.next_below(static_cast<std::uint64_t>(c.vocab_size)));
  for (auto& t : y) t = static_cast<std::int64_t>(gen.next_below(static_cast<std::uint64_t>(c.vocab_size)));
  return {Tensor::from_int64(x, {kBatchPerRank, kSeq}), Tensor::from_int64(y, {kBatchPerRank, kSeq})};
}

enum class Strategy { oss_greedy, oss_flat, sddp_greedy, sddp_flat, fsdp, fsdp_no_prefetch };

// Forward and backward of a model wrapped by a data-parallel wrapper (which reduces the gradients during
// backward). The caller has zeroed the gradients through its optimizer (Note [training step contract]).
absl::Status ForwardBackward(nn::GPT& model, int rank, int step) {
  auto [x, y] = Batch(model.config(), rank, step);
  MemoryCategoryScope activations(MemoryCategory::activation);
  return autograd::try_backward(model.loss(x, y));
}

void BM_TrainStep(benchmark::State& state, int world, Strategy strategy) {
  const bool is_fsdp = strategy == Strategy::fsdp || strategy == Strategy::fsdp_no_prefetch;
  const bool sharded_grads = strategy == Strategy::sddp_greedy || strategy == Strategy::sddp_flat || is_fsdp;
  const oss::PartitionPolicy policy = strategy == Strategy::oss_greedy || strategy == Strategy::sddp_greedy
                                          ? oss::PartitionPolicy::greedy
                                          : oss::PartitionPolicy::flat;
  const nn::GPTConfig config = *nn::GPTConfig::named("gpt-10m");
  double strategy_seconds = 0, ddp_seconds = 0;
  std::int64_t iterations = 0;
  MemorySnapshot strategy_mem, ddp_mem;
  std::int64_t sent_per_step = 0, psi = 0;
  double overlap_sum = 0;
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    // Two ledgers on this rank's thread: one per strategy, so each one's peaks are its own.
    RankContext ddp_ctx{env.rank, world, std::make_shared<MemoryTracker>(), Generator(1)};
    RankContext oss_ctx{env.rank, world, std::make_shared<MemoryTracker>(), Generator(1)};
    std::unique_ptr<nn::GPT> ddp_model, oss_model;
    std::unique_ptr<optim::Optimizer> ddp_opt;
    std::unique_ptr<oss::Oss> oss_opt;
    std::unique_ptr<sddp::DataParallel> ddp_wrap, oss_wrap;
    std::unique_ptr<optim::Optimizer> fsdp_opt;  // over the shards (oss_model.parameters() after fully_shard)
    std::optional<fsdp::FSDPModule> fsdp_root;
    {
      RankContextScope scope(ddp_ctx);
      MemoryCategoryScope params(MemoryCategory::parameter);
      ddp_model = std::make_unique<nn::GPT>(config, 1);
      ddp_opt = std::move(*optim::AdamW::factory()({{ddp_model->parameters(), optim::AdamW::default_hyper()}}));
      auto w = sddp::DistributedDataParallel::create(*ddp_model, env.group_ptr, kWrapperOptions);
      if (!w.ok()) return w.status();
      ddp_wrap = std::move(*w);
    }
    {
      RankContextScope scope(oss_ctx);
      MemoryCategoryScope params(MemoryCategory::parameter);
      oss_model = std::make_unique<nn::GPT>(config, 1);
    }
    psi = oss_model->num_parameters();  // (after fully_shard, parameters() are the shards)
    if (is_fsdp) {
      RankContextScope scope(oss_ctx);
      const fsdp::FullyShardOptions options{.implicit_prefetch = strategy == Strategy::fsdp};
      // Nested units, bottom-up: every block's MLP, every block, then the root.
      for (const char* type : {"MLP", "TransformerBlock"}) {
        for (nn::Module* m : fsdp::modules_of_type(*oss_model, type)) {
          if (auto u = fsdp::fully_shard(*m, env.group_ptr, options); !u.ok()) return u.status();
        }
      }
      auto root = fsdp::fully_shard(*oss_model, env.group_ptr, options);
      if (!root.ok()) return root.status();
      fsdp_root = *root;
      MemoryCategoryScope cat(MemoryCategory::optimizer_state);
      auto o = optim::AdamW::factory()({{oss_model->parameters(), optim::AdamW::default_hyper()}});
      if (!o.ok()) return o.status();
      fsdp_opt = std::move(*o);
    } else {
      RankContextScope scope(oss_ctx);
      MemoryCategoryScope params(MemoryCategory::parameter);
      auto o = oss::Oss::create({{oss_model->parameters(), optim::AdamW::default_hyper()}},
                                optim::AdamW::factory(), env.group_ptr,
                                {.policy = policy, .flat_chunk_numel = kFlatChunk});
      if (!o.ok()) return o.status();
      oss_opt = std::move(*o);
      if (sharded_grads) {
        auto w = sddp::ShardedDataParallel::create(*oss_model, {oss_opt.get()}, env.group_ptr, kWrapperOptions);
        if (!w.ok()) return w.status();
        oss_wrap = std::move(*w);
      } else {
        auto w = sddp::DistributedDataParallel::create(*oss_model, env.group_ptr, kWrapperOptions);
        if (!w.ok()) return w.status();
        oss_wrap = std::move(*w);
      }
    }
    // Rank 0 drives the benchmark loop; a broadcast flag tells the others whether another step follows.
    Tensor go = Tensor::zeros({1}, TensorOptions{}.with_dtype(DType::i64));
    auto more = [&](bool value) -> absl::StatusOr<bool> {
      if (env.rank == 0) go.fill_(value ? 1 : 0);
      if (absl::Status s = env.group.broadcast(go)->wait(); !s.ok()) return s;
      return go.item() != 0;
    };
    auto one_round = [&](int step, bool measured) -> absl::Status {
      using clock = std::chrono::steady_clock;
      auto t0 = clock::now();
      {
        RankContextScope scope(ddp_ctx);
        ddp_opt->zero_grad();
        if (absl::Status s = ForwardBackward(*ddp_model, env.rank, step); !s.ok()) return s;
        MemoryCategoryScope cat(MemoryCategory::optimizer_state);
        if (absl::Status s = ddp_opt->step(); !s.ok()) return s;
      }
      if (absl::Status s = env.group.barrier()->wait(); !s.ok()) return s;
      auto t1 = clock::now();
      const std::int64_t sent_before = env.group.counters().total_sent();
      if (fsdp_opt) {
        RankContextScope scope(oss_ctx);
        auto [x, y] = Batch(config, env.rank, step);
        fsdp_opt->zero_grad();
        fsdp_root->reset_overlap_stats();
        {
          MemoryCategoryScope activations(MemoryCategory::activation);
          if (absl::Status s = autograd::try_backward(oss_model->loss(x, y)); !s.ok()) return s;
        }
        MemoryCategoryScope cat(MemoryCategory::optimizer_state);
        if (absl::Status s = fsdp_opt->step(); !s.ok()) return s;
      } else {
        RankContextScope scope(oss_ctx);
        oss_opt->zero_grad();
        if (absl::Status s = ForwardBackward(*oss_model, env.rank, step); !s.ok()) return s;
        if (absl::Status s = oss_opt->step(); !s.ok()) return s;
      }
      if (absl::Status s = env.group.barrier()->wait(); !s.ok()) return s;
      auto t2 = clock::now();
      if (env.rank == 0 && measured) {
        ddp_seconds += std::chrono::duration<double>(t1 - t0).count();
        strategy_seconds += std::chrono::duration<double>(t2 - t1).count();
        sent_per_step = env.group.counters().total_sent() - sent_before;
        if (oss_wrap) overlap_sum += oss_wrap->last_backward_stats().overlap_frac();
        if (fsdp_root) overlap_sum += fsdp_root->overlap_stats().overlap_frac();
        state.SetIterationTime(std::chrono::duration<double>(t2 - t1).count());
      }
      return absl::OkStatus();
    };
    // One warm-up round (first-step state allocation) outside the measurement.
    if (absl::Status s = one_round(0, false); !s.ok()) return s;
    ddp_ctx.memory->reset_peaks();  // report steady-state steps, not construction
    oss_ctx.memory->reset_peaks();
    if (env.rank == 0) {
      int step = 1;
      for (auto _ : state) {
        if (auto m = more(true); !m.ok()) return m.status();
        if (absl::Status s = one_round(step++, true); !s.ok()) return s;
        ++iterations;
      }
      if (auto m = more(false); !m.ok()) return m.status();
      strategy_mem = oss_ctx.memory->snapshot();
      ddp_mem = ddp_ctx.memory->snapshot();
    } else {
      for (int step = 1;; ++step) {
        absl::StatusOr<bool> m = more(false);
        if (!m.ok()) return m.status();
        if (!*m) break;
        if (absl::Status s = one_round(step, false); !s.ok()) return s;
      }
    }
    return absl::OkStatus();
  });
  if (!st.ok()) {
    state.SkipWithError(std::string(st.message()).c_str());
    return;
  }
  const double n = static_cast<double>(std::max<std::int64_t>(iterations, 1));
  state.counters["vs_ddp"] = strategy_seconds / ddp_seconds;
  state.counters["ddp_step_ms"] = 1e3 * ddp_seconds / n;
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    state.counters[std::string(memory_category_name(static_cast<MemoryCategory>(c))) + "_peak_B"] =
        static_cast<double>(strategy_mem.peak[static_cast<std::size_t>(c)]);
  }
  state.counters["ddp_optimizer_state_peak_B"] = static_cast<double>(ddp_mem.peak_of(MemoryCategory::optimizer_state));
  state.counters["optimizer_state_formula_B"] = 8.0 * static_cast<double>(psi) / world;
  state.counters["overlap_frac"] = overlap_sum / n;
  if (is_fsdp) state.counters["parameter_formula_B"] = 4.0 * static_cast<double>(psi) / world;
  // Gradient bytes after backward: DDP-class 4Ψ; ShardedDDP 4Ψ/N (DESIGN.md section 6).
  state.counters["gradient_formula_B"] = 4.0 * static_cast<double>(psi) / (sharded_grads ? world : 1);
  state.counters["sent_B_per_rank"] = static_cast<double>(sent_per_step);
  state.counters["params"] = static_cast<double>(psi);
}

void RegisterAll() {
  const std::pair<Strategy, const char*> strategies[] = {{Strategy::oss_greedy, "oss_greedy"},
                                                         {Strategy::oss_flat, "oss_flat"},
                                                         {Strategy::sddp_greedy, "sddp_greedy"},
                                                         {Strategy::sddp_flat, "sddp_flat"},
                                                         {Strategy::fsdp, "fsdp"},
                                                         {Strategy::fsdp_no_prefetch, "fsdp_no_prefetch"}};
  for (int world : {2, 4}) {
    for (const auto& [strategy, label] : strategies) {
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
