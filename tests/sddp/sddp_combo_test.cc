// Feature combinations of DDP, OSS + DDP and OSS + ShardedDDP (greedy, flat reduce-scatter, flat reduce to owner)
// that the other sddp tests leave out, each against single-rank training (DESIGN.md section 8):
//   * a parameter that no rank uses in a step (a head used in some steps only) under AdamW: one rank leaves its
//     gradient undefined and AdamW skips it; every strategy must leave it where it is too;
//   * a block frozen before the wrapper is built and unfrozen mid-run;
//   * param groups with different hyper-parameters (no-decay group, another lr), the groups interleaved in module
//     order, under an lr schedule changed every step;
//   * ShardedGradScaler + clipping (unscale, clip, step) in every mode, SGD so that a gradient left scaled or
//     unclipped shows.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/autograd/ops/activation.h"
#include "common/autograd/ops/elementwise.h"
#include "common/autograd/ops/reduce.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/layers.h"
#include "common/optim/clip_grad.h"
#include "common/optim/lr_schedule.h"
#include "common/optim/sgd.h"
#include "oss/oss.h"
#include "sddp/data_parallel.h"
#include "sddp/grad_scaler.h"
#include "tests/sddp/sddp_test_util.h"
#include "tests/sddp/sddp_trainer.h"
#include "tests/testing/two_head_net.h"

namespace shardkit::sddp {
namespace {

using test_util::Batch;
using test_util::kBatch;
using test_util::TinyConfig;
using test_util::Values;
using test_util::CaseName;
using test_util::kModes;
using test_util::Mode;
using test_util::ModeName;
using test_util::Trainer;
using two_head::HeadInput;
using two_head::TwoHeadNet;

// ---- a parameter no rank uses in a step ---------------------------------------------------------------------

constexpr int kHeadSteps = 4;
bool UsesB(int step) { return step == 0; }  // head b: in the first step only, on every rank

// PyTorch's rule, also for its DDP (a globally unused parameter's .grad is left untouched) and FSDP2 (only
// gradients that exist are reduced): a parameter that got no gradient keeps grad undefined, and the optimizer
// skips it. With AdamW (weight decay, moments) a zero gradient in its place would still move it.
TEST(UnusedParameterCombo, ReferenceLeavesTheUnusedHeadAlone) {
  RankContext ctx;
  RankContextScope scope(ctx);
  TwoHeadNet net(3);
  auto opt = optim::AdamW::factory()({{net.parameters(), optim::AdamW::default_hyper()}});
  ASSERT_TRUE(opt.ok());
  std::vector<float> b_after_first;
  for (int step = 0; step < kHeadSteps; ++step) {
    net.use_b = UsesB(step);
    (*opt)->zero_grad();
    autograd::backward(net(HeadInput(step, 0)));
    ASSERT_TRUE((*opt)->step().ok());
    if (step == 0) b_after_first = net.b->weight().to_vector();
  }
  EXPECT_EQ(net.b->weight().to_vector(), b_after_first);
}

std::vector<std::vector<float>> HeadReference(int world) {
  RankContext ctx;
  RankContextScope scope(ctx);
  TwoHeadNet net(3);
  auto opt = optim::AdamW::factory()({{net.parameters(), optim::AdamW::default_hyper()}});
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < kHeadSteps; ++step) {
    net.use_b = UsesB(step);
    (*opt)->zero_grad();
    Tensor loss = net(HeadInput(step, 0));
    for (int r = 1; r < world; ++r) loss = autograd::add(loss, net(HeadInput(step, r)));
    autograd::backward(autograd::scale(loss, 1.0f / static_cast<float>(world)));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return Values(net);
}

class UnusedParameterCombo : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

// Head b is used in step 0 only, on every rank. One rank on all ranks' inputs leaves b as step 0 left it (AdamW
// skips a parameter without gradient); every strategy must too, and end equal to that run.
TEST_P(UnusedParameterCombo, AHeadNoRankUsesStaysWhereOneRankLeavesIt) {
  const auto [world, mode] = GetParam();
  const auto want = HeadReference(world);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    TwoHeadNet net(3);
    auto t = Trainer::make(mode, net, {{net.parameters(), optim::AdamW::default_hyper()}}, optim::AdamW::factory(),
                           env.group_ptr, {.reduce_buffer_size = 16});
    if (!t.ok()) return t.status();
    std::vector<float> b_after_first;
    for (int step = 0; step < kHeadSteps; ++step) {
      net.use_b = UsesB(step);
      t->zero_grad();
      if (absl::Status s = autograd::try_backward(net(HeadInput(step, env.rank))); !s.ok()) return s;
      if (absl::Status s = t->step(); !s.ok()) return s;
      if (step == 0) b_after_first = net.b->weight().to_vector();
      if (step > 0) {
        EXPECT_EQ(net.b->weight().to_vector(), b_after_first) << "rank " << env.rank << ": head b moved in step " << step
                                                              << ", which no rank used it in";
      }
    }
    got[static_cast<std::size_t>(env.rank)] = Values(net);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(got, want, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Modes, UnusedParameterCombo,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::ValuesIn(kModes)), CaseName);

// ---- frozen before wrapping, unfrozen mid-run --------------------------------------------------------------

constexpr int kFreezeSteps = 8;
constexpr int kUnfreezeAt = 3;

void SetBlock0Trainable(nn::GPT& model, bool on) { (*model.blocks)[0]->set_requires_grad(on); }

std::vector<std::vector<float>> UnfreezeReference() {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT model(TinyConfig(), 1);
  SetBlock0Trainable(model, false);
  auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < kFreezeSteps; ++step) {
    if (step == kUnfreezeAt) SetBlock0Trainable(model, true);
    auto [x, y] = Batch(step, 0, kBatch);
    (*opt)->zero_grad();
    autograd::backward(model.loss(x, y));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return Values(model);
}

class UnfreezeCombo : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

// Block 0 frozen before the wrapper and the optimizer are built (they hold it, frozen), unfrozen before step 3 on
// every rank: the wrapper notices before the next forward and reduces its gradients from then on.
TEST_P(UnfreezeCombo, ABlockFrozenAtConstructionAndUnfrozenLaterTrainsAsOnOneRank) {
  const auto [world, mode] = GetParam();
  static const auto want = UnfreezeReference();
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    SetBlock0Trainable(model, false);
    auto t = Trainer::make(mode, model, {{model.parameters(), optim::AdamW::default_hyper()}}, optim::AdamW::factory(),
                           env.group_ptr, {.reduce_buffer_size = 300, .warn_on_trainable_params_changed = false});
    if (!t.ok()) return t.status();
    const std::int64_t frozen_numel = t->dp->trainable_numel();
    const int rows = kBatch / world;
    for (int step = 0; step < kFreezeSteps; ++step) {
      if (step == kUnfreezeAt) SetBlock0Trainable(model, true);
      auto [x, y] = Batch(step, env.rank * rows, rows);
      t->zero_grad();
      if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
      if (absl::Status s = t->step(); !s.ok()) return s;
    }
    EXPECT_GT(t->dp->trainable_numel(), frozen_numel) << "the wrapper reduces block 0 after unfreezing";
    got[static_cast<std::size_t>(env.rank)] = Values(model);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(got, want, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(Modes, UnfreezeCombo, ::testing::Combine(::testing::Values(2, 3), ::testing::ValuesIn(kModes)),
                         CaseName);

// ---- param groups with their own hyper-parameters, under an lr schedule ---------------------------------------

constexpr int kGroupSteps = 10;
const optim::HyperParams kDecay{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1};
const optim::HyperParams kNoDecay{.lr = 4e-3, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.0};

// GPT's usual split: matrices decay, vectors (biases, LayerNorm) do not. The two groups alternate in module
// order, so neither is a contiguous run of the flat index space.
std::vector<optim::ParamGroup> DecayGroups(const nn::Module& model) {
  std::vector<optim::ParamGroup> groups{{{}, kDecay}, {{}, kNoDecay}};
  for (const Tensor& p : model.parameters()) groups[p.dim() >= 2 ? 0 : 1].params.push_back(p);
  return groups;
}

// The lr of group g for step `step`: its base lr times a warm-up + cosine factor.
double ScheduledLr(std::size_t g, int step) {
  const double base = g == 0 ? kDecay.lr : kNoDecay.lr;
  return base * optim::warmup_cosine_factor(step, 3, kGroupSteps, 0.1);
}

std::vector<std::vector<float>> GroupsReference() {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT model(TinyConfig(), 1);
  auto opt = optim::AdamW::factory()(DecayGroups(model));
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < kGroupSteps; ++step) {
    for (std::size_t g = 0; g < 2; ++g) (*opt)->mutable_hyper(g).lr = ScheduledLr(g, step);
    auto [x, y] = Batch(step, 0, kBatch);
    (*opt)->zero_grad();
    autograd::backward(model.loss(x, y));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return Values(model);
}

class ParamGroupCombo : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

TEST_P(ParamGroupCombo, InterleavedGroupsWithTheirOwnHyperParametersAndAScheduleTrainAsOnOneRank) {
  const auto [world, mode] = GetParam();
  static const auto want = GroupsReference();
  // The groups matter: training them with one group's hyper-parameters ends elsewhere.
  static const auto one_group = test_util::Reference(kGroupSteps);
  ASSERT_NE(want, one_group);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    auto t = Trainer::make(mode, model, DecayGroups(model), optim::AdamW::factory(), env.group_ptr,
                           {.reduce_buffer_size = 300});
    if (!t.ok()) return t.status();
    const int rows = kBatch / world;
    for (int step = 0; step < kGroupSteps; ++step) {
      for (std::size_t g = 0; g < 2; ++g) t->hyper(g).lr = ScheduledLr(g, step);
      auto [x, y] = Batch(step, env.rank * rows, rows);
      t->zero_grad();
      if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
      if (absl::Status s = t->step(); !s.ok()) return s;
    }
    got[static_cast<std::size_t>(env.rank)] = Values(model);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(got, want, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(Modes, ParamGroupCombo,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::ValuesIn(kModes)), CaseName);

// ---- ShardedGradScaler + clipping ----------------------------------------------------------------------------

constexpr int kScalerSteps = 8;
constexpr double kMaxNorm = 0.05;
const optim::HyperParams kSgd{.lr = 0.05, .momentum = 0.9};

std::vector<std::vector<float>> ClippedSgdReference() {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT model(TinyConfig(), 1);
  auto opt = optim::Sgd::factory()({{model.parameters(), kSgd}});
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < kScalerSteps; ++step) {
    auto [x, y] = Batch(step, 0, kBatch);
    (*opt)->zero_grad();
    autograd::backward(model.loss(x, y));
    optim::clip_grad_norm(model.parameters(), kMaxNorm);
    EXPECT_TRUE((*opt)->step().ok());
  }
  return Values(model);
}

class ScalerClipCombo : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

// PyTorch's recipe: scale the loss, backward, unscale the gradients this rank holds, clip them by the global
// norm, step through the scaler, update. A power-of-two scale is exact, so this equals single-rank clipped
// training without a scaler. SGD with momentum: a gradient left scaled (unscale missed what step() reads) or
// clipped by the scaled norm shows in the parameters.
TEST_P(ScalerClipCombo, UnscaleClipStepEqualsSingleRankClippedTraining) {
  const auto [world, mode] = GetParam();
  static const auto want = ClippedSgdReference();
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    auto t = Trainer::make(mode, model, {{model.parameters(), kSgd}}, optim::Sgd::factory(), env.group_ptr,
                           {.reduce_buffer_size = 300});
    if (!t.ok()) return t.status();
    ShardedGradScaler scaler(env.group_ptr, {.init_scale = 1024.0, .growth_interval = 3});
    const int rows = kBatch / world;
    for (int step = 0; step < kScalerSteps; ++step) {
      auto [x, y] = Batch(step, env.rank * rows, rows);
      t->zero_grad();
      if (absl::Status s = autograd::try_backward(scaler.scale(model.loss(x, y))); !s.ok()) return s;
      const std::vector<Tensor> grads = t->dp->held_gradients();
      auto found_inf = scaler.unscale(grads);
      if (!found_inf.ok()) return found_inf.status();
      if (*found_inf) return absl::InternalError("unexpected overflow");
      absl::StatusOr<double> norm = t->clip_grad_norm(kMaxNorm);
      if (!norm.ok()) return norm.status();
      EXPECT_GT(*norm, 2 * kMaxNorm) << "step " << step << ": the test needs clipping to act";
      EXPECT_LT(*norm, 100.0) << "step " << step << ": the norm of unscaled gradients";
      auto stepped = scaler.step(grads, [&] { return t->step(); });
      if (!stepped.ok()) return stepped.status();
      if (!*stepped) return absl::InternalError("the scaler skipped a step");
      scaler.update();
    }
    EXPECT_GT(scaler.get_scale(), 1024.0) << "the scale grew (growth_interval 3)";
    got[static_cast<std::size_t>(env.rank)] = Values(model);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(got, want, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(Modes, ScalerClipCombo,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::ValuesIn(kModes)), CaseName);

}  // namespace
}  // namespace shardkit::sddp
