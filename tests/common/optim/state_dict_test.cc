// state_dict / load_state_dict: bit-identical continuation, and clear errors that change nothing.
#include <string>
#include <vector>

#include "common/optim/adam.h"
#include "common/optim/sgd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_util.h"

namespace shardkit::optim::testing {
namespace {

using ::testing::HasSubstr;

// Two groups: an fp32 group {33, [4,6]} and a bf16 group {19} (master weights), plus an untouched param.
struct Model {
  std::vector<Tensor> params;
  std::vector<std::vector<float>> targets;

  explicit Model(std::uint64_t seed) {
    Generator gen(seed);
    params.push_back(Tensor::uniform({33}, gen, -1.f, 1.f));
    params.push_back(Tensor::uniform({4, 6}, gen, -1.f, 1.f));
    params.push_back(Tensor::uniform({19}, gen, -1.f, 1.f, TensorOptions{}.with_dtype(DType::bf16)));
    params.push_back(Tensor::uniform({3}, gen, -1.f, 1.f));  // never gets a gradient: no state
    for (const Tensor& p : params) targets.push_back(std::vector<float>(static_cast<std::size_t>(p.numel()), 0.1f));
  }
  Model Clone() const {
    Model m(0);
    for (std::size_t i = 0; i < params.size(); ++i) m.params[i] = params[i].clone();
    m.targets = targets;
    return m;
  }
  std::vector<ParamGroup> Groups(const HyperParams& h) const {
    HyperParams h2 = h;
    h2.lr = h.lr * 0.5;
    return {ParamGroup{{params[0], params[1]}, h}, ParamGroup{{params[2], params[3]}, h2}};
  }
  void SetGrads(int t) const {
    for (int k = 0; k < 3; ++k) {
      params[k].set_grad(MakeGrad(params[k], targets[k], t, k, k == 2 ? DType::bf16 : DType::f32));
    }
  }
};

std::unique_ptr<Optimizer> Build(Algo algo, const Model& m) {
  HyperParams h;
  h.lr = algo == Algo::kSgd ? 0.05 : 0.01;
  h.momentum = algo == Algo::kSgd ? 0.9 : 0.0;
  h.weight_decay = 0.05;
  return MakeOptimizer(algo, m.Groups(h));
}

class RoundTripTest : public ::testing::TestWithParam<Algo> {};

TEST_P(RoundTripTest, MidRunStateDictContinuesBitIdentically) {
  const Algo algo = GetParam();
  Model a(42);
  std::unique_ptr<Optimizer> opt_a = Build(algo, a);
  for (int t = 0; t < 4; ++t) {
    a.SetGrads(t);
    ASSERT_TRUE(opt_a->step().ok());
  }
  const OptimizerStateDict saved = opt_a->state_dict();
  const Model b = a.Clone();  // parameters as saved
  EXPECT_EQ(saved.state.size(), 3u);
  EXPECT_EQ(saved.num_params(), 4);
  EXPECT_TRUE(saved.state.at(2).tensors.contains(kMaster));

  for (int t = 4; t < 10; ++t) {  // uninterrupted run
    a.SetGrads(t);
    ASSERT_TRUE(opt_a->step().ok());
  }
  std::unique_ptr<Optimizer> opt_b = Build(algo, b);
  opt_b->mutable_hyper(0).lr = 123.0;  // overwritten by the dict's hyper-parameters
  ASSERT_TRUE(opt_b->load_state_dict(saved).ok());
  EXPECT_EQ(opt_b->param_group(0).hyper, saved.param_groups[0].hyper);
  for (int t = 4; t < 10; ++t) {
    b.SetGrads(t);
    ASSERT_TRUE(opt_b->step().ok());
  }
  for (std::size_t k = 0; k < a.params.size(); ++k) EXPECT_TRUE(SameBits(a.params[k], b.params[k])) << "param " << k;
  EXPECT_TRUE(SameState(opt_a->state_dict(), opt_b->state_dict()));
}

INSTANTIATE_TEST_SUITE_P(All, RoundTripTest, ::testing::Values(Algo::kSgd, Algo::kAdam, Algo::kAdamW),
                         [](const auto& info) {
                           return std::string(info.param == Algo::kSgd ? "Sgd" : info.param == Algo::kAdam ? "Adam" : "AdamW");
                         });

// Loading pairs indices by position: a dict whose indices are arbitrary (e.g. global indices of an OSS
// shard) loads into an optimizer over the same parameters in the same order.
TEST(StateDictTest, IndicesArePairedByPosition) {
  Model a(5);
  std::unique_ptr<Optimizer> opt = Build(Algo::kAdamW, a);
  a.SetGrads(0);
  ASSERT_TRUE(opt->step().ok());
  const OptimizerStateDict local = opt->state_dict();
  const std::vector<std::int64_t> global = {10, 11, 20, 21};
  absl::StatusOr<OptimizerStateDict> remapped = remap_indices(local, global);
  ASSERT_TRUE(remapped.ok()) << remapped.status();
  EXPECT_EQ(remapped->param_groups[1].params, (std::vector<std::int64_t>{20, 21}));
  EXPECT_TRUE(remapped->state.contains(20));
  Model b = a.Clone();
  std::unique_ptr<Optimizer> opt_b = Build(Algo::kAdamW, b);
  ASSERT_TRUE(opt_b->load_state_dict(*remapped).ok());
  EXPECT_TRUE(SameState(opt->state_dict(), opt_b->state_dict()));
  EXPECT_FALSE(remap_indices(local, {0, 1}).ok());
}

struct BadCase {
  std::string name;
  std::function<void(OptimizerStateDict&)> corrupt;
  std::string message;
};

TEST(StateDictTest, BadDictsGiveClearErrorsAndChangeNothing) {
  const std::vector<BadCase> cases = {
      {"name", [](OptimizerStateDict& d) { d.optimizer = "SGD"; }, "expected a state dict of AdamW, found one of SGD"},
      {"groups", [](OptimizerStateDict& d) { d.param_groups.pop_back(); }, "expected 2 param groups, found 1"},
      {"params", [](OptimizerStateDict& d) { d.param_groups[1].params.push_back(7); },
       "param group 1: expected 2 parameters, found 3"},
      {"duplicate", [](OptimizerStateDict& d) { d.param_groups[1].params[1] = 0; },
       "expected each parameter index once, found index 0 twice"},
      {"negative index", [](OptimizerStateDict& d) { d.param_groups[0].params[1] = -1; },
       "param group 0, entry 1: expected a parameter index >= 0, found -1"},
      {"unknown index", [](OptimizerStateDict& d) { d.state[99] = d.state.at(0); },
       "unexpected state for parameter index 99, which no param group lists"},
      {"missing key", [](OptimizerStateDict& d) { d.state.at(1).tensors.erase(kExpAvgSq); },
       "parameter 1 (f32[4, 6] cpu): missing state key 'exp_avg_sq' (expected keys: exp_avg, exp_avg_sq)"},
      {"missing master", [](OptimizerStateDict& d) { d.state.at(2).tensors.erase(kMaster); },
       "parameter 2 (bf16[19] cpu): missing state key 'master' (expected keys: exp_avg, exp_avg_sq, master)"},
      {"unexpected key",
       [](OptimizerStateDict& d) { d.state.at(0).tensors[kMomentumBuffer] = Tensor::zeros({33}); },
       "parameter 0 (f32[33] cpu): unexpected state key 'momentum_buffer' (expected keys: exp_avg, exp_avg_sq)"},
      {"master on fp32", [](OptimizerStateDict& d) { d.state.at(0).tensors[kMaster] = Tensor::zeros({33}); },
       "unexpected state key 'master'"},
      {"shape", [](OptimizerStateDict& d) { d.state.at(1).tensors[kExpAvg] = Tensor::zeros({6, 4}); },
       "parameter 1 (f32[4, 6] cpu): state 'exp_avg': expected shape [4, 6], found [6, 4]"},
      {"dtype",
       [](OptimizerStateDict& d) { d.state.at(0).tensors[kExpAvg] = Tensor::zeros({33}, TensorOptions{}.with_dtype(DType::bf16)); },
       "state 'exp_avg': expected an f32 CPU tensor, found bf16[33] cpu"},
      {"step", [](OptimizerStateDict& d) { d.state.at(0).step = -1; }, "expected a step count >= 0, found -1"},
      {"hyper", [](OptimizerStateDict& d) { d.param_groups[1].hyper.lr = -1; }, "param group 1: expected lr >= 0, found -1"},
      {"betas", [](OptimizerStateDict& d) { d.param_groups[0].hyper.beta2 = 1.0; },
       "param group 0: expected 0 <= beta2 < 1, found 1"},
  };
  Model m(9);
  std::unique_ptr<Optimizer> opt = Build(Algo::kAdamW, m);
  m.SetGrads(0);
  ASSERT_TRUE(opt->step().ok());
  const OptimizerStateDict good = opt->state_dict();
  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.name);
    OptimizerStateDict bad = good.clone();
    c.corrupt(bad);
    const absl::Status s = opt->load_state_dict(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
    EXPECT_THAT(std::string(s.message()), HasSubstr("AdamW load_state_dict: "));
    EXPECT_TRUE(SameState(opt->state_dict(), good));
  }
  // And it still steps exactly like an optimizer that never saw the bad dicts.
  Model fresh = m.Clone();
  std::unique_ptr<Optimizer> twin = Build(Algo::kAdamW, fresh);
  ASSERT_TRUE(twin->load_state_dict(good).ok());
  m.SetGrads(1);
  fresh.SetGrads(1);
  ASSERT_TRUE(opt->step().ok());
  ASSERT_TRUE(twin->step().ok());
  EXPECT_TRUE(SameState(opt->state_dict(), twin->state_dict()));
}

TEST(StateDictTest, SgdMomentumBufferIsOptional) {
  Model m(3);
  std::unique_ptr<Optimizer> opt = Build(Algo::kSgd, m);
  m.SetGrads(0);
  ASSERT_TRUE(opt->step().ok());
  OptimizerStateDict d = opt->state_dict();
  d.state.at(0).tensors.erase(kMomentumBuffer);  // as after steps taken with momentum 0
  EXPECT_TRUE(opt->load_state_dict(d).ok());
  EXPECT_FALSE(opt->state(0)->tensors.contains(kMomentumBuffer));
  d.state.at(1).tensors[kExpAvg] = Tensor::zeros({4, 6});
  EXPECT_THAT(std::string(opt->load_state_dict(d).message()),
              HasSubstr("unexpected state key 'exp_avg' (expected keys: none and optionally others)"));
}

TEST(OptimizerTest, AddParamGroupValidates) {
  Tensor a = Tensor::zeros({3});
  AdamW opt(std::vector<Tensor>{a});
  EXPECT_EQ(opt.num_param_groups(), 1u);
  EXPECT_THAT(std::string(opt.add_param_group({a}).message()),
              HasSubstr("AdamW param group 1, parameter 0: expected each parameter in one group only, found f32[3] cpu twice"));
  HyperParams bad = AdamW::default_hyper();
  bad.eps = -1;
  EXPECT_THAT(std::string(opt.add_param_group(ParamGroup{{Tensor::zeros({2})}, bad}).message()),
              HasSubstr("AdamW param group 1: expected eps >= 0, found -1"));
  EXPECT_THAT(std::string(opt.add_param_group({Tensor::from_int64({1}, {1})}).message()),
              HasSubstr("expected a floating-point tensor, found i64[1] cpu"));
  EXPECT_EQ(opt.num_param_groups(), 1u);
  EXPECT_EQ(opt.num_params(), 1);
  EXPECT_TRUE(opt.add_param_group(std::vector<Tensor>{}).ok());  // empty groups are fine (an OSS rank may own nothing)
  Tensor b = Tensor::zeros({2});
  EXPECT_TRUE(opt.add_param_group({b}).ok());
  EXPECT_EQ(opt.num_params(), 2);
  EXPECT_TRUE(opt.param(1).is_same(b));
  EXPECT_EQ(opt.param_group(2).hyper, AdamW::default_hyper());
  HyperParams nesterov;
  nesterov.nesterov = true;
  EXPECT_THAT(Sgd::make({ParamGroup{{Tensor::zeros({1})}, nesterov}}).status().message(),
              HasSubstr("Nesterov momentum expects momentum > 0 and dampening = 0"));
}

TEST(OptimizerTest, ZeroGrad) {
  Tensor a = Tensor::zeros({3});
  Tensor b = Tensor::zeros({2});
  Sgd opt({a, b});
  a.set_grad(Tensor::full({3}, 2.0));
  opt.zero_grad(/*set_to_none=*/false);
  ASSERT_TRUE(a.grad().defined());
  EXPECT_EQ(a.grad().to_vector(), std::vector<float>(3, 0.0f));
  EXPECT_FALSE(b.grad().defined());
  opt.zero_grad();
  EXPECT_FALSE(a.grad().defined());
}

TEST(OptimizerTest, SyncMasterFromParams) {
  Tensor p = Tensor::full({4}, 1.0, TensorOptions{}.with_dtype(DType::bf16));
  Sgd opt({p}, HyperParams{.lr = 0.5});
  p.set_grad(Tensor::full({4}, 1.0));
  ASSERT_TRUE(opt.step().ok());
  EXPECT_EQ(p.item_at(0), 0.5);
  p.fill_(3.0);  // changed from outside
  opt.sync_master_from_params();
  ASSERT_TRUE(opt.step().ok());
  EXPECT_EQ(p.item_at(0), 2.5);
}

}  // namespace
}  // namespace shardkit::optim::testing
