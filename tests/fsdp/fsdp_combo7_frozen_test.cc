// Seventh round of feature combinations of fully_shard: frozen parameters (fully_shard shards them; a reduce moves
// the gradients of the parameters that require grad only: Note [frozen parameters are not reduced] in
// fsdp/param_group.cc), each against single-rank training with the same parts frozen (DESIGN.md section 8):
//   * parts frozen: attention inside a unit, a whole block unit, the tied embedding (wte = lm_head, in the root's
//     unit), ln_f; crossed with HSDP meshes, bf16 mixed precision (bf16 reductions, and bf16 gathers with f32
//     reductions), cpu offload, parameters with collectives of their own (own_collective_min_numel = 1), k-group
//     reshard and both accumulation modes. Frozen parameters must not move (bitwise), get no gradient, and the
//     trainable ones must equal one rank; bf16 runs must equal one rank with the same casts (bitwise, 1-D) and
//     the bits of the same case without offload and own collectives;
//   * each unit's reduce_scatters per step: one shared (when a trainable parameter uses the buffer) plus one per
//     trainable parameter with a collective of its own; frozen ones issue none;
//   * fsdp::clip_grad_norm: the norm of the trainable gradients only, as on one rank;
//   * sharded state dicts (model and optimizer) saved with frozen parts under one layout, loaded under another
//     (another world size, HSDP, own collectives, offload) into a model built from another seed, continued, and the
//     frozen parts unfrozen afterwards: as uninterrupted single-rank training;
//   * freezing and unfreezing between steps while the units are kept unsharded after backward
//     (set_reshard_after_backward(false)).
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/autograd/engine.h"
#include "common/comm/device_mesh.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "common/optim/clip_grad.h"
#include "common/optim/sgd.h"
#include "fsdp/clip_grad.h"
#include "fsdp/fully_shard.h"
#include "fsdp/state_dict.h"
#include "gtest/gtest.h"
#include "tests/fsdp/fsdp_combo6_util.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp {
namespace {

using combo6::Accumulate;
using combo6::Params;

// Module names whose parameters are frozen ("wte" freezes lm_head too: the same tensor).
using Parts = std::vector<std::string>;
const Parts kParts = {"blocks.0.attn", "blocks.1", "wte", "ln_f"};

void SetTrainable(nn::GPT& model, const Parts& parts, bool on) {
  for (const auto& [name, m] : model.named_modules()) {
    for (const std::string& p : parts) {
      if (name == p) m->set_requires_grad(on);
    }
  }
}

// Positions (in the unsharded model's parameters() order) of the parameters `parts` freezes.
std::set<std::size_t> FrozenIndices(const Parts& parts) {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT model(gpt_tiny::TinyConfig(), 1);
  SetTrainable(model, parts, false);
  std::set<std::size_t> out;
  const std::vector<Tensor> ps = model.parameters();
  for (std::size_t i = 0; i < ps.size(); ++i) {
    if (!ps[i].requires_grad()) out.insert(i);
  }
  return out;
}

enum class Mp { f32, bf16, bf16_gather };  // bf16_gather: bf16 all-gathers and compute, f32 reduce-scatters

struct FCase {
  int replicas = 1;  // > 1: HSDP on a replicas x shards mesh
  int shards = 2;
  Mp mp = Mp::f32;
  bool offload = false;
  bool own = false;  // own_collective_min_numel = 1
  Accumulate accumulate = Accumulate::none;
  std::optional<std::variant<bool, int>> block_reshard = std::nullopt;
  bool freeze_before_shard = true;
  int world() const { return replicas * shards; }
  combo6::GptCase Gpt() const { return {.replicas = replicas, .shards = shards, .accumulate = accumulate}; }
};

std::string Describe(const FCase& c) {
  return absl::StrCat(c.replicas > 1 ? absl::StrCat("hsdp ", c.replicas, "x") : "1-D ", c.shards,
                      c.mp == Mp::bf16 ? " bf16" : c.mp == Mp::bf16_gather ? " bf16-gather/f32-reduce" : "",
                      c.offload ? " offload" : "", c.own ? " own-collectives" : "",
                      c.accumulate == Accumulate::defer_all_reduce ? " deferred-all-reduce"
                      : c.accumulate == Accumulate::no_sync        ? " no-sync"
                                                                   : "",
                      c.block_reshard && std::holds_alternative<int>(*c.block_reshard)
                          ? absl::StrCat(" k=", std::get<int>(*c.block_reshard))
                          : "",
                      c.freeze_before_shard ? " frozen-before" : " frozen-after");
}

FullyShardOptions Options(const FCase& c) {
  FullyShardOptions o;
  o.reshard_after_forward = c.block_reshard;
  if (c.own) o.own_collective_min_numel = 1;
  if (c.mp == Mp::bf16) o.mp_policy = {.param_dtype = DType::bf16, .reduce_dtype = DType::bf16};
  if (c.mp == Mp::bf16_gather) o.mp_policy = {.param_dtype = DType::bf16, .reduce_dtype = DType::f32};
  o.offload_policy.cpu = c.offload;
  return o;
}

absl::Status ShardCase(nn::GPT& model, const std::shared_ptr<comm::ProcessGroup>& pg, const FCase& c) {
  std::optional<comm::DeviceMesh> mesh;
  if (c.replicas > 1) {
    auto m = comm::DeviceMesh::create(pg, {c.replicas, c.shards}, {"replicate", "shard"});
    if (!m.ok()) return m.status();
    mesh.emplace(std::move(*m));
  }
  const FullyShardOptions blocks = Options(c);
  for (nn::Module* b : modules_of_type(model, "TransformerBlock")) {
    if (auto s = mesh ? fully_shard(*b, *mesh, blocks) : fully_shard(*b, pg, blocks); !s.ok()) return s.status();
  }
  FullyShardOptions root = blocks;
  root.reshard_after_forward = std::nullopt;
  return (mesh ? fully_shard(model, *mesh, root) : fully_shard(model, pg, root)).status();
}

// What changes requires_grad at the start of a step (on every rank, and in the reference).
using Schedule = std::function<void(int step, nn::GPT& model)>;

Schedule FrozenThroughout(const Parts& parts) {
  return [parts](int step, nn::GPT& m) {
    if (step == 0) SetTrainable(m, parts, false);
  };
}
Schedule FrozenUntil(const Parts& parts, int unfreeze_at) {
  return [parts, unfreeze_at](int step, nn::GPT& m) {
    if (step == 0) SetTrainable(m, parts, false);
    if (step == unfreeze_at) SetTrainable(m, parts, true);
  };
}

// Single-rank training on the whole batch (the f32 reference): `sched` before each step; clipped to `clip` when > 0
// (`norms`: the norms before clipping).
Params Reference(const Schedule& sched, int steps, const optim::OptimizerFactory& factory = optim::AdamW::factory(),
                 double clip = 0, std::vector<double>* norms = nullptr) {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT model(gpt_tiny::TinyConfig(), 1);
  auto opt = factory({{model.parameters(), optim::AdamW::default_hyper()}});
  for (int step = 0; step < steps; ++step) {
    sched(step, model);
    auto [x, y] = gpt_tiny::Batch(step, 0, gpt_tiny::kBatch);
    (*opt)->zero_grad();
    autograd::backward(model.loss(x, y));
    if (clip > 0) {
      const double n = optim::clip_grad_norm(model.parameters(), clip);
      if (norms != nullptr) norms->push_back(n);
    }
    EXPECT_TRUE((*opt)->step().ok());
  }
  return gpt_tiny::Values(model);
}

// test_util::Bf16Reference (1-D, bf16 gathers and reductions, world ranks' rows) with `parts` frozen throughout.
Params Bf16FrozenReference(const Parts& parts, int steps, int world) {
  return test_util::Bf16Reference(steps, [world](int) { return world; },
                                  [&parts](nn::GPT& m) { SetTrainable(m, parts, false); });
}

// Checks every rank runs before each optimizer step (and may tamper with, to plant mistakes).
using BeforeStep = std::function<void(int step, int rank, nn::GPT& model)>;

// One rank: GPT-tiny seed 1 sharded as `c` (`sched`'s step-0 change applied before fully_shard when the case says
// so), `steps` steps of `factory`'s optimizer; full values at the end.
absl::StatusOr<Params> RunRank(const std::shared_ptr<comm::ProcessGroup>& pg, const FCase& c, const Schedule& sched,
                               int steps, const BeforeStep& before_step = nullptr,
                               const optim::OptimizerFactory& factory = optim::AdamW::factory()) {
  nn::GPT model(gpt_tiny::TinyConfig(), 1);
  if (c.freeze_before_shard) sched(0, model);
  if (absl::Status s = ShardCase(model, pg, c); !s.ok()) return s;
  auto opt = factory({{model.parameters(), optim::AdamW::default_hyper()}});
  if (!opt.ok()) return opt.status();
  combo6::Plant plant;
  if (before_step) {
    plant.before_step = [&](int step, int rank, optim::Optimizer&, nn::GPT& m) { before_step(step, rank, m); };
  }
  for (int step = 0; step < steps; ++step) {
    if (step > 0 || !c.freeze_before_shard) sched(step, model);
    if (absl::Status s = combo6::TrainSteps(model, **opt, pg->rank(), c.Gpt(), step, step + 1, &plant); !s.ok()) return s;
  }
  return test_util::FullValues(model);
}

std::vector<Params> InProcess(const FCase& c, const Schedule& sched, int steps, const BeforeStep& before_step = nullptr,
                              const optim::OptimizerFactory& factory = optim::AdamW::factory()) {
  std::vector<Params> got(static_cast<std::size_t>(c.world()));
  absl::Status st = comm::RunRanks(c.world(), [&](comm::RankEnv& env) -> absl::Status {
    auto v = RunRank(env.group_ptr, c, sched, steps, before_step, factory);
    if (!v.ok()) return v.status();
    got[static_cast<std::size_t>(env.rank)] = std::move(*v);
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << Describe(c) << ": " << st;
  return got;
}

Params Initial() {
  RankContext ctx;
  RankContextScope scope(ctx);
  return gpt_tiny::Values(nn::GPT(gpt_tiny::TinyConfig(), 1));
}

// Every rank's frozen parameters hold their initial values, bitwise.
void ExpectFrozenUnchanged(const std::vector<Params>& got, const std::set<std::size_t>& frozen) {
  static const Params initial = Initial();
  for (std::size_t r = 0; r < got.size(); ++r) {
    ASSERT_EQ(got[r].size(), initial.size());
    for (const std::size_t i : frozen) EXPECT_EQ(got[r][i], initial[i]) << "rank " << r << ": frozen parameter " << i << " moved";
  }
}

// Before each step: frozen shards have no gradient and still require none; the trainable ones have one.
void ExpectGradientsOnTrainableOnly(int step, int rank, nn::GPT& model) {
  for (const NamedParameter& p : named_parameters(model)) {
    const bool frozen = !p.param.requires_grad();
    bool in_part = false;
    for (const std::string& part : kParts) {
      for (const std::string& n : p.names) in_part = in_part || n.rfind(part + ".", 0) == 0;
    }
    EXPECT_EQ(frozen, in_part) << p.names.front() << " step " << step << " rank " << rank;
    if (p.param.numel() == 0) continue;  // no rows here
    EXPECT_EQ(p.param.grad().defined(), !frozen) << p.names.front() << " step " << step << " rank " << rank;
  }
}

constexpr int kSteps = 3;

// f32: frozen parts never move, get no gradient, and the rest trains as on one rank with the same parts frozen.
TEST(FsdpFrozenCombo7, FrozenPartsStayPutAndTheRestTrainsAsOneRank) {
  static const Params want = Reference(FrozenThroughout(kParts), kSteps);
  static const std::set<std::size_t> frozen = FrozenIndices(kParts);
  ASSERT_EQ(frozen.size(), 4u + 12u + 1u + 2u);
  const FCase cases[] = {
      {.shards = 2, .own = true},
      {.shards = 3, .offload = true, .own = true, .freeze_before_shard = false},
      {.shards = 4, .offload = true, .own = true, .block_reshard = 2},
      {.replicas = 2, .shards = 2, .offload = true, .own = true, .accumulate = Accumulate::defer_all_reduce},
      {.replicas = 2, .shards = 2, .own = true, .accumulate = Accumulate::no_sync, .freeze_before_shard = false},
      {.replicas = 2, .shards = 3, .offload = true, .block_reshard = false},
  };
  for (const FCase& c : cases) {
    SCOPED_TRACE(Describe(c));
    const std::vector<Params> got = InProcess(c, FrozenThroughout(kParts), kSteps, ExpectGradientsOnTrainableOnly);
    ExpectFrozenUnchanged(got, frozen);
    gpt_tiny::ExpectMatches(got, want, 2e-5);
  }
}

// bf16: 1-D bf16 gathers and reductions equal one rank with the same casts and the same parts frozen, bitwise; every
// bf16 case gives the bits of the same case without offload and own collectives; frozen parts never move.
TEST(FsdpFrozenCombo7, Bf16WithFrozenPartsEqualsTheSameCastsOnOneRank) {
  static const std::set<std::size_t> frozen = FrozenIndices(kParts);
  for (const int world : {2, 3}) {
    const FCase c{.shards = world, .mp = Mp::bf16, .offload = true, .own = true};
    SCOPED_TRACE(Describe(c));
    const std::vector<Params> got = InProcess(c, FrozenThroughout(kParts), kSteps, ExpectGradientsOnTrainableOnly);
    ExpectFrozenUnchanged(got, frozen);
    gpt_tiny::ExpectMatches(got, Bf16FrozenReference(kParts, kSteps, world), 0.0);
  }
  const FCase cases[] = {
      {.shards = 2, .mp = Mp::bf16_gather, .offload = true, .own = true},
      {.replicas = 2, .shards = 2, .mp = Mp::bf16_gather, .offload = true, .own = true,
       .accumulate = Accumulate::defer_all_reduce},
      {.replicas = 2, .shards = 2, .mp = Mp::bf16, .offload = true, .accumulate = Accumulate::no_sync,
       .freeze_before_shard = false},
      {.shards = 4, .mp = Mp::bf16, .offload = true, .own = true, .block_reshard = 2},
  };
  for (const FCase& c : cases) {
    SCOPED_TRACE(Describe(c));
    FCase plain = c;
    plain.offload = false;
    plain.own = false;
    const std::vector<Params> got = InProcess(c, FrozenThroughout(kParts), kSteps, ExpectGradientsOnTrainableOnly);
    ExpectFrozenUnchanged(got, frozen);
    gpt_tiny::ExpectMatches(got, InProcess(plain, FrozenThroughout(kParts), kSteps)[0], 0.0);
  }
}

// With own collectives: each unit issues per backward one shared reduce_scatter when a trainable parameter goes
// through the buffer, plus one per trainable parameter with a collective of its own (its rows split evenly); frozen
// parameters issue none. Counted on a 1-D group of 3 (16 rows go through the buffer, 48 and 64 rows get their own), f32
// reductions.
TEST(FsdpFrozenCombo7, OwnReduceScattersAreIssuedForTrainableParametersOnly) {
  constexpr int kWorld = 3;
  // Expected reduce_scatters per step, from the layout rule (fully_shard_options.h own_collective_min_numel).
  std::int64_t want = 0;
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    nn::GPT model(gpt_tiny::TinyConfig(), 1);
    SetTrainable(model, kParts, false);
    auto count_unit = [&](const std::vector<std::pair<std::string, Tensor>>& params) {
      bool shared = false;
      for (const auto& [name, t] : params) {
        if (!t.requires_grad()) continue;
        const RowSplit rs = split_rows(t.shape(), 0, kWorld);
        if (rs.rows_per_rank * kWorld == rs.rows) {
          ++want;
        } else {
          shared = true;
        }
      }
      if (shared) ++want;
    };
    std::vector<std::pair<std::string, Tensor>> root;
    std::vector<std::vector<std::pair<std::string, Tensor>>> blocks(3);
    for (const auto& [name, t] : model.named_parameters()) {
      if (name.rfind("blocks.", 0) == 0) {
        blocks[static_cast<std::size_t>(name[7] - '0')].emplace_back(name, t);
      } else {
        root.emplace_back(name, t);
      }
    }
    for (const auto& b : blocks) count_unit(b);
    count_unit(root);
  }
  ASSERT_GT(want, 3);
  absl::Status st = comm::RunRanks(kWorld, [&](comm::RankEnv& env) -> absl::Status {
    const FCase c{.shards = kWorld, .offload = true, .own = true};
    nn::GPT model(gpt_tiny::TinyConfig(), 1);
    SetTrainable(model, kParts, false);
    if (absl::Status s = ShardCase(model, env.group_ptr, c); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    const comm::CommCounters before = env.group.counters();
    if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, kWorld, 0, 1); !s.ok()) return s;
    const comm::CommCounters step = env.group.counters().since(before);
    EXPECT_EQ(step.of(comm::CollectiveKind::reduce_scatter).calls, want) << "rank " << env.rank;
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// clip_grad_norm with frozen parts: the norm of the trainable gradients (the one-rank norm, every rank), clipping
// acts, and training equals clipped single-rank training.
TEST(FsdpFrozenCombo7, ClippedTrainingWithFrozenPartsEqualsOneRank) {
  constexpr double kMaxNorm = 0.05;
  constexpr int kClipSteps = 4;
  const optim::OptimizerFactory sgd = optim::Sgd::factory({.lr = 0.1, .momentum = 0.9});
  std::vector<double> want_norms;
  const Params want = Reference(FrozenThroughout(kParts), kClipSteps, sgd, kMaxNorm, &want_norms);
  const FCase cases[] = {
      {.shards = 3, .offload = true, .own = true},
      {.replicas = 2, .shards = 2, .offload = true, .own = true, .accumulate = Accumulate::defer_all_reduce},
      {.shards = 2, .own = true, .accumulate = Accumulate::no_sync, .freeze_before_shard = false},
  };
  for (const FCase& c : cases) {
    SCOPED_TRACE(Describe(c));
    std::vector<std::vector<double>> norms(static_cast<std::size_t>(c.world()));
    const BeforeStep clip = [&](int step, int rank, nn::GPT& model) {
      absl::StatusOr<double> n = clip_grad_norm(model, kMaxNorm);
      ASSERT_TRUE(n.ok()) << n.status();
      norms[static_cast<std::size_t>(rank)].push_back(*n);
    };
    const std::vector<Params> got = InProcess(c, FrozenThroughout(kParts), kClipSteps, clip, sgd);
    gpt_tiny::ExpectMatches(got, want, 1e-6);
    for (std::size_t r = 0; r < norms.size(); ++r) {
      ASSERT_EQ(norms[r].size(), want_norms.size()) << "rank " << r;
      for (std::size_t s = 0; s < want_norms.size(); ++s) {
        EXPECT_GT(want_norms[s], 2 * kMaxNorm) << "the test needs clipping to act";
        EXPECT_NEAR(norms[r][s], want_norms[s], 1e-5 * want_norms[s]) << "rank " << r << " step " << s;
      }
    }
  }
}

// ---- sharded state dicts with frozen parts ------------------------------------------------------------------------

struct Pieces {
  std::vector<ShardedStateDict> model;
  std::vector<ShardedOptimizerState> optim;
};

// Steps [0, 2) under `a` with kParts frozen (saving every rank's sharded pieces), then steps [2, 5) under `b` in a
// model built from seed 2 that loads them (kParts frozen again before fully_shard), kParts unfrozen before step 3.
std::vector<Params> SaveAndResume(const FCase& a, const FCase& b) {
  constexpr int kSave = 2, kUnfreeze = 3, kEnd = 5;
  Pieces pieces;
  pieces.model.resize(static_cast<std::size_t>(a.world()));
  pieces.optim.resize(static_cast<std::size_t>(a.world()));
  absl::Status st = comm::RunRanks(a.world(), [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(gpt_tiny::TinyConfig(), 1);
    SetTrainable(model, kParts, false);
    if (absl::Status s = ShardCase(model, env.group_ptr, a); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (absl::Status s = combo6::TrainSteps(model, **opt, env.rank, a.Gpt(), 0, kSave); !s.ok()) return s;
    auto msd = sharded_state_dict(model);
    if (!msd.ok()) return msd.status();
    auto osd = sharded_optimizer_state(model, **opt);
    if (!osd.ok()) return osd.status();
    for (const ShardedParamState& ps : osd->state) {
      for (const std::string& part : kParts) {
        EXPECT_NE(ps.name.rfind(part + ".", 0), 0u) << ps.name << ": a frozen parameter never stepped, so has no state";
      }
    }
    pieces.model[static_cast<std::size_t>(env.rank)] = *std::move(msd);
    pieces.optim[static_cast<std::size_t>(env.rank)] = *std::move(osd);
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << Describe(a) << ": " << st;
  std::vector<Params> got(static_cast<std::size_t>(b.world()));
  st = comm::RunRanks(b.world(), [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(gpt_tiny::TinyConfig(), 2);  // another initialisation: the frozen parts come from the checkpoint too
    SetTrainable(model, kParts, false);
    if (absl::Status s = ShardCase(model, env.group_ptr, b); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (absl::Status s = load_sharded_state_dict(model, pieces.model); !s.ok()) return s;
    if (absl::Status s = load_sharded_optimizer_state(model, **opt, pieces.optim); !s.ok()) return s;
    for (int step = kSave; step < kEnd; ++step) {
      if (step == kUnfreeze) SetTrainable(model, kParts, true);
      if (absl::Status s = combo6::TrainSteps(model, **opt, env.rank, b.Gpt(), step, step + 1); !s.ok()) return s;
    }
    return test_util::StoreFullValues(model, got, env.rank);
  });
  EXPECT_TRUE(st.ok()) << Describe(b) << ": " << st;
  return got;
}

// Saved at one layout with frozen parts, resumed at another (world size, HSDP, own collectives, offload) and the parts
// unfrozen later: uninterrupted single-rank training with the same schedule (the unfrozen parts start AdamW's state
// from nothing there too).
TEST(FsdpFrozenCombo7, ShardedStateWithFrozenPartsResumesUnderAnotherLayoutAsOneRank) {
  static const Params want = Reference(FrozenUntil(kParts, 3), 5);
  const std::pair<FCase, FCase> runs[] = {
      {{.shards = 2, .offload = true, .own = true}, {.replicas = 2, .shards = 2, .own = true}},
      {{.replicas = 2, .shards = 2, .offload = true, .accumulate = Accumulate::defer_all_reduce},
       {.shards = 3, .offload = true, .own = true}},
      {{.shards = 4, .own = true, .block_reshard = 2}, {.shards = 2, .offload = true, .accumulate = Accumulate::no_sync}},
  };
  for (const auto& [a, b] : runs) {
    SCOPED_TRACE(absl::StrCat(Describe(a), " -> ", Describe(b)));
    gpt_tiny::ExpectMatches(SaveAndResume(a, b), want, 2e-5);
  }
}

// ---- freezing while the units are kept unsharded ------------------------------------------------------------------

// Every unit keeps its full parameters after backward (set_reshard_after_backward(false)), so between steps the
// module's parameters are the unsharded tensors. Block 0 is frozen before step 1 and unfrozen before step 3, at rest
// between steps, on every rank, as the reference does: the header's rule "frozen or unfrozen at rest between steps"
// must hold here too (or the change be refused), not be lost at the next gather.
TEST(FsdpFrozenCombo7, FreezingBetweenStepsWhileKeptUnshardedTrainsAsOneRank) {
  const Parts block0 = {"blocks.0"};
  const Schedule sched = [&](int step, nn::GPT& m) {
    if (step == 1) SetTrainable(m, block0, false);
    if (step == 3) SetTrainable(m, block0, true);
  };
  const Params want = Reference(sched, 5);
  for (const int world : {2, 3}) {
    SCOPED_TRACE(::testing::Message() << "n=" << world);
    std::vector<Params> got(static_cast<std::size_t>(world));
    absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(gpt_tiny::TinyConfig(), 1);
      if (absl::Status s = ShardCase(model, env.group_ptr, {.shards = world}); !s.ok()) return s;
      state_of(model)->set_reshard_after_backward(false);
      auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
      if (!opt.ok()) return opt.status();
      for (int step = 0; step < 5; ++step) {
        sched(step, model);
        if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, world, step, step + 1); !s.ok()) return s;
      }
      state_of(model)->set_reshard_after_backward(true);
      return test_util::StoreFullValues(model, got, env.rank);
    });
    ASSERT_TRUE(st.ok()) << st;
    gpt_tiny::ExpectMatches(got, want, 2e-5);
  }
}

}  // namespace
}  // namespace shardkit::fsdp
