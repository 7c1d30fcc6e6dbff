// Shared helpers of the fsdp tests: shard GPT-tiny bottom-up, train a rank on its rows, read the full model.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "common/comm/testing/run_ranks.h"
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

}  // namespace shardkit::fsdp::test_util
