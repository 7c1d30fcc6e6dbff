// Seventh round of feature combinations of fully_shard: deferred initialisation (common/nn/deferred_init.h,
// Note [deferred init under fully_shard] in fsdp/param_group.cc) crossed with HSDP meshes, cpu offload, k-group
// reshard, nested units, frozen parameters and GPT's tied embedding (DESIGN.md section 8):
//   * every rank's materialised shards are exactly its rows of an eagerly built model with the same seed (the rows
//     of its shard group under HSDP), frozen parameters keep requires_grad false, the tied embedding stays one
//     tensor under both names, no recipe is left, and training (with the frozen parts unfrozen mid-run) gives the
//     bits of the same layout built eagerly and equals one rank;
//   * parameters a fully_shard call leaves whole (FullyShardOptions::ignored_params) inside a DeferredInitScope
//     must be materialised (they are whole on every rank) or refused, never left without bytes.
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/comm/device_mesh.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/deferred_init.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "fsdp/fully_shard.h"
#include "gtest/gtest.h"
#include "tests/fsdp/fsdp_combo6_util.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp {
namespace {

using combo6::Params;

// Frozen before fully_shard (inside the scope): attention of block 0, and the tied embedding (wte = lm_head).
const std::vector<std::string> kFrozen = {"blocks.0.attn", "wte"};

void SetTrainable(nn::GPT& model, bool on) {
  for (const auto& [name, m] : model.named_modules()) {
    for (const std::string& f : kFrozen) {
      if (name == f) m->set_requires_grad(on);
    }
  }
}

bool IsFrozenName(const std::string& n) {
  for (const std::string& f : kFrozen) {
    if (n.rfind(f + ".", 0) == 0) return true;
  }
  return false;
}

struct DCase {
  int replicas = 1;
  int shards = 2;
  bool offload = false;
  bool nested = false;  // MLP units inside the block units
  std::optional<std::variant<bool, int>> block_reshard = std::nullopt;
  int world() const { return replicas * shards; }
};

std::string Describe(const DCase& c) {
  return absl::StrCat(c.replicas > 1 ? absl::StrCat("hsdp ", c.replicas, "x") : "1-D ", c.shards,
                      c.offload ? " offload" : "", c.nested ? " nested" : "",
                      c.block_reshard && std::holds_alternative<int>(*c.block_reshard)
                          ? absl::StrCat(" k=", std::get<int>(*c.block_reshard))
                          : "");
}

absl::Status ShardCase(nn::GPT& model, const std::shared_ptr<comm::ProcessGroup>& pg, const DCase& c) {
  std::optional<comm::DeviceMesh> mesh;
  if (c.replicas > 1) {
    auto m = comm::DeviceMesh::create(pg, {c.replicas, c.shards}, {"replicate", "shard"});
    if (!m.ok()) return m.status();
    mesh.emplace(std::move(*m));
  }
  FullyShardOptions o;
  o.reshard_after_forward = c.block_reshard;
  o.offload_policy.cpu = c.offload;
  auto shard = [&](nn::Module& m, const FullyShardOptions& opts) -> absl::Status {
    return (mesh ? fully_shard(m, *mesh, opts) : fully_shard(m, pg, opts)).status();
  };
  if (c.nested) {
    for (nn::Module* m : modules_of_type(model, "MLP")) {
      if (absl::Status s = shard(*m, o); !s.ok()) return s;
    }
  }
  for (nn::Module* b : modules_of_type(model, "TransformerBlock")) {
    if (absl::Status s = shard(*b, o); !s.ok()) return s;
  }
  FullyShardOptions root = o;
  root.reshard_after_forward = std::nullopt;
  return shard(model, root);
}

// The eager model's values by name (seed 1).
std::vector<std::pair<std::string, std::vector<float>>> EagerByName() {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT model(gpt_tiny::TinyConfig(), 1);
  std::vector<std::pair<std::string, std::vector<float>>> out;
  for (const auto& [name, t] : model.named_parameters()) out.emplace_back(name, t.to_vector());
  return out;
}

constexpr int kSteps = 4;
constexpr int kUnfreezeAt = 2;

// Single-rank training with kFrozen frozen until kUnfreezeAt.
Params Reference() {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT model(gpt_tiny::TinyConfig(), 1);
  SetTrainable(model, false);
  auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
  for (int step = 0; step < kSteps; ++step) {
    if (step == kUnfreezeAt) SetTrainable(model, true);
    auto [x, y] = gpt_tiny::Batch(step, 0, gpt_tiny::kBatch);
    (*opt)->zero_grad();
    autograd::backward(model.loss(x, y));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return gpt_tiny::Values(model);
}

// One rank: GPT-tiny seed 1 built inside a DeferredInitScope when `deferred` (kFrozen frozen there, before
// fully_shard) and sharded as `c` inside it, its shards checked against the eager rows; then trained kSteps steps
// with kFrozen unfrozen before kUnfreezeAt. Full values at the end.
absl::StatusOr<Params> RunRank(comm::RankEnv& env, const DCase& c, bool deferred) {
  static const auto eager = EagerByName();
  nn::DeferredInit init;
  std::unique_ptr<nn::GPT> model;
  {
    std::optional<nn::DeferredInitScope> scope;
    if (deferred) scope.emplace(init);
    model = std::make_unique<nn::GPT>(gpt_tiny::TinyConfig(), 1);
    SetTrainable(*model, false);
    if (absl::Status s = ShardCase(*model, env.group_ptr, c); !s.ok()) return s;
  }
  EXPECT_EQ(init.pending(), 0u) << "every parameter materialised";
  // The tied embedding is still one tensor, registered under both names.
  EXPECT_EQ(model->wte->parameter("weight").id(), model->lm_head->parameter("weight").id());
  const int shard_rank = env.rank % c.shards;  // the rank's place in its shard group (a row of the mesh)
  std::size_t checked = 0;
  for (const NamedParameter& p : named_parameters(*model)) {
    const std::string& name = p.names.front();
    if (name == "wte.weight") {
      EXPECT_EQ(p.names, (std::vector<std::string>{"wte.weight", "lm_head.weight"}));
    }
    if (!p.shard.has_value()) {
      ADD_FAILURE() << name << " is not sharded";
      continue;
    }
    const ShardedTensor& s = *p.shard;
    EXPECT_EQ(s.local.requires_grad(), !IsFrozenName(name)) << name;
    EXPECT_TRUE(s.local.device().is_cpu()) << name;
    const RowSplit rs = split_rows(s.global_shape, shard_rank, c.shards);
    EXPECT_EQ(s.row_offset, rs.row_offset) << name << " rank " << env.rank;
    for (const auto& [ename, values] : eager) {
      if (ename != name) continue;
      ++checked;
      const std::vector<float> rows(values.begin() + rs.row_offset * rs.row_numel,
                                    values.begin() + (rs.row_offset + rs.local_rows) * rs.row_numel);
      EXPECT_EQ(s.local.to_vector(), rows) << name << " rank " << env.rank << ": not the eager model's rows";
    }
  }
  EXPECT_EQ(checked, eager.size());
  auto opt = optim::AdamW::factory()({{model->parameters(), optim::AdamW::default_hyper()}});
  if (!opt.ok()) return opt.status();
  const combo6::GptCase gc{.replicas = c.replicas, .shards = c.shards};
  for (int step = 0; step < kSteps; ++step) {
    if (step == kUnfreezeAt) SetTrainable(*model, true);
    if (absl::Status s = combo6::TrainSteps(*model, **opt, env.rank, gc, step, step + 1); !s.ok()) return s;
  }
  return test_util::FullValues(*model);
}

std::vector<Params> InProcess(const DCase& c, bool deferred) {
  std::vector<Params> got(static_cast<std::size_t>(c.world()));
  absl::Status st = comm::RunRanks(c.world(), [&](comm::RankEnv& env) -> absl::Status {
    auto v = RunRank(env, c, deferred);
    if (!v.ok()) return v.status();
    got[static_cast<std::size_t>(env.rank)] = std::move(*v);
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << Describe(c) << (deferred ? " deferred" : " eager") << ": " << st;
  return got;
}

TEST(FsdpDeferredInitCombo7, MaterialisedShardsAreTheEagerRowsAndTrainAsEagerAndOneRank) {
  static const Params want = Reference();
  const DCase cases[] = {
      {.shards = 3, .offload = true},
      {.shards = 4, .block_reshard = 2},
      {.shards = 2, .offload = true, .nested = true},
      {.replicas = 2, .shards = 2, .offload = true},
      {.replicas = 2, .shards = 3, .nested = true},
      {.replicas = 2, .shards = 4, .offload = true, .block_reshard = 2},
  };
  for (const DCase& c : cases) {
    SCOPED_TRACE(Describe(c));
    const std::vector<Params> deferred = InProcess(c, true);
    gpt_tiny::ExpectMatches(deferred, InProcess(c, false)[0], 0.0);
    gpt_tiny::ExpectMatches(deferred, want, 2e-5);
  }
}

// A parameter this call leaves whole (ignored_params: ln_f's) inside the scope: FSDP does not shard it, so it must
// come out materialised with the eager values on every rank, never without bytes (an audit found it left without
// bytes and the first forward dying on an internal check).
TEST(FsdpDeferredInitCombo7, AnIgnoredParameterInsideTheScopeIsMaterialised) {
  static const auto eager = EagerByName();
  std::vector<float> want;
  for (const auto& [name, values] : eager) {
    if (name == "ln_f.weight") want = values;
  }
  ASSERT_FALSE(want.empty());
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::DeferredInit init;
    nn::DeferredInitScope scope(init);
    nn::GPT model(gpt_tiny::TinyConfig(), 1);
    const Tensor ignored = model.ln_f->parameter("weight");
    FullyShardOptions o;
    o.ignored_params = {ignored};
    for (nn::Module* b : modules_of_type(model, "TransformerBlock")) {
      if (auto s = fully_shard(*b, env.group_ptr); !s.ok()) return s.status();
    }
    if (absl::Status s = fully_shard(model, env.group_ptr, o).status(); !s.ok()) return s;
    EXPECT_FALSE(ignored.storage_released()) << "ln_f.weight is left without bytes";
    EXPECT_EQ(init.pending(), 0u) << "a recipe is left";
    if (!ignored.storage_released()) {
      EXPECT_EQ(ignored.to_vector(), want);
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace shardkit::fsdp
