// fsdp::clip_grad_norm: the global norm of the sharded gradients, and clipping that scales the shards' gradients
// (what an optimizer over model.parameters() steps), with units per block or nested (per block and per MLP).
#include "absl/strings/str_cat.h"
#include "common/optim/clip_grad.h"
#include "common/optim/sgd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "fsdp/clip_grad.h"
#include "tests/fsdp/fsdp_test_util.h"

namespace shardkit::fsdp {
namespace {

using gpt_tiny::Batch;
using gpt_tiny::kBatch;
using gpt_tiny::TinyConfig;

constexpr double kMaxNorm = 0.05;

// SGD: its update is proportional to the gradient, so a clip that scales nothing shows. (The groups below and the
// reference's carry AdamW::default_hyper(), which replaces this factory's defaults: plain SGD at lr 1e-3, no
// momentum.)
optim::OptimizerFactory ClipSgd() { return optim::Sgd::factory({.lr = 0.1, .momentum = 0.9}); }

class FsdpClip : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(FsdpClip, ClippedTrainingEqualsSingleRankClippedTraining) {
  const auto [world, nested] = GetParam();
  static const auto want = gpt_tiny::Reference(12, -1, ClipSgd(), kMaxNorm);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env, {}, nested); !s.ok()) return s;
    auto opt = ClipSgd()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    const int rows = kBatch / world;
    for (int step = 0; step < 12; ++step) {
      auto [x, y] = Batch(step, env.rank * rows, rows);
      (*opt)->zero_grad();
      if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
      absl::StatusOr<double> before = clip_grad_norm(model, kMaxNorm);
      if (!before.ok()) return before.status();
      EXPECT_GT(*before, 2 * kMaxNorm) << "step " << step << ": the test needs clipping to act";
      absl::StatusOr<double> after = clip_grad_norm(model, kMaxNorm);
      if (!after.ok()) return after.status();
      EXPECT_LE(*after, kMaxNorm * (1 + 1e-5)) << "step " << step;
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    }
    return test_util::StoreFullValues(model, got, env.rank);
  });
  ASSERT_TRUE(st.ok()) << st;
  gpt_tiny::ExpectMatches(got, want, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(Ranks, FsdpClip, ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Bool()),
                         [](const auto& info) {
                           return absl::StrCat(std::get<1>(info.param) ? "nested_" : "", "n", std::get<0>(info.param));
                         });

TEST(FsdpClipTest, RejectsOtherNorms) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    EXPECT_THAT(std::string(clip_grad_norm(model, 1.0).status().message()),
                ::testing::HasSubstr("was not sharded by fully_shard"));
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    EXPECT_EQ(clip_grad_norm(model, 1.0, 1.0).status().message(),
              "clip_grad_norm: expected norm_type 2 or inf, found 1");
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace shardkit::fsdp
