// GPT training: a ~100K-parameter GPT overfits a fixed batch with AdamW.
#include <cmath>
#include <cstdio>

#include "common/autograd/engine.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "common/tensor/rank_context.h"
#include "gtest/gtest.h"

namespace shardkit::nn {
namespace {

TEST(GptTrainingTest, HundredKGptOverfitsAFixedBatchWithAdamW) {
  const GPTConfig config = *GPTConfig::named("gpt-100k");
  GPT gpt(config, 1);
  ASSERT_EQ(gpt.num_parameters(), 92592);
  const std::int64_t b = 4, t = 32;
  Generator data(2024);
  std::vector<std::int64_t> tokens(static_cast<std::size_t>(b * (t + 1)));
  for (auto& tok : tokens) tok = static_cast<std::int64_t>(data.next_below(static_cast<std::uint64_t>(config.vocab_size)));
  std::vector<std::int64_t> in, target;
  for (std::int64_t r = 0; r < b; ++r) {
    for (std::int64_t i = 0; i < t; ++i) {
      in.push_back(tokens[static_cast<std::size_t>(r * (t + 1) + i)]);
      target.push_back(tokens[static_cast<std::size_t>(r * (t + 1) + i + 1)]);
    }
  }
  Tensor idx = Tensor::from_int64(in, {b, t});
  Tensor targets = Tensor::from_int64(target, {b, t});
  optim::HyperParams hp;
  hp.lr = 1e-2;
  hp.weight_decay = 0.0;
  optim::AdamW opt(gpt.parameters(), hp);
  double first = 0, last = 0;
  int steps = 0;
  for (; steps < 300; ++steps) {
    opt.zero_grad();
    Tensor loss = gpt.loss(idx, targets);
    last = loss.item();
    if (steps == 0) first = last;
    if (last < 0.1 * first) break;
    autograd::backward(loss);
    ASSERT_TRUE(opt.step().ok());
  }
  EXPECT_NEAR(first, std::log(static_cast<double>(config.vocab_size)), 0.3);
  EXPECT_LT(last, 0.1 * first) << "after " << steps << " steps";
  std::printf("gpt-100k overfit: loss %.4f -> %.4f in %d steps\n", first, last, steps);
}

TEST(GptTrainingTest, Bf16ParametersTrainWithMasterWeightsAndHalveParameterAndGradientBytes) {
  RankContext ctx;
  RankContextScope scope(ctx);
  const GPTConfig config = *GPTConfig::named("gpt-10k");
  GPT gpt(config, 3);
  gpt.to(DType::bf16);
  const std::int64_t n = config.num_parameters();
  EXPECT_EQ(ctx.memory->current(MemoryCategory::parameter), 2 * n);
  EXPECT_TRUE(gpt.lm_head->weight().is_same(gpt.wte->weight()));  // still tied
  for (const auto& [name, p] : gpt.named_parameters()) {
    EXPECT_EQ(p.dtype(), DType::bf16) << name;
    EXPECT_TRUE(p.requires_grad()) << name;
  }
  Tensor idx = Tensor::from_int64({1, 2, 3, 4, 5, 6, 7, 8}, {1, 8});
  Tensor targets = Tensor::from_int64({2, 3, 4, 5, 6, 7, 8, 9}, {1, 8});
  optim::HyperParams hp;
  hp.lr = 1e-2;
  optim::AdamW opt(gpt.parameters(), hp);
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    opt.zero_grad();
    Tensor loss = gpt.loss(idx, targets);
    last = loss.item();
    if (step == 0) first = last;
    autograd::backward(loss);
    if (step == 0) {
      EXPECT_EQ(gpt.wte->weight().grad().dtype(), DType::bf16);
      EXPECT_EQ(ctx.memory->current(MemoryCategory::gradient), 2 * n);
    }
    ASSERT_TRUE(opt.step().ok());
  }
  EXPECT_LT(last, 0.5 * first);
}

}  // namespace
}  // namespace shardkit::nn
