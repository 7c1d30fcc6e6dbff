#include "common/nn/module.h"

#include "common/autograd/engine.h"
#include "common/autograd/hooks.h"
#include "common/nn/nn.h"
#include "common/tensor/rank_context.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::nn {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<std::string> Names(const NamedTensors& v) {
  std::vector<std::string> out;
  for (const auto& [n, t] : v) out.push_back(n);
  return out;
}

GPTConfig Tiny() { return *GPTConfig::named("gpt-10k"); }

TEST(ModuleTest, GptNamesAndTiedParameterListedOnce) {
  GPT gpt(Tiny(), 1);
  const auto names = Names(gpt.named_parameters());
  ASSERT_GE(names.size(), 4u);
  EXPECT_EQ(names[0], "wte.weight");
  EXPECT_EQ(names[1], "wpe.weight");
  EXPECT_EQ(names[2], "blocks.0.ln1.weight");
  EXPECT_THAT(names, ::testing::Contains("blocks.2.mlp.fc.weight"));
  EXPECT_THAT(names, ::testing::Contains("blocks.1.attn.qkv.bias"));
  EXPECT_EQ(names.back(), "ln_f.bias");
  EXPECT_THAT(names, ::testing::Not(::testing::Contains("lm_head.weight")));
  const auto all = Names(gpt.named_parameters({.recurse = true, .remove_duplicate = false}));
  EXPECT_EQ(all.size(), names.size() + 1);
  EXPECT_EQ(all.back(), "lm_head.weight");
  EXPECT_TRUE(gpt.lm_head->weight().is_same(gpt.wte->weight()));
  EXPECT_EQ(gpt.num_parameters(), Tiny().num_parameters());
  EXPECT_EQ(gpt.num_parameters(), 11152);
  EXPECT_EQ(names.size(), 2 + 3 * 12 + 2u);
}

TEST(ModuleTest, NamedConfigsHaveTheDocumentedSizes) {
  const std::vector<std::pair<std::string, std::int64_t>> expected = {
      {"gpt-10k", 11152}, {"gpt-100k", 92592}, {"gpt-1m", 867072}, {"gpt-10m", 10558976}, {"gpt-100m", 98032128},
      {"gpt2-small", 124439808}};
  EXPECT_EQ(GPTConfig::names().size(), expected.size());
  for (const auto& [name, n] : expected) {
    auto c = GPTConfig::named(name);
    ASSERT_TRUE(c.ok()) << name;
    EXPECT_EQ(c->num_parameters(), n) << name;
  }
  for (const char* name : {"gpt-100k", "gpt-1m"}) {
    GPT g(*GPTConfig::named(name), 3);
    EXPECT_EQ(g.num_parameters(), GPTConfig::named(name)->num_parameters()) << name;
  }
  auto bad = GPTConfig::named("gpt-7b");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("found \"gpt-7b\""));
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("gpt-100k"));
}

TEST(ModuleTest, ParametersChargedAsParametersAndInitIsDeterministic) {
  RankContext ctx;
  RankContextScope scope(ctx);
  GPT a(Tiny(), 42);
  EXPECT_EQ(ctx.memory->current(MemoryCategory::parameter), 4 * Tiny().num_parameters());
  EXPECT_EQ(ctx.memory->current(MemoryCategory::activation), 0);
  GPT b(Tiny(), 42), c(Tiny(), 43);
  const auto pa = a.named_parameters(), pb = b.named_parameters(), pc = c.named_parameters();
  bool any_diff = false;
  for (std::size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pa[i].second.to_vector(), pb[i].second.to_vector()) << pa[i].first;
    any_diff = any_diff || pa[i].second.to_vector() != pc[i].second.to_vector();
    EXPECT_TRUE(pa[i].second.requires_grad());
  }
  EXPECT_TRUE(any_diff);
}

TEST(ModuleTest, TrainEvalApplyRequiresGradZeroGrad) {
  Generator gen(1);
  auto net = make_batchnorm_mlp({3, 4, 2}, gen);
  EXPECT_TRUE(net->is_training());
  net->eval();
  for (auto& [name, m] : net->named_modules()) EXPECT_FALSE(m->is_training()) << name;
  net->train();
  std::vector<std::string> order;
  net->apply([&](Module& m) { order.push_back(m.type_name()); });
  EXPECT_THAT(order, ElementsAre("Linear", "BatchNorm1d", "ReLU", "Linear", "Sequential"));
  net->set_requires_grad(false);
  for (const Tensor& p : net->parameters()) EXPECT_FALSE(p.requires_grad());
  net->set_requires_grad(true);
  Tensor x = Tensor::from_vector({1, 2, 3, 4, 5, 6}, {2, 3});
  autograd::backward(autograd::sum((*net)(x)));
  for (const Tensor& p : net->parameters()) EXPECT_TRUE(p.grad().defined());
  net->zero_grad(false);
  for (const Tensor& p : net->parameters()) EXPECT_THAT(p.grad().to_vector(), ::testing::Each(0.f));
  net->zero_grad();
  for (const Tensor& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
}

TEST(ModuleTest, BatchNormMlpBuffers) {
  Generator gen(2);
  auto net = make_batchnorm_mlp({3, 4, 4, 2}, gen);
  EXPECT_THAT(Names(net->named_buffers()),
              ElementsAre("1.running_mean", "1.running_var", "4.running_mean", "4.running_var"));
  const auto sd = Names(net->state_dict());
  EXPECT_THAT(sd, ::testing::Contains("4.running_var"));
  EXPECT_THAT(sd, ::testing::Contains("6.bias"));
  Tensor x = Tensor::from_vector({1, 2, 3, 4, 5, 6, -1, 0, 2}, {3, 3});
  const auto before = net->named_buffers()[0].second.to_vector();
  (*net)(x);
  const auto after_train = net->named_buffers()[0].second.to_vector();
  EXPECT_NE(before, after_train);
  net->eval();
  (*net)(x);
  EXPECT_EQ(net->named_buffers()[0].second.to_vector(), after_train);
}

TEST(ModuleTest, StateDictRoundTripGivesBitIdenticalOutputs) {
  GPT a(Tiny(), 1), b(Tiny(), 2);
  Tensor idx = Tensor::from_int64({1, 5, 9, 2, 7, 3, 3, 0}, {2, 4});
  const auto ya = a(idx).to_vector();
  EXPECT_NE(b(idx).to_vector(), ya);
  // Through copies, as a checkpoint would.
  StateDict copy;
  for (const auto& [n, t] : a.state_dict()) copy.emplace_back(n, t.clone());
  ASSERT_TRUE(b.load_state_dict(copy).ok());
  EXPECT_EQ(b(idx).to_vector(), ya);
  EXPECT_TRUE(b.lm_head->weight().is_same(b.wte->weight()));  // still tied
}

TEST(ModuleTest, LoadStateDictErrorsNameTheKeysAndLeaveTheModuleUnchanged) {
  Generator gen(3);
  auto net = make_mlp({3, 4, 2}, gen);
  const auto before = net->state_dict();
  std::vector<std::vector<float>> before_values;
  for (const auto& [n, t] : before) before_values.push_back(t.to_vector());
  StateDict bad;
  bad.emplace_back("0.weight", Tensor::zeros({3, 4}));   // shape mismatch
  bad.emplace_back("0.bias", Tensor::zeros({4}));        // fine
  bad.emplace_back("extra.weight", Tensor::zeros({1}));  // unexpected
  // "2.weight" and "2.bias" missing
  const absl::Status st = net->load_state_dict(bad);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  const std::string msg(st.message());
  EXPECT_THAT(msg, HasSubstr("missing keys: [2.weight, 2.bias]"));
  EXPECT_THAT(msg, HasSubstr("unexpected keys: [extra.weight]"));
  EXPECT_THAT(msg, HasSubstr("0.weight: expected [4, 3], found [3, 4]"));
  for (std::size_t i = 0; i < before.size(); ++i) EXPECT_EQ(net->state_dict()[i].second.to_vector(), before_values[i]);
  // Non-strict: missing / unexpected are fine, shape mismatches are not.
  bad[0].second = Tensor::zeros({4, 3});
  ASSERT_TRUE(net->load_state_dict(bad, /*strict=*/false).ok());
  EXPECT_THAT(net->state_dict()[0].second.to_vector(), ::testing::Each(0.f));
}

TEST(ModuleTest, ForwardHooksRunAroundForwardAndCanReplace) {
  Generator gen(4);
  auto net = make_mlp({2, 2, 2}, gen);
  auto first = net->child("0");
  std::vector<std::string> log;
  HookHandle pre = first->register_forward_pre_hook([&](Module& m, const TensorList& in) -> std::optional<TensorList> {
    log.push_back("pre " + m.type_name());
    return TensorList{autograd::scale(in[0], 0.f)};  // replace input by zeros
  });
  HookHandle post = first->register_forward_hook(
      [&](Module& m, const TensorList& in, const TensorList& out) -> std::optional<TensorList> {
        log.push_back("post " + m.type_name());
        EXPECT_THAT(in[0].to_vector(), ::testing::Each(0.f));  // sees the replaced input
        return std::nullopt;
      });
  HookHandle outer = net->register_forward_hook(
      [&](Module& m, const TensorList&, const TensorList& out) -> std::optional<TensorList> {
        log.push_back("post " + m.type_name());
        return TensorList{autograd::scale(out[0], 2.f)};
      });
  Tensor x = Tensor::from_vector({1, 2}, {1, 2});
  Tensor y = (*net)(x);
  EXPECT_THAT(log, ElementsAre("pre Linear", "post Linear", "post Sequential"));
  // Output = 2 * net(0).
  Tensor y0;
  {
    pre.remove();
    post.remove();
    outer.remove();
    y0 = (*net)(Tensor::zeros({1, 2}));
  }
  EXPECT_FLOAT_EQ(y.item_at(0), 2 * y0.item_at(0));
  log.clear();
  (*net)(x);
  EXPECT_TRUE(log.empty());
}

TEST(ModuleTest, ReplaceParameterIsSeenByForward) {
  Generator gen(5);
  Linear l(2, 1, gen, /*bias=*/false);
  l.replace_parameter("weight", Tensor::from_vector({1, 10}, {1, 2}));
  EXPECT_FLOAT_EQ(l(Tensor::from_vector({3, 4}, {1, 2})).item(), 43.f);
}

TEST(ModuleTest, TwelveLayerMlpGradientsReadyInReverseForwardOrder) {
  Generator gen(6);
  std::vector<std::int64_t> sizes(13, 8);
  auto net = make_mlp(sizes, gen);
  std::vector<std::string> ready;
  std::vector<HookHandle> handles;
  for (const auto& [name, p] : net->named_parameters()) {
    handles.push_back(autograd::register_post_accumulate_grad_hook(p, [&ready, name](const Tensor&) { ready.push_back(name); }));
  }
  Tensor x = Tensor::uniform({4, 8}, gen, -1, 1);
  autograd::backward(autograd::sum((*net)(x)));
  ASSERT_EQ(ready.size(), 24u);
  // Layer k is child 2k; its weight and bias come before any parameter of layer k-1.
  std::vector<int> layers;
  for (const std::string& n : ready) layers.push_back(std::stoi(n.substr(0, n.find('.'))) / 2);
  for (int k = 0; k < 12; ++k) {
    EXPECT_EQ(layers[static_cast<std::size_t>(2 * k)], 11 - k);
    EXPECT_EQ(layers[static_cast<std::size_t>(2 * k + 1)], 11 - k);
  }
}

TEST(ModuleTest, TiedEmbeddingHookFiresOnceAfterBothUses) {
  GPT gpt(Tiny(), 7);
  std::vector<std::string> ready;
  std::vector<HookHandle> handles;
  for (const auto& [name, p] : gpt.named_parameters()) {
    handles.push_back(autograd::register_post_accumulate_grad_hook(p, [&ready, name](const Tensor&) { ready.push_back(name); }));
  }
  Tensor idx = Tensor::from_int64({1, 2, 3, 4, 5, 6}, {1, 6});
  Tensor targets = Tensor::from_int64({2, 3, 4, 5, 6, 7}, {1, 6});
  autograd::backward(gpt.loss(idx, targets));
  EXPECT_EQ(std::count(ready.begin(), ready.end(), "wte.weight"), 1);
  EXPECT_EQ(ready.size(), gpt.named_parameters().size());
  EXPECT_EQ(ready.back(), "wte.weight");  // its last contribution (the input embedding) comes last
  EXPECT_EQ(ready.front().substr(0, 5), "ln_f.");  // the last module of the forward is ready first
  // The tied gradient is the sum of both uses: equal to the gradient of an untied copy's two parts.
  EXPECT_TRUE(gpt.wte->weight().grad().defined());
}

TEST(ModuleTest, GptActivationsReleasedWithTheGraph) {
  RankContext ctx;
  RankContextScope scope(ctx);
  GPT gpt(Tiny(), 8);
  Tensor idx = Tensor::from_int64({1, 2, 3, 4, 5, 6, 7, 8}, {2, 4});
  Tensor targets = Tensor::from_int64({2, 3, 4, 5, 6, 7, 8, 9}, {2, 4});
  Tensor loss = gpt.loss(idx, targets);
  const std::int64_t held = ctx.memory->current(MemoryCategory::activation);
  EXPECT_GT(held, 10 * 8 * 16 * 4);  // many [B*T, C] activations saved for backward
  autograd::backward(loss);
  EXPECT_EQ(ctx.memory->current(MemoryCategory::activation), 4);  // only the loss scalar
  loss = Tensor();
  EXPECT_EQ(ctx.memory->current(MemoryCategory::activation), 0);
  EXPECT_EQ(ctx.memory->current(MemoryCategory::gradient), 4 * Tiny().num_parameters());
  EXPECT_EQ(ctx.memory->current(MemoryCategory::parameter), 4 * Tiny().num_parameters());
}

TEST(DeferredInitTest, MaterialisedPiecesEqualTheEagerModelBitForBit) {
  const GPTConfig config = *GPTConfig::named("gpt-100k");
  RankContext ctx;
  RankContextScope scope(ctx);
  DeferredInit deferred;
  std::shared_ptr<GPT> lazy;
  {
    DeferredInitScope d(deferred);
    lazy = std::make_shared<GPT>(config, 11);
  }
  // Structure only: no parameter bytes held, and never more than one parameter at a time.
  EXPECT_EQ(ctx.memory->current(MemoryCategory::parameter), 0);
  const auto params = lazy->named_parameters();
  std::int64_t largest = 0;
  for (const auto& [n, t] : params) largest = std::max<std::int64_t>(largest, static_cast<std::int64_t>(t.nbytes()));
  EXPECT_EQ(ctx.memory->peak(MemoryCategory::parameter), largest);  // 4 * [4C, C]
  EXPECT_EQ(deferred.pending(), params.size());
  for (const auto& [n, t] : params) EXPECT_TRUE(t.storage_released()) << n;
  // One unit at a time.
  Module& block1 = *lazy->blocks->child("1");
  deferred.materialize(block1);
  std::int64_t block_elems = 0;
  for (const auto& [n, t] : block1.named_parameters()) block_elems += t.numel();
  EXPECT_EQ(ctx.memory->current(MemoryCategory::parameter), 4 * block_elems);
  EXPECT_FALSE(deferred.is_deferred(block1.named_parameters()[0].second));
  EXPECT_TRUE(deferred.is_deferred(lazy->wte->weight()));
  deferred.materialize(*lazy);
  EXPECT_EQ(deferred.pending(), 0u);
  EXPECT_EQ(ctx.memory->current(MemoryCategory::parameter), 4 * config.num_parameters());
  GPT eager(config, 11);
  const auto pe = eager.named_parameters();
  ASSERT_EQ(pe.size(), params.size());
  for (std::size_t i = 0; i < pe.size(); ++i) {
    EXPECT_EQ(params[i].second.to_vector(), pe[i].second.to_vector()) << pe[i].first;
  }
  Tensor idx = Tensor::from_int64({1, 2, 3, 4}, {1, 4});
  EXPECT_EQ((*lazy)(idx).to_vector(), eager(idx).to_vector());
  EXPECT_TRUE(lazy->lm_head->weight().is_same(lazy->wte->weight()));
}

}  // namespace
}  // namespace shardkit::nn
