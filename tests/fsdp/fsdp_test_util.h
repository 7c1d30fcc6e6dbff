// Shared helpers of the fsdp tests: shard GPT-tiny by blocks, train a rank on its rows, read the full model.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "common/comm/testing/run_ranks.h"
#include "fsdp/fully_shard.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp::test_util {

// fully_shard with every TransformerBlock a unit (the rest in the root unit).
inline absl::StatusOr<std::unique_ptr<FullyShardedModel>> ShardBlocks(nn::Module& model, comm::RankEnv& env,
                                                                      FullyShardOptions options = {}) {
  options.units = modules_of_type(model, "TransformerBlock");
  return FullyShardedModel::create(model, env.group_ptr, std::move(options));
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

// The module's full parameter values (unshard, read, reshard). Collective.
inline absl::StatusOr<std::vector<std::vector<float>>> FullValues(FullyShardedModel& fs, const nn::Module& model) {
  if (absl::Status s = fs.unshard(); !s.ok()) return s;
  std::vector<std::vector<float>> values = gpt_tiny::Values(model);
  fs.reshard();
  return values;
}

}  // namespace shardkit::fsdp::test_util
