// Feature combinations of the replicate mode that the other sddp tests leave out, each against single-rank training
// (DESIGN.md section 8):
//   * activation checkpointing (common/nn/checkpoint.h) inside a step compiled with capture::compile and
//     sddp::ReplicateMode: the blocks checkpointed, or the attention and MLP inside each block, with the final
//     LayerNorm; against eager single-rank training on the whole batch without checkpointing (within float
//     rounding), and bit for bit against eager DDP without checkpointing (which the compiled replicate step equals
//     bitwise, tests/sddp/replicate_mode_test.cc, and which checkpointing must not change, checkpoint.h).
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
#include "gtest/gtest.h"
#include "sddp/data_parallel.h"
#include "sddp/replicate_mode.h"
#include "tests/sddp/sddp_test_util.h"
#include "tests/testing/checkpoint_gpt.h"

namespace shardkit::sddp {
namespace {

using test_util::Batch;
using test_util::kBatch;
using test_util::TinyConfig;
using test_util::Values;

constexpr int kSteps = 5;

using checkpoint_gpt::Checkpoint;
using checkpoint_gpt::Ckpt;

class ReplicateModeCheckpoint : public ::testing::TestWithParam<std::tuple<int, Ckpt, std::int64_t>> {};

// Five GPT-tiny steps compiled with the replicate mode, the model checkpointed: every rank's parameters equal
// single-rank training on the whole batch (no checkpointing) within float rounding, every loss and parameter equal
// eager DDP's (no checkpointing) bit for bit, and the graph all-reduces the gradients.
TEST_P(ReplicateModeCheckpoint, CompiledCheckpointedStepsTrainAsOnOneRank) {
  const auto [world, what, bucket] = GetParam();
  const auto want = test_util::Reference(kSteps);
  std::vector<std::vector<std::vector<float>>> eager_values(world), compiled_values(world);
  std::vector<std::vector<float>> eager_losses(world), compiled_losses(world);
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    const int rows = kBatch / env.world_size;
    const auto r = static_cast<std::size_t>(env.rank);
    nn::GPT eager_model(TinyConfig(), 1), compiled_model(TinyConfig(), 1);
    if (absl::Status s = Checkpoint(compiled_model, what); !s.ok()) return s;
    optim::AdamW eager_opt(eager_model.parameters()), compiled_opt(compiled_model.parameters());
    auto ddp = DistributedDataParallel::create(eager_model, env.group_ptr, {.reduce_buffer_size = bucket});
    if (!ddp.ok()) return ddp.status();
    auto mode = std::make_shared<ReplicateMode>(env.group_ptr, ReplicateModeOptions{.bucket_cap_bytes = bucket * 4});
    capture::CompiledStep compiled = capture::compile(
        [&](const std::vector<Tensor>& batch) {
          Tensor loss = compiled_model.loss(batch[0], batch[1]);
          autograd::backward(loss);
          EXPECT_TRUE(compiled_opt.step().ok());
          compiled_opt.zero_grad();
          return loss;
        },
        compiled_model, compiled_opt, {.parallel_mode = mode});
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = Batch(step, env.rank * rows, rows);
      eager_opt.zero_grad();
      Tensor eager_loss = eager_model.loss(x, y);
      if (absl::Status s = autograd::try_backward(eager_loss); !s.ok()) return s;
      if (absl::Status s = eager_opt.step(); !s.ok()) return s;
      absl::StatusOr<Tensor> loss = compiled({x, y});
      if (!loss.ok()) return loss.status();
      eager_losses[r].push_back(static_cast<float>(eager_loss.item()));
      compiled_losses[r].push_back(static_cast<float>(loss->item()));
    }
    const std::map<std::string, int> counts = compiled.graph()->counts();
    EXPECT_GE(counts.count("collective/all_reduce") ? counts.at("collective/all_reduce") : 0, 1);
    eager_values[r] = Values(eager_model);
    compiled_values[r] = Values(compiled_model);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(compiled_values, want, 2e-5);
  gpt_tiny::ExpectBitwiseEqualRuns(compiled_losses, eager_losses, compiled_values, eager_values);
}

INSTANTIATE_TEST_SUITE_P(Worlds, ReplicateModeCheckpoint,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values(Ckpt::blocks, Ckpt::inside_blocks),
                                            ::testing::Values(0, 16 << 10)),
                         [](const auto& info) {
                           return absl::StrCat("n", std::get<0>(info.param),
                                               std::get<1>(info.param) == Ckpt::blocks ? "_blocks" : "_inside_blocks",
                                               std::get<2>(info.param) == 0 ? "_per_param" : "_bucketed");
                         });

}  // namespace
}  // namespace shardkit::sddp
