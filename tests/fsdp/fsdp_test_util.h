// Shared helpers of the fsdp tests: shard GPT-tiny bottom-up, train a rank on its rows, read the full model.
#pragma once

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "common/comm/testing/run_ranks.h"
#include "common/nn/mixed_precision.h"
#include "common/optim/adam.h"
#include "fsdp/fully_shard.h"
#include "fsdp/state_dict.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp::test_util {

// fully_shard bottom-up: (nested: every block's MLP,) every TransformerBlock, then the root.
inline absl::Status ShardGpt(nn::GPT& model, comm::RankEnv& env, FullyShardOptions options = {}, bool nested = false) {
  if (nested) {
    for (nn::Module* m : modules_of_type(model, "MLP")) {
      if (auto s = fully_shard(*m, env.group_ptr, options); !s.ok()) return s.status();
    }
  }
  for (nn::Module* b : modules_of_type(model, "TransformerBlock")) {
    if (auto s = fully_shard(*b, env.group_ptr, options); !s.ok()) return s.status();
  }
  FullyShardOptions root = options;
  root.reshard_after_forward = std::nullopt;  // FSDP2's default for the root: keep
  return fully_shard(model, env.group_ptr, root).status();
}

// Steps [first, last): rank `rank` of `world` on its rows of each GPT-tiny batch, one forward and backward,
// one optimizer step (rank 0 of 1: the whole batch).
inline absl::Status TrainRows(nn::GPT& model, optim::Optimizer& opt, int rank, int world, int first, int last) {
  const int rows = gpt_tiny::kBatch / world;
  for (int step = first; step < last; ++step) {
    auto [x, y] = gpt_tiny::Batch(step, rank * rows, rows);
    opt.zero_grad();
    if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
    if (absl::Status s = opt.step(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// The module's full parameter values, in the unsharded model's parameters() order. Collective.
inline absl::StatusOr<std::vector<std::vector<float>>> FullValues(nn::Module& model) {
  auto unit = state_of(model);
  if (!unit.ok()) return unit.status();
  if (absl::Status s = unit->summon_full_params(); !s.ok()) return s;
  std::vector<std::vector<float>> values = gpt_tiny::Values(model);
  if (absl::Status s = unit->reshard(/*recurse=*/true); !s.ok()) return s;
  return values;
}

// FullValues(model) stored as rank `rank`'s entry of `got` (what the equivalence tests compare). Collective.
inline absl::Status StoreFullValues(nn::Module& model, std::vector<std::vector<std::vector<float>>>& got, int rank) {
  auto values = FullValues(model);
  if (!values.ok()) return values.status();
  got[static_cast<std::size_t>(rank)] = std::move(*values);
  return absl::OkStatus();
}

// Single-rank training with FSDP's casts done by hand (bf16 parameters and reductions), in step s for world_at(s)
// ranks' rows: an f32 master model stepped by AdamW; each step a compute model gets the master's values rounded to
// bf16, every block's input is rounded to bf16, each rank's rows give a gradient rounded to bf16, and the master gets
// their average as the backends form it (f32 sum in rank order, divided by the count, rounded to bf16 once;
// process_group.h). `prepare` runs on both models first (e.g. freezing parts: frozen parameters get no gradient).
inline std::vector<std::vector<float>> Bf16Reference(int steps, const std::function<int(int)>& world_at,
                                                     const std::function<void(nn::GPT&)>& prepare = nullptr) {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT master(gpt_tiny::TinyConfig(), 1), compute(gpt_tiny::TinyConfig(), 1);
  if (prepare) {
    prepare(master);
    prepare(compute);
  }
  std::vector<autograd::HookHandle> hooks;
  for (nn::Module* b : modules_of_type(compute, "TransformerBlock")) {
    hooks.push_back(b->register_forward_pre_hook([](nn::Module&, const nn::TensorList& in) -> std::optional<nn::TensorList> {
      return nn::round_floating(in, DType::bf16);
    }));
  }
  auto opt = optim::AdamW::factory()({{master.parameters(), optim::AdamW::default_hyper()}});
  const std::vector<Tensor> mp = master.parameters(), cp = compute.parameters();
  for (int step = 0; step < steps; ++step) {
    const int world = world_at(step), rows = gpt_tiny::kBatch / world;
    for (std::size_t i = 0; i < mp.size(); ++i) cp[i].copy_(mp[i].to(DType::bf16));
    std::vector<std::vector<float>> sum(mp.size());
    for (int r = 0; r < world; ++r) {
      for (const Tensor& p : cp) p.set_grad(Tensor());
      auto [x, y] = gpt_tiny::Batch(step, r * rows, rows);
      autograd::backward(compute.loss(x, y));
      for (std::size_t i = 0; i < mp.size(); ++i) {
        if (!cp[i].requires_grad()) continue;
        const std::vector<float> g = cp[i].grad().to(DType::bf16).to(DType::f32).to_vector();
        if (r == 0) {
          sum[i] = g;
        } else {
          for (std::size_t k = 0; k < g.size(); ++k) sum[i][k] += g[k];
        }
      }
    }
    (*opt)->zero_grad();
    for (std::size_t i = 0; i < mp.size(); ++i) {
      if (!mp[i].requires_grad()) continue;
      for (float& v : sum[i]) v /= static_cast<float>(world);
      mp[i].set_grad(Tensor::from_vector(sum[i], mp[i].shape()).to(DType::bf16).to(DType::f32));
    }
    EXPECT_TRUE((*opt)->step().ok());
  }
  return gpt_tiny::Values(master);
}

}  // namespace shardkit::fsdp::test_util
