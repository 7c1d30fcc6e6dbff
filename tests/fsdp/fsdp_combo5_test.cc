// Feature combinations of the fully-shard mode that the other fsdp tests leave out, each against single-rank
// training (DESIGN.md section 8):
//   * activation checkpointing (common/nn/checkpoint.h) inside a step compiled with capture::compile and
//     fsdp::FullyShardMode (a bucket per parameter, or 4 KiB buckets prefetched one ahead): the blocks
//     checkpointed, or the attention and MLP inside each block, with the final LayerNorm; against eager single-rank
//     training on the whole batch without checkpointing (within float rounding), and bit for bit against eager FSDP
//     without checkpointing (which the compiled fully-shard step equals bitwise, tests/fsdp/fully_shard_mode_test.cc,
//     and which checkpointing must not change, checkpoint.h).
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/autograd/engine.h"
#include "common/capture/compile.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/checkpoint.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "fsdp/fully_shard.h"
#include "fsdp/fully_shard_mode.h"
#include "gtest/gtest.h"
#include "tests/fsdp/eager_fsdp_reference.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/checkpoint_gpt.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp {
namespace {

using gpt_tiny::Batch;
using gpt_tiny::kBatch;
using gpt_tiny::TinyConfig;

constexpr int kSteps = 5;

using checkpoint_gpt::Checkpoint;
using checkpoint_gpt::Ckpt;

class FullyShardModeCheckpoint : public ::testing::TestWithParam<std::tuple<int, Ckpt, bool>> {};

// Five GPT-tiny steps compiled with the fully-shard mode, the model checkpointed: every rank's full parameters
// equal single-rank training on the whole batch (no checkpointing) within float rounding, every loss and parameter
// equal eager FSDP's (no checkpointing) bit for bit, and the graph gathers and reduce-scatters.
TEST_P(FullyShardModeCheckpoint, CompiledCheckpointedStepsTrainAsOnOneRank) {
  const auto [world, what, bucketed] = GetParam();
  const auto want = gpt_tiny::Reference(kSteps);
  const FullyShardModeOptions options =
      bucketed ? FullyShardModeOptions{.bucket_bytes = 4 << 10, .prefetch = 1} : FullyShardModeOptions{};
  std::vector<std::vector<std::vector<float>>> eager_values(world), compiled_values(world);
  std::vector<std::vector<float>> eager_losses(world), compiled_losses(world);
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    const int rows = kBatch / env.world_size;
    const auto r = static_cast<std::size_t>(env.rank);
    if (absl::Status s = test_util::RunEagerFsdp(env, TinyConfig(), kSteps, eager_losses[r], eager_values); !s.ok()) {
      return s;
    }
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = Checkpoint(model, what); !s.ok()) return s;
    optim::AdamW opt(model.parameters());
    auto mode = std::make_shared<FullyShardMode>(env.group_ptr, options);
    capture::CompiledStep compiled = capture::compile(
        [&](const std::vector<Tensor>& batch) {
          Tensor loss = model.loss(batch[0], batch[1]);
          autograd::backward(loss);
          EXPECT_TRUE(opt.step().ok());
          opt.zero_grad();
          return loss;
        },
        model, opt, {.parallel_mode = mode});
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = Batch(step, env.rank * rows, rows);
      absl::StatusOr<Tensor> loss = compiled({x, y});
      if (!loss.ok()) return loss.status();
      compiled_losses[r].push_back(static_cast<float>(loss->item()));
    }
    const std::map<std::string, int> counts = compiled.graph()->counts();
    EXPECT_GE(counts.count("collective/all_gather") ? counts.at("collective/all_gather") : 0, 1);
    EXPECT_GE(counts.count("collective/reduce_scatter") ? counts.at("collective/reduce_scatter") : 0, 1);
    if (absl::Status s = mode->unshard_parameters(); !s.ok()) return s;
    compiled_values[r] = gpt_tiny::Values(model);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  gpt_tiny::ExpectMatches(compiled_values, want, 2e-5);
  gpt_tiny::ExpectBitwiseEqualRuns(compiled_losses, eager_losses, compiled_values, eager_values);
}

INSTANTIATE_TEST_SUITE_P(Worlds, FullyShardModeCheckpoint,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values(Ckpt::blocks, Ckpt::inside_blocks),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return absl::StrCat("n", std::get<0>(info.param),
                                               std::get<1>(info.param) == Ckpt::blocks ? "_blocks" : "_inside_blocks",
                                               std::get<2>(info.param) ? "_bucketed" : "_per_param");
                         });

}  // namespace
}  // namespace shardkit::fsdp
