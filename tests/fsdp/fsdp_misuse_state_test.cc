// Misuse of the state dicts, the safetensors export and clip_grad_norm of a fully sharded model (error-policy
// audit, DESIGN.md section 7): a clear Status on every rank, the module unchanged where a refusal says so.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/autograd/hooks.h"
#include "common/comm/testing/run_ranks.h"
#include "fsdp/clip_grad.h"
#include "fsdp/fully_shard.h"
#include "fsdp/safetensors_export.h"
#include "fsdp/state_dict.h"
#include "gmock/gmock.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp {
namespace {

using gpt_tiny::Batch;
using gpt_tiny::TinyConfig;
using ::testing::HasSubstr;

// One rank's whole model state as a single piece (row 0, whole tensors): written at N = 1.
const ShardedStateDict& WholePiece() {
  static const ShardedStateDict piece = [] {
    ShardedStateDict out;
    absl::Status st = comm::RunRanks(1, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(TinyConfig(), 3);
      if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
      auto p = sharded_state_dict(model);
      if (!p.ok()) return p.status();
      out = *p;
      return absl::OkStatus();
    });
    EXPECT_TRUE(st.ok()) << st;
    return out;
  }();
  return piece;
}

ShardedEntry* Find(ShardedStateDict& p, const std::string& name) {
  for (ShardedEntry& e : p.entries) {
    if (e.name == name) return &e;
  }
  ADD_FAILURE() << "no entry " << name;
  return &p.entries.front();
}

constexpr char kFc[] = "blocks.1.mlp.fc.weight";  // [64, 16]

// Loads `pieces` at N = 2: every rank refuses with InvalidArgument containing `wanted`, and the model is unchanged.
void ExpectRefused(const std::vector<ShardedStateDict>& pieces, const std::string& wanted) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 7);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    auto before = test_util::FullValues(model);
    if (!before.ok()) return before.status();
    const absl::Status s = load_sharded_state_dict(model, pieces);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "rank " << env.rank << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(wanted)) << "rank " << env.rank;
    auto after = test_util::FullValues(model);
    if (!after.ok()) return after.status();
    EXPECT_EQ(*after, *before) << "rank " << env.rank << ": the module changed";
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

TEST(FsdpMisuseState, ShardedPiecesOutOfRangeOrEmptyAreRefused) {
  // Rows [0, 32) at offset -1, and rows [0, 32) at offset 40 (past the end), beside the whole tensor split in two.
  auto split = [](std::int64_t second_offset) {
    std::vector<ShardedStateDict> pieces = {WholePiece(), WholePiece()};
    ShardedEntry* a = Find(pieces[0], kFc);
    ShardedEntry* b = Find(pieces[1], kFc);
    a->local = a->local.narrow0(0, 32).clone();
    b->local = b->local.narrow0(32, 32).clone();
    b->row_offset = second_offset;
    return pieces;
  };
  ExpectRefused(split(40), absl::StrCat("'", kFc, "': piece 1 holds f32[32, 16] cpu at row 40; expected rows of the "
                                        "global shape [64, 16] (same trailing dimensions) inside rows [0, 64)"));
  ExpectRefused(split(-1), "at row -1");
  // A piece with an undefined tensor.
  std::vector<ShardedStateDict> pieces = {WholePiece()};
  Find(pieces[0], kFc)->local = Tensor();
  ExpectRefused(pieces, absl::StrCat("'", kFc, "': piece 0 holds an undefined tensor"));
  // No pieces at all (strict: every name missing).
  ExpectRefused({}, "no piece holds");
  // A whole piece beside a range of it is an overlap, not a replica.
  pieces = split(32);
  pieces.push_back(WholePiece());
  ExpectRefused(pieces, "pieces overlap");
}

// A piece in another dtype is converted as nn::Module::load_state_dict does (documented): bf16 rows load rounded.
TEST(FsdpMisuseState, ShardedPieceInAnotherDtypeIsConverted) {
  std::vector<ShardedStateDict> pieces = {WholePiece()};
  ShardedEntry* fc = Find(pieces[0], kFc);
  fc->local = fc->local.to(DType::bf16);
  const std::vector<float> want = fc->local.to(DType::f32).to_vector();
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 7);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    if (absl::Status s = load_sharded_state_dict(model, pieces); !s.ok()) return s;
    auto full = full_state_dict(model);
    if (!full.ok()) return full.status();
    for (const auto& [name, t] : *full) {
      if (name == kFc) {
        EXPECT_EQ(t.to_vector(), want) << "rank " << env.rank;
      }
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// load_full_state_dict with an extra key, a missing key (strict), or a wrong shape: InvalidArgument on every rank,
// the module unchanged; non-strict with a missing key loads the rest.
TEST(FsdpMisuseState, FullStateDictWithExtraOrMissingKeys) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT source(TinyConfig(), 3), model(TinyConfig(), 7);
    const nn::StateDict good = source.state_dict();
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    auto before = test_util::FullValues(model);
    if (!before.ok()) return before.status();
    nn::StateDict extra = good, missing = good, wrong = good;
    extra.push_back({"blocks.7.ln1.weight", Tensor::zeros({16})});
    std::erase_if(missing, [](const auto& kv) { return kv.first == "ln_f.bias"; });
    for (auto& kv : wrong) {
      if (kv.first == kFc) kv.second = Tensor::zeros({64, 15});
    }
    for (const nn::StateDict* bad : {&extra, &missing, &wrong}) {
      const absl::Status s = load_full_state_dict(model, *bad);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "rank " << env.rank << ": " << s;
      auto after = test_util::FullValues(model);
      if (!after.ok()) return after.status();
      EXPECT_EQ(*after, *before) << "rank " << env.rank << ": the module changed";
    }
    EXPECT_THAT(std::string(load_full_state_dict(model, extra).message()), HasSubstr("blocks.7.ln1.weight"));
    EXPECT_THAT(std::string(load_full_state_dict(model, missing).message()), HasSubstr("ln_f.bias"));
    EXPECT_THAT(std::string(load_full_state_dict(model, wrong).message()), HasSubstr(kFc));
    if (absl::Status s = load_full_state_dict(model, missing, /*strict=*/false); !s.ok()) return s;
    auto after = full_state_dict(model);
    if (!after.ok()) return after.status();
    for (const auto& [name, t] : *after) {
      for (const auto& [gname, g] : good) {
        if (gname == name && name != "ln_f.bias") {
          EXPECT_EQ(t.to_vector(), g.to_vector()) << name;
        }
      }
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// Export into a directory that does not exist: every rank returns an error naming the path (bounded: each rank's
// own write fails, or it is told by the group), and the model trains on afterwards.
TEST(FsdpMisuseState, ExportToAMissingDirectoryFailsOnEveryRank) {
  const std::string dir = ::testing::TempDir() + "/fsdp_misuse_no_such_dir/deeper";
  std::vector<absl::Status> seen(2);
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env, {.timeout = absl::Seconds(2)}); !s.ok()) return s;
    seen[static_cast<std::size_t>(env.rank)] = export_sharded_safetensors(model, dir);
    return absl::OkStatus();
  }, {.timeout = absl::Seconds(2)});
  EXPECT_TRUE(st.ok()) << st;
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(seen[static_cast<std::size_t>(r)].ok()) << "rank " << r;
    EXPECT_THAT(std::string(seen[static_cast<std::size_t>(r)].message()), HasSubstr("fsdp_misuse_no_such_dir"))
        << "rank " << r << ": " << seen[static_cast<std::size_t>(r)];
  }
}

// Export from inside a backward (a gradient hook): FailedPrecondition on every rank, before any communication;
// the backward then ends normally.
TEST(FsdpMisuseState, ExportInsideABackwardIsRefusedOnEveryRank) {
  const std::string dir = ::testing::TempDir();
  std::vector<absl::Status> seen(2, absl::OkStatus());
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env, {.timeout = absl::Seconds(2)}); !s.ok()) return s;
    std::vector<autograd::HookHandle> hooks;
    autograd::HookHandle fh = (*model.blocks)[1]->register_forward_hook(
        [&](nn::Module&, const nn::TensorList&, const nn::TensorList& out) -> std::optional<nn::TensorList> {
          if (out[0].requires_grad()) {
            hooks.push_back(autograd::register_hook(out[0], [&](const Tensor&) -> std::optional<Tensor> {
              seen[static_cast<std::size_t>(env.rank)] = export_sharded_safetensors(model, dir);
              return std::nullopt;
            }));
          }
          return std::nullopt;
        });
    auto [x, y] = Batch(0, env.rank * 12, 12);
    return autograd::try_backward(model.loss(x, y));
  }, {.timeout = absl::Seconds(2)});
  EXPECT_TRUE(st.ok()) << st;
  for (int r = 0; r < 2; ++r) {
    const absl::Status& s = seen[static_cast<std::size_t>(r)];
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << "rank " << r << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("training state")) << "rank " << r;
  }
}

// ---- clip_grad_norm -------------------------------------------------------------------------------------------

// No gradients at all (before any backward): norm 0 on every rank, nothing to clip. Block 0 frozen: its shards have
// no gradient, the norm is of the rest, the same on every rank and finite.
TEST(FsdpMisuseClip, NoGradientsAndFrozenUnits) {
  std::vector<double> norms(2), frozen(2);
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    auto none = clip_grad_norm(model, 1.0);
    if (!none.ok()) return none.status();
    norms[static_cast<std::size_t>(env.rank)] = *none;
    gpt_tiny::FreezeBlock0(model);
    auto [x, y] = Batch(0, env.rank * 12, 12);
    if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
    for (const Tensor& p : (*model.blocks)[0]->parameters()) EXPECT_FALSE(p.grad().defined());
    auto n = clip_grad_norm(model, 1e9);
    if (!n.ok()) return n.status();
    frozen[static_cast<std::size_t>(env.rank)] = *n;
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(norms, std::vector<double>(2, 0.0));
  EXPECT_EQ(frozen[0], frozen[1]);
  EXPECT_TRUE(std::isfinite(frozen[0]) && frozen[0] > 0) << frozen[0];
}

// norm_type other than 2 / inf (0, -1, 3, NaN): InvalidArgument on every rank, gradients untouched, no crash.
TEST(FsdpMisuseClip, OtherNormTypesAreRefusedOnEveryRank) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    auto [x, y] = Batch(0, env.rank * 12, 12);
    if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
    const std::vector<float> g = model.parameters()[0].grad().to_vector();
    for (const double t : {0.0, -1.0, 3.0, std::numeric_limits<double>::quiet_NaN(), -std::numeric_limits<double>::infinity()}) {
      auto n = clip_grad_norm(model, 1e-3, t);
      EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument) << "norm_type " << t;
      EXPECT_THAT(std::string(n.status().message()), HasSubstr("expected norm_type 2 or inf")) << "norm_type " << t;
    }
    EXPECT_EQ(model.parameters()[0].grad().to_vector(), g) << "rank " << env.rank;
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// max_norm <= 0 or NaN: scaling by max_norm / norm would zero, negate or NaN every gradient (a silently wrong
// number); expected InvalidArgument on every rank with the gradients untouched.
TEST(FsdpMisuseClip, MaxNormZeroNegativeOrNanIsRefused) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    auto [x, y] = Batch(0, env.rank * 12, 12);
    if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
    const std::vector<float> g = model.parameters()[0].grad().to_vector();
    for (const double m : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN()}) {
      auto n = clip_grad_norm(model, m);
      EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument) << "max_norm " << m;
      EXPECT_THAT(std::string(n.status().message()), HasSubstr("max_norm")) << "max_norm " << m;
    }
    EXPECT_EQ(model.parameters()[0].grad().to_vector(), g) << "rank " << env.rank;
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace shardkit::fsdp
