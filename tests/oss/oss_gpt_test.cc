// GPT-tiny trained 20 steps with OSS on N simulated ranks (each its slice of the batch, gradients averaged
// by one all_reduce per gradient, as DDP does) ends equal to single-rank training on the whole batch.
#include <cmath>

#include "common/autograd/engine.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "common/optim/sgd.h"
#include "gtest/gtest.h"
#include "oss/oss.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::oss {
namespace {

using gpt_tiny::Batch;
using gpt_tiny::kBatch;
using gpt_tiny::TinyConfig;
using gpt_tiny::Values;

constexpr int kSteps = 20;

std::vector<std::vector<float>> Reference(const optim::OptimizerFactory& factory) {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT model(TinyConfig(), 1);
  auto opt = factory({{model.parameters(), optim::AdamW::default_hyper()}});
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = Batch(step, 0, kBatch);
    (*opt)->zero_grad();
    autograd::backward(model.loss(x, y));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return Values(model);
}

class OssGpt : public ::testing::TestWithParam<std::tuple<int, PartitionPolicy>> {};

// Flat: chunks of at most this many elements, so GPT-tiny's group is cut into several (Note [flat chunks]).
constexpr std::int64_t kChunk = 700;

void RunAndCompare(int world, PartitionPolicy policy, const optim::OptimizerFactory& factory, double tol) {
  const auto want = Reference(factory);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    auto oss = Oss::create({{model.parameters(), optim::AdamW::default_hyper()}}, factory, env.group_ptr,
                           {.policy = policy, .bucket_bytes = 4096, .flat_chunk_numel = kChunk});
    if (!oss.ok()) return oss.status();
    const int rows = kBatch / world;
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = Batch(step, env.rank * rows, rows);
      (*oss)->zero_grad();
      autograd::backward(model.loss(x, y));
      for (const Tensor& p : model.parameters()) {  // the DDP part: average every gradient
        if (!p.grad().defined()) continue;
        if (absl::Status s = env.group.all_reduce(p.grad(), {.op = comm::ReduceOp::avg()})->wait(); !s.ok()) return s;
      }
      if (absl::Status s = (*oss)->step(); !s.ok()) return s;
    }
    got[static_cast<std::size_t>(env.rank)] = Values(model);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  for (int r = 0; r < world; ++r) {
    const auto& g = got[static_cast<std::size_t>(r)];
    ASSERT_EQ(g.size(), want.size());
    for (std::size_t i = 0; i < g.size(); ++i) {
      for (std::size_t k = 0; k < g[i].size(); ++k) {
        ASSERT_NEAR(g[i][k], want[i][k], tol + tol * std::abs(want[i][k])) << "rank " << r << " param " << i << "[" << k << "]";
      }
    }
    EXPECT_EQ(g, got[0]) << "rank " << r << " differs from rank 0";
  }
}

// Tolerance: per-rank losses are means over fewer rows and gradients are averaged in another order, so
// gradients differ in the last bits; AdamW's update is ~lr per step whatever the gradient's size, so 20
// steps of lr 1e-3 move parameters by at most 2e-2 and rounding differences stay below ~1e-5.
TEST_P(OssGpt, AdamWEqualsSingleRankOnTheWholeBatch) {
  const auto [world, policy] = GetParam();
  RunAndCompare(world, policy, optim::AdamW::factory(), 2e-5);
}

TEST_P(OssGpt, SgdMomentumEqualsSingleRankOnTheWholeBatch) {
  const auto [world, policy] = GetParam();
  RunAndCompare(world, policy, optim::Sgd::factory({.lr = 0.1, .momentum = 0.9}), 2e-5);
}

INSTANTIATE_TEST_SUITE_P(Ranks, OssGpt,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 8),
                                            ::testing::Values(PartitionPolicy::greedy, PartitionPolicy::flat)),
                         [](const auto& info) {
                           return std::string(partition_policy_name(std::get<1>(info.param))) + "_n" +
                                  std::to_string(std::get<0>(info.param));
                         });

}  // namespace
}  // namespace shardkit::oss
