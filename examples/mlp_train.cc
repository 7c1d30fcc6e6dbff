// Your own model, every strategy, one training loop: the MLP classifier of examples/mlp_model.h trained with
// AdamW by DDP, OSS + DDP, OSS + ShardedDataParallel and FSDP, on 2 and 4 ranks (threads), each rank on its
// rows of every batch. Every strategy runs the same loop body (train() below): zero_grad(), forward,
// backward, step() on the object that owns the step (Note [training step contract] in
// common/optim/optimizer.h). At the end every rank's parameters are compared with single-rank training on
// the whole batch (the mean loss over the global batch is the same); the program fails if any differs by
// more than fp32 reduction-order noise. Run: build/examples/mlp_train
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "common/autograd/engine.h"
#include "common/comm/run_ranks.h"
#include "common/optim/adam.h"
#include "examples/mlp_model.h"
#include "oss/oss.h"
#if SHARDKIT_EXAMPLE_SDDP
#include "sddp/data_parallel.h"
#endif
#if SHARDKIT_EXAMPLE_FSDP
#include "fsdp/fully_shard.h"
#endif

using namespace shardkit;

namespace {

constexpr int kSteps = 10;
// |difference| <= kTol * max(1, |reference|): reductions summed in another order differ by a few ulps.
constexpr double kTol = 1e-5;

enum class Strategy { single, ddp, oss_greedy_ddp, oss_flat_ddp, oss_greedy_sddp, oss_flat_sddp, fsdp };

const char* name(Strategy s) {
  switch (s) {
    case Strategy::single: return "single rank";
    case Strategy::ddp: return "DDP";
    case Strategy::oss_greedy_ddp: return "OSS greedy + DDP";
    case Strategy::oss_flat_ddp: return "OSS flat + DDP";
    case Strategy::oss_greedy_sddp: return "OSS greedy + ShardedDDP";
    case Strategy::oss_flat_sddp: return "OSS flat + ShardedDDP";
    case Strategy::fsdp: return "FSDP";
  }
  return "?";
}

using Params = std::vector<std::vector<float>>;  // every parameter's values, in model.parameters() order

Params values(const nn::Module& model) {
  Params out;
  for (const Tensor& p : model.parameters()) out.push_back(p.to_vector());
  return out;
}

// The training loop, the same for every strategy. `owner` is what owns the step: a plain optimizer (one
// rank, DDP, FSDP) or an oss::Oss (ZeRO-1, ZeRO-2); both have zero_grad() and step().
template <typename StepOwner>
absl::Status train(StepOwner& owner, mlp_example::MlpClassifier& model, int rank, int world,
                   std::vector<double>& losses) {
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = mlp_example::batch(step, rank, world);
    owner.zero_grad();
    Tensor loss = model.loss(x, y);
    if (absl::Status s = autograd::try_backward(loss); !s.ok()) return s;  // a wrapper reduces gradients here
    if (absl::Status s = owner.step(); !s.ok()) return s;
    losses.push_back(loss.item());
  }
  return absl::OkStatus();
}

struct RankResult {
  Params params;                // the full model after training
  std::vector<double> losses;   // this rank's loss (on its rows) at each step
};

// Builds the model and `strategy`'s objects on this rank, trains, and returns the full final parameters.
absl::StatusOr<RankResult> train_rank(Strategy strategy, comm::ThreadRankEnv& env) {
  const std::shared_ptr<comm::ProcessGroup>& pg = env.group;
  optim::HyperParams hyper = optim::AdamW::default_hyper();
  hyper.lr = 1e-2;
  mlp_example::MlpClassifier model(/*seed=*/1);
  RankResult result;

  if (strategy == Strategy::single || strategy == Strategy::ddp) {
#if SHARDKIT_EXAMPLE_SDDP
    std::unique_ptr<sddp::DistributedDataParallel> ddp;  // all-reduces (averages) every gradient in backward
    if (strategy == Strategy::ddp) {
      auto wrapped = sddp::DistributedDataParallel::create(model, pg);
      if (!wrapped.ok()) return wrapped.status();
      ddp = std::move(*wrapped);
    }
#endif
    auto opt = optim::AdamW::factory()({{model.parameters(), hyper}});
    if (!opt.ok()) return opt.status();
    if (absl::Status s = train(**opt, model, env.rank, env.world_size, result.losses); !s.ok()) return s;
    result.params = values(model);
    return result;
  }

#if SHARDKIT_EXAMPLE_FSDP
  if (strategy == Strategy::fsdp) {
    // Each layer is a unit (gathered around its forward and its backward), then the model: its root.
    for (nn::Module* layer : {static_cast<nn::Module*>(model.fc1.get()), static_cast<nn::Module*>(model.fc2.get()),
                              static_cast<nn::Module*>(model.head.get())}) {
      if (auto unit = fsdp::fully_shard(*layer, pg); !unit.ok()) return unit.status();
    }
    auto root = fsdp::fully_shard(model, pg);
    if (!root.ok()) return root.status();
    auto opt = optim::AdamW::factory()({{model.parameters(), hyper}});  // at rest: this rank's shards
    if (!opt.ok()) return opt.status();
    if (absl::Status s = train(**opt, model, env.rank, env.world_size, result.losses); !s.ok()) return s;
    if (absl::Status s = root->summon_full_params(); !s.ok()) return s;  // the full parameters, back in the model
    result.params = values(model);
    if (absl::Status s = root->reshard(/*recurse=*/true); !s.ok()) return s;
    return result;
  }
#endif

  // ZeRO-1 / ZeRO-2: the Oss owns the step; a data-parallel wrapper reduces the gradients.
  const bool greedy = strategy == Strategy::oss_greedy_ddp || strategy == Strategy::oss_greedy_sddp;
  auto opt = oss::Oss::create({{model.parameters(), hyper}}, optim::AdamW::factory(), pg,
                              {.policy = greedy ? oss::PartitionPolicy::greedy : oss::PartitionPolicy::flat});
  if (!opt.ok()) return opt.status();
#if SHARDKIT_EXAMPLE_SDDP
  std::unique_ptr<sddp::DataParallel> dp;
  if (strategy == Strategy::oss_greedy_ddp || strategy == Strategy::oss_flat_ddp) {
    auto ddp = sddp::DistributedDataParallel::create(model, pg);  // every rank gets every averaged gradient
    if (!ddp.ok()) return ddp.status();
    dp = std::move(*ddp);
  } else {
    auto sharded = sddp::ShardedDataParallel::create(model, {opt->get()}, pg);  // only the owner gets it
    if (!sharded.ok()) return sharded.status();
    dp = std::move(*sharded);
  }
#endif
  if (absl::Status s = train(**opt, model, env.rank, env.world_size, result.losses); !s.ok()) return s;
  result.params = values(model);  // the Oss's step brought every rank's parameters up to date
  return result;
}

// Whether every value of `got` is within kTol of `want`; raises max_diff to the largest |difference|.
bool matches(const Params& got, const Params& want, double& max_diff) {
  if (got.size() != want.size()) return false;
  bool ok = true;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (got[i].size() != want[i].size()) return false;
    for (std::size_t k = 0; k < want[i].size(); ++k) {
      const double diff = std::abs(static_cast<double>(got[i][k]) - want[i][k]);
      if (!std::isnan(max_diff) && !(diff <= max_diff)) max_diff = diff;  // a NaN sticks
      ok = ok && diff <= kTol * std::max(1.0, std::abs(static_cast<double>(want[i][k])));  // false for NaN
    }
  }
  return ok;
}

// Trains with `strategy` on `world` ranks; every rank's result.
absl::StatusOr<std::vector<RankResult>> run(Strategy strategy, int world) {
  std::vector<RankResult> results(static_cast<std::size_t>(world));
  absl::Status status = comm::run_ranks(world, [&](comm::ThreadRankEnv& env) -> absl::Status {
    absl::StatusOr<RankResult> r = train_rank(strategy, env);
    if (!r.ok()) return r.status();
    results[static_cast<std::size_t>(env.rank)] = std::move(*r);
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return results;
}

}  // namespace

int main() {
  // The reference: one rank trains on the whole batch of every step.
  absl::StatusOr<std::vector<RankResult>> reference = run(Strategy::single, 1);
  if (!reference.ok()) return std::fprintf(stderr, "error: %s\n", std::string(reference.status().message()).c_str()), 1;
  const Params& want = (*reference)[0].params;
  const std::vector<double>& losses = (*reference)[0].losses;
  std::printf("single rank, %d rows per step: loss %.4f -> %.4f after %d AdamW steps\n\n", mlp_example::kGlobalRows,
              losses.front(), losses.back(), kSteps);

  std::vector<Strategy> strategies;
#if SHARDKIT_EXAMPLE_SDDP
  strategies.insert(strategies.end(), {Strategy::ddp, Strategy::oss_greedy_ddp, Strategy::oss_flat_ddp,
                                       Strategy::oss_greedy_sddp, Strategy::oss_flat_sddp});
#endif
#if SHARDKIT_EXAMPLE_FSDP
  strategies.push_back(Strategy::fsdp);
#endif

  bool all_ok = true;
  std::printf("%-24s %2s  %-28s %s\n", "strategy", "N", "max |param - single rank|", "");
  for (Strategy strategy : strategies) {
    for (int world : {2, 4}) {
      absl::StatusOr<std::vector<RankResult>> got = run(strategy, world);
      if (!got.ok()) {
        std::printf("%-24s %2d  error: %s\n", name(strategy), world, std::string(got.status().message()).c_str());
        all_ok = false;
        continue;
      }
      double max_diff = 0;
      bool ok = true;
      for (const RankResult& r : *got) ok = matches(r.params, want, max_diff) && ok;  // every rank's
      std::printf("%-24s %2d  %-28.3g %s\n", name(strategy), world, max_diff, ok ? "ok" : "MISMATCH");
      all_ok = all_ok && ok;
    }
  }
  if (!all_ok) {
    std::fprintf(stderr, "error: a strategy did not end at the single-rank parameters (tolerance %g)\n", kTol);
    return 1;
  }
  return 0;
}
