// FSDP prefetch (Note [prefetch] in fsdp/state.cc) and the reduce-scatter in flight (Note [reduce-scatter in
// flight]): equality with single-rank training with implicit, explicit and no prefetch; which collectives were
// issued ahead (CommOverlapStats, exactly); the ledger bound on the units unsharding ahead; errors.
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "common/comm/testing/run_ranks.h"
#include "common/optim/adam.h"
#include "fsdp/fully_shard.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp {
namespace {

using gpt_tiny::Batch;
using gpt_tiny::kBatch;
using gpt_tiny::TinyConfig;
using ::testing::HasSubstr;

enum class Prefetch { off, implicit, explicit_lists };

std::vector<FSDPModule> Units(nn::GPT& model, const char* type) {
  std::vector<FSDPModule> out;
  for (nn::Module* m : modules_of_type(model, type)) out.push_back(*state_of(*m));
  return out;
}

// Explicit lists: each block prefetches the next two blocks in forward and the previous one in backward; the root
// prefetches the first two blocks (forward) and the last block (backward).
absl::Status SetExplicitLists(nn::GPT& model) {
  std::vector<FSDPModule> blocks = Units(model, "TransformerBlock");
  const int n = static_cast<int>(blocks.size());
  for (int i = 0; i < n; ++i) {
    std::vector<FSDPModule> fwd, bwd;
    for (int j = i + 1; j < std::min(n, i + 3); ++j) fwd.push_back(blocks[static_cast<std::size_t>(j)]);
    if (i > 0) bwd.push_back(blocks[static_cast<std::size_t>(i - 1)]);
    if (absl::Status s = blocks[static_cast<std::size_t>(i)].set_modules_to_forward_prefetch(fwd); !s.ok()) return s;
    if (absl::Status s = blocks[static_cast<std::size_t>(i)].set_modules_to_backward_prefetch(bwd); !s.ok()) return s;
  }
  FSDPModule root = *state_of(model);
  if (absl::Status s = root.set_modules_to_forward_prefetch({blocks[0], blocks[1]}); !s.ok()) return s;
  return root.set_modules_to_backward_prefetch({blocks.back()});
}

class FsdpPrefetchGpt : public ::testing::TestWithParam<std::tuple<int, Prefetch, bool>> {};

// 20 steps: every rank equal to single-rank training on the whole batch, whatever is prefetched (the explicit
// lists run with two units ahead).
TEST_P(FsdpPrefetchGpt, EqualsSingleRankOnTheWholeBatch) {
  const auto [world, prefetch, nested] = GetParam();
  static const auto want = gpt_tiny::Reference(20);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    FullyShardOptions options{.implicit_prefetch = prefetch == Prefetch::implicit, .max_prefetched_units = 2};
    if (absl::Status s = test_util::ShardGpt(model, env, options, nested); !s.ok()) return s;
    if (prefetch == Prefetch::explicit_lists) {
      if (absl::Status s = SetExplicitLists(model); !s.ok()) return s;
    }
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, world, 0, 20); !s.ok()) return s;
    return test_util::StoreFullValues(model, got, env.rank);
  });
  ASSERT_TRUE(st.ok()) << st;
  gpt_tiny::ExpectMatches(got, want, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(Ranks, FsdpPrefetchGpt,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 8),
                                            ::testing::Values(Prefetch::off, Prefetch::explicit_lists),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           const Prefetch p = std::get<1>(info.param);
                           return std::string(p == Prefetch::off ? "off" : p == Prefetch::implicit ? "implicit" : "explicit") +
                                  (std::get<2>(info.param) ? "_nested" : "") + "_n" + std::to_string(std::get<0>(info.param));
                         });
// (Implicit prefetch is the default: fsdp_test's FsdpGpt covers it at N = 1, 2, 3, 4, 8.)

// Which collectives were issued ahead, exactly, in the second step (the first records the order). GPT-tiny with a
// unit per block: the root keeps its parameters from forward to backward (FSDP2's root default), so a step is the
// root's all-gather, every block's all-gather in forward and again in backward, and every unit's reduce-scatter.
// Prefetched: every block's gathers (forward: the root prefetches block 0, block i block i + 1; backward: the root
// prefetches the last block, block i block i - 1). Reduce-scatters finished by a later hook: every block's; the
// root's is issued and finished by the final callback. Without prefetch only the blocks' reduce-scatters overlap.
TEST(FsdpPrefetch, OverlapStatsCountWhatWasIssuedAhead) {
  for (const bool implicit : {true, false}) {
    absl::Status st = comm::RunRanks(4, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(TinyConfig(), 1);
      if (absl::Status s = test_util::ShardGpt(model, env, {.implicit_prefetch = implicit}); !s.ok()) return s;
      std::int64_t block_bytes = 0;  // N × S × 4 summed over the blocks
      for (nn::Module* m : modules_of_type(model, "TransformerBlock")) {
        block_bytes += state_of(*m)->state().param_group()->unsharded_bytes();
      }
      FSDPModule root = *state_of(model);
      const std::int64_t root_bytes = root.state().param_group()->unsharded_bytes();
      auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
      if (!opt.ok()) return opt.status();
      if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, 4, 0, 1); !s.ok()) return s;
      root.reset_overlap_stats();
      if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, 4, 1, 2); !s.ok()) return s;
      const CommOverlapStats stats = root.overlap_stats();
      EXPECT_EQ(stats.bytes, 3 * block_bytes + 2 * root_bytes) << "implicit " << implicit;
      EXPECT_EQ(stats.overlapped_bytes, (implicit ? 3 : 1) * block_bytes) << "implicit " << implicit;
      return absl::OkStatus();
    });
    EXPECT_TRUE(st.ok()) << st;
  }
}

// The bound (Note [prefetch]): at most max_prefetched_units units gather ahead. Explicit lists ask for two blocks
// ahead; with a bound of one the forward's communication buffers hold the running block's gather and one more,
// with two the running block's and two more. The parameter peak stays within the shards, the root and one block unsharded (a prefetched unit's
// parameters are copied out of its gather buffer only when it runs).
TEST(FsdpPrefetch, TheLedgerShowsTheBoundOnUnitsAhead) {
  for (const int bound : {1, 2}) {
    absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
      MemoryTracker& mem = *env.context.memory;
      nn::GPT model(TinyConfig(), 1);
      const std::int64_t root_numel = model.num_parameters() - 3 * (*model.blocks)[0]->num_parameters();
      if (absl::Status s = test_util::ShardGpt(model, env, {.max_prefetched_units = bound}); !s.ok()) return s;
      if (absl::Status s = SetExplicitLists(model); !s.ok()) return s;
      const std::int64_t shards = mem.current(MemoryCategory::parameter);
      const std::int64_t block_bytes = state_of(*(*model.blocks)[0])->state().param_group()->unsharded_bytes();
      EXPECT_LT(state_of(model)->state().param_group()->unsharded_bytes(), block_bytes) << "the largest unit is a block";
      auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
      if (!opt.ok()) return opt.status();
      for (int step = 0; step < 3; ++step) {
        auto [x, y] = Batch(step, env.rank * (kBatch / 2), kBatch / 2);
        (*opt)->zero_grad();
        mem.reset_peaks();
        Tensor loss = model.loss(x, y);
        const std::int64_t comm_peak = mem.peak(MemoryCategory::communication_buffer);
        EXPECT_LE(mem.peak(MemoryCategory::parameter), shards + (root_numel * 4 + block_bytes)) << "step " << step;
        if (absl::Status s = autograd::try_backward(loss); !s.ok()) return s;
        if (absl::Status s = (*opt)->step(); !s.ok()) return s;
        if (step == 0) continue;  // the first forward records the order and prefetches nothing
        // A unit's own gather buffer is alive while it issues its prefetches: the running unit plus `bound` ahead.
        EXPECT_LE(comm_peak, (1 + bound) * block_bytes) << "step " << step;
        EXPECT_GT(comm_peak, bound * block_bytes) << "step " << step;
      }
      return absl::OkStatus();
    });
    EXPECT_TRUE(st.ok()) << st;
  }
}

TEST(FsdpPrefetch, AUnitInItsOwnListIsRefused) {
  absl::Status st = comm::RunRanks(1, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    FSDPModule block = *state_of(*(*model.blocks)[1]);
    absl::Status s = block.set_modules_to_backward_prefetch({Units(model, "TransformerBlock")[0], block});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("set_modules_to_backward_prefetch on a TransformerBlock lists the unit itself"));
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace shardkit::fsdp
