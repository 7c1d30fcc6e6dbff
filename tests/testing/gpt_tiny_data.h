// GPT-tiny ("gpt-10k") training data and the single-rank reference shared by the equivalence tests of every
// sharding layer: N ranks, each on its rows of a step's batch, must end equal to one rank on the whole batch.
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "common/autograd/engine.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "common/optim/clip_grad.h"
#include "common/tensor/rank_context.h"
#include "common/tensor/random.h"
#include "common/tensor/tensor.h"
#include "gtest/gtest.h"

namespace shardkit::gpt_tiny {

inline constexpr int kBatch = 24;  // divisible by 1, 2, 3, 4 and 8

inline nn::GPTConfig TinyConfig() { return *nn::GPTConfig::named("gpt-10k"); }

// Batch `step`: tokens and next-token targets, rows [row0, row0 + rows) of the step's kBatch rows.
inline std::pair<Tensor, Tensor> Batch(int step, int row0, int rows) {
  const nn::GPTConfig c = TinyConfig();
  Generator gen(99, static_cast<std::uint64_t>(step));
  std::vector<std::int64_t> all(static_cast<std::size_t>(kBatch * (c.context + 1)));
  for (auto& t : all) t = static_cast<std::int64_t>(gen.next_below(static_cast<std::uint64_t>(c.vocab_size)));
  std::vector<std::int64_t> x, y;
  for (int r = row0; r < row0 + rows; ++r) {
    for (std::int64_t t = 0; t < c.context; ++t) {
      x.push_back(all[static_cast<std::size_t>(r * (c.context + 1) + t)]);
      y.push_back(all[static_cast<std::size_t>(r * (c.context + 1) + t + 1)]);
    }
  }
  return {Tensor::from_int64(x, {rows, c.context}), Tensor::from_int64(y, {rows, c.context})};
}

// Every parameter's values, in parameters() order.
// Every parameter's values, copied to the host when on a device.
inline std::vector<std::vector<float>> Values(const nn::Module& m) {
  std::vector<std::vector<float>> out;
  for (const Tensor& p : m.parameters()) {
    out.push_back(p.device().is_cpu() ? p.to_vector() : p.to(Device::cpu()).to_vector());
  }
  return out;
}

// Freezes block 0 of a GPT (what the "freeze mid-run" tests do on every rank and in the reference).
inline void FreezeBlock0(nn::GPT& model) { (*model.blocks)[0]->set_requires_grad(false); }

// Single-rank AdamW training on the whole batch; `freeze_at` >= 0 freezes block 0 before that step;
// `clip_max_norm` > 0 clips the gradients' total 2-norm to it before each step.
inline std::vector<std::vector<float>> Reference(int steps, int freeze_at = -1,
                                                 const optim::OptimizerFactory& factory = optim::AdamW::factory(),
                                                 double clip_max_norm = 0) {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT model(TinyConfig(), 1);
  auto opt = factory({{model.parameters(), optim::AdamW::default_hyper()}});
  for (int step = 0; step < steps; ++step) {
    if (step == freeze_at) FreezeBlock0(model);
    auto [x, y] = Batch(step, 0, kBatch);
    (*opt)->zero_grad();
    autograd::backward(model.loss(x, y));
    if (clip_max_norm > 0) optim::clip_grad_norm(model.parameters(), clip_max_norm);
    EXPECT_TRUE((*opt)->step().ok());
  }
  return Values(model);
}

// Every rank's parameters equal the reference within tol, and equal rank 0's exactly.
inline void ExpectMatches(const std::vector<std::vector<std::vector<float>>>& got,
                          const std::vector<std::vector<float>>& want, double tol) {
  for (std::size_t r = 0; r < got.size(); ++r) {
    const auto& g = got[r];
    ASSERT_EQ(g.size(), want.size()) << "rank " << r;
    for (std::size_t i = 0; i < g.size(); ++i) {
      ASSERT_EQ(g[i].size(), want[i].size());
      for (std::size_t k = 0; k < g[i].size(); ++k) {
        ASSERT_NEAR(g[i][k], want[i][k], tol + tol * std::abs(want[i][k]))
            << "rank " << r << " param " << i << "[" << k << "]";
      }
    }
    EXPECT_EQ(g, got[0]) << "rank " << r << " differs from rank 0";
  }
}

// Each rank's compiled run equals its eager run bit for bit: every loss and every parameter.
inline void ExpectBitwiseEqualRuns(const std::vector<std::vector<float>>& compiled_losses,
                                   const std::vector<std::vector<float>>& eager_losses,
                                   const std::vector<std::vector<std::vector<float>>>& compiled_values,
                                   const std::vector<std::vector<std::vector<float>>>& eager_values) {
  for (std::size_t r = 0; r < compiled_values.size(); ++r) {
    EXPECT_EQ(compiled_losses[r], eager_losses[r]) << "rank " << r;
    ASSERT_EQ(compiled_values[r].size(), eager_values[r].size());
    for (std::size_t p = 0; p < compiled_values[r].size(); ++p) {
      EXPECT_TRUE(compiled_values[r][p] == eager_values[r][p]) << "rank " << r << " parameter " << p;
    }
  }
}

}  // namespace shardkit::gpt_tiny
