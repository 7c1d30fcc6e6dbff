// Deferred initialisation under fully_shard (issue 12 item 8): a model built without parameter bytes and sharded
// inside the same DeferredInitScope holds exactly the values eager init gives (bitwise), and no rank ever holds
// the whole model: the ledger's parameter peak during construction and sharding is at most the shards plus the
// largest parameter.
#include <algorithm>
#include <memory>
#include <vector>

#include "common/nn/deferred_init.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/fsdp/fsdp_test_util.h"

namespace shardkit::fsdp {
namespace {

using gpt_tiny::TinyConfig;

TEST(FsdpDeferredInit, EqualsEagerInitBitwiseAndNeverHoldsTheModel) {
  std::vector<std::vector<float>> eager;
  std::int64_t psi = 0;
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    nn::GPT model(TinyConfig(), 1);
    eager = gpt_tiny::Values(model);
    psi = model.num_parameters();
  }
  for (const int world : {1, 2, 3, 4}) {
    SCOPED_TRACE(::testing::Message() << "n=" << world);
    absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
      MemoryTracker& mem = *env.context.memory;
      nn::DeferredInit deferred;
      std::unique_ptr<nn::GPT> model;
      std::int64_t padded = 0, largest = 0;
      {
        nn::DeferredInitScope scope(deferred);
        mem.reset_peaks();
        model = std::make_unique<nn::GPT>(TinyConfig(), 1);
        EXPECT_EQ(mem.current(MemoryCategory::parameter), 0) << "built without parameter bytes";
        for (const Tensor& p : model->parameters()) {
          const RowSplit rs = split_rows(p.shape(), env.rank, world);
          padded += rs.rows_per_rank * rs.row_numel;
          largest = std::max(largest, p.numel());
        }
        if (absl::Status s = test_util::ShardGpt(*model, env, {}, /*nested=*/true); !s.ok()) return s;
        EXPECT_EQ(deferred.pending(), 0u) << "every parameter materialised";
      }
      const std::int64_t peak = mem.peak(MemoryCategory::parameter);
      EXPECT_LE(peak, (padded + largest) * 4) << "construction peak: shards plus one parameter";
      if (world > 1) {
        EXPECT_LT(peak, psi * 4) << "never the whole model";
      }
      EXPECT_EQ(mem.current(MemoryCategory::parameter), padded * 4) << "at rest: the shards";
      auto values = test_util::FullValues(*model);
      if (!values.ok()) return values.status();
      EXPECT_EQ(*values, eager) << "rank " << env.rank << ": deferred init must equal eager init bitwise";
      return absl::OkStatus();
    });
    EXPECT_TRUE(st.ok()) << st;
  }
}

}  // namespace
}  // namespace shardkit::fsdp
