// compile() on one rank, on a step whose model uses activation checkpointing (Note [capturing activation
// checkpointing] in common/nn/checkpoint.cc): the replay equals the eager checkpointed step bit for bit (and so the
// eager step without checkpointing, which checkpointing must not change), with dropout too; the graph recomputes
// each checkpointed call inside the backward; and the replay keeps what eager checkpointing keeps, not every
// activation.
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/autograd/engine.h"
#include "common/capture/compile.h"
#include "common/nn/checkpoint.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "common/tensor/rank_context.h"
#include "gtest/gtest.h"
#include "tests/testing/checkpoint_gpt.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::capture {
namespace {

using checkpoint_gpt::Ckpt;

// A GPT, checkpointed as the combination tests do (the final LayerNorm, and the blocks or the attention and MLP
// inside each block) or not, and its optimizer.
struct Trainer {
  explicit Trainer(std::optional<Ckpt> what, nn::GPTConfig config = gpt_tiny::TinyConfig()) : model(config, 1) {
    if (what) {
      EXPECT_TRUE(checkpoint_gpt::Checkpoint(model, *what).ok());
    }
  }
  Tensor step(const std::vector<Tensor>& batch) {
    Tensor loss = model.loss(batch[0], batch[1]);
    autograd::backward(loss);
    EXPECT_TRUE(opt.step().ok());
    opt.zero_grad();
    return loss;
  }
  StepFn step_fn() {
    return [this](const std::vector<Tensor>& batch) { return step(batch); };
  }

  nn::GPT model;
  optim::AdamW opt{model.parameters()};
};

std::vector<Tensor> Batch(int step) {
  auto [x, y] = gpt_tiny::Batch(step, 0, gpt_tiny::kBatch);
  return {x, y};
}

std::string Name(Ckpt what) { return what == Ckpt::blocks ? "blocks" : "inside_blocks"; }

int Count(const StepGraph& g, const std::string& op, std::optional<bool> grad_enabled = std::nullopt) {
  int n = 0;
  for (const Node& node : g.nodes()) {
    n += node.kind == NodeKind::op && node.name == op && (!grad_enabled || node.grad_enabled == *grad_enabled);
  }
  return n;
}

class CompileCheckpoint : public ::testing::TestWithParam<std::tuple<Ckpt, float>> {};

// Ten steps: every loss and every parameter of the compiled checkpointed step equal the eager checkpointed step's
// bit for bit, and the eager step's without checkpointing. With dropout, the recompute draws the forward's masks in
// replay as in eager (checkpoint_rng_save / _swap / _restore).
TEST_P(CompileCheckpoint, ReplayEqualsTheEagerCheckpointedStepBitwise) {
  const auto [what, dropout] = GetParam();
  nn::GPTConfig config = gpt_tiny::TinyConfig();
  config.dropout = dropout;
  std::vector<float> plain_losses, eager_losses, compiled_losses;
  std::vector<std::vector<float>> plain_values, eager_values, compiled_values;
  // Each run on a rank context of its own: the same Generator stream for each.
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    Trainer plain(std::nullopt, config);
    for (int s = 0; s < 10; ++s) plain_losses.push_back(static_cast<float>(plain.step(Batch(s)).item()));
    plain_values = gpt_tiny::Values(plain.model);
  }
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    Trainer eager(what, config);
    for (int s = 0; s < 10; ++s) eager_losses.push_back(static_cast<float>(eager.step(Batch(s)).item()));
    eager_values = gpt_tiny::Values(eager.model);
  }
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    Trainer c(what, config);
    CompiledStep compiled = compile(c.step_fn(), c.model, c.opt);
    for (int s = 0; s < 10; ++s) {
      absl::StatusOr<Tensor> loss = compiled(Batch(s));
      ASSERT_TRUE(loss.ok()) << loss.status();
      compiled_losses.push_back(static_cast<float>(loss->item()));
    }
    EXPECT_EQ(compiled.captures(), 1);
    compiled_values = gpt_tiny::Values(c.model);
  }
  EXPECT_EQ(compiled_losses, eager_losses);
  EXPECT_TRUE(compiled_values == eager_values) << "the compiled checkpointed parameters differ from eager's";
  EXPECT_EQ(eager_losses, plain_losses);
  EXPECT_TRUE(eager_values == plain_values) << "checkpointing changed eager training";
}

INSTANTIATE_TEST_SUITE_P(Ckpt, CompileCheckpoint,
                         ::testing::Combine(::testing::Values(Ckpt::blocks, Ckpt::inside_blocks),
                                            ::testing::Values(0.f, 0.1f)),
                         [](const auto& info) {
                           return absl::StrCat(Name(std::get<0>(info.param)),
                                               std::get<1>(info.param) > 0 ? "_dropout" : "");
                         });

// The graph: each checkpointed call's forward ops with grad mode off, and inside the backward its recompute (the same
// ops with grad mode on) and the nested backward's nodes; the backward runs as many nodes as without checkpointing.
TEST(CompileCheckpointGraph, EachCheckpointedCallIsRecomputedInsideTheRecordedBackward) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Trainer plain(std::nullopt), ckpt(Ckpt::blocks);
  CompiledStep plain_step = compile(plain.step_fn(), plain.model, plain.opt);
  CompiledStep ckpt_step = compile(ckpt.step_fn(), ckpt.model, ckpt.opt);
  ASSERT_TRUE(plain_step(Batch(0)).ok());
  ASSERT_TRUE(ckpt_step(Batch(0)).ok());
  const StepGraph& p = *plain_step.graph();
  const StepGraph& g = *ckpt_step.graph();
  const int calls = gpt_tiny::TinyConfig().num_layers + 1;  // the blocks and the final LayerNorm
  EXPECT_EQ(Count(g, "checkpoint_outputs"), calls);
  EXPECT_EQ(Count(g, "checkpoint_inputs"), calls);
  EXPECT_EQ(Count(g, "checkpoint_rng_save"), calls);
  EXPECT_EQ(Count(g, "checkpoint_rng_swap"), calls);
  EXPECT_EQ(Count(g, "checkpoint_rng_restore"), calls);
  // Every linear but the head's is in a block: run once with grad mode off (forward) and once with it on (the
  // recompute); the head's runs once, with grad mode on.
  const int linears = Count(p, "linear");
  ASSERT_GT(linears, 1);
  EXPECT_EQ(Count(g, "linear", false), linears - 1);
  EXPECT_EQ(Count(g, "linear", true), linears);
  EXPECT_EQ(Count(g, "LinearBackward"), Count(p, "LinearBackward"));
  EXPECT_EQ(Count(g, "layer_norm", true), Count(p, "layer_norm"));
  EXPECT_EQ(Count(g, "accumulate_grad"), Count(p, "accumulate_grad"));
  EXPECT_EQ(Count(g, "AdamW.update"), Count(p, "AdamW.update"));
  // Every checkpointed forward is before the backward's root gradient ("ones"); every recompute after it.
  const std::vector<Node>& nodes = g.nodes();
  std::size_t ones = nodes.size();
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i].name == "ones") ones = i;
  }
  ASSERT_LT(ones, nodes.size());
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = nodes[i];
    if (n.name == "checkpoint_outputs" || n.name == "checkpoint_rng_save" || (n.name == "layer_norm" && !n.grad_enabled)) {
      EXPECT_LT(i, ones) << describe(n);
    }
    if (n.name == "checkpoint_inputs" || n.name == "checkpoint_rng_swap" || (n.name == "layer_norm" && n.grad_enabled)) {
      EXPECT_GT(i, ones) << describe(n);
    }
  }
}

// The ledger's activation peak of a replayed step (gpt-100k, 4 layers) is lower with checkpointed blocks than
// without, by about what eager checkpointing saves; the replay's total peak is at most the eager checkpointed
// step's; and the step arena (what the rank holds for the replay's values between steps) is smaller too.
TEST(CompileCheckpointMemory, TheReplayKeepsWhatEagerCheckpointingKeeps) {
  nn::GPTConfig config = *nn::GPTConfig::named("gpt-100k");
  config.num_layers = 4;
  Generator gen(11);
  std::vector<std::int64_t> tokens(static_cast<std::size_t>(8 * (config.context + 1)));
  for (auto& t : tokens) t = static_cast<std::int64_t>(gen.next_below(static_cast<std::uint64_t>(config.vocab_size)));
  std::vector<std::int64_t> xs, ys;
  for (int r = 0; r < 8; ++r) {
    for (std::int64_t t = 0; t < config.context; ++t) {
      xs.push_back(tokens[static_cast<std::size_t>(r * (config.context + 1) + t)]);
      ys.push_back(tokens[static_cast<std::size_t>(r * (config.context + 1) + t + 1)]);
    }
  }
  const std::vector<Tensor> batch = {Tensor::from_int64(xs, {8, config.context}),
                                     Tensor::from_int64(ys, {8, config.context})};
  struct Peaks {
    std::int64_t activation = 0, total = 0, arena = 0;
  };
  auto eager = [&](bool ckpt) {
    RankContext ctx;
    RankContextScope scope(ctx);
    Trainer t(ckpt ? std::optional<Ckpt>(Ckpt::blocks) : std::nullopt, config);
    t.step(batch);  // optimizer state exists from here on, as in the replayed steps
    ctx.memory->reset_peaks();
    t.step(batch);
    return Peaks{ctx.memory->peak(MemoryCategory::activation), ctx.memory->total_peak(), 0};
  };
  auto replay = [&](bool ckpt) {
    RankContext ctx;
    RankContextScope scope(ctx);
    Trainer t(ckpt ? std::optional<Ckpt>(Ckpt::blocks) : std::nullopt, config);
    t.step(batch);
    CompiledStep compiled = compile(t.step_fn(), t.model, t.opt);
    EXPECT_TRUE(compiled(batch).ok());  // the capture, and the replay that records the arena
    ctx.memory->reset_peaks();
    EXPECT_TRUE(compiled(batch).ok());
    return Peaks{ctx.memory->peak(MemoryCategory::activation), ctx.memory->total_peak(),
                 compiled.arena_stats().arena_bytes};
  };
  const Peaks eager_plain = eager(false), eager_ckpt = eager(true);
  const Peaks replay_plain = replay(false), replay_ckpt = replay(true);
  std::printf("gpt-100k (4 layers), batch 8 x %lld: activation peak eager %lld -> %lld with checkpointing, replay "
              "%lld -> %lld; arena %lld -> %lld bytes\n",
              static_cast<long long>(config.context), static_cast<long long>(eager_plain.activation),
              static_cast<long long>(eager_ckpt.activation), static_cast<long long>(replay_plain.activation),
              static_cast<long long>(replay_ckpt.activation), static_cast<long long>(replay_plain.arena),
              static_cast<long long>(replay_ckpt.arena));
  ASSERT_LT(eager_ckpt.activation, eager_plain.activation);
  EXPECT_LE(replay_ckpt.activation, eager_ckpt.activation);
  EXPECT_LE(replay_ckpt.total, eager_ckpt.total);
  // At least half of what eager checkpointing saves is saved by the replay too.
  EXPECT_LE(replay_ckpt.activation, replay_plain.activation - (eager_plain.activation - eager_ckpt.activation) / 2);
  EXPECT_LT(replay_ckpt.arena, replay_plain.arena);
}

}  // namespace
}  // namespace shardkit::capture
