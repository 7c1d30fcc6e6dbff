// Wrap policies and fsdp::auto_shard (fsdp/wrap_policy.h): each policy's choice on a hand-written tree and on
// GPT-tiny, shared parameters placed in their lowest common ancestor unit (two sibling blocks over one weight,
// GPT's tied embedding) trained equal to one rank, ignored modules left with each rank's own gradient, and errors.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/autograd/ops/activation.h"
#include "common/autograd/ops/elementwise.h"
#include "common/autograd/ops/reduce.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/init.h"
#include "common/nn/layers.h"
#include "common/optim/adam.h"
#include "fsdp/fully_shard.h"
#include "fsdp/wrap_policy.h"
#include "gmock/gmock.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// Two Linears in a row (a, then b).
class Stack : public nn::Module {
 public:
  Stack(std::int64_t in, std::int64_t mid, std::int64_t out, Generator& gen) : Module("Stack") {
    a = register_module("a", std::make_shared<nn::Linear>(in, mid, gen));
    b = register_module("b", std::make_shared<nn::Linear>(mid, out, gen));
  }
  std::shared_ptr<nn::Linear> a, b;

 protected:
  Tensor forward(const Tensor& x) override { return (*b)(autograd::relu((*a)(x))); }
};

// Parameter counts (elements): scale 4; enc.a 40, enc.b 36 (enc 76); mid 20; dec.a 10, dec.b 12 (dec 22);
// extra.0 15, extra.1 15 (extra, a ModuleList, 30). Bottom-up: enc.a enc.b enc mid dec.a dec.b dec extra.0
// extra.1 extra, then the root.
class Tree : public nn::Module {
 public:
  explicit Tree(std::uint64_t seed) : Module("Tree") {
    Generator gen(seed, 0);
    register_parameter("scale", nn::init::ones({4}));
    enc = register_module("enc", std::make_shared<Stack>(4, 8, 4, gen));
    mid = register_module("mid", std::make_shared<nn::Linear>(4, 4, gen));
    dec = register_module("dec", std::make_shared<Stack>(4, 2, 4, gen));
    extra = register_module("extra", std::make_shared<nn::ModuleList>());
    extra->push_back(std::make_shared<nn::Linear>(4, 3, gen));
    extra->push_back(std::make_shared<nn::Linear>(4, 3, gen));
  }
  std::shared_ptr<Stack> enc, dec;
  std::shared_ptr<nn::Linear> mid;
  std::shared_ptr<nn::ModuleList> extra;

 protected:
  Tensor forward(const Tensor& x) override {
    Tensor h = (*dec)((*mid)((*enc)(x)));
    return autograd::add((*(*extra)[0])(h), (*(*extra)[1])(h));
  }
};

// The fully qualified names of `modules` under `root`.
std::vector<std::string> Names(nn::Module& root, const std::vector<nn::Module*>& modules) {
  std::vector<std::string> out;
  for (nn::Module* m : modules) {
    std::string name = "<not under the root>";
    for (const auto& [fqn, sub] : root.named_modules()) {
      if (sub == m) name = fqn;
    }
    out.push_back(name);
  }
  return out;
}

std::vector<std::string> Chosen(nn::Module& root, const WrapPolicy& policy) { return Names(root, policy(root)); }

TEST(FsdpWrapPolicy, ModulesBottomUpListsChildrenBeforeParentsAndTheRootLast) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Tree tree(1);
  std::vector<std::string> names;
  for (const auto& [fqn, m] : modules_bottom_up(tree)) names.push_back(fqn);
  EXPECT_THAT(names, ElementsAre("enc.a", "enc.b", "enc", "mid", "dec.a", "dec.b", "dec", "extra.0", "extra.1", "extra", ""));
}

TEST(FsdpWrapPolicy, ByModuleType) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Tree tree(1);
  EXPECT_THAT(Chosen(tree, by_module_type({"Stack"})), ElementsAre("enc", "dec"));
  EXPECT_THAT(Chosen(tree, by_module_type({"Linear"})),
              ElementsAre("enc.a", "enc.b", "mid", "dec.a", "dec.b", "extra.0", "extra.1"));
  EXPECT_THAT(Chosen(tree, by_module_type({"Tree"})), IsEmpty()) << "the root is never chosen";
  EXPECT_THAT(Chosen(tree, by_module_type({})), IsEmpty());

  nn::GPT gpt(gpt_tiny::TinyConfig(), 1);
  EXPECT_THAT(Chosen(gpt, by_module_type({"TransformerBlock"})), ElementsAre("blocks.0", "blocks.1", "blocks.2"));
  EXPECT_THAT(Chosen(gpt, by_module_type({"TransformerBlock", "MLP"})),
              ElementsAre("blocks.0.mlp", "blocks.0", "blocks.1.mlp", "blocks.1", "blocks.2.mlp", "blocks.2"));
}

// The counts of the tree above: each threshold just at and just above a module's remaining parameters.
TEST(FsdpWrapPolicy, ByParameterCountAtExactThresholds) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Tree tree(1);
  EXPECT_THAT(Chosen(tree, by_parameter_count(40)), ElementsAre("enc.a")) << "enc.b 36, then enc has 36 left";
  EXPECT_THAT(Chosen(tree, by_parameter_count(36)), ElementsAre("enc.a", "enc.b")) << "enc has nothing left";
  EXPECT_THAT(Chosen(tree, by_parameter_count(41)), ElementsAre("enc")) << "76 under enc, none below reaches 41";
  EXPECT_THAT(Chosen(tree, by_parameter_count(76)), ElementsAre("enc"));
  EXPECT_THAT(Chosen(tree, by_parameter_count(77)), IsEmpty()) << "only the root (152) reaches 77";
  EXPECT_THAT(Chosen(tree, by_parameter_count(22)), ElementsAre("enc.a", "enc.b", "dec"));
  EXPECT_THAT(Chosen(tree, by_parameter_count(23)), ElementsAre("enc.a", "enc.b"));
  EXPECT_THAT(Chosen(tree, by_parameter_count(15)), ElementsAre("enc.a", "enc.b", "mid", "dec", "extra.0", "extra.1"));
  // extra holds 30 but has no forward of its own: never chosen, its parameters count toward the root.
  EXPECT_THAT(Chosen(tree, by_parameter_count(30)), ElementsAre("enc.a", "enc.b"));
  // Frozen parameters count too: a unit shards them (fully_shard.h).
  tree.enc->a->set_requires_grad(false);
  EXPECT_THAT(Chosen(tree, by_parameter_count(40)), ElementsAre("enc.a")) << "as above";
  EXPECT_THAT(Chosen(tree, by_parameter_count(36)), ElementsAre("enc.a", "enc.b"));

  // GPT-tiny: a block is 3280 elements, its MLP 2128 (fc 1088, proj 1040), its attention 1088; wte 1024 is the
  // same tensor as lm_head.weight, counted once.
  nn::GPT gpt(gpt_tiny::TinyConfig(), 1);
  EXPECT_THAT(Chosen(gpt, by_parameter_count(3280)), ElementsAre("blocks.0", "blocks.1", "blocks.2"));
  EXPECT_THAT(Chosen(gpt, by_parameter_count(3281)), IsEmpty());
  EXPECT_THAT(Chosen(gpt, by_parameter_count(2128)), ElementsAre("blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"));
  EXPECT_THAT(Chosen(gpt, by_parameter_count(1024)),
              ElementsAre("wte", "blocks.0.attn", "blocks.0.mlp.fc", "blocks.0.mlp.proj", "blocks.1.attn", "blocks.1.mlp.fc",
                          "blocks.1.mlp.proj", "blocks.2.attn", "blocks.2.mlp.fc", "blocks.2.mlp.proj"))
      << "lm_head's weight was taken by wte";
}

TEST(FsdpWrapPolicy, ByPredicateSeesEveryModuleUnderTheRootByName) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Tree tree(1);
  std::vector<std::string> seen;
  const WrapPolicy policy = by_predicate([&](const std::string& fqn, const nn::Module& m) {
    seen.push_back(fqn);
    return absl::EndsWith(fqn, ".b") || m.type_name() == "ModuleList";
  });
  EXPECT_THAT(Chosen(tree, policy), ElementsAre("enc.b", "dec.b", "extra"));
  EXPECT_THAT(seen, ElementsAre("enc.a", "enc.b", "enc", "mid", "dec.a", "dec.b", "dec", "extra.0", "extra.1", "extra"));

  nn::GPT gpt(gpt_tiny::TinyConfig(), 1);
  EXPECT_THAT(Chosen(gpt, by_predicate([](const std::string& fqn, const nn::Module&) { return fqn == "lm_head"; })),
              ElementsAre("lm_head"));
}

TEST(FsdpWrapPolicy, AnyOfIsTheUnionBottomUp) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Tree tree(1);
  EXPECT_THAT(Chosen(tree, any_of({by_module_type({"Stack"}), by_parameter_count(36)})),
              ElementsAre("enc.a", "enc.b", "enc", "dec"));
  EXPECT_THAT(Chosen(tree, any_of({by_module_type({"Linear"}), by_module_type({"Linear", "Stack"})})),
              ElementsAre("enc.a", "enc.b", "enc", "mid", "dec.a", "dec.b", "dec", "extra.0", "extra.1"))
      << "each module once";
  EXPECT_THAT(Chosen(tree, any_of({})), IsEmpty());

  nn::GPT gpt(gpt_tiny::TinyConfig(), 1);
  EXPECT_THAT(Chosen(gpt, any_of({by_module_type({"TransformerBlock"}),
                                  by_predicate([](const std::string& fqn, const nn::Module&) { return fqn == "lm_head"; })})),
              ElementsAre("blocks.0", "blocks.1", "blocks.2", "lm_head"));
}

// ---- shared parameters ---------------------------------------------------------------------------------

// x + relu(lin(x)).
class SharedBlock : public nn::Module {
 public:
  explicit SharedBlock(std::shared_ptr<nn::Linear> l) : Module("SharedBlock") { lin = register_module("lin", std::move(l)); }
  std::shared_ptr<nn::Linear> lin;

 protected:
  Tensor forward(const Tensor& x) override { return autograd::add(x, autograd::relu((*lin)(x))); }
};

// Two sibling blocks over one weight: second.lin registers first.lin's weight tensor, with a bias of its own.
class SharedNet : public nn::Module {
 public:
  explicit SharedNet(std::uint64_t seed) : Module("SharedNet") {
    Generator gen(seed, 0);
    in = register_module("in", std::make_shared<nn::Linear>(3, 4, gen));
    first = register_module("first", std::make_shared<SharedBlock>(std::make_shared<nn::Linear>(4, 4, gen)));
    second = register_module("second", std::make_shared<SharedBlock>(
                                           std::make_shared<nn::Linear>(first->lin->weight(), nn::init::uniform({4}, gen, -0.5f, 0.5f))));
    out = register_module("out", std::make_shared<nn::Linear>(4, 2, gen));
  }
  Tensor loss(const Tensor& x) { return autograd::mean((*this)(x)); }  // through the root's hooks
  std::shared_ptr<nn::Linear> in, out;
  std::shared_ptr<SharedBlock> first, second;

 protected:
  Tensor forward(const Tensor& x) override { return (*out)((*second)((*first)((*in)(x)))); }
};

constexpr int kSharedRows = 6;  // divisible by 1, 2 and 3

// Rows [row0, row0 + rows) of step `step`'s batch [6, 3].
Tensor SharedBatch(int step, int row0, int rows) {
  std::vector<float> v;
  for (int r = row0; r < row0 + rows; ++r) {
    for (int c = 0; c < 3; ++c) v.push_back(std::sin(0.7f * static_cast<float>(r * 3 + c) + 1.3f * static_cast<float>(step)));
  }
  return Tensor::from_vector(v, {rows, 3});
}

const WrapPolicy& SharedPolicy() {
  static const WrapPolicy p = by_module_type({"SharedBlock", "Linear"});
  return p;
}

std::vector<std::string> PlanNames(const ShardPlan& plan) {
  std::vector<std::string> out;
  for (const auto& u : plan.units) out.push_back(u.fqn);
  return out;
}

// first.lin.weight is registered in first.lin and second.lin: their lowest common ancestor among the units is the
// root, so the four units on the two paths leave it to the root.
TEST(FsdpSharedParams, PlanGivesASharedWeightToTheLowestCommonAncestor) {
  RankContext ctx;
  RankContextScope scope(ctx);
  SharedNet net(1);
  auto plan = plan_auto_shard(net, SharedPolicy());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(PlanNames(*plan), ElementsAre("in", "first.lin", "first", "second.lin", "second", "out", ""));
  const TensorImpl* w = net.first->lin->weight().id();
  for (const auto& u : plan->units) {
    SCOPED_TRACE(u.fqn);
    const bool on_a_path = u.fqn == "first" || u.fqn == "first.lin" || u.fqn == "second" || u.fqn == "second.lin";
    ASSERT_EQ(u.leave_to_ancestor.size(), on_a_path ? 1u : 0u);
    if (on_a_path) {
      EXPECT_EQ(u.leave_to_ancestor[0].id(), w);
    }
  }
  EXPECT_THAT(plan->units[1].params, ElementsAre("first.lin.bias"));
  EXPECT_THAT(plan->units[2].params, IsEmpty());
  EXPECT_THAT(plan->units[3].params, ElementsAre("second.lin.bias"));
  EXPECT_THAT(plan->units.back().params, ElementsAre("first.lin.weight"));

  // A policy that picks `first` only: the weight is also used in `second` (no unit), so the root holds it and
  // `first` leaves it; every other parameter stays in its nearest unit, the root.
  auto only_first = plan_auto_shard(net, by_predicate([](const std::string& fqn, const nn::Module&) { return fqn == "first"; }));
  ASSERT_TRUE(only_first.ok()) << only_first.status();
  EXPECT_THAT(PlanNames(*only_first), ElementsAre("first", ""));
  EXPECT_THAT(only_first->units[0].params, ElementsAre("first.lin.bias"));
  ASSERT_EQ(only_first->units[0].leave_to_ancestor.size(), 1u);
  EXPECT_THAT(only_first->units[1].params,
              ElementsAre("in.weight", "in.bias", "first.lin.weight", "second.lin.bias", "out.weight", "out.bias"));
}

// Every block, and wte and lm_head (the two registrations of the tied embedding) as units of their own. (Not wpe:
// GPT's forward reads wpe.weight itself instead of calling wpe, so wpe cannot be a unit.)
WrapPolicy GptTiedPolicy() {
  return any_of({by_module_type({"TransformerBlock"}), by_predicate([](const std::string& fqn, const nn::Module&) {
                   return fqn == "wte" || fqn == "lm_head";
                 })});
}

TEST(FsdpSharedParams, PlanGivesGptsTiedEmbeddingToTheRoot) {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT gpt(gpt_tiny::TinyConfig(), 1);
  auto plan = plan_auto_shard(gpt, GptTiedPolicy());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(PlanNames(*plan), ElementsAre("wte", "blocks.0", "blocks.1", "blocks.2", "lm_head", ""));
  EXPECT_THAT(plan->units[0].params, IsEmpty()) << "wte leaves its weight to the root";
  EXPECT_THAT(plan->units[1].params, ElementsAre("blocks.0.ln1.weight", "blocks.0.ln1.bias", "blocks.0.attn.qkv.weight",
                                                 "blocks.0.attn.qkv.bias", "blocks.0.attn.proj.weight",
                                                 "blocks.0.attn.proj.bias", "blocks.0.ln2.weight", "blocks.0.ln2.bias",
                                                 "blocks.0.mlp.fc.weight", "blocks.0.mlp.fc.bias",
                                                 "blocks.0.mlp.proj.weight", "blocks.0.mlp.proj.bias"));
  EXPECT_THAT(plan->units[4].params, IsEmpty()) << "lm_head too";
  ASSERT_EQ(plan->units[0].leave_to_ancestor.size(), 1u);
  ASSERT_EQ(plan->units[4].leave_to_ancestor.size(), 1u);
  EXPECT_EQ(plan->units[4].leave_to_ancestor[0].id(), gpt.wte->weight().id());
  EXPECT_TRUE(plan->units[1].leave_to_ancestor.empty());
  EXPECT_THAT(plan->units.back().params, ElementsAre("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"));
}

// The names of the unit's parameters, each tensor's names joined by '|'.
std::vector<std::string> UnitParamNames(nn::Module& m) {
  std::vector<std::string> out;
  const FSDPState* s = state_attached(m);
  if (s == nullptr || s->param_group() == nullptr) return out;
  for (const FSDPParam& p : s->param_group()->params()) {
    std::string joined;
    for (const std::string& n : p.names) joined += (joined.empty() ? "" : "|") + n;
    out.push_back(joined);
  }
  return out;
}

// Trains SharedNet for `steps` AdamW steps on one rank over the whole batch.
std::vector<std::vector<float>> SharedReference(int steps) {
  RankContext ctx;
  RankContextScope scope(ctx);
  SharedNet net(2);
  auto opt = optim::AdamW::factory()({{net.parameters(), optim::AdamW::default_hyper()}});
  for (int step = 0; step < steps; ++step) {
    (*opt)->zero_grad();
    autograd::backward(net.loss(SharedBatch(step, 0, kSharedRows)));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return gpt_tiny::Values(net);
}

TEST(FsdpSharedParams, OneWeightSharedByTwoSiblingBlocksTrainsLikeOneRank) {
  constexpr int kSteps = 8;
  const auto want = SharedReference(kSteps);
  for (const int world : {1, 2, 3}) {
    SCOPED_TRACE(::testing::Message() << "n=" << world);
    std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
    absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
      SharedNet net(2);
      auto root = auto_shard(net, SharedPolicy(), env.group_ptr);
      if (!root.ok()) return root.status();
      // The shared weight is the root's, under both names, and stays one tensor in both modules.
      EXPECT_THAT(UnitParamNames(net), ElementsAre("first.lin.weight|second.lin.weight"));
      EXPECT_THAT(UnitParamNames(*net.first->lin), ElementsAre("bias"));  // names under the unit's module
      EXPECT_THAT(UnitParamNames(*net.second->lin), ElementsAre("bias"));
      EXPECT_THAT(UnitParamNames(*net.first), IsEmpty());
      auto opt = optim::AdamW::factory()({{net.parameters(), optim::AdamW::default_hyper()}});
      if (!opt.ok()) return opt.status();
      const int rows = kSharedRows / world;
      for (int step = 0; step < kSteps; ++step) {
        (*opt)->zero_grad();
        if (absl::Status s = autograd::try_backward(net.loss(SharedBatch(step, env.rank * rows, rows))); !s.ok()) return s;
        if (absl::Status s = (*opt)->step(); !s.ok()) return s;
      }
      EXPECT_EQ(net.first->lin->weight().id(), net.second->lin->weight().id());
      return test_util::StoreFullValues(net, got, env.rank);
    });
    ASSERT_TRUE(st.ok()) << st;
    gpt_tiny::ExpectMatches(got, want, 2e-5);
  }
}

// GPT's tied embedding under a policy that picks lm_head (and wte) as units of their own: the weight goes to the
// root, stays one tensor registered as both wte.weight and lm_head.weight, and training equals one rank.
TEST(FsdpSharedParams, GptTiedEmbeddingStaysOneTensorAndTrainsLikeOneRank) {
  constexpr int kSteps = 10;
  static const auto want = gpt_tiny::Reference(kSteps);
  const WrapPolicy policy = GptTiedPolicy();
  for (const int world : {2, 3}) {
    SCOPED_TRACE(::testing::Message() << "n=" << world);
    std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
    absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(gpt_tiny::TinyConfig(), 1);
      auto root = auto_shard(model, policy, env.group_ptr);
      if (!root.ok()) return root.status();
      EXPECT_TRUE(state_of(*model.lm_head).ok()) << "lm_head is a unit";
      EXPECT_THAT(UnitParamNames(*model.lm_head), IsEmpty());
      EXPECT_THAT(UnitParamNames(*model.wte), IsEmpty());
      EXPECT_EQ(state_of(*model.wpe).status().code(), absl::StatusCode::kNotFound);
      EXPECT_THAT(UnitParamNames(model), ElementsAre("wte.weight|lm_head.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"));
      auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
      if (!opt.ok()) return opt.status();
      if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, world, 0, kSteps); !s.ok()) return s;
      EXPECT_EQ(model.wte->weight().id(), model.lm_head->weight().id()) << "one tensor at rest";
      EXPECT_EQ(model.parameters().size(), 40u) << "lm_head.weight is still wte.weight";
      return test_util::StoreFullValues(model, got, env.rank);
    });
    ASSERT_TRUE(st.ok()) << st;
    gpt_tiny::ExpectMatches(got, want, 2e-5);
  }
}

// The same by hand: lm_head's fully_shard leaves the tied weight for the root's.
TEST(FsdpSharedParams, ManualLeaveToAncestorTiesTheEmbeddingAtTheRoot) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(gpt_tiny::TinyConfig(), 1);
    for (nn::Module* b : modules_of_type(model, "TransformerBlock")) {
      if (auto s = fully_shard(*b, env.group_ptr); !s.ok()) return s.status();
    }
    if (auto s = fully_shard(*model.lm_head, env.group_ptr, {.leave_to_ancestor = {model.wte->weight()}}); !s.ok()) {
      return s.status();
    }
    if (auto s = fully_shard(model, env.group_ptr); !s.ok()) return s.status();
    EXPECT_THAT(UnitParamNames(*model.lm_head), IsEmpty());
    EXPECT_THAT(UnitParamNames(model), ElementsAre("wte.weight|lm_head.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"));
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    return test_util::TrainRows(model, **opt, env.rank, 2, 0, 1);
  });
  EXPECT_TRUE(st.ok()) << st;
}

// ---- ignored modules -----------------------------------------------------------------------------------

class Chain : public nn::Module {
 public:
  explicit Chain(std::uint64_t seed) : Module("Chain") {
    Generator gen(seed, 0);
    a = register_module("a", std::make_shared<nn::Linear>(3, 4, gen));
    b = register_module("b", std::make_shared<nn::Linear>(4, 2, gen));
  }
  Tensor loss(const Tensor& x) { return autograd::mean((*this)(x)); }
  std::shared_ptr<nn::Linear> a, b;

 protected:
  Tensor forward(const Tensor& x) override { return (*b)(autograd::relu((*a)(x))); }
};

// An ignored module stays whole, and after backward its gradient is the rank's own (the gradient of this rank's
// loss alone), while the sharded module's gradient is the average over the ranks.
TEST(FsdpIgnored, AnIgnoredModuleKeepsTheRanksOwnGradient) {
  std::vector<std::vector<float>> b_grad(2);
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    // Each rank's gradients of an unsharded copy, on either rank's rows.
    std::vector<std::vector<float>> ref_a(2), ref_b(2);
    for (int r = 0; r < 2; ++r) {
      Chain ref(5);
      autograd::backward(ref.loss(SharedBatch(0, 3 * r, 3)));
      ref_a[static_cast<std::size_t>(r)] = ref.a->weight().grad().to_vector();
      ref_b[static_cast<std::size_t>(r)] = ref.b->weight().grad().to_vector();
    }
    Chain net(5);
    auto plan = plan_auto_shard(net, by_module_type({"Linear"}), {.ignored_modules = {net.b.get()}});
    if (!plan.ok()) return plan.status();
    EXPECT_THAT(PlanNames(*plan), ElementsAre("a", "")) << "an ignored module is no unit";
    EXPECT_EQ(plan->ignored.size(), 2u);
    auto root = auto_shard(net, by_module_type({"Linear"}), env.group_ptr, {}, {.ignored_modules = {net.b.get()}});
    if (!root.ok()) return root.status();
    EXPECT_EQ(state_of(*net.b).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(sharded_parameters(net).size(), 2u) << "a.weight and a.bias only";
    EXPECT_EQ(net.b->weight().shape(), (Shape{2, 4})) << "whole on every rank";
    if (absl::Status s = autograd::try_backward(net.loss(SharedBatch(0, 3 * env.rank, 3))); !s.ok()) return s;
    b_grad[static_cast<std::size_t>(env.rank)] = net.b->weight().grad().to_vector();
    EXPECT_EQ(b_grad[static_cast<std::size_t>(env.rank)], ref_b[static_cast<std::size_t>(env.rank)]) << "the rank's own";
    // a.weight [4, 3]: rank r holds rows 2r, 2r + 1, with the average of both ranks' gradients.
    const std::vector<float> a_grad = net.a->weight().grad().to_vector();
    EXPECT_EQ(a_grad.size(), 6u);
    for (std::size_t k = 0; k < a_grad.size(); ++k) {
      const std::size_t g = static_cast<std::size_t>(6 * env.rank) + k;
      EXPECT_NEAR(a_grad[k], 0.5f * (ref_a[0][g] + ref_a[1][g]), 1e-6) << "a.weight rows, element " << k;
    }
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_NE(b_grad[0], b_grad[1]) << "not averaged";
}

// ---- errors --------------------------------------------------------------------------------------------

// Nothing under the root carries FSDP state.
bool Untouched(nn::Module& root) {
  for (const auto& [fqn, m] : root.named_modules()) {
    if (state_attached(*m) != nullptr) return false;
  }
  return true;
}

void ExpectError(const absl::Status& s, absl::StatusCode code, const std::string& message) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(message));
}

TEST(FsdpAutoShardErrors, BadPoliciesAndOptionsLeaveTheModelUnchanged) {
  absl::Status st = comm::RunRanks(1, [&](comm::RankEnv& env) -> absl::Status {
    Tree tree(1);
    Generator gen(3);
    nn::Linear outside(4, 4, gen);
    const auto fixed = [](std::vector<nn::Module*> ms) -> WrapPolicy { return [ms](nn::Module&) { return ms; }; };
    ExpectError(auto_shard(tree, fixed({tree.mid.get(), &outside}), env.group_ptr).status(), absl::StatusCode::kInvalidArgument,
                "auto_shard: the wrap policy returned a Linear that is not under the root Tree (entry 1); expected "
                "modules of the root's subtree");
    ExpectError(auto_shard(tree, fixed({&tree}), env.group_ptr).status(), absl::StatusCode::kInvalidArgument,
                "auto_shard: the wrap policy returned the root Tree itself (entry 0); expected modules under it");
    ExpectError(auto_shard(tree, fixed({nullptr}), env.group_ptr).status(), absl::StatusCode::kInvalidArgument,
                "auto_shard: the wrap policy returned a null module (entry 0)");
    ExpectError(auto_shard(tree, by_module_type({"ModuleList"}), env.group_ptr).status(), absl::StatusCode::kInvalidArgument,
                "auto_shard: the wrap policy chose 'extra' (a ModuleList), which has no forward of its own");
    ExpectError(auto_shard(tree, WrapPolicy(), env.group_ptr).status(), absl::StatusCode::kInvalidArgument,
                "auto_shard: expected a wrap policy, found an empty one");
    ExpectError(auto_shard(tree, by_module_type({"Stack"}), env.group_ptr, {}, {.ignored_modules = {&outside}}).status(),
                absl::StatusCode::kInvalidArgument,
                "auto_shard: ignored_modules[0] is a Linear that is not under the root Tree; expected modules under the root");
    ExpectError(auto_shard(tree, by_module_type({"Stack"}), env.group_ptr, {}, {.ignored_modules = {&tree}}).status(),
                absl::StatusCode::kInvalidArgument, "auto_shard: ignored_modules[0] is the root Tree itself");
    ExpectError(auto_shard(tree, by_module_type({"Stack"}), env.group_ptr, {.leave_to_ancestor = {tree.mid->weight()}}).status(),
                absl::StatusCode::kInvalidArgument,
                "auto_shard: expected empty options.leave_to_ancestor (auto_shard sets it from its plan), found 1 tensors");
    EXPECT_TRUE(Untouched(tree));
    // A module sharded before: refused before anything else is sharded.
    if (auto s = fully_shard(*tree.mid, env.group_ptr); !s.ok()) return s.status();
    ExpectError(auto_shard(tree, by_module_type({"Stack"}), env.group_ptr).status(), absl::StatusCode::kFailedPrecondition,
                "auto_shard: 'mid' (a Linear) is already sharded; expected a model no fully_shard call has touched");
    EXPECT_EQ(state_of(*tree.enc).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(state_of(tree).status().code(), absl::StatusCode::kNotFound);
    // fully_shard's own errors name the unit.
    Tree bf16(1);
    bf16.to(DType::bf16);
    ExpectError(auto_shard(bf16, by_module_type({"Stack"}), env.group_ptr).status(), absl::StatusCode::kInvalidArgument,
                "auto_shard: unit 'enc' (a Stack): fully_shard: expected f32 parameters, found bf16 for 'a.weight'");
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace shardkit::fsdp
