// Third round of feature combinations of DDP, OSS + DDP and OSS + ShardedDDP (greedy, flat reduce-scatter, flat
// reduce to owner), each against single-rank training (DESIGN.md section 8):
//   * Oss::add_param_group after training started (a head frozen and left out of the optimizer, then unfrozen and
//     added as a group of its own hyper-parameters), against one rank that adds the same group at the same step;
//   * ShardedGradScaler with an inf/nan gradient on ONE rank only, reaching some ranks' owned parts only: every
//     rank must skip the step and back the scale off identically, and training goes on as one rank that skips it;
//   * clip_grad_norm with norm_type 2 and inf, with a head that only rank 0 uses (no gradient on the others
//     before the reduction);
//   * a checkpoint in the middle of training (consolidate_state_dict / state_dict, parameters), loaded at another
//     world size (load_state_dict), two param groups and an lr schedule, continued: equal to uninterrupted
//     single-rank training (AdamW's step count, so its bias correction, must come back).
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
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
using test_util::CaseName;
using test_util::kBatch;
using test_util::kModes;
using test_util::Mode;
using test_util::ModeName;
using test_util::TinyConfig;
using test_util::Trainer;
using test_util::Values;
using two_head::HeadInput;
using two_head::TwoHeadNet;

using Params = std::vector<std::vector<float>>;

// ---- Oss::add_param_group after training started --------------------------------------------------------------

constexpr int kAddSteps = 5;
constexpr int kAddAt = 2;  // head b is unfrozen and added as a group before this step

std::vector<Tensor> TrunkAndA(TwoHeadNet& net) {
  std::vector<Tensor> out = net.trunk->parameters();
  for (const Tensor& p : net.a->parameters()) out.push_back(p);
  return out;
}

optim::HyperParams HeadHyper() {
  optim::HyperParams h = optim::AdamW::default_hyper();
  h.lr = 5e-3;
  h.weight_decay = 0.05;
  return h;
}

Params AddGroupReference(int world) {
  RankContext ctx;
  RankContextScope scope(ctx);
  TwoHeadNet net(3);
  net.b->set_requires_grad(false);
  auto opt = optim::AdamW::factory()({{TrunkAndA(net), optim::AdamW::default_hyper()}});
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < kAddSteps; ++step) {
    if (step == kAddAt) {
      net.b->set_requires_grad(true);
      EXPECT_TRUE((*opt)->add_param_group({net.b->parameters(), HeadHyper()}).ok());
    }
    (*opt)->zero_grad();
    Tensor loss = net(HeadInput(step, 0));
    for (int r = 1; r < world; ++r) loss = autograd::add(loss, net(HeadInput(step, r)));
    autograd::backward(autograd::scale(loss, 1.0f / static_cast<float>(world)));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return Values(net);
}

class AddGroupCombo : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

// Head b frozen and in no optimizer group at construction; before step 2 every rank unfreezes it and adds it as a
// param group (its own lr and weight decay). The wrappers pick the new trainable set up at the next forward (the
// Oss partitions the new group on its own). Every strategy must end where one rank that does the same ends.
TEST_P(AddGroupCombo, AGroupAddedMidRunTrainsAsOnOneRank) {
  const auto [world, mode] = GetParam();
  const Params want = AddGroupReference(world);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    TwoHeadNet net(3);
    net.b->set_requires_grad(false);
    auto t = Trainer::make(mode, net, {{TrunkAndA(net), optim::AdamW::default_hyper()}}, optim::AdamW::factory(),
                           env.group_ptr, {.reduce_buffer_size = 16});
    if (!t.ok()) return t.status();
    for (int step = 0; step < kAddSteps; ++step) {
      if (step == kAddAt) {
        net.b->set_requires_grad(true);
        const optim::ParamGroup g{net.b->parameters(), HeadHyper()};
        if (absl::Status s = t->plain ? t->plain->add_param_group(g) : t->oss->add_param_group(g); !s.ok()) return s;
      }
      const std::vector<float> b_before = net.b->weight().to_vector();
      t->zero_grad();
      if (absl::Status s = autograd::try_backward(net(HeadInput(step, env.rank))); !s.ok()) return s;
      if (absl::Status s = t->step(); !s.ok()) return s;
      if (step >= kAddAt) {
        EXPECT_NE(net.b->weight().to_vector(), b_before) << "rank " << env.rank << ": b did not train in step " << step;
      }
    }
    got[static_cast<std::size_t>(env.rank)] = Values(net);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(got, want, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Modes, AddGroupCombo, ::testing::Combine(::testing::Values(2, 3), ::testing::ValuesIn(kModes)),
                         CaseName);

// ---- ShardedGradScaler with an overflow on one rank only -----------------------------------------------------------

// Two heads on the input itself: an overflow in head b's loss term reaches b's gradients only, so after the
// reduction only the ranks that own (part of) b see it.
class SplitNet : public nn::Module {
 public:
  SplitNet() : Module("SplitNet") {
    Generator gen(11, 0);
    a = register_module("a", std::make_shared<nn::Linear>(4, 6, gen));
    b = register_module("b", std::make_shared<nn::Linear>(4, 5, gen));
  }
  float b_factor = 1.0f;
  std::shared_ptr<nn::Linear> a, b;

 protected:
  Tensor forward(const Tensor& x) override {
    const Tensor ya = (*a)(x);
    const Tensor yb = (*b)(x);
    return autograd::add(autograd::mean(autograd::mul(ya, ya)),
                         autograd::scale(autograd::mean(autograd::mul(yb, yb)), b_factor));
  }
};

constexpr int kScalerSteps = 5;
constexpr int kInfStep = 2;
const optim::HyperParams kSgd{.lr = 0.05, .momentum = 0.9};

// One rank on every rank's input, SGD with momentum, step kInfStep skipped (what a scaler that found the overflow
// does: no step at all, the momentum buffers untouched).
Params ScalerReference(int world, bool skip_inf_step) {
  RankContext ctx;
  RankContextScope scope(ctx);
  SplitNet net;
  auto opt = optim::Sgd::factory()({{net.parameters(), kSgd}});
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < kScalerSteps; ++step) {
    if (step == kInfStep && skip_inf_step) continue;
    (*opt)->zero_grad();
    Tensor loss = net(HeadInput(step, 0));
    for (int r = 1; r < world; ++r) loss = autograd::add(loss, net(HeadInput(step, r)));
    autograd::backward(autograd::scale(loss, 1.0f / static_cast<float>(world)));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return Values(net);
}

class ScalerOneRankInfCombo : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

// In step 2 the last rank's head-b term is multiplied by +inf: its b gradients are inf/nan, the others' finite, and
// after the reduction only the ranks holding part of b see the overflow. Every rank must skip that step (agreed
// found_inf), halve the scale alike, keep its parameters, and the run must end as one rank that skips the step.
TEST_P(ScalerOneRankInfCombo, EveryRankSkipsAndBacksOffAlike) {
  const auto [world, mode] = GetParam();
  const Params want = ScalerReference(world, /*skip_inf_step=*/true);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  std::vector<std::vector<double>> scales(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    SplitNet net;
    auto t = Trainer::make(mode, net, {{net.parameters(), kSgd}}, optim::Sgd::factory(), env.group_ptr,
                           {.reduce_buffer_size = 16});
    if (!t.ok()) return t.status();
    ShardedGradScaler scaler(env.group_ptr, {.init_scale = 1024.0, .growth_interval = 100});
    for (int step = 0; step < kScalerSteps; ++step) {
      net.b_factor = (step == kInfStep && env.rank == world - 1) ? std::numeric_limits<float>::infinity() : 1.0f;
      t->zero_grad();
      if (absl::Status s = autograd::try_backward(scaler.scale(net(HeadInput(step, env.rank)))); !s.ok()) return s;
      const std::vector<Tensor> grads = t->dp->held_gradients();
      const Params before = Values(net);
      auto stepped = scaler.step(grads, [&] { return t->step(); });
      if (!stepped.ok()) return stepped.status();
      EXPECT_EQ(*stepped, step != kInfStep) << "rank " << env.rank << " step " << step;
      if (!*stepped) {
        EXPECT_EQ(Values(net), before) << "rank " << env.rank << ": a skipped step moved parameters";
      }
      scaler.update();
      scales[static_cast<std::size_t>(env.rank)].push_back(scaler.get_scale());
    }
    got[static_cast<std::size_t>(env.rank)] = Values(net);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(scales[static_cast<std::size_t>(r)], (std::vector<double>{1024, 1024, 512, 512, 512})) << "rank " << r;
  }
  test_util::ExpectMatches(got, want, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Modes, ScalerOneRankInfCombo,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::ValuesIn(kModes)), CaseName);

// ---- clip_grad_norm (2, inf) with a head only rank 0 uses --------------------------------------------------------

constexpr int kClipSteps = 4;

double MaxNorm(double norm_type) { return std::isinf(norm_type) ? 0.02 : 0.05; }

// One rank on every rank's input, b in rank 0's loss term only; clipped to MaxNorm before each step. Returns the
// parameters; `norms` the norms before clipping.
Params ClipReference(int world, double norm_type, std::vector<double>* norms) {
  RankContext ctx;
  RankContextScope scope(ctx);
  TwoHeadNet net(3);
  auto opt = optim::Sgd::factory()({{net.parameters(), kSgd}});
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < kClipSteps; ++step) {
    (*opt)->zero_grad();
    Tensor loss;
    for (int r = 0; r < world; ++r) {
      net.use_b = r == 0;
      const Tensor l = net(HeadInput(step, r));
      loss = loss.defined() ? autograd::add(loss, l) : l;
    }
    autograd::backward(autograd::scale(loss, 1.0f / static_cast<float>(world)));
    norms->push_back(optim::clip_grad_norm(net.parameters(), MaxNorm(norm_type), norm_type));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return Values(net);
}

class ClipNormCombo : public ::testing::TestWithParam<std::tuple<int, Mode, double>> {};

// Head b is used on rank 0 only: the other ranks have no gradient for it before the reduction. The global norm
// (2 or inf, over the averaged gradients b included) must be the one-rank norm on every rank, clipping must act,
// and training must end where the clipped one-rank run ends.
TEST_P(ClipNormCombo, NormAndClippingWithAHeadOneRankUsesAsOnOneRank) {
  const auto [world, mode, norm_type] = GetParam();
  std::vector<double> want_norms;
  const Params want = ClipReference(world, norm_type, &want_norms);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    TwoHeadNet net(3);
    net.use_b = env.rank == 0;
    auto t = Trainer::make(mode, net, {{net.parameters(), kSgd}}, optim::Sgd::factory(), env.group_ptr,
                           {.reduce_buffer_size = 16});
    if (!t.ok()) return t.status();
    for (int step = 0; step < kClipSteps; ++step) {
      t->zero_grad();
      if (absl::Status s = autograd::try_backward(net(HeadInput(step, env.rank))); !s.ok()) return s;
      absl::StatusOr<double> norm = t->plain ? optim::clip_grad_norm(t->params, MaxNorm(norm_type), norm_type)
                                             : t->oss->clip_grad_norm(MaxNorm(norm_type), norm_type);
      if (!norm.ok()) return norm.status();
      EXPECT_NEAR(*norm, want_norms[static_cast<std::size_t>(step)], 1e-6 * want_norms[static_cast<std::size_t>(step)])
          << "rank " << env.rank << " step " << step;
      EXPECT_GT(*norm, 2 * MaxNorm(norm_type)) << "step " << step << ": the test needs clipping to act";
      if (absl::Status s = t->step(); !s.ok()) return s;
    }
    got[static_cast<std::size_t>(env.rank)] = Values(net);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(got, want, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Modes, ClipNormCombo,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::ValuesIn(kModes),
                                            ::testing::Values(2.0, std::numeric_limits<double>::infinity())),
                         [](const auto& info) {
                           return ModeName(std::get<1>(info.param)) + "_n" + std::to_string(std::get<0>(info.param)) +
                                  (std::isinf(std::get<2>(info.param)) ? "_inf" : "_l2");
                         });

// ---- a checkpoint mid-run, loaded at another world size ----------------------------------------------------------

constexpr int kCkptSteps = 8;
constexpr int kCkptAt = 4;

// Two groups: matrices (lr 2e-3, weight decay 0.1) and the rest (lr 4e-3, no weight decay), in parameters() order
// of GPT-tiny; the lr of each is base * warmup_cosine(2, kCkptSteps) of the step.
std::vector<optim::ParamGroup> GptGroups(const nn::GPT& model) {
  optim::HyperParams decay = optim::AdamW::default_hyper(), no_decay = optim::AdamW::default_hyper();
  decay.lr = 2e-3;
  decay.weight_decay = 0.1;
  no_decay.lr = 4e-3;
  no_decay.weight_decay = 0.0;
  std::vector<Tensor> d, nd;
  for (const Tensor& p : model.parameters()) (p.shape().size() >= 2 ? d : nd).push_back(p);
  return {{d, decay}, {nd, no_decay}};
}

double LrFactor(int step) { return optim::warmup_cosine_factor(step, 2, kCkptSteps, 0.1); }
constexpr double kBaseLr[] = {2e-3, 4e-3};

Params CkptReference() {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT model(TinyConfig(), 1);
  auto opt = optim::AdamW::factory()(GptGroups(model));
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < kCkptSteps; ++step) {
    for (std::size_t g = 0; g < 2; ++g) (*opt)->mutable_hyper(g).lr = kBaseLr[g] * LrFactor(step);
    auto [x, y] = Batch(step, 0, kBatch);
    (*opt)->zero_grad();
    autograd::backward(model.loss(x, y));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return Values(model);
}

struct Checkpoint {
  Params params;
  optim::OptimizerStateDict state;
};

// Trains steps [first, last) at `world` in `mode`, starting from `from` (parameters and optimizer state) when
// given; returns every rank's final parameters and, in *out, the checkpoint (consolidated on rank 0).
std::vector<std::vector<std::vector<float>>> TrainSpan(int world, Mode mode, int first, int last,
                                                       const Checkpoint* from, Checkpoint* out, bool merge) {
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  std::vector<oss::ShardedStateDict> pieces(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (from != nullptr) {
      const std::vector<Tensor> params = model.parameters();
      for (std::size_t i = 0; i < params.size(); ++i) {
        params[i].copy_(Tensor::from_vector(from->params[i], params[i].shape()));
      }
    }
    auto t = Trainer::make(mode, model, GptGroups(model), optim::AdamW::factory(), env.group_ptr,
                           {.reduce_buffer_size = 300});
    if (!t.ok()) return t.status();
    if (from != nullptr) {
      if (absl::Status s = t->oss->load_state_dict(from->state); !s.ok()) return s;
    }
    const int rows = kBatch / world;
    for (int step = first; step < last; ++step) {
      for (std::size_t g = 0; g < 2; ++g) t->hyper(g).lr = kBaseLr[g] * LrFactor(step);
      auto [x, y] = Batch(step, env.rank * rows, rows);
      t->zero_grad();
      if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
      if (absl::Status s = t->step(); !s.ok()) return s;
    }
    if (out != nullptr && merge) {
      pieces[static_cast<std::size_t>(env.rank)] = t->oss->sharded_state_dict();
      if (env.rank == 0) out->params = Values(model);
    } else if (out != nullptr) {
      if (absl::Status s = t->oss->consolidate_state_dict(0); !s.ok()) return s;
      if (env.rank == 0) {
        auto sd = t->oss->state_dict();
        if (!sd.ok()) return sd.status();
        out->state = *sd;
        out->params = Values(model);
      }
    }
    got[static_cast<std::size_t>(env.rank)] = Values(model);
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
  if (out != nullptr && merge) {
    auto merged = oss::merge_sharded_state_dicts(pieces);
    EXPECT_TRUE(merged.ok()) << merged.status();
    if (merged.ok()) out->state = *merged;
  }
  return got;
}

class CheckpointResumeCombo : public ::testing::TestWithParam<std::tuple<int, int, Mode, bool>> {};

// Steps 0..3 at world A, checkpoint (parameters + optimizer state, consolidated on rank 0 or merged from every
// rank's sharded_state_dict), steps 4..7 at world B from the
// loaded checkpoint: equal to uninterrupted single-rank training (as tests/sddp/sddp_gpt_test.cc's tolerance).
TEST_P(CheckpointResumeCombo, ResumedAtAnotherWorldSizeTrainsAsUninterruptedOneRank) {
  const auto [world_a, world_b, mode, merge] = GetParam();
  static const Params want = CkptReference();
  Checkpoint ckpt;
  (void)TrainSpan(world_a, mode, 0, kCkptAt, nullptr, &ckpt, merge);
  ASSERT_FALSE(ckpt.params.empty());
  ASSERT_EQ(ckpt.state.param_groups.size(), 2u);
  const auto got = TrainSpan(world_b, mode, kCkptAt, kCkptSteps, &ckpt, nullptr, false);
  test_util::ExpectMatches(got, want, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(
    Modes, CheckpointResumeCombo,
    ::testing::Combine(::testing::Values(2, 3), ::testing::Values(3, 2),
                       ::testing::Values(Mode::oss_flat_ddp, Mode::sddp_greedy, Mode::sddp_flat, Mode::sddp_flat_owner),
                       ::testing::Bool()),
    [](const auto& info) {
      return ModeName(std::get<2>(info.param)) + "_n" + std::to_string(std::get<0>(info.param)) + "to" +
             std::to_string(std::get<1>(info.param)) + (std::get<3>(info.param) ? "_merged" : "_consolidated");
    });

}  // namespace
}  // namespace shardkit::sddp
