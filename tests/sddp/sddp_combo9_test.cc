// Ninth round of feature combinations of DDP, OSS + DDP and OSS + ShardedDDP (greedy, flat reduce-scatter, flat
// reduce to owner), each against single-rank training (DESIGN.md section 8), on the optimizers' side:
//   * SGD with momentum and dampening, Nesterov with weight decay, maximize; Adam with weight decay; AdamW; each with
//     two param groups of their own hyper-parameters (weights / biases, interleaved in module order), an lr
//     schedule, a head some or no rank uses in a step, and flat chunks smaller than the tensors (every tensor
//     straddles ranks, so its momentum / moments are split): the parameters AND the optimizer state, consolidated on
//     the LAST rank, must equal one rank's (and no other rank holds it);
//   * a checkpoint after Oss::add_param_group (a head frozen, out of the optimizer, then unfrozen and added as a
//     group), consolidated on the last rank or merged from sharded_state_dict, loaded at another world size under
//     the OTHER partition policy (greedy <-> flat) and strategy, continued: equal to uninterrupted single-rank;
//   * a state dict of a model whose tensors have the same sizes but other shapes (a transposed head) is refused on
//     every rank with the shape named, for both policies, and training goes on as if it had not been offered.
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
#include "common/optim/adam.h"
#include "common/optim/lr_schedule.h"
#include "common/optim/sgd.h"
#include "oss/oss.h"
#include "sddp/data_parallel.h"
#include "tests/sddp/sddp_test_util.h"
#include "tests/sddp/sddp_trainer.h"
#include "tests/testing/two_head_net.h"

namespace shardkit::sddp {
namespace {

using ::testing::HasSubstr;
using test_util::kModes;
using test_util::Mode;
using test_util::ModeName;
using test_util::Trainer;
using test_util::Values;
using two_head::HeadInput;
using two_head::TwoHeadNet;

using Params = std::vector<std::vector<float>>;

enum class Opt { sgd_damp, sgd_nesterov, sgd_maximize, adam, adamw };
constexpr Opt kOpts[] = {Opt::sgd_damp, Opt::sgd_nesterov, Opt::sgd_maximize, Opt::adam, Opt::adamw};

std::string OptName(Opt o) {
  switch (o) {
    case Opt::sgd_damp: return "sgd_damp";
    case Opt::sgd_nesterov: return "sgd_nesterov";
    case Opt::sgd_maximize: return "sgd_maximize";
    case Opt::adam: return "adam";
    case Opt::adamw: return "adamw";
  }
  return "?";
}

optim::OptimizerFactory Factory(Opt o) {
  switch (o) {
    case Opt::adam: return optim::Adam::factory();
    case Opt::adamw: return optim::AdamW::factory();
    default: return optim::Sgd::factory();
  }
}

// The two groups' hyper-parameters (different in every field the optimizer reads).
optim::HyperParams Hyper(Opt o, int group) {
  const bool g0 = group == 0;
  switch (o) {
    case Opt::sgd_damp:
      return g0 ? optim::HyperParams{.lr = 0.05, .weight_decay = 1e-3, .momentum = 0.9, .dampening = 0.3}
                : optim::HyperParams{.lr = 0.1, .momentum = 0.5, .dampening = 0.1};
    case Opt::sgd_nesterov:
      return g0 ? optim::HyperParams{.lr = 0.05, .weight_decay = 1e-2, .momentum = 0.9, .nesterov = true}
                : optim::HyperParams{.lr = 0.02, .momentum = 0.8, .nesterov = true};
    case Opt::sgd_maximize:
      return g0 ? optim::HyperParams{.lr = 0.01, .weight_decay = 1e-2, .momentum = 0.9, .maximize = true}
                : optim::HyperParams{.lr = 0.02, .momentum = 0.7, .maximize = true};
    case Opt::adam:
      return g0 ? optim::HyperParams{.lr = 1e-2, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 1e-2}
                : optim::HyperParams{.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8};
    case Opt::adamw:
      return g0 ? optim::HyperParams{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1}
                : optim::HyperParams{.lr = 5e-3, .beta1 = 0.85, .beta2 = 0.995, .eps = 1e-7};
  }
  return {};
}

constexpr int kSteps = 6;
double Factor(int step) { return optim::warmup_cosine_factor(step, 2, kSteps, 0.2); }

// Head b: rank 0 only in step 0, no rank in step 1, the last rank only in step 3, every rank otherwise.
bool UsesB(int step, int rank, int world) {
  if (step == 0) return rank == 0;
  if (step == 1) return false;
  if (step == 3) return rank == world - 1;
  return true;
}

// Weights (group 0) and biases (group 1), interleaved in module order.
std::vector<optim::ParamGroup> WeightBiasGroups(TwoHeadNet& net, Opt o) {
  std::vector<Tensor> w, b;
  for (const Tensor& p : net.parameters()) (p.dim() >= 2 ? w : b).push_back(p);
  return {{w, Hyper(o, 0)}, {b, Hyper(o, 1)}};
}

void SetLrs(std::vector<optim::HyperParams*> hypers, Opt o, int step) {
  for (std::size_t g = 0; g < hypers.size(); ++g) hypers[g]->lr = Hyper(o, static_cast<int>(g)).lr * Factor(step);
}

// One rank on every rank's input (the mean of their losses, each with that rank's use of b).
Tensor MeanLoss(TwoHeadNet& net, int step, int world) {
  Tensor loss;
  for (int r = 0; r < world; ++r) {
    net.use_b = UsesB(step, r, world);
    const Tensor l = net(HeadInput(step, r));
    loss = loss.defined() ? autograd::add(loss, l) : l;
  }
  return autograd::scale(loss, 1.0f / static_cast<float>(world));
}

// Every state entry (step counts exactly, tensors within tol) and every group's hyper-parameters and indices.
void ExpectSameState(const optim::OptimizerStateDict& got, const optim::OptimizerStateDict& want, double tol) {
  EXPECT_EQ(got.optimizer, want.optimizer);
  ASSERT_EQ(got.param_groups.size(), want.param_groups.size());
  for (std::size_t g = 0; g < want.param_groups.size(); ++g) {
    EXPECT_EQ(got.param_groups[g].params, want.param_groups[g].params) << "group " << g;
    EXPECT_EQ(got.param_groups[g].hyper, want.param_groups[g].hyper) << "group " << g;
  }
  ASSERT_EQ(got.state.size(), want.state.size());
  for (const auto& [index, ws] : want.state) {
    ASSERT_TRUE(got.state.contains(index)) << "no state for parameter " << index;
    const optim::ParamState& gs = got.state.at(index);
    EXPECT_EQ(gs.step, ws.step) << "parameter " << index;
    ASSERT_EQ(gs.tensors.size(), ws.tensors.size()) << "parameter " << index;
    for (const auto& [key, wt] : ws.tensors) {
      ASSERT_TRUE(gs.tensors.contains(key)) << "parameter " << index << " has no '" << key << "'";
      const Tensor& gt = gs.tensors.at(key);
      EXPECT_EQ(gt.shape(), wt.shape()) << "parameter " << index << " " << key;
      const std::vector<float> gv = gt.to_vector(), wv = wt.to_vector();
      ASSERT_EQ(gv.size(), wv.size());
      for (std::size_t k = 0; k < wv.size(); ++k) {
        ASSERT_NEAR(gv[k], wv[k], tol + tol * std::abs(wv[k])) << "parameter " << index << " " << key << "[" << k << "]";
      }
    }
  }
}

// ---- optimizers with straddling state ---------------------------------------------------------------------------

struct RunResult {
  Params params;
  optim::OptimizerStateDict state;
};

RunResult OptReference(Opt o, int world) {
  RankContext ctx;
  RankContextScope scope(ctx);
  TwoHeadNet net(3);
  auto opt = Factory(o)(WeightBiasGroups(net, o));
  EXPECT_TRUE(opt.ok()) << opt.status();
  for (int step = 0; step < kSteps; ++step) {
    SetLrs({&(*opt)->mutable_hyper(0), &(*opt)->mutable_hyper(1)}, o, step);
    (*opt)->zero_grad();
    autograd::backward(MeanLoss(net, step, world));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return {Values(net), (*opt)->state_dict()};
}

class OptimizerStateCombo : public ::testing::TestWithParam<std::tuple<Opt, int, Mode>> {};

// Chunks of 8 elements (the weights have 32, 24 and 40): every weight straddles ranks, and so does its state.
TEST_P(OptimizerStateCombo, ParametersAndConsolidatedStateEqualOneRanks) {
  const auto [o, world, mode] = GetParam();
  const RunResult want = OptReference(o, world);
  std::vector<Params> got(static_cast<std::size_t>(world));
  optim::OptimizerStateDict state;
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    TwoHeadNet net(3);
    auto t = Trainer::make(mode, net, WeightBiasGroups(net, o), Factory(o), env.group_ptr, {.reduce_buffer_size = 8});
    if (!t.ok()) return t.status();
    for (int step = 0; step < kSteps; ++step) {
      SetLrs({&t->hyper(0), &t->hyper(1)}, o, step);
      net.use_b = UsesB(step, env.rank, world);
      t->zero_grad();
      if (absl::Status s = autograd::try_backward(net(HeadInput(step, env.rank))); !s.ok()) return s;
      if (absl::Status s = t->step(); !s.ok()) return s;
    }
    got[static_cast<std::size_t>(env.rank)] = Values(net);
    if (t->oss == nullptr) return absl::OkStatus();
    const int to = world - 1;
    if (absl::Status s = t->oss->consolidate_state_dict(to); !s.ok()) return s;
    auto sd = t->oss->state_dict();
    if (env.rank == to) {
      if (!sd.ok()) return sd.status();
      state = *std::move(sd);
    } else {
      EXPECT_EQ(sd.status().code(), absl::StatusCode::kFailedPrecondition) << "rank " << env.rank;
    }
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(got, want.params, 1e-6);
  if (mode != Mode::ddp) ExpectSameState(state, want.state, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, OptimizerStateCombo,
                         ::testing::Combine(::testing::ValuesIn(kOpts), ::testing::Values(2, 3),
                                            ::testing::ValuesIn(kModes)),
                         [](const auto& info) {
                           return OptName(std::get<0>(info.param)) + "_" + ModeName(std::get<2>(info.param)) + "_n" +
                                  std::to_string(std::get<1>(info.param));
                         });

// ---- a checkpoint after add_param_group, resumed under the other policy -----------------------------------------

constexpr int kAddAt = 1;   // head b is unfrozen and added as group 1 before this step
constexpr int kCkptAt = 3;  // the checkpoint is taken after steps [0, kCkptAt)

std::vector<Tensor> TrunkAndA(TwoHeadNet& net) {
  std::vector<Tensor> out = net.trunk->parameters();
  for (const Tensor& p : net.a->parameters()) out.push_back(p);
  return out;
}

// Head b from kAddAt on: every rank, except the last rank only in step 4.
bool ResumeUsesB(int step, int rank, int world) { return step >= kAddAt && (step != 4 || rank == world - 1); }

Params AddResumeReference(Opt o, int world_a, int world_b) {
  RankContext ctx;
  RankContextScope scope(ctx);
  TwoHeadNet net(3);
  net.b->set_requires_grad(false);
  auto opt = Factory(o)({{TrunkAndA(net), Hyper(o, 0)}});
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < kSteps; ++step) {
    const int world = step < kCkptAt ? world_a : world_b;
    if (step == kAddAt) {
      net.b->set_requires_grad(true);
      EXPECT_TRUE((*opt)->add_param_group({net.b->parameters(), Hyper(o, 1)}).ok());
    }
    std::vector<optim::HyperParams*> hypers;
    for (std::size_t g = 0; g < (*opt)->num_param_groups(); ++g) hypers.push_back(&(*opt)->mutable_hyper(g));
    SetLrs(hypers, o, step);
    (*opt)->zero_grad();
    Tensor loss;
    for (int r = 0; r < world; ++r) {
      net.use_b = ResumeUsesB(step, r, world);
      const Tensor l = net(HeadInput(step, r));
      loss = loss.defined() ? autograd::add(loss, l) : l;
    }
    autograd::backward(autograd::scale(loss, 1.0f / static_cast<float>(world)));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return Values(net);
}

struct ResumeCase {
  int world_a;
  Mode mode_a;
  int world_b;
  Mode mode_b;
  bool merge;  // merge_sharded_state_dicts of every rank's sharded_state_dict; else consolidate on the last rank
  Opt opt;
};

std::string ResumeCaseName(const ::testing::TestParamInfo<ResumeCase>& info) {
  const ResumeCase& c = info.param;
  return absl::StrCat(ModeName(c.mode_a), "_n", c.world_a, "_to_", ModeName(c.mode_b), "_n", c.world_b,
                      c.merge ? "_merged_" : "_consolidated_", OptName(c.opt));
}

class AddGroupResumeCombo : public ::testing::TestWithParam<ResumeCase> {};

TEST_P(AddGroupResumeCombo, ResumedUnderTheOtherPolicyTrainsAsUninterruptedOneRank) {
  const ResumeCase c = GetParam();
  const Params want = AddResumeReference(c.opt, c.world_a, c.world_b);
  Params ckpt_params;
  optim::OptimizerStateDict ckpt_state;
  std::vector<oss::ShardedStateDict> pieces(static_cast<std::size_t>(c.world_a));
  absl::Status st = comm::RunRanks(c.world_a, [&](comm::RankEnv& env) -> absl::Status {
    TwoHeadNet net(3);
    net.b->set_requires_grad(false);
    auto t = Trainer::make(c.mode_a, net, {{TrunkAndA(net), Hyper(c.opt, 0)}}, Factory(c.opt), env.group_ptr,
                           {.reduce_buffer_size = 8});
    if (!t.ok()) return t.status();
    for (int step = 0; step < kCkptAt; ++step) {
      if (step == kAddAt) {
        net.b->set_requires_grad(true);
        if (absl::Status s = t->oss->add_param_group({net.b->parameters(), Hyper(c.opt, 1)}); !s.ok()) return s;
      }
      std::vector<optim::HyperParams*> hypers;
      for (std::size_t g = 0; g < t->oss->num_param_groups(); ++g) hypers.push_back(&t->oss->mutable_hyper(g));
      SetLrs(hypers, c.opt, step);
      net.use_b = ResumeUsesB(step, env.rank, c.world_a);
      t->zero_grad();
      if (absl::Status s = autograd::try_backward(net(HeadInput(step, env.rank))); !s.ok()) return s;
      if (absl::Status s = t->step(); !s.ok()) return s;
    }
    if (c.merge) {
      pieces[static_cast<std::size_t>(env.rank)] = t->oss->sharded_state_dict();
    } else {
      if (absl::Status s = t->oss->consolidate_state_dict(c.world_a - 1); !s.ok()) return s;
      if (env.rank == c.world_a - 1) {
        auto sd = t->oss->state_dict();
        if (!sd.ok()) return sd.status();
        ckpt_state = *std::move(sd);
      }
    }
    if (env.rank == 0) ckpt_params = Values(net);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  if (c.merge) {
    auto merged = oss::merge_sharded_state_dicts(pieces);
    ASSERT_TRUE(merged.ok()) << merged.status();
    ckpt_state = *std::move(merged);
  }
  ASSERT_EQ(ckpt_state.param_groups.size(), 2u);

  std::vector<Params> got(static_cast<std::size_t>(c.world_b));
  st = comm::RunRanks(c.world_b, [&](comm::RankEnv& env) -> absl::Status {
    TwoHeadNet net(3);
    const std::vector<Tensor> params = net.parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      params[i].copy_(Tensor::from_vector(ckpt_params[i], params[i].shape()));
    }
    auto t = Trainer::make(c.mode_b, net, {{TrunkAndA(net), Hyper(c.opt, 0)}, {net.b->parameters(), Hyper(c.opt, 1)}},
                           Factory(c.opt), env.group_ptr, {.reduce_buffer_size = 8});
    if (!t.ok()) return t.status();
    if (absl::Status s = t->oss->load_state_dict(ckpt_state); !s.ok()) return s;
    for (int step = kCkptAt; step < kSteps; ++step) {
      SetLrs({&t->hyper(0), &t->hyper(1)}, c.opt, step);
      net.use_b = ResumeUsesB(step, env.rank, c.world_b);
      t->zero_grad();
      if (absl::Status s = autograd::try_backward(net(HeadInput(step, env.rank))); !s.ok()) return s;
      if (absl::Status s = t->step(); !s.ok()) return s;
    }
    got[static_cast<std::size_t>(env.rank)] = Values(net);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(got, want, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, AddGroupResumeCombo,
    ::testing::Values(ResumeCase{2, Mode::sddp_greedy, 3, Mode::sddp_flat, false, Opt::sgd_nesterov},
                      ResumeCase{3, Mode::sddp_flat, 2, Mode::sddp_greedy, true, Opt::adamw},
                      ResumeCase{3, Mode::sddp_flat_owner, 4, Mode::oss_flat_ddp, false, Opt::adam},
                      ResumeCase{4, Mode::oss_ddp, 3, Mode::sddp_flat_owner, true, Opt::sgd_damp},
                      ResumeCase{2, Mode::sddp_flat, 3, Mode::sddp_flat, true, Opt::sgd_maximize},
                      ResumeCase{3, Mode::oss_flat_ddp, 2, Mode::sddp_flat, false, Opt::adamw},
                      ResumeCase{4, Mode::sddp_flat, 3, Mode::sddp_greedy, false, Opt::sgd_damp}),
    ResumeCaseName);

// ---- a state dict of other shapes (same sizes) --------------------------------------------------------------

// TwoHeadNet with head b built transposed-shaped: Linear(5, 8) has an [8, 5] weight and an [8] bias, where
// TwoHeadNet's b has [5, 8] and [5]. The weight has the same 40 elements: only the shape tells them apart.
class OtherShapeNet : public nn::Module {
 public:
  OtherShapeNet() : Module("OtherShapeNet") {
    Generator gen(3, 0);
    trunk = register_module("trunk", std::make_shared<nn::Linear>(4, 8, gen));
    a = register_module("a", std::make_shared<nn::Linear>(8, 3, gen));
    b = register_module("b", std::make_shared<nn::Linear>(5, 8, gen, /*bias=*/false));
  }
  std::shared_ptr<nn::Linear> trunk, a, b;

 protected:
  Tensor forward(const Tensor& x) override {
    const Tensor h = autograd::relu((*trunk)(x));
    const Tensor ya = (*a)(h);
    Tensor loss = autograd::mean(autograd::mul(ya, ya));
    const Tensor w = b->weight();
    return autograd::add(loss, autograd::mean(autograd::mul(w, w)));
  }
};

class OtherShapesRefused : public ::testing::TestWithParam<Mode> {};

// A state dict from OtherShapeNet (b.weight [8, 5] where TwoHeadNet's is [5, 8]; b.bias missing) is refused by
// every rank with the shape named; loading goes on to change nothing: training equals the uninterrupted run.
TEST_P(OtherShapesRefused, ClearErrorOnEveryRankAndNothingChanges) {
  const Mode mode = GetParam();
  constexpr int kWorld = 3;
  // The other model's SGD state after two steps, with a [5] momentum buffer added for b.bias, so that only b.weight's
  // shape is wrong.
  optim::OptimizerStateDict other;
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    OtherShapeNet net;
    auto opt = optim::Sgd::factory()({{net.parameters(), Hyper(Opt::sgd_damp, 0)}});
    ASSERT_TRUE(opt.ok());
    for (int step = 0; step < 2; ++step) {
      (*opt)->zero_grad();
      autograd::backward(net(HeadInput(step, 0)));
      ASSERT_TRUE((*opt)->step().ok());
    }
    other = (*opt)->state_dict();  // indices 0..4: trunk.w, trunk.b, a.w, a.b, b.w [8, 5]
  }
  // TwoHeadNet's order: trunk.w, trunk.b, a.w, a.b, b.w [5, 8], b.b [5]: add b.b's state as index 5.
  optim::ParamState bias_state;
  bias_state.step = 2;
  bias_state.tensors[optim::kMomentumBuffer] = Tensor::zeros({5});
  other.state[5] = bias_state;
  other.param_groups[0].params.push_back(5);

  const Params want = [] {
    RankContext ctx;
    RankContextScope scope(ctx);
    TwoHeadNet net(3);
    auto opt = optim::Sgd::factory()({{net.parameters(), Hyper(Opt::sgd_damp, 0)}});
    for (int step = 0; step < 4; ++step) {
      (*opt)->zero_grad();
      autograd::backward(MeanLoss(net, step, kWorld));
      EXPECT_TRUE((*opt)->step().ok());
    }
    return Values(net);
  }();
  std::vector<Params> got(kWorld);
  std::vector<absl::Status> errors(kWorld);
  absl::Status st = comm::RunRanks(kWorld, [&](comm::RankEnv& env) -> absl::Status {
    TwoHeadNet net(3);
    auto t = Trainer::make(mode, net, {{net.parameters(), Hyper(Opt::sgd_damp, 0)}}, optim::Sgd::factory(),
                           env.group_ptr, {.reduce_buffer_size = 8});
    if (!t.ok()) return t.status();
    for (int step = 0; step < 4; ++step) {
      if (step == 2) errors[static_cast<std::size_t>(env.rank)] = t->oss->load_state_dict(other);
      net.use_b = UsesB(step, env.rank, kWorld);
      t->zero_grad();
      if (absl::Status s = autograd::try_backward(net(HeadInput(step, env.rank))); !s.ok()) return s;
      if (absl::Status s = t->step(); !s.ok()) return s;
    }
    got[static_cast<std::size_t>(env.rank)] = Values(net);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(errors[static_cast<std::size_t>(r)].code(), absl::StatusCode::kInvalidArgument) << "rank " << r;
    EXPECT_THAT(std::string(errors[static_cast<std::size_t>(r)].message()), HasSubstr("[5, 8]")) << "rank " << r;
  }
  test_util::ExpectMatches(got, want, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Modes, OtherShapesRefused,
                         ::testing::Values(Mode::oss_ddp, Mode::oss_flat_ddp, Mode::sddp_greedy, Mode::sddp_flat,
                                           Mode::sddp_flat_owner),
                         [](const auto& info) { return ModeName(info.param); });

}  // namespace
}  // namespace shardkit::sddp
