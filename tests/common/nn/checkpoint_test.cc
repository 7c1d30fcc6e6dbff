// Activation checkpointing (common/nn/checkpoint.h) on one rank: a GPT whose blocks are checkpointed trains
// bitwise like the same GPT without (dropout included: the Generator is restored for the recompute), its
// gradients become ready in the same order with final callbacks after the whole backward, the ledger's
// activation peak is lower, and misuse is a clear error. The strategies (DDP, OSS, ShardedDDP, FSDP) are in
// tests/integration/activation_checkpoint_test.cc.
#include "common/nn/checkpoint.h"

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "common/autograd/engine.h"
#include "common/autograd/grad_mode.h"
#include "common/autograd/hooks.h"
#include "common/autograd/ops.h"
#include "common/nn/nn.h"
#include "common/optim/adam.h"
#include "common/tensor/rank_context.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::nn {
namespace {

using ::testing::HasSubstr;

GPTConfig TinyWithDropout() {
  GPTConfig c = gpt_tiny::TinyConfig();
  c.dropout = 0.2f;
  return c;
}

struct Trained {
  std::vector<std::vector<float>> params;
  std::vector<double> losses;
  std::uint64_t rng_offset = 0;  // the rank's Generator after training
};

// `steps` AdamW steps of a GPT (seed 1) on GPT-tiny batches, on a rank whose Generator is Generator(7).
// `setup` runs on the model before the optimizer is built (checkpointing, or nothing).
Trained Train(const GPTConfig& config, int steps, const std::function<void(GPT&)>& setup) {
  RankContext ctx;
  ctx.generator = Generator(7);
  RankContextScope scope(ctx);
  GPT model(config, 1);
  setup(model);
  auto opt = optim::AdamW::make({{model.parameters(), optim::AdamW::default_hyper()}}, optim::AdamW::default_hyper());
  EXPECT_TRUE(opt.ok());
  Trained out;
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = gpt_tiny::Batch(step, 0, 8);
    (*opt)->zero_grad();
    Tensor loss = model.loss(x, y);
    out.losses.push_back(loss.item());
    autograd::backward(loss);
    EXPECT_TRUE((*opt)->step().ok());
  }
  out.params = gpt_tiny::Values(model);
  out.rng_offset = ctx.generator.offset();
  return out;
}

void NoSetup(GPT&) {}
void CheckpointBlocks(GPT& m) { ASSERT_TRUE(checkpoint_blocks(m).ok()); }

TEST(CheckpointTest, GptWithCheckpointedBlocksTrainsBitwiseLikeWithoutAlsoWithDropout) {
  const Trained plain = Train(TinyWithDropout(), 4, NoSetup);
  const Trained ckpt = Train(TinyWithDropout(), 4, CheckpointBlocks);
  EXPECT_EQ(ckpt.losses, plain.losses);
  EXPECT_EQ(ckpt.params, plain.params);
  // The recompute drew its masks from a copy: the rank's stream is where the plain run left it.
  EXPECT_EQ(ckpt.rng_offset, plain.rng_offset);
  EXPECT_GT(plain.rng_offset, 0u);
}

// What makes the test above pass with dropout: without restoring the Generator, the recompute draws other masks
// (gradients of a different function), and the stream ends elsewhere.
TEST(CheckpointTest, WithoutRestoringTheGeneratorDropoutMasksDiffer) {
  const Trained plain = Train(TinyWithDropout(), 2, NoSetup);
  const Trained unrestored = Train(TinyWithDropout(), 2, [](GPT& m) {
    ASSERT_TRUE(checkpoint_blocks(m, {.preserve_rng_state = false}).ok());
  });
  EXPECT_EQ(unrestored.losses[0], plain.losses[0]);  // the first forward is the same
  EXPECT_NE(unrestored.params, plain.params);
  EXPECT_NE(unrestored.rng_offset, plain.rng_offset);
}

TEST(CheckpointTest, NestedCheckpointsTrainBitwiseLikeWithout) {
  const Trained plain = Train(TinyWithDropout(), 3, NoSetup);
  const Trained nested = Train(TinyWithDropout(), 3, [](GPT& m) {
    ASSERT_TRUE(checkpoint_blocks(m).ok());
    for (const auto& [name, mod] : m.named_modules()) {
      if (mod->type_name() == "MLP" || mod->type_name() == "CausalSelfAttention") {
        ASSERT_TRUE(checkpoint(*mod).ok());
      }
    }
  });
  EXPECT_EQ(nested.params, plain.params);
  EXPECT_EQ(nested.rng_offset, plain.rng_offset);
}

Tensor RandomLeaf(const Shape& shape, std::uint64_t seed) {
  Generator gen(seed);
  Tensor t = Tensor::normal(shape, gen, 0.f, 1.f);
  t.set_requires_grad(true);
  return t;
}

// The block's forward runs once in forward, without grad (recording one CheckpointBackward node and nothing
// inside the block), and once more in backward, with grad; gradients equal the plain block's bitwise.
TEST(CheckpointTest, BlockForwardRunsAgainInBackwardAndOnlyTheCheckpointNodeIsRecorded) {
  GPT plain(gpt_tiny::TinyConfig(), 1), model(gpt_tiny::TinyConfig(), 1);
  Module& block = *(*model.blocks)[1];
  ASSERT_TRUE(checkpoint(block).ok());
  EXPECT_TRUE(is_checkpointed(block));
  EXPECT_FALSE(is_checkpointed(*(*model.blocks)[0]));
  std::vector<bool> grad_mode_in_forwards;
  HookHandle h = block.register_forward_hook([&](Module&, const TensorList&, const TensorList&) -> std::optional<TensorList> {
    grad_mode_in_forwards.push_back(autograd::is_grad_enabled());
    return std::nullopt;
  });
  const Tensor x = RandomLeaf({2, 5, 16}, 3), x_plain = RandomLeaf({2, 5, 16}, 3);
  Tensor y = block(x);
  EXPECT_EQ(grad_mode_in_forwards, std::vector<bool>{false});
  ASSERT_TRUE(y.requires_grad());
  EXPECT_EQ(autograd::grad_fn(y)->name(), "CheckpointBackward");
  ASSERT_EQ(autograd::grad_fn(y)->next_edges().size(), 1u);  // the input only: no parameter, no inner node
  Tensor y_plain = (*(*plain.blocks)[1])(x_plain);
  EXPECT_EQ(y.to_vector(), y_plain.to_vector());

  autograd::backward(autograd::sum(autograd::mul(y, y)));
  autograd::backward(autograd::sum(autograd::mul(y_plain, y_plain)));
  EXPECT_EQ(grad_mode_in_forwards, (std::vector<bool>{false, true}));
  EXPECT_EQ(x.grad().to_vector(), x_plain.grad().to_vector());
  const auto got = block.parameters(), want = (*plain.blocks)[1]->parameters();
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(got[i].grad().defined()) << i;
    EXPECT_EQ(got[i].grad().to_vector(), want[i].grad().to_vector()) << i;
  }

  remove_checkpoint(block);
  EXPECT_FALSE(is_checkpointed(block));
  Tensor again = block(x);
  EXPECT_NE(autograd::grad_fn(again)->name(), "CheckpointBackward");
  EXPECT_EQ(grad_mode_in_forwards.back(), true);
}

// Without grad (inference, sampling) or with nothing that can get a gradient, a checkpointed call is a plain call.
TEST(CheckpointTest, CallsThatRecordNoGraphRunOnce) {
  GPT model(gpt_tiny::TinyConfig(), 1);
  Module& block = *(*model.blocks)[0];
  ASSERT_TRUE(checkpoint(block).ok());
  int forwards = 0;
  HookHandle h = block.register_forward_hook([&](Module&, const TensorList&, const TensorList&) -> std::optional<TensorList> {
    ++forwards;
    return std::nullopt;
  });
  const Tensor x = RandomLeaf({1, 4, 16}, 5);
  {
    autograd::NoGradGuard no_grad;
    EXPECT_FALSE(block(x).requires_grad());
  }
  block.set_requires_grad(false);
  Tensor frozen = block(x.detach());
  EXPECT_FALSE(frozen.requires_grad());
  EXPECT_EQ(forwards, 2);
}

// Gradients become ready in the same order as without checkpointing (reverse forward order: what ShardedDDP's
// buckets follow), and a final callback queued by the first of them, inside the recompute's nested backward,
// runs once after the whole backward (BackwardOptions::callbacks_to_enclosing), not when the nested one ends.
TEST(CheckpointTest, GradientsBecomeReadyInTheSameOrderAndCallbacksRunAfterTheWholeBackward) {
  auto order = [](bool ckpt) {
    GPT model(gpt_tiny::TinyConfig(), 1);
    if (ckpt) {
      EXPECT_TRUE(checkpoint_blocks(model).ok());
    }
    std::vector<std::string> log;
    std::vector<HookHandle> hooks;
    bool queued = false;
    for (const auto& [name, p] : model.named_parameters()) {
      hooks.push_back(autograd::register_post_accumulate_grad_hook(p, [&log, &queued, name = name](const Tensor&) {
        log.push_back(name);
        // Only block parameters queue: with checkpointing their hooks run inside a nested backward.
        if (!queued && name.rfind("blocks.", 0) == 0) {
          queued = true;
          autograd::queue_callback([&log] { log.push_back("final callback"); });
        }
      }));
    }
    auto [x, y] = gpt_tiny::Batch(0, 0, 4);
    autograd::backward(model.loss(x, y));
    return log;
  };
  const std::vector<std::string> plain = order(false), ckpt = order(true);
  EXPECT_EQ(ckpt, plain);
  ASSERT_FALSE(ckpt.empty());
  EXPECT_EQ(ckpt.back(), "final callback");
  EXPECT_EQ(ckpt.size(), gpt_tiny::TinyConfig().num_layers * 12 + 5u);  // every parameter once, and the callback
}

// The ledger's activation peak of a training step (forward + backward) on a GPT: checkpointing every block keeps
// each block's input instead of all its intermediates, plus one block's activations while it is recomputed.
TEST(CheckpointTest, ActivationPeakOfAGptStepIsLowerWithCheckpointedBlocks) {
  GPTConfig config = *GPTConfig::named("gpt-100k");
  config.num_layers = 4;
  auto peak = [&](bool ckpt) {
    RankContext ctx;
    RankContextScope scope(ctx);
    GPT model(config, 1);
    if (ckpt) {
      EXPECT_TRUE(checkpoint_blocks(model).ok());
    }
    Generator gen(11);
    std::vector<std::int64_t> tokens(static_cast<std::size_t>(8 * config.context));
    for (auto& t : tokens) t = static_cast<std::int64_t>(gen.next_below(static_cast<std::uint64_t>(config.vocab_size)));
    const Tensor x = Tensor::from_int64(tokens, {8, config.context});
    ctx.memory->reset_peaks();
    autograd::backward(model.loss(x, x));
    EXPECT_EQ(ctx.memory->current(MemoryCategory::activation), 0) << "activations left after backward";
    return ctx.memory->peak(MemoryCategory::activation);
  };
  const std::int64_t without = peak(false), with = peak(true);
  std::printf("gpt-100k (4 layers), batch 8 x 32: activation peak %lld bytes without checkpointing, %lld with (%.2f)\n",
              static_cast<long long>(without), static_cast<long long>(with),
              static_cast<double>(with) / static_cast<double>(without));
  EXPECT_LT(with, without);
}

TEST(CheckpointTest, AModuleWithoutAForwardIsRefusedWithAClearStatus) {
  GPT model(gpt_tiny::TinyConfig(), 1);
  const absl::Status s = checkpoint(*model.blocks);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("expected a module with a forward of its own, found a ModuleList"));
  EXPECT_FALSE(is_checkpointed(*model.blocks));
}

TEST(CheckpointTest, AModuleWithAnotherCallWrapperIsRefused) {
  Generator gen(1);
  Linear lin(4, 4, gen);
  lin.set_call_wrapper([](const TensorList& in, const Module::HookedCall& hooked) { return hooked(in); });
  const absl::Status s = checkpoint(lin);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("found one installed by another API"));
  // Checkpointing twice only replaces the options.
  Linear other(4, 4, gen);
  EXPECT_TRUE(checkpoint(other).ok());
  EXPECT_TRUE(checkpoint(other, {.preserve_rng_state = false}).ok());
  EXPECT_TRUE(is_checkpointed(other));
}

// A module whose recompute returns something else than its forward did: backward fails with a message naming it.
class ShrinksWhenCalledAgain : public Module {
 public:
  ShrinksWhenCalledAgain() : Module("ShrinksWhenCalledAgain") {}

 protected:
  Tensor forward(const Tensor& x) override {
    ++calls_;
    return calls_ == 1 ? autograd::scale(x, 2.f) : autograd::narrow(x, 0, 0, 1);
  }

 private:
  int calls_ = 0;
};

TEST(CheckpointTest, ARecomputeThatReturnsOtherShapesIsAClearError) {
  ShrinksWhenCalledAgain m;
  ASSERT_TRUE(checkpoint(m).ok());
  const Tensor x = RandomLeaf({3, 2}, 1);
  const absl::Status s = autograd::try_backward(autograd::sum(m(x)));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("recompute of a checkpointed ShrinksWhenCalledAgain"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("its forward returned shape [3, 2]"));
}

// A module that returns its input: the output is a new handle (the input's own history is untouched).
class Identity : public Module {
 public:
  Identity() : Module("Identity") {}

 protected:
  Tensor forward(const Tensor& x) override { return x; }
};

TEST(CheckpointTest, AnOutputThatIsTheInputKeepsTheInputsHistory) {
  Identity id;
  ASSERT_TRUE(checkpoint(id).ok());
  const Tensor x = RandomLeaf({4}, 2);
  Tensor y = id(x);
  EXPECT_FALSE(y.is_same(x));
  EXPECT_TRUE(autograd::is_leaf(x));
  autograd::backward(autograd::sum(autograd::mul(y, y)));
  const std::vector<float> xv = x.to_vector(), g = x.grad().to_vector();
  for (std::size_t i = 0; i < xv.size(); ++i) EXPECT_EQ(g[i], 2 * xv[i]);
}

// Buffers the forward updates (BatchNorm's running statistics) are updated once, as without checkpointing.
TEST(CheckpointTest, BatchNormRunningStatisticsAreUpdatedOnce) {
  auto run = [](bool ckpt) {
    Generator gen(4);
    Sequential net;
    net.push_back(std::make_shared<Linear>(3, 5, gen));
    net.push_back(std::make_shared<BatchNorm1d>(5));
    net.push_back(std::make_shared<ReLU>());
    if (ckpt) {
      EXPECT_TRUE(checkpoint(net).ok());
    }
    const Tensor x = RandomLeaf({6, 3}, 8);
    autograd::backward(autograd::sum(net(x)));
    std::vector<std::vector<float>> out;
    for (const auto& [name, b] : net.named_buffers()) out.push_back(b.to_vector());
    for (const Tensor& p : net.parameters()) out.push_back(p.grad().to_vector());
    out.push_back(x.grad().to_vector());
    return out;
  };
  EXPECT_EQ(run(true), run(false));
}

// backward twice through a retained graph recomputes twice and accumulates what the plain graph does.
TEST(CheckpointTest, RetainedGraphRecomputesInEachBackward) {
  auto grad_values = [](bool ckpt) {
    RankContext ctx;
    ctx.generator = Generator(5);
    RankContextScope scope(ctx);
    GPT model(TinyWithDropout(), 1);
    if (ckpt) {
      EXPECT_TRUE(checkpoint_blocks(model).ok());
    }
    auto [x, y] = gpt_tiny::Batch(1, 0, 4);
    Tensor loss = model.loss(x, y);
    autograd::backward(loss, Tensor(), {.retain_graph = true});
    autograd::backward(loss);
    std::vector<std::vector<float>> out;
    for (const Tensor& p : model.parameters()) out.push_back(p.grad().to_vector());
    return out;
  };
  EXPECT_EQ(grad_values(true), grad_values(false));
}

}  // namespace
}  // namespace shardkit::nn
