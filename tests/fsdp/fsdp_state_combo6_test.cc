// Sharded state dicts (fsdp/state_dict.h) and safetensors export (fsdp/safetensors_export.h) in the combinations
// the other tests leave out, each against uninterrupted training (DESIGN.md section 8):
//   * every rank's sharded model and optimizer pieces, written mid-run under HSDP, cpu offload or bf16 mixed precision
//     (alone and together), loaded at another world size or mesh shape (HSDP <-> 1-D, 2 x 2 -> 2 x 3, 3 x 1, one rank)
//     into a model built from another seed, and continued: bit for bit the same as resuming from the full state dicts
//     (full_state_dict + full_optimizer_state, tested elsewhere), bit for bit the uninterrupted run when the shape
//     does not change, and (f32) within float rounding of uninterrupted single-rank training;
//   * the sharded and the single-file safetensors export of an HSDP model (with offload, with bf16), where the
//     replicas write the same parts: every file reads back, at another world size and mesh, to the model's full state
//     bit for bit, and the parts are those of the shard group.
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/comm/testing/run_ranks.h"
#include "common/io/model_safetensors.h"
#include "common/optim/adam.h"
#include "fsdp/fully_shard.h"
#include "fsdp/safetensors_export.h"
#include "fsdp/state_dict.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/io/io_test_util.h"
#include "tests/fsdp/fsdp_combo6_util.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp {
namespace {

using combo6::Accumulate;
using combo6::GptCase;
using combo6::Params;
using io::testing::ScratchDir;

constexpr int kSaveAt = 3, kSteps = 6;

// What a first run hands the next: every rank's sharded pieces and rank 0's full state dicts.
struct Saved {
  std::vector<ShardedStateDict> model_pieces;
  std::vector<ShardedOptimizerState> opt_pieces;
  nn::StateDict full_model;
  optim::OptimizerStateDict full_opt;
};

enum class From { none, sharded, full };

// Steps [first, last) of GPT-tiny under `c`: from `in` (a model built from seed 7, so a tensor the load misses
// shows) in the form `from`; saving both forms into `out` when given. Every rank's full values at the end.
std::vector<Params> RunSpan(const GptCase& c, int first, int last, const Saved* in, From from, Saved* out) {
  std::vector<Params> got(static_cast<std::size_t>(c.world()));
  if (out != nullptr) {
    out->model_pieces.assign(static_cast<std::size_t>(c.world()), {});
    out->opt_pieces.assign(static_cast<std::size_t>(c.world()), {});
  }
  absl::Status st = comm::RunRanks(c.world(), [&](comm::RankEnv& env) -> absl::Status {
    const auto r = static_cast<std::size_t>(env.rank);
    nn::GPT model(gpt_tiny::TinyConfig(), from == From::none ? 1 : 7);
    if (absl::Status s = combo6::ShardGptCase(model, env.group_ptr, c); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (from == From::sharded) {
      if (absl::Status s = load_sharded_state_dict(model, in->model_pieces); !s.ok()) return s;
      if (absl::Status s = load_sharded_optimizer_state(model, **opt, in->opt_pieces); !s.ok()) return s;
    } else if (from == From::full) {
      if (absl::Status s = load_full_state_dict(model, in->full_model); !s.ok()) return s;
      if (absl::Status s = load_full_optimizer_state(model, **opt, in->full_opt); !s.ok()) return s;
    }
    if (absl::Status s = combo6::TrainSteps(model, **opt, env.rank, c, first, last); !s.ok()) return s;
    if (out != nullptr) {
      auto piece = sharded_state_dict(model);
      if (!piece.ok()) return piece.status();
      out->model_pieces[r] = std::move(*piece);
      auto opt_piece = sharded_optimizer_state(model, **opt);
      if (!opt_piece.ok()) return opt_piece.status();
      out->opt_pieces[r] = std::move(*opt_piece);
      auto full = full_state_dict(model);
      if (!full.ok()) return full.status();
      auto full_opt = full_optimizer_state(model, **opt);
      if (!full_opt.ok()) return full_opt.status();
      if (env.rank == 0) {
        out->full_model = std::move(*full);
        out->full_opt = std::move(*full_opt);
      }
    }
    return test_util::StoreFullValues(model, got, env.rank);
  });
  EXPECT_TRUE(st.ok()) << combo6::Describe(c) << ": " << st;
  return got;
}

// Written under `save` after kSaveAt steps, continued under `load` to kSteps from the sharded pieces: the bits of
// the continuation from the full state dicts; the bits of the uninterrupted run when the layout is the same; f32
// within float rounding of one rank.
TEST(FsdpShardedStateCombo, PiecesWrittenUnderOneLayoutResumeUnderAnother) {
  static const Params want = gpt_tiny::Reference(kSteps);
  struct Case {
    GptCase save, load;
  };
  const Case cases[] = {
      {{.replicas = 2, .shards = 2, .offload = true}, {.shards = 3}},
      {{.replicas = 2, .shards = 2, .offload = true}, {.replicas = 2, .shards = 3, .offload = true}},
      {{.shards = 3, .offload = true}, {.replicas = 2, .shards = 2, .accumulate = Accumulate::defer_all_reduce}},
      {{.replicas = 2, .shards = 3, .accumulate = Accumulate::no_sync}, {.shards = 1}},
      {{.replicas = 2, .shards = 2, .bf16 = true}, {.shards = 2, .bf16 = true, .offload = true}},
      {{.shards = 2, .bf16 = true, .offload = true}, {.replicas = 3, .shards = 1, .bf16 = true}},
      {{.replicas = 2, .shards = 2, .bf16 = true, .offload = true, .accumulate = Accumulate::defer_all_reduce},
       {.replicas = 2, .shards = 2, .bf16 = true, .offload = true, .accumulate = Accumulate::defer_all_reduce}},
      {{.replicas = 2, .shards = 2, .offload = true, .block_reshard = false},
       {.replicas = 2, .shards = 2, .offload = true, .block_reshard = false}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("saved under ", combo6::Describe(c.save), ", loaded under ", combo6::Describe(c.load)));
    Saved saved;
    RunSpan(c.save, 0, kSaveAt, nullptr, From::none, &saved);
    ASSERT_EQ(saved.model_pieces.size(), static_cast<std::size_t>(c.save.world()));
    const std::vector<Params> sharded = RunSpan(c.load, kSaveAt, kSteps, &saved, From::sharded, nullptr);
    const std::vector<Params> full = RunSpan(c.load, kSaveAt, kSteps, &saved, From::full, nullptr);
    ASSERT_FALSE(full.empty() || full[0].empty());
    gpt_tiny::ExpectMatches(sharded, full[0], 0.0);
    if (combo6::Describe(c.save) == combo6::Describe(c.load)) {
      gpt_tiny::ExpectMatches(sharded, combo6::InProcess(c.save, kSteps)[0], 0.0);
    }
    if (!c.save.bf16 && !c.load.bf16) gpt_tiny::ExpectMatches(sharded, want, 2e-5);
  }
}

// ---- safetensors from an HSDP model -------------------------------------------------------------------------------

io::ModelExportOptions Gpt2() { return {.names = io::TensorNames::gpt2(gpt_tiny::TinyConfig())}; }

// Trained kSaveAt steps under `c`, then exported (sharded into `dir`, one file at `one`) on every rank; the full
// values at export time.
Params TrainAndExport(const GptCase& c, const std::string& dir, const std::string& one) {
  std::vector<Params> got(static_cast<std::size_t>(c.world()));
  absl::Status st = comm::RunRanks(c.world(), [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(gpt_tiny::TinyConfig(), 1);
    if (absl::Status s = combo6::ShardGptCase(model, env.group_ptr, c); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (absl::Status s = combo6::TrainSteps(model, **opt, env.rank, c, 0, kSaveAt); !s.ok()) return s;
    if (absl::Status s = export_sharded_safetensors(model, dir, Gpt2()); !s.ok()) return s;
    if (absl::Status s = export_single_safetensors(model, one, Gpt2()); !s.ok()) return s;
    return test_util::StoreFullValues(model, got, env.rank);
  });
  EXPECT_TRUE(st.ok()) << st;
  return got.empty() ? Params{} : got[0];
}

// Loaded under `c` from `path` (a model from another seed): every rank's full values.
std::vector<Params> Load(const GptCase& c, const std::string& path) {
  std::vector<Params> got(static_cast<std::size_t>(c.world()));
  absl::Status st = comm::RunRanks(c.world(), [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(gpt_tiny::TinyConfig(), 7);
    if (absl::Status s = combo6::ShardGptCase(model, env.group_ptr, c); !s.ok()) return s;
    if (absl::Status s = load_safetensors_rows(model, path, io::TensorNames::gpt2(gpt_tiny::TinyConfig())); !s.ok()) {
      return s;
    }
    return test_util::StoreFullValues(model, got, env.rank);
  });
  EXPECT_TRUE(st.ok()) << st;
  return got;
}

// Exported from a 2 x 2 HSDP model (with offload; with bf16 and the all-reduce deferred), the sharded files (the
// shard group's two parts, written by both replicas) and the single file read back under other layouts to the
// exported model's values, bit for bit.
TEST(HsdpSafetensorsCombo, ExportsReadBackAtAnyLayoutBitwise) {
  const GptCase saves[] = {
      {.replicas = 2, .shards = 2, .offload = true},
      {.replicas = 2, .shards = 2, .bf16 = true, .offload = true, .accumulate = Accumulate::defer_all_reduce},
      {.replicas = 2, .shards = 3},
  };
  const GptCase loads[] = {{.shards = 1}, {.shards = 3}, {.replicas = 2, .shards = 3, .offload = true}};
  for (const GptCase& save : saves) {
    SCOPED_TRACE(absl::StrCat("exported under ", combo6::Describe(save)));
    ScratchDir dir, single;
    const Params exported = TrainAndExport(save, dir.path(), single.file("model.safetensors"));
    ASSERT_FALSE(exported.empty());
    std::vector<std::string> want_files;
    for (int p = 1; p <= save.shards; ++p) {
      want_files.push_back(absl::StrFormat("model-%05d-of-%05d.safetensors", p, save.shards));
    }
    want_files.push_back("model.safetensors.index.json");
    EXPECT_EQ(dir.listing(), want_files);
    EXPECT_EQ(single.listing(), std::vector<std::string>{"model.safetensors"});
    for (const GptCase& load : loads) {
      SCOPED_TRACE(absl::StrCat("loaded under ", combo6::Describe(load)));
      gpt_tiny::ExpectMatches(Load(load, dir.path()), exported, 0.0);
      gpt_tiny::ExpectMatches(Load(load, single.file("model.safetensors")), exported, 0.0);
    }
  }
}

}  // namespace
}  // namespace shardkit::fsdp
