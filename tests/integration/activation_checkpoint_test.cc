// Activation checkpointing (common/nn/checkpoint.h) under every strategy: GPT-tiny with dropout, its blocks (or
// the modules inside them) checkpointed, trained a few steps on N simulated ranks ends with parameters bitwise
// equal to the same strategy without checkpointing, on every rank: single rank; DDP; OSS + DDP; ShardedDDP
// (greedy, flat); FSDP (fully_shard) with the checkpoint wrapping block units, wrapping block units that hold
// nested MLP units, and inside block units (Note [checkpoint and the sharding layers] in checkpoint.h).
#include <memory>
#include <string>
#include <vector>

#include "common/autograd/engine.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/checkpoint.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "fsdp/fully_shard.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "oss/oss.h"
#include "sddp/data_parallel.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit {
namespace {

constexpr int kSteps = 4;

enum class Mode {
  single,          // one rank, AdamW on the whole batch
  ddp,             // DistributedDataParallel + AdamW
  oss_ddp,         // DistributedDataParallel + Oss (greedy)
  sddp_greedy,     // ShardedDataParallel + Oss (greedy)
  sddp_flat,       // ShardedDataParallel + Oss (flat, reduce-scatter)
  fsdp_wraps_units,         // fully_shard(blocks), fully_shard(root); then checkpoint the blocks
  fsdp_wraps_nested_units,  // checkpoint the blocks; then fully_shard(MLPs), fully_shard(blocks), fully_shard(root)
  fsdp_inside_units,        // fully_shard(blocks), fully_shard(root); checkpoint attention and MLP inside each block
};

std::string ModeName(Mode m) {
  switch (m) {
    case Mode::single: return "single";
    case Mode::ddp: return "ddp";
    case Mode::oss_ddp: return "oss_ddp";
    case Mode::sddp_greedy: return "sddp_greedy";
    case Mode::sddp_flat: return "sddp_flat";
    case Mode::fsdp_wraps_units: return "fsdp_wraps_units";
    case Mode::fsdp_wraps_nested_units: return "fsdp_wraps_nested_units";
    case Mode::fsdp_inside_units: return "fsdp_inside_units";
  }
  return "?";
}

bool IsFsdp(Mode m) {
  return m == Mode::fsdp_wraps_units || m == Mode::fsdp_wraps_nested_units || m == Mode::fsdp_inside_units;
}

nn::GPTConfig TinyWithDropout() {
  nn::GPTConfig c = gpt_tiny::TinyConfig();
  c.dropout = 0.1f;
  return c;
}

// The blocks, and the final LayerNorm: the first gradient of each backward (ln_f's) then becomes ready inside a
// recompute's nested backward, where the data-parallel wrappers queue their final callback.
absl::Status CheckpointBlocks(nn::GPT& model) {
  if (absl::Status s = nn::checkpoint_blocks(model); !s.ok()) return s;
  return nn::checkpoint(*model.ln_f);
}

// Attention and MLP inside each block, and the final LayerNorm.
absl::Status CheckpointInsideBlocks(nn::GPT& model) {
  if (absl::Status s = nn::checkpoint(*model.ln_f); !s.ok()) return s;
  for (nn::Module* m : fsdp::modules_of_type(model, "CausalSelfAttention")) {
    if (absl::Status s = nn::checkpoint(*m); !s.ok()) return s;
  }
  for (nn::Module* m : fsdp::modules_of_type(model, "MLP")) {
    if (absl::Status s = nn::checkpoint(*m); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// What one rank ends with.
struct RankResult {
  std::vector<std::vector<float>> params;  // full values, parameters() order of the unsharded model
  sddp::ReductionStats last_backward;      // data-parallel modes
  std::vector<std::int64_t> bucket_numels;
  comm::CommCounters comm;                 // the training steps' collectives
  std::int64_t activation_peak = 0;        // the ledger's, over the training steps
};

// Builds GPT-tiny (dropout 0.1) on this rank, wraps it for `mode` (checkpointing when `ckpt`, in the order the
// mode names), trains kSteps steps on the rank's rows of each batch and returns the full parameters.
absl::Status RunRank(Mode mode, bool ckpt, comm::RankEnv& env, RankResult& out) {
  nn::GPT model(TinyWithDropout(), 1);
  const std::vector<optim::ParamGroup> groups{{model.parameters(), optim::AdamW::default_hyper()}};
  std::unique_ptr<optim::Optimizer> plain;
  std::unique_ptr<oss::Oss> sharded;
  std::unique_ptr<sddp::DataParallel> dp;
  const sddp::DataParallelOptions dp_options{.reduce_buffer_size = 300};  // many buckets
  if (ckpt && !IsFsdp(mode)) {
    if (absl::Status s = CheckpointBlocks(model); !s.ok()) return s;
  }
  switch (mode) {
    case Mode::single:
    case Mode::ddp: {
      auto o = optim::AdamW::factory()(groups);
      if (!o.ok()) return o.status();
      plain = std::move(*o);
      if (mode == Mode::ddp) {
        auto d = sddp::DistributedDataParallel::create(model, env.group_ptr, dp_options);
        if (!d.ok()) return d.status();
        dp = std::move(*d);
      }
      break;
    }
    case Mode::oss_ddp:
    case Mode::sddp_greedy:
    case Mode::sddp_flat: {
      const bool flat = mode == Mode::sddp_flat;
      auto o = oss::Oss::create(groups, optim::AdamW::factory(), env.group_ptr,
                                {.policy = flat ? oss::PartitionPolicy::flat : oss::PartitionPolicy::greedy,
                                 .bucket_bytes = 4096,
                                 .flat_chunk_numel = dp_options.reduce_buffer_size});
      if (!o.ok()) return o.status();
      sharded = std::move(*o);
      if (mode == Mode::oss_ddp) {
        auto d = sddp::DistributedDataParallel::create(model, env.group_ptr, dp_options);
        if (!d.ok()) return d.status();
        dp = std::move(*d);
      } else {
        auto d = sddp::ShardedDataParallel::create(model, {sharded.get()}, env.group_ptr, dp_options);
        if (!d.ok()) return d.status();
        dp = std::move(*d);
      }
      break;
    }
    case Mode::fsdp_wraps_units:
    case Mode::fsdp_inside_units:
    case Mode::fsdp_wraps_nested_units: {
      const bool nested = mode == Mode::fsdp_wraps_nested_units;
      if (ckpt && nested) {
        if (absl::Status s = CheckpointBlocks(model); !s.ok()) return s;  // before fully_shard
      }
      if (absl::Status s = fsdp::test_util::ShardGpt(model, env, {}, nested); !s.ok()) return s;
      if (ckpt && mode == Mode::fsdp_wraps_units) {
        if (absl::Status s = CheckpointBlocks(model); !s.ok()) return s;  // after fully_shard
      }
      if (ckpt && mode == Mode::fsdp_inside_units) {
        if (absl::Status s = CheckpointInsideBlocks(model); !s.ok()) return s;
      }
      auto o = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});  // the shards
      if (!o.ok()) return o.status();
      plain = std::move(*o);
      break;
    }
  }
  const comm::CommCounters before = env.group.counters();
  env.context.memory->reset_peaks();
  const int rows = gpt_tiny::kBatch / env.world_size;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = gpt_tiny::Batch(step, env.rank * rows, rows);
    if (plain) plain->zero_grad();
    if (sharded) sharded->zero_grad();
    if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
    if (absl::Status s = plain ? plain->step() : sharded->step(); !s.ok()) return s;
  }
  out.comm = env.group.counters().since(before);
  out.activation_peak = env.context.memory->peak(MemoryCategory::activation);
  if (dp) {
    out.last_backward = dp->last_backward_stats();
    out.bucket_numels = dp->bucket_numels();
  }
  if (IsFsdp(mode)) {
    auto values = fsdp::test_util::FullValues(model);
    if (!values.ok()) return values.status();
    out.params = std::move(*values);
  } else {
    out.params = gpt_tiny::Values(model);
  }
  return absl::OkStatus();
}

std::vector<RankResult> Train(Mode mode, bool ckpt, int world) {
  std::vector<RankResult> results(static_cast<std::size_t>(world));
  const absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    return RunRank(mode, ckpt, env, results[static_cast<std::size_t>(env.rank)]);
  });
  EXPECT_TRUE(st.ok()) << ModeName(mode) << (ckpt ? " with" : " without") << " checkpointing: " << st;
  return results;
}

class CheckpointStrategies : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

TEST_P(CheckpointStrategies, ParametersAreBitwiseThoseOfTheSameStrategyWithoutCheckpointing) {
  const auto [world, mode] = GetParam();
  const std::vector<RankResult> plain = Train(mode, false, world), ckpt = Train(mode, true, world);
  ASSERT_EQ(plain.size(), ckpt.size());
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const RankResult &p = plain[static_cast<std::size_t>(r)], &c = ckpt[static_cast<std::size_t>(r)];
    ASSERT_FALSE(p.params.empty());
    EXPECT_EQ(c.params, p.params);
    // Checkpointing was on, and saved memory under this strategy too.
    EXPECT_LT(c.activation_peak, p.activation_peak);
    // Data parallel: the gradients became ready in the same order, during backward (the same buckets, launched
    // from the same hooks: the same bytes overlapped with the rest of backward).
    EXPECT_EQ(c.bucket_numels, p.bucket_numels);
    EXPECT_EQ(c.last_backward.buckets, p.last_backward.buckets);
    EXPECT_EQ(c.last_backward.hooks, p.last_backward.hooks);
    EXPECT_EQ(c.last_backward.overlapped_bytes, p.last_backward.overlapped_bytes);
    if (mode != Mode::single && !IsFsdp(mode)) {
      EXPECT_GT(c.last_backward.overlapped_bytes, 0);
    }
    // FSDP: each unit's gradients are reduce-scattered once per step either way, and checkpointing gathers nothing
    // more: inside a unit, the unit's pre-backward gather serves the recompute; a checkpointed unit is gathered by
    // the recompute and kept for its backward (Note [forward inside backward] in fsdp/state.cc).
    if (IsFsdp(mode)) {
      const comm::CollectiveKind ag = comm::CollectiveKind::all_gather, rs = comm::CollectiveKind::reduce_scatter;
      EXPECT_EQ(c.comm.of(rs).calls, p.comm.of(rs).calls);
      EXPECT_EQ(c.comm.of(ag).calls, p.comm.of(ag).calls);
    } else {
      EXPECT_EQ(c.comm.total_sent(), p.comm.total_sent());
    }
  }
}

// What FSDP2 does with a checkpointed unit: its forward run inside backward (the recompute) neither re-gathers it
// nor releases it afterwards (the unit's pre-backward gather serves both) and prefetches nothing in forward order,
// so checkpointing costs no all-gather (Note [forward inside backward] in fsdp/state.cc). Before that note, a
// checkpointed unit was gathered for the recompute, released after it, gathered again by its pre-backward hook, and
// the recompute's forward prefetch gathered the next unit in forward order for nothing: 44 all-gathers instead of
// 28 over 4 steps of GPT-tiny at N = 2.
TEST(CheckpointFsdp, ACheckpointedUnitIsGatheredOncePerPassAsWithout) {
  const std::vector<RankResult> plain = Train(Mode::fsdp_wraps_units, false, 2), ckpt = Train(Mode::fsdp_wraps_units, true, 2);
  for (int r = 0; r < 2; ++r) {
    const comm::CollectiveKind ag = comm::CollectiveKind::all_gather;
    EXPECT_EQ(ckpt[static_cast<std::size_t>(r)].comm.of(ag).calls, plain[static_cast<std::size_t>(r)].comm.of(ag).calls)
        << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, CheckpointStrategies,
                         ::testing::Values(std::make_tuple(1, Mode::single), std::make_tuple(2, Mode::ddp),
                                           std::make_tuple(3, Mode::ddp), std::make_tuple(2, Mode::oss_ddp),
                                           std::make_tuple(2, Mode::sddp_greedy), std::make_tuple(3, Mode::sddp_greedy),
                                           std::make_tuple(2, Mode::sddp_flat), std::make_tuple(3, Mode::sddp_flat),
                                           std::make_tuple(2, Mode::fsdp_wraps_units),
                                           std::make_tuple(3, Mode::fsdp_wraps_units),
                                           std::make_tuple(2, Mode::fsdp_wraps_nested_units),
                                           std::make_tuple(2, Mode::fsdp_inside_units),
                                           std::make_tuple(3, Mode::fsdp_inside_units)),
                         [](const auto& info) {
                           return ModeName(std::get<1>(info.param)) + "_n" + std::to_string(std::get<0>(info.param));
                         });

}  // namespace
}  // namespace shardkit
