// Seventh round of feature combinations of fully_shard: activation checkpointing (common/nn/checkpoint.h) against
// single-rank training and against the same sharded run without checkpointing (DESIGN.md section 8):
//   * GPT-tiny with its blocks checkpointed after fully_shard, before it, with the attention and MLP checkpointed
//     inside the block units, with nested MLP units inside checkpointed block units, and with the whole root
//     checkpointed; crossed with HSDP meshes, bf16 mixed precision, cpu offload, reshard_after_forward = false and
//     = k (k-groups), prefetch off and explicit lists, the replicas' all-reduce deferred and no gradient sync. Every
//     checkpointed run must give the bits of the same run without checkpointing (the recompute is the same
//     computation on the same bytes, and checkpointing gathers the same values), and f32 runs equal one rank.
//   * The same with dropout inside the checkpointed blocks: the recompute must draw the masks the forward drew, so
//     the bits are again those of the run without checkpointing, and f32 runs equal a single-process run in which
//     each simulated rank's rows are computed with that rank's random stream (comm::RunRanks gives rank r
//     rank_generator(0, r, per_rank)).
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/autograd/engine.h"
#include "common/autograd/ops/elementwise.h"
#include "common/comm/device_mesh.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/checkpoint.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "fsdp/fully_shard.h"
#include "gtest/gtest.h"
#include "tests/fsdp/fsdp_combo6_util.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp {
namespace {

using combo6::Accumulate;
using combo6::GptCase;
using combo6::Params;
using combo6::Prefetch;

constexpr int kSteps = 3;

// Where the checkpoints go (each also checkpoints ln_f, so the first gradient of each backward comes from inside a
// recompute, except `root`).
enum class Ckpt {
  none,
  blocks_after,   // fully_shard(blocks), fully_shard(root); then checkpoint every block (whole units)
  blocks_before,  // checkpoint every block; then fully_shard(blocks), fully_shard(root)
  inside,         // fully_shard(blocks), fully_shard(root); then checkpoint attention and MLP inside each block unit
  nested,         // checkpoint every block; then fully_shard(MLPs), fully_shard(blocks), fully_shard(root)
  root,           // fully_shard(blocks), fully_shard(root); then checkpoint the root module (the whole model)
};

const char* CkptName(Ckpt c) {
  switch (c) {
    case Ckpt::none: return "none";
    case Ckpt::blocks_after: return "blocks-after-fully_shard";
    case Ckpt::blocks_before: return "blocks-before-fully_shard";
    case Ckpt::inside: return "inside-units";
    case Ckpt::nested: return "blocks-with-nested-mlp-units";
    case Ckpt::root: return "root";
  }
  return "?";
}

constexpr Ckpt kAllCkpt[] = {Ckpt::blocks_after, Ckpt::blocks_before, Ckpt::inside, Ckpt::nested, Ckpt::root};

nn::GPTConfig Config(float dropout) {
  nn::GPTConfig c = gpt_tiny::TinyConfig();
  c.dropout = dropout;
  return c;
}

absl::Status CheckpointBlocksAndLnF(nn::GPT& model, const nn::CheckpointOptions& o) {
  if (absl::Status s = nn::checkpoint_blocks(model, o); !s.ok()) return s;
  return nn::checkpoint(*model.ln_f, o);
}

absl::Status CheckpointInside(nn::GPT& model, const nn::CheckpointOptions& o) {
  if (absl::Status s = nn::checkpoint(*model.ln_f, o); !s.ok()) return s;
  for (const char* type : {"CausalSelfAttention", "MLP"}) {
    for (nn::Module* m : modules_of_type(model, type)) {
      if (absl::Status s = nn::checkpoint(*m, o); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

// combo6::ShardGptCase with nested MLP units first when `nested`.
absl::Status Shard(nn::GPT& model, const std::shared_ptr<comm::ProcessGroup>& pg, const GptCase& c, bool nested) {
  if (!nested) return combo6::ShardGptCase(model, pg, c);
  std::optional<comm::DeviceMesh> mesh;
  if (c.replicas > 1) {
    auto m = comm::DeviceMesh::create(pg, {c.replicas, c.shards}, {"replicate", "shard"});
    if (!m.ok()) return m.status();
    mesh.emplace(std::move(*m));
  }
  const FullyShardOptions o = combo6::BlockOptions(c);
  for (nn::Module* m : modules_of_type(model, "MLP")) {
    if (auto s = mesh ? fully_shard(*m, *mesh, o) : fully_shard(*m, pg, o); !s.ok()) return s.status();
  }
  GptCase rest = c;  // the blocks and the root as combo6 shards them (explicit prefetch lists over the blocks)
  return combo6::ShardGptCase(model, pg, rest);
}

struct CkptRun {
  GptCase c;
  Ckpt ckpt = Ckpt::none;
  float dropout = 0.f;
  // The recompute's random stream (CheckpointOptions::preserve_rng_state) on rank `fresh_rng_rank` only; -1: all.
  int fresh_rng_rank = -1;
  bool nested_units = false;  // nested MLP units without checkpointing (what Ckpt::nested compares with)
};

std::string Describe(const CkptRun& r) {
  return absl::StrCat(combo6::Describe(r.c), " ckpt ", CkptName(r.ckpt), r.nested_units ? " nested-mlp-units" : "",
                      r.dropout > 0 ? " dropout" : "");
}

absl::StatusOr<Params> RunRank(const std::shared_ptr<comm::ProcessGroup>& pg, const CkptRun& run) {
  nn::GPT model(Config(run.dropout), 1);
  const nn::CheckpointOptions co{.preserve_rng_state = pg->rank() != run.fresh_rng_rank};
  const bool before = run.ckpt == Ckpt::blocks_before || run.ckpt == Ckpt::nested;
  if (before) {
    if (absl::Status s = CheckpointBlocksAndLnF(model, co); !s.ok()) return s;
  }
  if (absl::Status s = Shard(model, pg, run.c, run.nested_units || run.ckpt == Ckpt::nested); !s.ok()) return s;
  if (run.ckpt == Ckpt::blocks_after) {
    if (absl::Status s = CheckpointBlocksAndLnF(model, co); !s.ok()) return s;
  }
  if (run.ckpt == Ckpt::inside) {
    if (absl::Status s = CheckpointInside(model, co); !s.ok()) return s;
  }
  if (run.ckpt == Ckpt::root) {
    if (absl::Status s = nn::checkpoint(model, co); !s.ok()) return s;
  }
  auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
  if (!opt.ok()) return opt.status();
  if (absl::Status s = combo6::TrainSteps(model, **opt, pg->rank(), run.c, 0, kSteps); !s.ok()) return s;
  return test_util::FullValues(model);
}

std::vector<Params> InProcess(const CkptRun& run) {
  std::vector<Params> got(static_cast<std::size_t>(run.c.world()));
  absl::Status st = comm::RunRanks(run.c.world(), [&](comm::RankEnv& env) -> absl::Status {
    auto v = RunRank(env.group_ptr, run);
    if (!v.ok()) return v.status();
    got[static_cast<std::size_t>(env.rank)] = std::move(*v);
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << Describe(run) << ": " << st;
  return got;
}

// One process, AdamW on the whole batch, dropout `dropout`: each step, every simulated world rank's rows (split in
// two halves scaled by 1/2 when the case accumulates) are run forward and backward with that rank's random stream
// (as comm::RunRanks seeds it, carried from step to step), each loss scaled by 1/world; gradients accumulate.
Params DropoutReference(const GptCase& c, float dropout, int steps) {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT model(Config(dropout), 1);
  auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
  const int world = c.world(), rows = gpt_tiny::kBatch / world, parts = c.accumulate == Accumulate::none ? 1 : 2;
  std::vector<Generator> gens;
  for (int r = 0; r < world; ++r) gens.push_back(rank_generator(0, r, RankStreams::per_rank));
  for (int step = 0; step < steps; ++step) {
    (*opt)->zero_grad();
    for (int r = 0; r < world; ++r) {
      for (int part = 0; part < parts; ++part) {
        ctx.generator = gens[static_cast<std::size_t>(r)];
        auto [x, y] = gpt_tiny::Batch(step, r * rows + part * rows / parts, rows / parts);
        autograd::backward(autograd::scale(model.loss(x, y), 1.0f / static_cast<float>(parts * world)));
        gens[static_cast<std::size_t>(r)] = ctx.generator;
      }
    }
    EXPECT_TRUE((*opt)->step().ok());
  }
  return gpt_tiny::Values(model);
}

// The combinations: 1-D groups and HSDP meshes, with bf16, offload, k-groups, kept blocks, prefetch choices and
// both accumulation modes.
const GptCase kCases[] = {
    {.shards = 2, .bf16 = true},
    {.shards = 3, .offload = true, .prefetch = Prefetch::off, .block_reshard = false},
    {.shards = 2, .bf16 = true, .offload = true, .prefetch = Prefetch::explicit_two},
    {.shards = 4, .bf16 = true, .offload = true, .block_reshard = 2},
    {.shards = 2, .offload = true, .accumulate = Accumulate::no_sync, .prefetch = Prefetch::explicit_two},
    {.replicas = 2, .shards = 2, .bf16 = true, .offload = true, .accumulate = Accumulate::defer_all_reduce},
    {.replicas = 2, .shards = 3, .offload = true, .accumulate = Accumulate::no_sync, .prefetch = Prefetch::off},
    {.replicas = 2, .shards = 4, .offload = true, .block_reshard = 2},
    {.replicas = 2, .shards = 2, .bf16 = true, .block_reshard = false},
};

// Without dropout: every checkpoint placement trains to the bits of the same case without checkpointing, on every
// rank, and f32 cases equal single-rank training on the whole batch.
TEST(FsdpActivationCheckpointCombo7, EveryPlacementTrainsToTheBitsWithoutCheckpointingAndAsOneRank) {
  static const Params want = gpt_tiny::Reference(kSteps);
  for (const GptCase& c : kCases) {
    const CkptRun plain_run{.c = c};
    SCOPED_TRACE(Describe(plain_run));
    const std::vector<Params> plain = InProcess(plain_run);
    ASSERT_FALSE(plain[0].empty());
    if (!c.bf16) gpt_tiny::ExpectMatches(plain, want, 2e-5);
    // Nested MLP units cast their inputs to bf16 once more: compared with nested units without checkpointing.
    const std::vector<Params> plain_nested = c.bf16 ? InProcess({.c = c, .nested_units = true}) : plain;
    for (const Ckpt ckpt : kAllCkpt) {
      const CkptRun run{.c = c, .ckpt = ckpt};
      SCOPED_TRACE(Describe(run));
      gpt_tiny::ExpectMatches(InProcess(run), (ckpt == Ckpt::nested ? plain_nested : plain)[0], 0.0);
    }
  }
}

// Dropout 0.1 inside the checkpointed blocks: the recompute draws the forward's masks (preserve_rng_state), so every
// placement gives the bits of the same case without checkpointing; f32 cases equal the single-process run with
// each rank's stream (the masks each rank draws are the ones one process draws for those rows with that stream).
TEST(FsdpActivationCheckpointCombo7, DropoutInsideCheckpointedBlocksDrawsTheForwardsMasks) {
  constexpr float kDropout = 0.1f;
  const GptCase cases[] = {
      {.shards = 3, .offload = true, .block_reshard = false},
      {.shards = 2, .bf16 = true, .offload = true, .prefetch = Prefetch::explicit_two},
      {.shards = 4, .offload = true, .block_reshard = 2},
      {.replicas = 2, .shards = 2, .offload = true, .accumulate = Accumulate::defer_all_reduce},
      {.replicas = 2, .shards = 2, .bf16 = true, .accumulate = Accumulate::no_sync, .prefetch = Prefetch::off},
  };
  const Params no_dropout = gpt_tiny::Reference(kSteps);
  for (const GptCase& c : cases) {
    const CkptRun plain_run{.c = c, .dropout = kDropout};
    SCOPED_TRACE(Describe(plain_run));
    const std::vector<Params> plain = InProcess(plain_run);
    ASSERT_FALSE(plain[0].empty());
    EXPECT_NE(plain[0], no_dropout) << "dropout must act";
    if (!c.bf16) gpt_tiny::ExpectMatches(plain, DropoutReference(c, kDropout, kSteps), 2e-5);
    const std::vector<Params> plain_nested =
        c.bf16 ? InProcess({.c = c, .dropout = kDropout, .nested_units = true}) : plain;
    for (const Ckpt ckpt : kAllCkpt) {
      const CkptRun run{.c = c, .ckpt = ckpt, .dropout = kDropout};
      SCOPED_TRACE(Describe(run));
      gpt_tiny::ExpectMatches(InProcess(run), (ckpt == Ckpt::nested ? plain_nested : plain)[0], 0.0);
    }
  }
}

// The check above can see a recompute that draws other masks: with preserve_rng_state off on one rank only, the
// ranks' gradients differ from the run without checkpointing, and so do the trained parameters.
TEST(FsdpActivationCheckpointCombo7, ARecomputeWithFreshMasksOnOneRankIsSeen) {
  const GptCase c{.replicas = 2, .shards = 2, .offload = true, .accumulate = Accumulate::defer_all_reduce};
  const std::vector<Params> plain = InProcess({.c = c, .dropout = 0.1f});
  const std::vector<Params> fresh = InProcess({.c = c, .ckpt = Ckpt::blocks_after, .dropout = 0.1f, .fresh_rng_rank = 3});
  ASSERT_EQ(fresh.size(), plain.size());
  EXPECT_NE(fresh[0], plain[0]);
  EXPECT_EQ(fresh[0], fresh[3]) << "the ranks still agree (the gradients are averaged)";
}

}  // namespace
}  // namespace shardkit::fsdp
