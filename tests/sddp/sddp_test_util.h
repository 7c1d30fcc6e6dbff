// Shared helpers of the sddp tests: GPT-tiny batches, a single-rank reference, parameter comparison.
#pragma once

#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/autograd/engine.h"
#include "common/autograd/ops.h"
#include "common/nn/gpt.h"
#include "common/tensor/rank_context.h"
#include "common/optim/adam.h"
#include "tests/testing/gpt_tiny_data.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::sddp::test_util {

using gpt_tiny::Batch;
using gpt_tiny::kBatch;
using gpt_tiny::TinyConfig;
using gpt_tiny::Values;

// Freezes block 0 of a GPT (what the "freeze mid-run" tests do on every rank and in the reference).
inline void FreezeBlock0(nn::GPT& model) { (*model.blocks)[0]->set_requires_grad(false); }

// Single-rank AdamW training on the whole batch; `freeze_at` >= 0 freezes block 0 before that step.
inline std::vector<std::vector<float>> Reference(int steps, int freeze_at = -1,
                                                 const optim::OptimizerFactory& factory = optim::AdamW::factory()) {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT model(TinyConfig(), 1);
  auto opt = factory({{model.parameters(), optim::AdamW::default_hyper()}});
  for (int step = 0; step < steps; ++step) {
    if (step == freeze_at) FreezeBlock0(model);
    auto [x, y] = Batch(step, 0, kBatch);
    (*opt)->zero_grad();
    autograd::backward(model.loss(x, y));
    (*opt)->step();
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

}  // namespace shardkit::sddp::test_util
