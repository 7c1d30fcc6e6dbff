// Finite-difference gradient checks for every layer (w.r.t. inputs and parameters), and per-rank RNG.
#include <thread>

#include "common/nn/nn.h"
#include "common/tensor/rank_context.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/autograd/gradcheck.h"
#include "tests/common/autograd/test_util.h"

namespace shardkit::nn {
namespace {

using testing_util::ExpectGradientsMatch;
using testing_util::RandomLeaf;
using TL = std::vector<Tensor>;

// Checks d(module(x))/d(x and every parameter).
void CheckModule(Module& m, const Tensor& x, testing_util::GradCheckOptions o = {}) {
  TL inputs = m.parameters();
  const bool with_x = x.requires_grad();
  if (with_x) inputs.push_back(x);
  ExpectGradientsMatch([&](const TL&) { return m(x); }, inputs, o);
}

TEST(LayerGradCheck, Linear) {
  Generator gen(1);
  Linear l(5, 3, gen), nb(5, 3, gen, false);
  CheckModule(l, RandomLeaf({4, 5}, 2));
  CheckModule(nb, RandomLeaf({2, 2, 5}, 3));
}

TEST(LayerGradCheck, EmbeddingLayerNormBatchNorm) {
  Generator gen(4);
  Embedding e(6, 3, gen);
  CheckModule(e, Tensor::from_int64({0, 5, 5, 2}, {2, 2}));
  LayerNorm ln(6);
  {
    autograd::NoGradGuard g;  // make weight / bias non-trivial
    Tensor w = ln.parameter("weight");
    w.copy_(Tensor::uniform({6}, gen, 0.5f, 1.5f));
    Tensor b = ln.parameter("bias");
    b.copy_(Tensor::uniform({6}, gen, -0.5f, 0.5f));
  }
  CheckModule(ln, RandomLeaf({3, 6}, 5, -2, 2));
  BatchNorm1d bn(4, /*momentum=*/0.f);  // momentum 0: running stats stay put across evaluations
  CheckModule(bn, RandomLeaf({5, 4}, 6, -2, 2));
  bn.eval();
  CheckModule(bn, RandomLeaf({5, 4}, 7, -2, 2));
}

TEST(LayerGradCheck, ActivationsAndDropout) {
  RankContext ctx;
  RankContextScope scope(ctx);
  ReLU relu;
  GELU gelu;
  Tensor x = RandomLeaf({3, 4}, 8, 0.2f, 1.f);
  CheckModule(relu, x);
  CheckModule(gelu, RandomLeaf({3, 4}, 9, -2, 2));
  Dropout d(0.5f);
  Tensor y = RandomLeaf({4, 4}, 10);
  ExpectGradientsMatch(
      [&](const TL& in) {
        ctx.generator = Generator(5);
        return d(in[0]);
      },
      {y});
  d.eval();
  EXPECT_TRUE(d(y).is_same(y));
}

TEST(LayerGradCheck, GeluOptionSelectsTheForm) {
  GELU exact_by_default;
  GELU exact(GeluApproximation::none);
  GELU tanh_form(GeluApproximation::tanh);
  EXPECT_EQ(exact_by_default.approximate(), GeluApproximation::none);
  EXPECT_EQ(tanh_form.approximate(), GeluApproximation::tanh);
  // GELU(1): 0.8413447460685429 exact (1 * Phi(1)), 0.8411919906082768 in GPT-2's tanh form.
  Tensor one = Tensor::from_vector({1.f}, {1});
  EXPECT_NEAR(exact_by_default(one).to_vector()[0], 0.8413447460685429, 2e-7);
  EXPECT_NEAR(exact(one).to_vector()[0], 0.8413447460685429, 2e-7);
  EXPECT_NEAR(tanh_form(one).to_vector()[0], 0.8411919906082768, 2e-7);
  Tensor x = RandomLeaf({3, 4}, 9, -3, 3);
  EXPECT_EQ(exact_by_default(x).to_vector(), autograd::gelu(x, GeluApproximation::none).to_vector());
  EXPECT_EQ(tanh_form(x).to_vector(), autograd::gelu(x, GeluApproximation::tanh).to_vector());
  CheckModule(exact, x);
  CheckModule(tanh_form, x);
}

TEST(LayerGradCheck, TransformerMlpUsesTheTanhGelu) {
  // The GPT's MLP computes GPT-2's tanh form, whatever GELU's default is.
  Generator gen(11);
  MLP mlp(TransformerOptions{.width = 8, .num_heads = 2}, gen);
  const GELU* act = nullptr;
  for (const auto& [name, child] : mlp.named_children()) {
    if (name == "act") act = dynamic_cast<const GELU*>(child.get());
  }
  ASSERT_NE(act, nullptr) << "expected MLP to have a GELU child named act";
  EXPECT_EQ(act->approximate(), GeluApproximation::tanh);
}

TEST(LayerGradCheck, AttentionMlpBlock) {
  Generator gen(11);
  TransformerOptions o{.width = 8, .num_heads = 2, .num_layers = 2, .init_std = 0.3f};
  CausalSelfAttention attn(o, gen);
  CheckModule(attn, RandomLeaf({2, 3, 8}, 12), {.max_elements_per_input = 24});
  MLP mlp(o, gen);
  CheckModule(mlp, RandomLeaf({2, 3, 8}, 13), {.max_elements_per_input = 24});
  TransformerBlock block(o, gen);
  CheckModule(block, RandomLeaf({1, 4, 8}, 14), {.max_elements_per_input = 16});
}

// At GPT-2 init the residual stream is small (embeddings N(0, 0.02)), so the LayerNorms that read it
// are strongly curved on the scale of a 1e-2 step: central differences then have a truncation error
// of (eps / 0.02)^2 ~ 25%. A 1e-3 step brings it to ~0.25% (rounding error stays ~1e-4 relative).
constexpr testing_util::GradCheckOptions kGptCheck{.eps = 1e-3, .tolerance = 1e-2, .max_elements_per_input = 12};

TEST(LayerGradCheck, GptLossWithTiedEmbedding) {
  GPTConfig c{.vocab_size = 11, .context = 5, .width = 8, .num_layers = 2, .num_heads = 2};
  GPT gpt(c, 15);
  Tensor idx = Tensor::from_int64({1, 3, 3, 10, 0, 2, 4, 4}, {2, 4});
  Tensor targets = Tensor::from_int64({3, 3, 10, 0, 2, 4, 4, 1}, {2, 4});
  ExpectGradientsMatch([&](const TL&) { return gpt.loss(idx, targets); }, gpt.parameters(), kGptCheck);
}

TEST(LayerGradCheck, GptWithDropoutUsesTheRankStreamAndEvalIsDeterministic) {
  RankContext ctx;
  RankContextScope scope(ctx);
  GPTConfig c{.vocab_size = 9, .context = 4, .width = 8, .num_layers = 1, .num_heads = 2, .dropout = 0.2f};
  GPT gpt(c, 21);
  Tensor idx = Tensor::from_int64({1, 3, 8, 0}, {1, 4});
  Tensor targets = Tensor::from_int64({3, 8, 0, 2}, {1, 4});
  ExpectGradientsMatch(
      [&](const TL&) {
        ctx.generator = Generator(5, 1);
        return gpt.loss(idx, targets);
      },
      gpt.parameters(), kGptCheck);
  // Training outputs depend on the rank stream; evaluation equals the dropout-free model.
  ctx.generator = Generator(5, 1);
  const auto a = gpt(idx).to_vector();
  ctx.generator = Generator(5, 2);
  EXPECT_NE(gpt(idx).to_vector(), a);
  gpt.eval();
  c.dropout = 0.f;
  GPT plain(c, 21);
  EXPECT_EQ(gpt(idx).to_vector(), plain(idx).to_vector());
}

TEST(LayerGradCheck, MlpModels) {
  Generator gen(16);
  auto mlp = make_mlp({3, 5, 5, 2}, gen, Activation::gelu);
  CheckModule(*mlp, RandomLeaf({4, 3}, 17));
  auto bn = make_batchnorm_mlp({3, 5, 2}, gen);
  // momentum is 0.1 by default; running stats change per call but training-mode outputs do not use them.
  CheckModule(*bn, RandomLeaf({6, 3}, 18));
}

TEST(LayerThreads, DropoutMasksComeFromEachRanksOwnGenerator) {
  // Two ranks draw dropout masks concurrently; each equals what a lone thread draws with the same
  // generator, so neither rank consumed the other's random stream.
  auto masks = [](std::uint64_t stream, testing_util::Meeting* meeting) {
    RankContext ctx;
    ctx.generator = Generator(77, stream);
    RankContextScope scope(ctx);
    Dropout d(0.5f);
    Tensor ones = Tensor::full({256}, 1.0);
    std::vector<float> out;
    for (int i = 0; i < 20; ++i) {
      if (meeting != nullptr) meeting->arrive_and_wait();
      auto v = d(ones).to_vector();
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  };
  testing_util::Meeting meeting(2);
  std::vector<float> r0, r1;
  std::thread t0([&] { r0 = masks(0, &meeting); });
  std::thread t1([&] { r1 = masks(1, &meeting); });
  t0.join();
  t1.join();
  EXPECT_EQ(r0, masks(0, nullptr));
  EXPECT_EQ(r1, masks(1, nullptr));
  EXPECT_NE(r0, r1);
}

}  // namespace
}  // namespace shardkit::nn
