// compile() with the replicate mode equals eager DistributedDataParallel bit for bit (issue 16 acceptance), at
// N = 1..4 on GPT-tiny, with the gradients bucketed or one all_reduce each.
#include "sddp/replicate_mode.h"

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/autograd/engine.h"
#include "common/capture/compile.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "common/optim/clip_grad.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "sddp/data_parallel.h"
#include "tests/sddp/sddp_test_util.h"

namespace shardkit::sddp {
namespace {

using test_util::Batch;
using test_util::kBatch;
using test_util::TinyConfig;
using test_util::Values;

class ReplicateModeTest : public ::testing::TestWithParam<std::tuple<int, std::int64_t>> {};

TEST_P(ReplicateModeTest, TwentyStepsEqualEagerDdpBitwise) {
  const auto [world, bucket] = GetParam();
  std::vector<std::vector<std::vector<float>>> eager_values(world), compiled_values(world);
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    const int rows = kBatch / env.world_size;
    nn::GPT eager_model(TinyConfig(), 1), compiled_model(TinyConfig(), 1);
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
    for (int step = 0; step < 20; ++step) {
      auto [x, y] = Batch(step, env.rank * rows, rows);
      eager_opt.zero_grad();
      Tensor eager_loss = eager_model.loss(x, y);
      if (absl::Status s = autograd::try_backward(eager_loss); !s.ok()) return s;
      if (absl::Status s = eager_opt.step(); !s.ok()) return s;
      absl::StatusOr<Tensor> loss = compiled({x, y});
      if (!loss.ok()) return loss.status();
      EXPECT_EQ(static_cast<float>(loss->item()), static_cast<float>(eager_loss.item())) << "step " << step;
    }
    const std::map<std::string, int> counts = compiled.graph()->counts();
    const int params = static_cast<int>(compiled_model.parameters().size());
    const int calls = counts.count("collective/all_reduce") ? counts.at("collective/all_reduce") : 0;
    if (bucket == 0) {
      EXPECT_EQ(calls, params);  // one all_reduce per parameter
    } else {
      EXPECT_LT(calls, params);  // bucketed
      EXPECT_GE(calls, 1);
    }
    eager_values[static_cast<std::size_t>(env.rank)] = Values(eager_model);
    compiled_values[static_cast<std::size_t>(env.rank)] = Values(compiled_model);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  for (int r = 0; r < world; ++r) {
    const auto& got = compiled_values[static_cast<std::size_t>(r)];
    const auto& want = eager_values[static_cast<std::size_t>(r)];
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(got[i] == want[i]) << "rank " << r << " parameter " << i;
  }
}

// Clipping in the single-rank step clips the averaged gradients, as with eager DDP (clip after backward): the
// all_reduce goes right after the backward finished the gradient, before the clip reads it.
TEST(ReplicateMode, ClippingInTheStepClipsTheAveragedGradientsLikeEagerDdp) {
  constexpr int kWorld = 2;
  constexpr double kMaxNorm = 0.05;  // small enough that every step clips
  std::vector<std::vector<std::vector<float>>> eager_values(kWorld), compiled_values(kWorld);
  absl::Status st = comm::RunRanks(kWorld, [&](comm::RankEnv& env) -> absl::Status {
    const int rows = kBatch / env.world_size;
    nn::GPT eager_model(TinyConfig(), 1), compiled_model(TinyConfig(), 1);
    optim::AdamW eager_opt(eager_model.parameters()), compiled_opt(compiled_model.parameters());
    auto ddp = DistributedDataParallel::create(eager_model, env.group_ptr);
    if (!ddp.ok()) return ddp.status();
    capture::CompiledStep compiled = capture::compile(
        [&](const std::vector<Tensor>& batch) {
          Tensor loss = compiled_model.loss(batch[0], batch[1]);
          autograd::backward(loss);
          optim::clip_grad_norm(compiled_model.parameters(), kMaxNorm);
          EXPECT_TRUE(compiled_opt.step().ok());
          compiled_opt.zero_grad();
          return loss;
        },
        compiled_model, compiled_opt, {.parallel_mode = std::make_shared<ReplicateMode>(env.group_ptr)});
    for (int step = 0; step < 5; ++step) {
      auto [x, y] = Batch(step, env.rank * rows, rows);
      eager_opt.zero_grad();
      if (absl::Status s = autograd::try_backward(eager_model.loss(x, y)); !s.ok()) return s;
      const double norm = optim::clip_grad_norm(eager_model.parameters(), kMaxNorm);
      EXPECT_GT(norm, kMaxNorm);
      if (absl::Status s = eager_opt.step(); !s.ok()) return s;
      if (absl::StatusOr<Tensor> loss = compiled({x, y}); !loss.ok()) return loss.status();
    }
    eager_values[static_cast<std::size_t>(env.rank)] = Values(eager_model);
    compiled_values[static_cast<std::size_t>(env.rank)] = Values(compiled_model);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  for (std::size_t r = 0; r < kWorld; ++r) {
    for (std::size_t i = 0; i < eager_values[r].size(); ++i) {
      EXPECT_TRUE(compiled_values[r][i] == eager_values[r][i]) << "rank " << r << " parameter " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, ReplicateModeTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Values(0, 16 << 10)),
                         [](const auto& info) {
                           return absl::StrCat("n", std::get<0>(info.param),
                                               std::get<1>(info.param) == 0 ? "_per_param" : "_bucketed");
                         });

}  // namespace
}  // namespace shardkit::sddp
