// The eager fully_shard run the compiled fully-shard mode is held to (fully_shard_mode_test,
// fully_shard_mode_same_values_test, fsdp_combo5_test): one helper instead of a copy of the loop in each.
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "common/autograd/engine.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp::test_util {

// GPT `config` (seed 1) sharded by ShardGpt on this rank, `steps` AdamW steps on the rank's rows of gpt_tiny batches
// 0, 1, ...: appends each step's loss to `losses`, then stores the model's full values in values[rank]
// (StoreFullValues).
inline absl::Status RunEagerFsdp(comm::RankEnv& env, const nn::GPTConfig& config, int steps, std::vector<float>& losses,
                                 std::vector<std::vector<std::vector<float>>>& values) {
  const int rows = gpt_tiny::kBatch / env.world_size;
  nn::GPT model(config, 1);
  if (absl::Status s = ShardGpt(model, env); !s.ok()) return s;
  optim::AdamW opt(model.parameters());
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = gpt_tiny::Batch(step, env.rank * rows, rows);
    opt.zero_grad();
    Tensor loss = model.loss(x, y);
    if (absl::Status s = autograd::try_backward(loss); !s.ok()) return s;
    if (absl::Status s = opt.step(); !s.ok()) return s;
    losses.push_back(static_cast<float>(loss.item()));
  }
  return StoreFullValues(model, values, env.rank);
}

}  // namespace shardkit::fsdp::test_util
