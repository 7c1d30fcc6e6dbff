// fsdp MixedPrecisionPolicy (Note [mixed precision on f32 ops] in fsdp/mixed_precision.h): bf16 FSDP equal to
// single-rank training with the same casts, all-gather and reduce-scatter bytes halved, the f32 master intact.
#include <memory>
#include <vector>

#include "common/comm/testing/run_ranks.h"
#include "common/optim/adam.h"
#include "fsdp/fully_shard.h"
#include "fsdp/mixed_precision.h"
#include "gtest/gtest.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp {
namespace {

using gpt_tiny::Batch;
using gpt_tiny::kBatch;
using gpt_tiny::TinyConfig;

const MixedPrecisionPolicy kBf16{.param_dtype = DType::bf16, .reduce_dtype = DType::bf16};

float RoundBf16(float x) {
  Tensor t = Tensor::from_vector({x}, {1});
  return t.to(DType::bf16).to(DType::f32).to_vector()[0];
}

std::vector<std::vector<std::vector<float>>> TrainBf16(int world, int steps) {
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env, {.mp_policy = kBf16}); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, world, 0, steps); !s.ok()) return s;
    return test_util::StoreFullValues(model, got, env.rank);
  });
  EXPECT_TRUE(st.ok()) << st;
  return got;
}

// The same casts at the same points give the same parameters, bitwise, at every world size.
TEST(FsdpMixedPrecision, Bf16EqualsSingleRankTrainingWithTheSameCasts) {
  for (const int world : {1, 2, 3, 4, 8}) {
    SCOPED_TRACE(::testing::Message() << "n=" << world);
    gpt_tiny::ExpectMatches(TrainBf16(world, 20), test_util::Bf16Reference(20, [world](int) { return world; }), 0.0);
  }
}

// And the casts matter: bf16 training ends away from f32 training (so the test above could fail).
TEST(FsdpMixedPrecision, Bf16TrainingDiffersFromF32Training) {
  EXPECT_NE(TrainBf16(2, 5)[0], gpt_tiny::Reference(5));
}

// The master stays f32: after bf16 training, the summoned values (an exact f32 gather) are not all bf16 values, and
// a forward afterwards still computes with bf16 values (summon does not leave rounded values in the shards).
TEST(FsdpMixedPrecision, ShardsStayF32Masters) {
  const auto got = TrainBf16(2, 3);
  std::int64_t off_grid = 0;
  for (const auto& p : got[0]) {
    for (float v : p) off_grid += v != RoundBf16(v);
  }
  EXPECT_GT(off_grid, 0) << "every parameter is a bf16 value: the f32 master was overwritten";
}

// Bytes sent per step: bf16 params and reduce halve the all-gathers and reduce-scatters exactly.
TEST(FsdpMixedPrecision, AllGatherAndReduceScatterBytesAreHalved) {
  std::int64_t sent[2] = {0, 0};
  for (const bool bf16 : {false, true}) {
    absl::Status st = comm::RunRanks(4, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(TinyConfig(), 1);
      FullyShardOptions options;
      if (bf16) options.mp_policy = kBf16;
      if (absl::Status s = test_util::ShardGpt(model, env, options); !s.ok()) return s;
      auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
      if (!opt.ok()) return opt.status();
      const comm::CommCounters before = env.group.counters();
      if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, 4, 0, 2); !s.ok()) return s;
      if (env.rank == 0) sent[bf16] = env.group.counters().since(before).total_sent();
      return absl::OkStatus();
    });
    ASSERT_TRUE(st.ok()) << st;
  }
  EXPECT_GT(sent[0], 0);
  EXPECT_EQ(2 * sent[1], sent[0]);
}

}  // namespace
}  // namespace shardkit::fsdp
