#include "bench/train_step.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/autograd/engine.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "common/tensor/rank_context.h"
#include "fsdp/fully_shard.h"
#include "oss/oss.h"
#include "sddp/data_parallel.h"

namespace shardkit::bench {
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

constexpr std::pair<TrainStrategy, const char*> kStrategies[] = {{TrainStrategy::oss_greedy, "oss_greedy"},
                                                                 {TrainStrategy::oss_flat, "oss_flat"},
                                                                 {TrainStrategy::sddp_greedy, "sddp_greedy"},
                                                                 {TrainStrategy::sddp_flat, "sddp_flat"},
                                                                 {TrainStrategy::fsdp, "fsdp"},
                                                                 {TrainStrategy::fsdp_no_prefetch, "fsdp_no_prefetch"},
                                                                 {TrainStrategy::fsdp_bf16, "fsdp_bf16"}};

bool IsFsdp(TrainStrategy s) {
  return s == TrainStrategy::fsdp || s == TrainStrategy::fsdp_no_prefetch || s == TrainStrategy::fsdp_bf16;
}
bool ShardsGradients(TrainStrategy s) {
  return s == TrainStrategy::sddp_greedy || s == TrainStrategy::sddp_flat || IsFsdp(s);
}

std::pair<Tensor, Tensor> Batch(const nn::GPTConfig& c, int rank, int step) {
  Generator gen(5, static_cast<std::uint64_t>(step * 64 + rank));
  std::vector<std::int64_t> x(kBatchPerRank * kSeq), y(kBatchPerRank * kSeq);
  for (auto& t : x) t = static_cast<std::int64_t>(gen.next_below(static_cast<std::uint64_t>(c.vocab_size)));
  for (auto& t : y) t = static_cast<std::int64_t>(gen.next_below(static_cast<std::uint64_t>(c.vocab_size)));
  return {Tensor::from_int64(x, {kBatchPerRank, kSeq}), Tensor::from_int64(y, {kBatchPerRank, kSeq})};
}

// Forward and backward of a model wrapped by a data-parallel wrapper (which reduces the gradients during
// backward). The caller has zeroed the gradients through its optimizer (Note [training step contract]).
absl::Status ForwardBackward(nn::GPT& model, int rank, int step) {
  auto [x, y] = Batch(model.config(), rank, step);
  MemoryCategoryScope activations(MemoryCategory::activation);
  return autograd::try_backward(model.loss(x, y));
}

}  // namespace

absl::Span<const std::pair<TrainStrategy, const char*>> TrainStrategies() { return kStrategies; }

absl::StatusOr<TrainStrategy> TrainStrategyNamed(std::string_view label) {
  std::string known;
  for (const auto& [strategy, name] : kStrategies) {
    if (label == name) return strategy;
    absl::StrAppend(&known, known.empty() ? "" : ", ", name);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("train_bench: expected a strategy label (", known, "), found '", std::string(label), "'"));
}

absl::Status RunTrainRank(const std::shared_ptr<comm::ProcessGroup>& group_ptr, TrainStrategy strategy,
                          benchmark::State* state, TrainCaseResult& result) {
  comm::ProcessGroup& group = *group_ptr;
  const int rank = group.rank();
  const int world = group.size();
  SK_CHECK_EQ(rank == 0, state != nullptr);
  const bool is_fsdp = IsFsdp(strategy);
  const bool sharded_grads = ShardsGradients(strategy);
  const oss::PartitionPolicy policy =
      strategy == TrainStrategy::oss_greedy || strategy == TrainStrategy::sddp_greedy ? oss::PartitionPolicy::greedy
                                                                                      : oss::PartitionPolicy::flat;
  const nn::GPTConfig config = *nn::GPTConfig::named("gpt-10m");
  // Two ledgers on this rank's thread: one per strategy, so each one's peaks are its own.
  RankContext ddp_ctx{rank, world, std::make_shared<MemoryTracker>(), Generator(1)};
  RankContext oss_ctx{rank, world, std::make_shared<MemoryTracker>(), Generator(1)};
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
    auto w = sddp::DistributedDataParallel::create(*ddp_model, group_ptr, kWrapperOptions);
    if (!w.ok()) return w.status();
    ddp_wrap = std::move(*w);
  }
  {
    RankContextScope scope(oss_ctx);
    MemoryCategoryScope params(MemoryCategory::parameter);
    oss_model = std::make_unique<nn::GPT>(config, 1);
  }
  if (rank == 0) result.psi = oss_model->num_parameters();  // (after fully_shard, parameters() are the shards)
  if (is_fsdp) {
    RankContextScope scope(oss_ctx);
    fsdp::FullyShardOptions options{.implicit_prefetch = strategy != TrainStrategy::fsdp_no_prefetch};
    if (strategy == TrainStrategy::fsdp_bf16) {
      options.mp_policy = {.param_dtype = DType::bf16, .reduce_dtype = DType::bf16};
    }
    // Nested units, bottom-up: every block's MLP, every block, then the root.
    for (const char* type : {"MLP", "TransformerBlock"}) {
      for (nn::Module* m : fsdp::modules_of_type(*oss_model, type)) {
        if (auto u = fsdp::fully_shard(*m, group_ptr, options); !u.ok()) return u.status();
      }
    }
    auto root = fsdp::fully_shard(*oss_model, group_ptr, options);
    if (!root.ok()) return root.status();
    fsdp_root = *root;
    MemoryCategoryScope cat(MemoryCategory::optimizer_state);
    auto o = optim::AdamW::factory()({{oss_model->parameters(), optim::AdamW::default_hyper()}});
    if (!o.ok()) return o.status();
    fsdp_opt = std::move(*o);
  } else {
    RankContextScope scope(oss_ctx);
    MemoryCategoryScope params(MemoryCategory::parameter);
    auto o = oss::Oss::create({{oss_model->parameters(), optim::AdamW::default_hyper()}}, optim::AdamW::factory(),
                              group_ptr, {.policy = policy, .flat_chunk_numel = kFlatChunk});
    if (!o.ok()) return o.status();
    oss_opt = std::move(*o);
    if (sharded_grads) {
      auto w = sddp::ShardedDataParallel::create(*oss_model, {oss_opt.get()}, group_ptr, kWrapperOptions);
      if (!w.ok()) return w.status();
      oss_wrap = std::move(*w);
    } else {
      auto w = sddp::DistributedDataParallel::create(*oss_model, group_ptr, kWrapperOptions);
      if (!w.ok()) return w.status();
      oss_wrap = std::move(*w);
    }
  }
  // Rank 0 drives the benchmark loop; a broadcast flag tells the others whether another step follows.
  Tensor go = Tensor::zeros({1}, TensorOptions{}.with_dtype(DType::i64));
  auto more = [&](bool value) -> absl::StatusOr<bool> {
    if (rank == 0) go.fill_(value ? 1 : 0);
    if (absl::Status s = group.broadcast(go)->wait(); !s.ok()) return s;
    return go.item() != 0;
  };
  auto one_round = [&](int step, bool measured) -> absl::Status {
    using clock = std::chrono::steady_clock;
    auto t0 = clock::now();
    {
      RankContextScope scope(ddp_ctx);
      ddp_opt->zero_grad();
      if (absl::Status s = ForwardBackward(*ddp_model, rank, step); !s.ok()) return s;
      MemoryCategoryScope cat(MemoryCategory::optimizer_state);
      if (absl::Status s = ddp_opt->step(); !s.ok()) return s;
    }
    if (absl::Status s = group.barrier()->wait(); !s.ok()) return s;
    auto t1 = clock::now();
    const std::int64_t sent_before = group.counters().total_sent();
    if (fsdp_opt) {
      RankContextScope scope(oss_ctx);
      auto [x, y] = Batch(config, rank, step);
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
      if (absl::Status s = ForwardBackward(*oss_model, rank, step); !s.ok()) return s;
      if (absl::Status s = oss_opt->step(); !s.ok()) return s;
    }
    if (absl::Status s = group.barrier()->wait(); !s.ok()) return s;
    auto t2 = clock::now();
    if (rank == 0 && measured) {
      result.ddp_seconds += std::chrono::duration<double>(t1 - t0).count();
      result.strategy_seconds += std::chrono::duration<double>(t2 - t1).count();
      result.sent_per_step = group.counters().total_sent() - sent_before;
      if (oss_wrap) result.overlap_sum += oss_wrap->last_backward_stats().overlap_frac();
      if (fsdp_root) result.overlap_sum += fsdp_root->overlap_stats().overlap_frac();
      state->SetIterationTime(std::chrono::duration<double>(t2 - t1).count());
    }
    return absl::OkStatus();
  };
  // One warm-up round (first-step state allocation) outside the measurement.
  if (absl::Status s = one_round(0, false); !s.ok()) return s;
  ddp_ctx.memory->reset_peaks();  // report steady-state steps, not construction
  oss_ctx.memory->reset_peaks();
  if (rank == 0) {
    int step = 1;
    for (auto _ : *state) {
      if (auto m = more(true); !m.ok()) return m.status();
      if (absl::Status s = one_round(step++, true); !s.ok()) return s;
      ++result.iterations;
    }
    if (auto m = more(false); !m.ok()) return m.status();
    result.strategy_memory = oss_ctx.memory->snapshot();
    result.ddp_memory = ddp_ctx.memory->snapshot();
  } else {
    for (int step = 1;; ++step) {
      absl::StatusOr<bool> m = more(false);
      if (!m.ok()) return m.status();
      if (!*m) break;
      if (absl::Status s = one_round(step, false); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

void ReportTrainCounters(benchmark::State& state, TrainStrategy strategy, int world, const TrainCaseResult& r) {
  const double n = static_cast<double>(std::max<std::int64_t>(r.iterations, 1));
  state.counters["vs_ddp"] = r.strategy_seconds / r.ddp_seconds;
  state.counters["ddp_step_ms"] = 1e3 * r.ddp_seconds / n;
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    state.counters[std::string(memory_category_name(static_cast<MemoryCategory>(c))) + "_peak_B"] =
        static_cast<double>(r.strategy_memory.peak[static_cast<std::size_t>(c)]);
  }
  state.counters["ddp_optimizer_state_peak_B"] =
      static_cast<double>(r.ddp_memory.peak_of(MemoryCategory::optimizer_state));
  state.counters["optimizer_state_formula_B"] = 8.0 * static_cast<double>(r.psi) / world;
  state.counters["overlap_frac"] = r.overlap_sum / n;
  if (IsFsdp(strategy)) state.counters["parameter_formula_B"] = 4.0 * static_cast<double>(r.psi) / world;
  // Gradient bytes after backward: DDP-class 4Ψ; ShardedDDP 4Ψ/N (DESIGN.md section 6).
  state.counters["gradient_formula_B"] = 4.0 * static_cast<double>(r.psi) / (ShardsGradients(strategy) ? world : 1);
  state.counters["sent_B_per_rank"] = static_cast<double>(r.sent_per_step);
  state.counters["params"] = static_cast<double>(r.psi);
}

}  // namespace shardkit::bench
