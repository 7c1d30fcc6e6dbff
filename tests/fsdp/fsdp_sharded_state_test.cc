// Sharded state dicts (fsdp/state_dict.h, Note [loading sharded pieces]): every rank's piece of the model and
// optimizer state, written without communication at one world size, loads at another and continues equal to
// uninterrupted single-rank training; a round trip at the same world size is bitwise; pieces that do not fit are
// refused naming the entry, and nothing is loaded. The name-keyed full optimizer form (to_named / from_named).
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/comm/testing/run_ranks.h"
#include "fsdp/fully_shard.h"
#include "fsdp/state_dict.h"
#include "gmock/gmock.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp {
namespace {

using gpt_tiny::TinyConfig;
using ::testing::HasSubstr;

constexpr int kHalf = 5;  // steps before the checkpoint, and after

// Every rank's piece of one checkpoint, gathered through the harness (rank r writes slot r).
struct Checkpoint {
  std::vector<ShardedStateDict> model;
  std::vector<ShardedOptimizerState> optim;
};

// GPT-tiny (seed 1) sharded at `world`, trained `steps` steps with AdamW, then every rank's sharded state.
Checkpoint TrainAndSave(int world, int steps, bool nested) {
  Checkpoint ck;
  ck.model.resize(static_cast<std::size_t>(world));
  ck.optim.resize(static_cast<std::size_t>(world));
  const absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env, {}, nested); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, world, 0, steps); !s.ok()) return s;
    auto msd = sharded_state_dict(model);
    if (!msd.ok()) return msd.status();
    auto osd = sharded_optimizer_state(model, **opt);
    if (!osd.ok()) return osd.status();
    ck.model[static_cast<std::size_t>(env.rank)] = *std::move(msd);
    ck.optim[static_cast<std::size_t>(env.rank)] = *std::move(osd);
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
  return ck;
}

ShardedEntry* Find(ShardedStateDict& sd, const std::string& name) {
  for (ShardedEntry& e : sd.entries) {
    if (e.name == name) return &e;
  }
  ADD_FAILURE() << "no entry " << name;
  return nullptr;
}

// Each entry's values, by name (what the tests compare to see that nothing changed).
std::vector<std::pair<std::string, std::vector<float>>> Values(const ShardedStateDict& sd) {
  std::vector<std::pair<std::string, std::vector<float>>> out;
  for (const ShardedEntry& e : sd.entries) out.emplace_back(e.name, e.local.to_vector());
  return out;
}

// The acceptance case of issue 12: a sharded checkpoint written at N = 4 (nested units) continues at N = 2 (nested)
// and N = 3 (blocks only) equal to the uninterrupted single-rank run.
TEST(FsdpShardedState, CheckpointAtFourContinuesAtTwoAndThree) {
  static const auto want = gpt_tiny::Reference(2 * kHalf);
  const Checkpoint ck = TrainAndSave(4, kHalf, /*nested=*/true);
  for (const int world : {2, 3}) {
    std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
    const absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(TinyConfig(), 7);  // another initialisation: everything comes from the checkpoint
      if (absl::Status s = test_util::ShardGpt(model, env, {}, /*nested=*/world == 2); !s.ok()) return s;
      auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
      if (!opt.ok()) return opt.status();
      if (absl::Status s = load_sharded_state_dict(model, ck.model); !s.ok()) return s;
      if (absl::Status s = load_sharded_optimizer_state(model, **opt, ck.optim); !s.ok()) return s;
      if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, world, kHalf, 2 * kHalf); !s.ok()) return s;
      return test_util::StoreFullValues(model, got, env.rank);
    });
    ASSERT_TRUE(st.ok()) << "world " << world << ": " << st;
    gpt_tiny::ExpectMatches(got, want, 2e-5);
  }
}

// What a piece holds: every name of root.state_dict() (both names of the tied embedding), this rank's rows with
// the global shape and offset; optimizer state by the parameters' first names, sharded like them.
TEST(FsdpShardedState, PiecesHoldEachRanksRowsByName) {
  Checkpoint ck = TrainAndSave(3, 1, /*nested=*/true);
  RankContext ctx;
  RankContextScope scope(ctx);
  const nn::GPT plain(TinyConfig(), 1);
  const nn::StateDict names = plain.state_dict();
  std::vector<std::string> first_names;
  for (const auto& [name, t] : plain.named_parameters()) first_names.push_back(name);
  for (int r = 0; r < 3; ++r) {
    ShardedStateDict& piece = ck.model[static_cast<std::size_t>(r)];
    ASSERT_EQ(piece.entries.size(), names.size());
    for (std::size_t i = 0; i < names.size(); ++i) {
      const ShardedEntry& e = piece.entries[i];
      EXPECT_EQ(e.name, names[i].first);
      EXPECT_EQ(e.global_shape, names[i].second.shape()) << e.name;
      const RowSplit rs = split_rows(e.global_shape, r, 3);
      EXPECT_EQ(e.row_offset, rs.row_offset) << e.name;
      EXPECT_EQ(e.local.numel(), rs.local_rows * rs.row_numel) << e.name;
    }
    const ShardedEntry* wte = Find(piece, "wte.weight");
    const ShardedEntry* head = Find(piece, "lm_head.weight");
    ASSERT_TRUE(wte != nullptr && head != nullptr);
    EXPECT_EQ(wte->local.to_vector(), head->local.to_vector());  // one tensor, two names

    const ShardedOptimizerState& opt = ck.optim[static_cast<std::size_t>(r)];
    EXPECT_EQ(opt.optimizer, "AdamW");
    ASSERT_EQ(opt.param_groups.size(), 1u);
    EXPECT_EQ(opt.param_groups[0].params, first_names);
    EXPECT_EQ(opt.param_groups[0].hyper, optim::AdamW::default_hyper());
    ASSERT_EQ(opt.state.size(), first_names.size());
    for (const ShardedParamState& ps : opt.state) {
      EXPECT_EQ(ps.step, 1) << ps.name;
      EXPECT_EQ(ps.row_offset, split_rows(ps.global_shape, r, 3).row_offset) << ps.name;
      ASSERT_EQ(ps.tensors.count("exp_avg"), 1u) << ps.name;
      EXPECT_EQ(ps.tensors.at("exp_avg").shape(), Find(piece, ps.name)->local.shape()) << ps.name;
    }
  }
}

// Written and read back at the same world size, the state is bitwise the same, and training continues bitwise
// equal to the run that wrote it.
TEST(FsdpShardedState, RoundTripAtTheSameWorldIsBitwise) {
  constexpr int kWorld = 3;
  Checkpoint ck;
  ck.model.resize(kWorld);
  ck.optim.resize(kWorld);
  std::vector<std::vector<std::vector<float>>> continued(kWorld), reloaded(kWorld);
  absl::Status st = comm::RunRanks(kWorld, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env, {}, /*nested=*/true); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, kWorld, 0, 2); !s.ok()) return s;
    auto msd = sharded_state_dict(model);
    if (!msd.ok()) return msd.status();
    auto osd = sharded_optimizer_state(model, **opt);
    if (!osd.ok()) return osd.status();
    ck.model[static_cast<std::size_t>(env.rank)] = *std::move(msd);
    ck.optim[static_cast<std::size_t>(env.rank)] = *std::move(osd);
    if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, kWorld, 2, 4); !s.ok()) return s;
    auto values = test_util::FullValues(model);
    if (!values.ok()) return values.status();
    continued[static_cast<std::size_t>(env.rank)] = std::move(*values);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  st = comm::RunRanks(kWorld, [&](comm::RankEnv& env) -> absl::Status {
    const std::size_t r = static_cast<std::size_t>(env.rank);
    nn::GPT model(TinyConfig(), 7);
    if (absl::Status s = test_util::ShardGpt(model, env, {}, /*nested=*/true); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (absl::Status s = load_sharded_state_dict(model, ck.model); !s.ok()) return s;
    if (absl::Status s = load_sharded_optimizer_state(model, **opt, ck.optim); !s.ok()) return s;
    auto msd = sharded_state_dict(model);
    if (!msd.ok()) return msd.status();
    EXPECT_EQ(Values(*msd), Values(ck.model[r])) << "rank " << r;
    auto osd = sharded_optimizer_state(model, **opt);
    if (!osd.ok()) return osd.status();
    EXPECT_EQ(osd->state.size(), ck.optim[r].state.size());
    for (std::size_t i = 0; i < osd->state.size() && i < ck.optim[r].state.size(); ++i) {
      const ShardedParamState &got = osd->state[i], &want = ck.optim[r].state[i];
      EXPECT_EQ(got.name, want.name);
      EXPECT_EQ(got.step, want.step) << got.name;
      EXPECT_EQ(got.global_shape, want.global_shape) << got.name;
      EXPECT_EQ(got.row_offset, want.row_offset) << got.name;
      for (const auto& [key, t] : want.tensors) {
        EXPECT_EQ(got.tensors.at(key).to_vector(), t.to_vector()) << got.name << " " << key;
      }
    }
    if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, kWorld, 2, 4); !s.ok()) return s;
    auto values = test_util::FullValues(model);
    if (!values.ok()) return values.status();
    reloaded[r] = std::move(*values);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(reloaded, continued);
}

// Frozen parameters are sharded like the others (fully_shard.h): each rank's piece holds its rows, they load at
// another world size, and the loaded shards stay frozen.
TEST(FsdpShardedState, FrozenParametersAreShardedAndLoadAtAnotherWorldSize) {
  std::vector<std::vector<float>> want;
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    want = gpt_tiny::Values(nn::GPT(TinyConfig(), 1));
  }
  std::vector<ShardedStateDict> pieces(2);
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    model.ln_f->set_requires_grad(false);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    auto msd = sharded_state_dict(model);
    if (!msd.ok()) return msd.status();
    pieces[static_cast<std::size_t>(env.rank)] = *std::move(msd);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  for (std::size_t r = 0; r < pieces.size(); ++r) {
    const ShardedEntry* ln = Find(pieces[r], "ln_f.weight");
    ASSERT_NE(ln, nullptr);
    const std::int64_t rows = ln->global_shape[0];
    EXPECT_EQ(ln->row_offset, static_cast<std::int64_t>(r) * rows / 2) << "rank " << r;
    EXPECT_EQ(ln->local.shape(), Shape({rows / 2})) << "rank " << r;
  }
  st = comm::RunRanks(3, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 7);
    model.ln_f->set_requires_grad(false);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    if (absl::Status s = load_sharded_state_dict(model, pieces); !s.ok()) return s;
    EXPECT_FALSE(model.ln_f->parameter("weight").requires_grad()) << "rank " << env.rank;
    auto values = test_util::FullValues(model);
    if (!values.ok()) return values.status();
    EXPECT_EQ(*values, want) << "rank " << env.rank;
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// While the root is summoned, a piece holds the values written to the full parameters; loading reshards first, so
// the loaded values are what the module keeps.
TEST(FsdpShardedState, SummonedValuesAreWrittenAndLoadingReshards) {
  std::vector<std::vector<float>> values1, values2;
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    values1 = gpt_tiny::Values(nn::GPT(TinyConfig(), 1));
    values2 = gpt_tiny::Values(nn::GPT(TinyConfig(), 2));
  }
  std::vector<ShardedStateDict> original(2), summoned(2);
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    auto at_rest = sharded_state_dict(model);
    if (!at_rest.ok()) return at_rest.status();
    original[static_cast<std::size_t>(env.rank)] = *std::move(at_rest);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    const std::size_t r = static_cast<std::size_t>(env.rank);
    nn::GPT model(TinyConfig(), 1), other(TinyConfig(), 2);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    FSDPModule root = *state_of(model);
    if (absl::Status s = root.summon_full_params(); !s.ok()) return s;
    if (absl::Status s = model.load_state_dict(other.state_dict()); !s.ok()) return s;
    auto written = sharded_state_dict(model);  // the rows of the full values, not the stale shards
    if (!written.ok()) return written.status();
    summoned[r] = *std::move(written);
    if (absl::Status s = load_sharded_state_dict(model, original); !s.ok()) return s;  // still summoned here
    EXPECT_EQ(root.training_state(), TrainingState::idle);
    auto values = test_util::FullValues(model);
    if (!values.ok()) return values.status();
    EXPECT_EQ(*values, values1) << "rank " << r;
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  st = comm::RunRanks(1, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 7);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    if (absl::Status s = load_sharded_state_dict(model, summoned); !s.ok()) return s;
    auto values = test_util::FullValues(model);
    if (!values.ok()) return values.status();
    EXPECT_EQ(*values, values2);
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// ---- pieces that do not fit ---------------------------------------------------------------------------------

// Written at N = 2 after one step; the error tests load altered copies at N = 3.
const Checkpoint& SavedAtTwo() {
  static const Checkpoint ck = TrainAndSave(2, 1, /*nested=*/true);
  return ck;
}

constexpr char kFc[] = "blocks.1.mlp.fc.weight";  // [64, 16]: rows [0, 32) in piece 0, [32, 64) in piece 1

// Loads `model_pieces` (and `optim_pieces` when given) at N = 3 into a fresh model and optimizer; expects every rank
// to refuse with InvalidArgument containing each of `wanted`, and the model and optimizer unchanged.
void ExpectRefusedAtThree(const std::vector<ShardedStateDict>& model_pieces,
                          const std::vector<ShardedOptimizerState>* optim_pieces,
                          const std::vector<std::string>& wanted) {
  const absl::Status st = comm::RunRanks(3, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 7);
    if (absl::Status s = test_util::ShardGpt(model, env, {}, /*nested=*/true); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    auto before = sharded_state_dict(model);
    if (!before.ok()) return before.status();
    const absl::Status s = optim_pieces == nullptr ? load_sharded_state_dict(model, model_pieces)
                                                   : load_sharded_optimizer_state(model, **opt, *optim_pieces);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "rank " << env.rank << ": " << s;
    for (const std::string& w : wanted) EXPECT_THAT(std::string(s.message()), HasSubstr(w)) << "rank " << env.rank;
    auto after = sharded_state_dict(model);
    if (!after.ok()) return after.status();
    EXPECT_EQ(Values(*after), Values(*before)) << "rank " << env.rank << ": the module changed";
    for (std::int64_t k = 0; k < (*opt)->num_params(); ++k) {
      EXPECT_EQ((*opt)->state(k), nullptr) << "rank " << env.rank << ": the optimizer changed";
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

TEST(FsdpShardedState, MissingRowsAreRefused) {
  std::vector<ShardedStateDict> pieces = SavedAtTwo().model;
  std::erase_if(pieces[1].entries, [](const ShardedEntry& e) { return e.name == kFc; });
  ExpectRefusedAtThree(pieces, nullptr, {absl::StrCat("'", kFc, "' (global shape [64, 16]): missing rows [32, 64)")});
  pieces = SavedAtTwo().model;
  pieces.pop_back();  // a whole rank's piece
  ExpectRefusedAtThree(pieces, nullptr, {"missing rows [32, 64)"});
}

TEST(FsdpShardedState, OverlappingPiecesAreRefused) {
  std::vector<ShardedStateDict> pieces = SavedAtTwo().model;
  Find(pieces[1], kFc)->row_offset = 31;
  ExpectRefusedAtThree(pieces, nullptr,
                       {absl::StrCat("'", kFc, "': pieces overlap: piece 0 holds rows [0, 32) and piece 1 rows [31, 63)")});
  // A range held identically by two pieces is a replica (HSDP) and loads; one overlapping a range partly does not.
  pieces = SavedAtTwo().model;
  pieces.push_back(pieces[0]);
  Find(pieces[2], kFc)->row_offset = 16;
  ExpectRefusedAtThree(pieces, nullptr,
                       {absl::StrCat("'", kFc, "': pieces overlap: piece 0 holds rows [0, 32) and piece 2 rows [16, 48)")});
}

TEST(FsdpShardedState, WrongGlobalShapeIsRefused) {
  std::vector<ShardedStateDict> pieces = SavedAtTwo().model;
  Find(pieces[1], kFc)->global_shape = {65, 16};
  ExpectRefusedAtThree(pieces, nullptr,
                       {absl::StrCat("'", kFc, "': expected global shape [64, 16], found [65, 16] in piece 1")});
  pieces = SavedAtTwo().model;
  ShardedEntry* fc = Find(pieces[0], kFc);
  fc->local = fc->local.reshape({64, 8});  // rows that are not the global shape's
  ExpectRefusedAtThree(pieces, nullptr, {absl::StrCat("'", kFc, "': piece 0 holds f32[64, 8]")});
}

TEST(FsdpShardedState, UnknownNameIsRefusedWhenStrict) {
  std::vector<ShardedStateDict> pieces = SavedAtTwo().model;
  pieces[1].entries.push_back({"blocks.9.mlp.fc.weight", Tensor::zeros({4, 16}), {8, 16}, 4});
  ExpectRefusedAtThree(pieces, nullptr, {"unknown name 'blocks.9.mlp.fc.weight' in piece 1"});
  pieces = SavedAtTwo().model;
  for (ShardedStateDict& p : pieces) {
    std::erase_if(p.entries, [](const ShardedEntry& e) { return e.name == "ln_f.bias"; });
  }
  ExpectRefusedAtThree(pieces, nullptr, {"no piece holds 'ln_f.bias' (strict; 2 pieces)"});
}

TEST(FsdpShardedState, NonStrictSkipsUnknownAndMissingNames) {
  std::vector<ShardedStateDict> pieces = SavedAtTwo().model;
  pieces[1].entries.push_back({"blocks.9.mlp.fc.weight", Tensor::zeros({4, 16}), {8, 16}, 4});
  for (ShardedStateDict& p : pieces) {
    std::erase_if(p.entries, [](const ShardedEntry& e) { return e.name == "ln_f.bias"; });
  }
  std::vector<float> ln_f_bias_of_seed7;
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    ln_f_bias_of_seed7 = nn::GPT(TinyConfig(), 7).ln_f->parameter("bias").to_vector();
  }
  const absl::Status st = comm::RunRanks(3, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 7);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    const absl::Status strict = load_sharded_state_dict(model, pieces);
    EXPECT_THAT(std::string(strict.message()), HasSubstr("unknown name 'blocks.9.mlp.fc.weight'"));
    if (absl::Status s = load_sharded_state_dict(model, pieces, /*strict=*/false); !s.ok()) return s;
    auto msd = sharded_state_dict(model);
    if (!msd.ok()) return msd.status();
    const ShardedEntry* bias = Find(*msd, "ln_f.bias");
    const RowSplit rs = split_rows({16}, env.rank, 3);
    const std::vector<float> mine(ln_f_bias_of_seed7.begin() + rs.row_offset,
                                  ln_f_bias_of_seed7.begin() + rs.row_offset + rs.local_rows);
    EXPECT_EQ(bias->local.to_vector(), mine) << "rank " << env.rank << ": a name no piece holds is left as it was";
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

TEST(FsdpShardedState, OptimizerStateForUnknownNameIsRefused) {
  std::vector<ShardedOptimizerState> pieces = SavedAtTwo().optim;
  pieces[1].state[3].name = "blocks.9.mlp.fc.weight";
  ExpectRefusedAtThree({}, &pieces, {"piece 1 holds state for unknown parameter 'blocks.9.mlp.fc.weight'"});
  pieces = SavedAtTwo().optim;
  for (ShardedOptimizerState& p : pieces) p.param_groups[0].params[3] = "blocks.9.mlp.fc.weight";
  ExpectRefusedAtThree({}, &pieces, {"group 0 lists unknown parameter 'blocks.9.mlp.fc.weight'"});
}

TEST(FsdpShardedState, OptimizerPiecesThatDoNotFitAreRefused) {
  auto state_of_fc = [](ShardedOptimizerState& p) -> ShardedParamState& {
    for (ShardedParamState& ps : p.state) {
      if (ps.name == kFc) return ps;
    }
    ADD_FAILURE() << "no state for " << kFc;
    return p.state.front();
  };
  std::vector<ShardedOptimizerState> pieces = SavedAtTwo().optim;
  std::erase_if(pieces[0].state, [](const ShardedParamState& ps) { return ps.name == kFc; });
  ExpectRefusedAtThree({}, &pieces, {absl::StrCat("state 'exp_avg' of '", kFc, "' (global shape [64, 16]): missing rows [0, 32)")});
  pieces = SavedAtTwo().optim;
  state_of_fc(pieces[1]).row_offset = 31;
  ExpectRefusedAtThree({}, &pieces,
                       {absl::StrCat("state 'exp_avg' of '", kFc,
                                     "': pieces overlap: piece 0 holds rows [0, 32) and piece 1 rows [31, 63)")});
  pieces = SavedAtTwo().optim;
  state_of_fc(pieces[1]).global_shape = {64, 17};
  ExpectRefusedAtThree({}, &pieces, {"expected global shape [64, 16], found [64, 17] in piece 1"});
  pieces = SavedAtTwo().optim;
  state_of_fc(pieces[1]).step = 2;
  ExpectRefusedAtThree({}, &pieces, {absl::StrCat("'", kFc, "': step counts differ: 1 in piece 0, 2 in piece 1")});
  pieces = SavedAtTwo().optim;
  pieces[1].param_groups[0].hyper.lr = 0.5;
  ExpectRefusedAtThree({}, &pieces, {"the pieces disagree: piece 1's group 0 has lr=0.5"});
}

// ---- the name-keyed full optimizer state ------------------------------------------------------------------------

// to_named keys full_optimizer_state by the parameters' first names (the names the sharded form uses); from_named
// gives the index-keyed dict back, which loads.
TEST(FsdpShardedState, NamedFullOptimizerStateRoundTrips) {
  const absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, 2, 0, 1); !s.ok()) return s;
    auto full = full_optimizer_state(model, **opt);
    if (!full.ok()) return full.status();
    auto named = to_named(model, *full);
    if (!named.ok()) return named.status();
    auto sharded = sharded_optimizer_state(model, **opt);
    if (!sharded.ok()) return sharded.status();
    std::vector<std::string> sharded_names, named_names;
    for (const ShardedParamState& ps : sharded->state) sharded_names.push_back(ps.name);
    for (const auto& [name, ps] : named->state) named_names.push_back(name);
    std::sort(sharded_names.begin(), sharded_names.end());
    EXPECT_EQ(named_names, sharded_names);  // both forms, the same keys
    EXPECT_EQ(named->param_groups.size(), 1u);
    EXPECT_EQ(named->param_groups[0].params, sharded->param_groups[0].params);
    EXPECT_EQ(named->state.count("wte.weight"), 1u);
    EXPECT_EQ(named->state.count("lm_head.weight"), 0u);  // the tied embedding under its first name
    const std::int64_t wte_index = 0;                     // (the first parameter GPT registers)
    EXPECT_EQ(named->state.at("wte.weight").tensors.at("exp_avg").to_vector(),
              full->state.at(wte_index).tensors.at("exp_avg").to_vector());
    auto back = from_named(model, *named);
    if (!back.ok()) return back.status();
    EXPECT_EQ(back->param_groups[0].params, full->param_groups[0].params);
    EXPECT_EQ(back->state.size(), full->state.size());
    if (absl::Status s = load_full_optimizer_state(model, **opt, *back); !s.ok()) return s;

    NamedOptimizerState bad = *named;
    bad.state["blocks.9.mlp.fc.weight"] = bad.state.at("wte.weight");
    EXPECT_THAT(std::string(from_named(model, bad).status().message()),
                HasSubstr("state for unknown parameter 'blocks.9.mlp.fc.weight'"));
    bad = *named;
    bad.param_groups[0].params.push_back("wte.weight");
    EXPECT_THAT(std::string(from_named(model, bad).status().message()), HasSubstr("'wte.weight' is listed twice"));
    optim::OptimizerStateDict bad_full = full->clone();
    bad_full.param_groups[0].params.push_back(999);
    EXPECT_THAT(std::string(to_named(model, bad_full).status().message()),
                HasSubstr(absl::StrCat("expected parameter indices in [0, ", model.parameters().size(),
                                       ") (positions in root.parameters()), found 999")));
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace shardkit::fsdp
