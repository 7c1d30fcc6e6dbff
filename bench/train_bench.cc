// train_bench: one training step of GPT "gpt-10m" (10.6 M parameters) on N simulated ranks (threads),
// sharded strategy against the DDP baseline, measured interleaved in the same run so both see the same
// machine state.
//
//   build/bench/train_bench [--benchmark_filter=oss]
//
// Each benchmark iteration runs one DDP step (all_reduce of every gradient, then a full AdamW step on every
// rank) and one step of the strategy under test (same model, same data) on every rank. The reported time is
// the strategy's step (rank 0's wall time; every rank is synchronised by the collectives); counters:
//   vs_ddp              strategy step time / DDP step time (goal for OSS: <= 1.05)
//   ddp_step_ms         the DDP step
//   <category>_peak_B   rank 0's peak bytes per ledger category during the strategy's steps
//   ddp_optimizer_state_peak_B   the same for DDP, to compare
//   sent_B_per_rank     bytes rank 0 sent per strategy step (ring-equivalent volume, comm_counters.h)
//   optimizer_state_formula_B    the ZeRO formula for the strategy (DESIGN.md section 6)
#include <benchmark/benchmark.h>

#include <chrono>

#include "common/autograd/engine.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "oss/oss.h"

namespace shardkit {
namespace {

constexpr std::int64_t kBatchPerRank = 2;
constexpr std::int64_t kSeq = 64;

std::pair<Tensor, Tensor> Batch(const nn::GPTConfig& c, int rank, int step) {
  Generator gen(5, static_cast<std::uint64_t>(step * 64 + rank));
  std::vector<std::int64_t> x(kBatchPerRank * kSeq), y(kBatchPerRank * kSeq);
  for (auto& t : x) t = static_cast<std::int64_t>(gen.next_below(static_cast<std::uint64_t>(c.vocab_size)));
  for (auto& t : y) t = static_cast<std::int64_t>(gen.next_below(static_cast<std::uint64_t>(c.vocab_size)));
  return {Tensor::from_int64(x, {kBatchPerRank, kSeq}), Tensor::from_int64(y, {kBatchPerRank, kSeq})};
}

// Forward, backward, and the gradient average every strategy here shares (one all_reduce per gradient,
// issued as the list is walked and waited at the end).
absl::Status ForwardBackwardAverage(nn::GPT& model, comm::ProcessGroup& pg, int rank, int step) {
  auto [x, y] = Batch(model.config(), rank, step);
  for (const Tensor& p : model.parameters()) p.set_grad(Tensor());
  {
    MemoryCategoryScope activations(MemoryCategory::activation);
    autograd::backward(model.loss(x, y));
  }
  std::vector<std::shared_ptr<comm::Work>> works;
  for (const Tensor& p : model.parameters()) {
    if (p.grad().defined()) works.push_back(pg.all_reduce(p.grad(), {.op = comm::ReduceOp::avg()}));
  }
  for (auto& w : works) {
    if (absl::Status s = w->wait(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

void BM_TrainStep(benchmark::State& state, int world, oss::PartitionPolicy policy) {
  const nn::GPTConfig config = *nn::GPTConfig::named("gpt-10m");
  double strategy_seconds = 0, ddp_seconds = 0;
  std::int64_t iterations = 0;
  MemorySnapshot strategy_mem, ddp_mem;
  std::int64_t sent_per_step = 0, psi = 0;
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    // Two ledgers on this rank's thread: one per strategy, so each one's peaks are its own.
    RankContext ddp_ctx{env.rank, world, std::make_shared<MemoryTracker>(), Generator(1)};
    RankContext oss_ctx{env.rank, world, std::make_shared<MemoryTracker>(), Generator(1)};
    std::unique_ptr<nn::GPT> ddp_model, oss_model;
    std::unique_ptr<optim::Optimizer> ddp_opt;
    std::unique_ptr<oss::Oss> oss_opt;
    {
      RankContextScope scope(ddp_ctx);
      MemoryCategoryScope params(MemoryCategory::parameter);
      ddp_model = std::make_unique<nn::GPT>(config, 1);
      ddp_opt = std::move(*optim::AdamW::factory()({{ddp_model->parameters(), optim::AdamW::default_hyper()}}));
    }
    {
      RankContextScope scope(oss_ctx);
      MemoryCategoryScope params(MemoryCategory::parameter);
      oss_model = std::make_unique<nn::GPT>(config, 1);
      auto o = oss::Oss::create({{oss_model->parameters(), optim::AdamW::default_hyper()}},
                                optim::AdamW::factory(), env.group_ptr, {.policy = policy});
      if (!o.ok()) return o.status();
      oss_opt = std::move(*o);
    }
    psi = oss_model->num_parameters();
    // Rank 0 drives the benchmark loop; a broadcast flag tells the others whether another step follows.
    Tensor go = Tensor::zeros({1}, TensorOptions{}.with_dtype(DType::i64));
    auto more = [&](bool value) -> absl::StatusOr<bool> {
      if (env.rank == 0) go.fill_(value ? 1 : 0);
      if (absl::Status s = env.group.broadcast(go)->wait(); !s.ok()) return s;
      return go.item() != 0;
    };
    auto one_round = [&](int step) -> absl::Status {
      using clock = std::chrono::steady_clock;
      auto t0 = clock::now();
      {
        RankContextScope scope(ddp_ctx);
        if (absl::Status s = ForwardBackwardAverage(*ddp_model, env.group, env.rank, step); !s.ok()) return s;
        MemoryCategoryScope cat(MemoryCategory::optimizer_state);
        ddp_opt->step();
      }
      if (absl::Status s = env.group.barrier()->wait(); !s.ok()) return s;
      auto t1 = clock::now();
      const std::int64_t sent_before = env.group.counters().total_sent();
      {
        RankContextScope scope(oss_ctx);
        if (absl::Status s = ForwardBackwardAverage(*oss_model, env.group, env.rank, step); !s.ok()) return s;
        if (absl::Status s = oss_opt->step(); !s.ok()) return s;
      }
      if (absl::Status s = env.group.barrier()->wait(); !s.ok()) return s;
      auto t2 = clock::now();
      if (env.rank == 0) {
        ddp_seconds += std::chrono::duration<double>(t1 - t0).count();
        strategy_seconds += std::chrono::duration<double>(t2 - t1).count();
        sent_per_step = env.group.counters().total_sent() - sent_before;
        state.SetIterationTime(std::chrono::duration<double>(t2 - t1).count());
      }
      return absl::OkStatus();
    };
    // One warm-up round (first-step state allocation) outside the measurement.
    if (absl::Status s = one_round(0); !s.ok()) return s;
    if (env.rank == 0) {
      ddp_seconds = strategy_seconds = 0;
      int step = 1;
      for (auto _ : state) {
        if (auto m = more(true); !m.ok()) return m.status();
        if (absl::Status s = one_round(step++); !s.ok()) return s;
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
        if (absl::Status s = one_round(step); !s.ok()) return s;
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
  state.counters["sent_B_per_rank"] = static_cast<double>(sent_per_step);
  state.counters["params"] = static_cast<double>(psi);
}

void RegisterAll() {
  for (int world : {2, 4}) {
    for (auto policy : {oss::PartitionPolicy::greedy, oss::PartitionPolicy::flat}) {
      const std::string name = std::string("oss_") + (policy == oss::PartitionPolicy::greedy ? "greedy" : "flat") +
                               "/gpt-10m/n" + std::to_string(world);
      benchmark::RegisterBenchmark(name.c_str(), BM_TrainStep, world, policy)
          ->UseManualTime()
          ->Iterations(3)
          ->Unit(benchmark::kMillisecond);
    }
  }
}

const int kRegistered = (RegisterAll(), 0);

}  // namespace
}  // namespace shardkit
