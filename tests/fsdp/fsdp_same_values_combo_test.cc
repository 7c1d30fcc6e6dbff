// Combination audit of two features (a helper's; tests only): fully_shard's same-values check (Note [same values on
// every rank] in fsdp/same_values.cc) and the per-unit collective fingerprints (Note [unit fingerprints] in
// fsdp/param_group.cc), crossed with the process backends (TCP and shared memory, tests/testing/tcp_ranks.h), HSDP
// 2x2, reshard_after_forward = k, nested units, auto_shard with GPT's tied embedding left to the root, activation
// checkpointing, set_reshard_after_backward(false) with accumulation, deferred init, cpu offload, bf16 and loads of a
// checkpoint saved at another world size. What a user expects:
//   * the same seed trains exactly as before: over TCP / shm bitwise equal to the same case in-process (whose f32
//     cases equal single-rank training within the existing tolerance), so no fingerprint differs where it must not;
//   * another seed on one rank is told on every rank (InvalidArgument naming the parameter), in bounded time, under
//     every backend and combination;
//   * fsdp's loaders (full, sharded from world 4, safetensors rows exported at world 4) clear it, and the loaded
//     model trains to the bits of a model built from the checkpoint's seed;
//   * ranks that run different units of one size are told under every fingerprint-checking backend, also when the
//     breach is seen only by HSDP's replicate all-reduce (each replica agrees within itself). (With an input that
//     needs no gradient the units no post-backward reached are reduced in module order at the end of backward, so
//     the replicas' all-reduces pair a with a and c with c: no breach there, and nothing to tell.)
// Found (kept skipped as a BUG): two roots of one size (each unit that is a root is named "" under itself) carry one
// fingerprint, so ranks that run them in another order pair them silently (FsdpFingerprintTwoRoots).
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/autograd/engine.h"
#include "common/autograd/ops/elementwise.h"
#include "common/comm/device_mesh.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/checkpoint.h"
#include "common/nn/deferred_init.h"
#include "common/nn/gpt.h"
#include "common/nn/layers.h"
#include "common/optim/adam.h"
#include "fsdp/fully_shard.h"
#include "fsdp/safetensors_export.h"
#include "fsdp/state_dict.h"
#include "fsdp/wrap_policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/fsdp/fsdp_combo6_util.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"
#include "tests/testing/tcp_ranks.h"

namespace shardkit::fsdp {
namespace {

using ::testing::HasSubstr;
using combo6::Accumulate;
using combo6::GptCase;
using Params = std::vector<std::vector<float>>;

constexpr int kSteps = 2;

struct Case {
  std::string name;
  GptCase g;
  bool nested = false;        // every block's MLP a unit of its own
  bool ckpt = false;          // nn::checkpoint_blocks after sharding
  bool deferred = false;      // built and sharded inside a DeferredInitScope
  bool auto_shard = false;    // auto_shard choosing the blocks and lm_head (its tied weight left to the root)
  bool keep = false;          // set_reshard_after_backward(false) on every unit (with accumulation)
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

const std::vector<Case>& Cases() {
  static const std::vector<Case> cases = {
      {.name = "plain", .g = {.shards = 2}},
      {.name = "n3", .g = {.shards = 3}},
      {.name = "hsdp_2x2", .g = {.replicas = 2, .shards = 2}},
      {.name = "k2_n4", .g = {.shards = 4, .block_reshard = 2}},
      {.name = "hsdp_2x4_k2_bf16", .g = {.replicas = 2, .shards = 4, .bf16 = true, .block_reshard = 2}},
      {.name = "nested", .g = {.shards = 2}, .nested = true},
      {.name = "nested_hsdp_ckpt", .g = {.replicas = 2, .shards = 2}, .nested = true, .ckpt = true},
      {.name = "ckpt_k2", .g = {.shards = 4, .block_reshard = 2}, .ckpt = true},
      {.name = "auto_shard_tied", .g = {.shards = 2}, .auto_shard = true},
      {.name = "auto_shard_tied_hsdp", .g = {.replicas = 2, .shards = 2}, .auto_shard = true},
      {.name = "keep_no_sync", .g = {.shards = 2, .accumulate = Accumulate::no_sync}, .keep = true},
      {.name = "keep_hsdp_defer", .g = {.replicas = 2, .shards = 2, .accumulate = Accumulate::defer_all_reduce},
       .keep = true},
      {.name = "deferred", .g = {.shards = 2}, .deferred = true},
      {.name = "deferred_hsdp_offload", .g = {.replicas = 2, .shards = 2, .offload = true}, .deferred = true},
      {.name = "offload_bf16", .g = {.shards = 2, .bf16 = true, .offload = true}},
      {.name = "hsdp_2x1_replicas_only", .g = {.replicas = 2, .shards = 1}},
      {.name = "hsdp_4x1_replicas_only_nested", .g = {.replicas = 4, .shards = 1}, .nested = true},
  };
  return cases;
}

absl::Status Caught(const std::function<absl::Status()>& fn) {
  try {
    return fn();
  } catch (const autograd::StatusError& e) {
    return e.status();
  }
}

// fully_shard (or auto_shard) GPT-tiny as the case says, with short timeouts.
absl::Status Shard(nn::GPT& model, const std::shared_ptr<comm::ProcessGroup>& pg, const Case& c) {
  std::optional<comm::DeviceMesh> mesh;
  if (c.g.replicas > 1) {
    auto m = comm::DeviceMesh::create(pg, {c.g.replicas, c.g.shards}, {"replicate", "shard"});
    if (!m.ok()) return m.status();
    mesh.emplace(std::move(*m));
  }
  FullyShardOptions o = combo6::BlockOptions(c.g);
  o.timeout = absl::Seconds(2);
  if (c.auto_shard) {
    // auto_shard has no mesh overload: under HSDP the blocks and lm_head by hand, lm_head's tied weight left to the
    // root, as the plan places it.
    auto pred = [](const std::string& fqn, const nn::Module& m) {
      return m.type_name() == "TransformerBlock" || fqn == "lm_head";
    };
    if (!mesh) return auto_shard(model, by_predicate(pred), pg, o).status();
    auto plan = plan_auto_shard(model, by_predicate(pred));
    if (!plan.ok()) return plan.status();
    for (const ShardPlan::Unit& u : plan->units) {
      FullyShardOptions uo = o;
      uo.leave_to_ancestor = u.leave_to_ancestor;
      if (u.module == &model) uo.reshard_after_forward = std::nullopt;
      if (auto s = fully_shard(*u.module, *mesh, uo); !s.ok()) return s.status();
    }
    return absl::OkStatus();
  }
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

// What one rank saw: the status of the first and the second step (after loading `load`, when given), and the full
// values at the end when both passed.
struct Seen {
  absl::Status first, second;
  Params values;
};

using Load = std::function<absl::Status(nn::GPT&)>;

Seen RunRank(const std::shared_ptr<comm::ProcessGroup>& pg, const Case& c, std::uint64_t seed, const Load& load = nullptr,
             const Load& after_opt = nullptr) {
  Seen seen;
  nn::DeferredInit init;
  std::unique_ptr<nn::GPT> model;
  {
    std::optional<nn::DeferredInitScope> scope;
    if (c.deferred) scope.emplace(init);
    model = std::make_unique<nn::GPT>(gpt_tiny::TinyConfig(), seed);
    seen.first = Shard(*model, pg, c);
  }
  if (!seen.first.ok()) return seen;
  if (c.ckpt) {
    if (absl::Status s = nn::checkpoint_blocks(*model); !s.ok()) {
      seen.first = s;
      return seen;
    }
  }
  if (c.keep) state_of(*model)->set_reshard_after_backward(false, /*recurse=*/true);
  if (load) {
    if (absl::Status s = Caught([&] { return load(*model); }); !s.ok()) {
      seen.first = s;
      return seen;
    }
  }
  auto opt = optim::AdamW::factory()({{model->parameters(), optim::AdamW::default_hyper()}});
  if (!opt.ok()) {
    seen.first = opt.status();
    return seen;
  }
  if (after_opt) {
    if (absl::Status s = Caught([&] { return after_opt(*model); }); !s.ok()) {
      seen.first = s;
      return seen;
    }
  }
  seen.first = Caught([&] { return combo6::TrainSteps(*model, **opt, pg->rank(), c.g, 0, 1); });
  seen.second = Caught([&] { return combo6::TrainSteps(*model, **opt, pg->rank(), c.g, 1, kSteps); });
  if (seen.first.ok() && seen.second.ok()) {
    auto v = Caught([&]() -> absl::Status {
      auto full = test_util::FullValues(*model);
      if (!full.ok()) return full.status();
      seen.values = std::move(*full);
      return absl::OkStatus();
    });
    if (!v.ok()) seen.second = v;
  }
  return seen;
}

// Every rank of `c` over `backend` ("inproc", "tcp", "shm"), seed seed_of(rank).
std::vector<Seen> RunAll(const std::string& backend, const Case& c, const std::function<std::uint64_t(int)>& seed_of,
                      const Load& load = nullptr, const Load& after_opt = nullptr) {
  const int world = c.g.world();
  std::vector<Seen> seen(static_cast<std::size_t>(world));
  auto one = [&](const std::shared_ptr<comm::ProcessGroup>& pg) -> absl::Status {
    seen[static_cast<std::size_t>(pg->rank())] = RunRank(pg, c, seed_of(pg->rank()), load, after_opt);
    return absl::OkStatus();
  };
  absl::Status st;
  if (backend == "inproc") {
    st = comm::RunRanks(world, [&](comm::RankEnv& env) { return one(env.group_ptr); }, {.timeout = absl::Seconds(20)});
  } else {
    st = tcp_ranks::RunTcpRanks(world, backend, "same_values_combo", one);  // (a store of its own each run)
  }
  EXPECT_TRUE(st.ok()) << backend << " " << c.name << ": " << st;
  return seen;
}

bool IsF32Exact(const Case& c) { return !c.g.bf16 && c.g.accumulate == Accumulate::none; }

class FsdpSameValuesCombo : public ::testing::TestWithParam<std::tuple<std::string, Case>> {};

// The same seed everywhere: both steps pass on every rank, and the values equal the same case in-process bitwise
// (and, f32 without accumulation, single-rank training within 1e-5).
TEST_P(FsdpSameValuesCombo, TheSameSeedTrainsAsInProcess) {
  const auto& [backend, c] = GetParam();
  const std::vector<Seen> got = RunAll(backend, c, [](int) { return 1; });
  std::vector<Params> values;
  for (std::size_t r = 0; r < got.size(); ++r) {
    ASSERT_TRUE(got[r].first.ok()) << "rank " << r << ": " << got[r].first;
    ASSERT_TRUE(got[r].second.ok()) << "rank " << r << ": " << got[r].second;
    values.push_back(got[r].values);
  }
  if (backend == "inproc") {
    if (IsF32Exact(c)) gpt_tiny::ExpectMatches(values, gpt_tiny::Reference(kSteps), 1e-5);
    for (std::size_t r = 1; r < values.size(); ++r) EXPECT_EQ(values[r], values[0]) << "rank " << r;
    return;
  }
  // Bitwise at 2 ranks (and HSDP 2x2); beyond, the process backends sum a reduce-scatter's pieces in another order
  // than the in-process one, so within the tolerance of tests/fsdp/fsdp_combo4_test.cc (and equal across ranks).
  const std::vector<Seen> want = RunAll("inproc", c, [](int) { return 1; });
  if (c.g.shards == 2) {
    for (std::size_t r = 0; r < got.size(); ++r) EXPECT_TRUE(got[r].values == want[r].values) << "rank " << r << " differs";
  } else {
    gpt_tiny::ExpectMatches(values, want[0].values, c.g.bf16 ? 1e-3 : 1e-6);
  }
}

// The last rank builds from seed 2: every rank is told at the first step and again at the second, naming wte.weight
// (the tied embedding, left to the root by auto_shard) and the ranks; nothing hangs.
TEST_P(FsdpSameValuesCombo, AnotherSeedOnTheLastRankIsToldOnEveryRank) {
  const auto& [backend, c] = GetParam();
  const int last = c.g.world() - 1;
  const std::vector<Seen> got = RunAll(backend, c, [last](int r) { return r == last ? 2 : 1; });
  for (std::size_t r = 0; r < got.size(); ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    for (const absl::Status& s : {got[r].first, got[r].second}) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_THAT(std::string(s.message()),
                  HasSubstr(absl::StrCat("parameter 'wte.weight' on rank ", last, " differs from rank 0's")));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Combos, FsdpSameValuesCombo,
                         ::testing::Combine(::testing::Values(std::string("inproc"), std::string("tcp"),
                                                              std::string("shm")),
                                            ::testing::ValuesIn(Cases())),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param).name; });

// ---- loads of a checkpoint saved at another world size ----------------------------------------------------------

// The checkpoint: GPT-tiny seed 1 sharded over 4 in-process ranks, untrained: every rank's sharded piece, and a
// safetensors export (sharded, one file per rank) in a temporary directory.
struct Checkpoint {
  std::vector<ShardedStateDict> pieces;
  nn::StateDict full;
  std::string dir;
};

const Checkpoint& World4Checkpoint() {
  static const Checkpoint* ck = [] {
    auto* c = new Checkpoint;
    c->pieces.resize(4);
    c->dir = (std::filesystem::temp_directory_path() / absl::StrCat("fsdp_same_values_combo_", ::getpid())).string();
    std::filesystem::create_directories(c->dir);
    static std::string to_remove;
    to_remove = c->dir;
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(to_remove, ec);
    });
    absl::Status st = comm::RunRanks(4, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(gpt_tiny::TinyConfig(), 1);
      if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
      auto piece = sharded_state_dict(model);
      if (!piece.ok()) return piece.status();
      c->pieces[static_cast<std::size_t>(env.rank)] = std::move(*piece);
      if (absl::Status s = export_sharded_safetensors(model, c->dir); !s.ok()) return s;
      auto full = full_state_dict(model);
      if (!full.ok()) return full.status();
      if (env.rank == 0) c->full = std::move(*full);
      return absl::OkStatus();
    });
    EXPECT_TRUE(st.ok()) << st;
    return c;
  }();
  return *ck;
}

enum class Loader { full, sharded, safetensors };

class FsdpSameValuesLoadCombo : public ::testing::TestWithParam<std::tuple<std::string, Loader, Case>> {};

// Every rank built from its own seed (3 + rank), loads the world-4 checkpoint of seed 1, and trains: nothing is
// told, and the values equal the same case built from seed 1 with no load, bitwise.
TEST_P(FsdpSameValuesLoadCombo, ALoadFromAnotherWorldSizeClearsIt) {
  const auto& [backend, loader, c] = GetParam();
  const Checkpoint& ck = World4Checkpoint();
  Load load = [&, loader = loader](nn::GPT& model) -> absl::Status {
    switch (loader) {
      case Loader::full: return load_full_state_dict(model, ck.full);
      case Loader::sharded: return load_sharded_state_dict(model, ck.pieces);
      case Loader::safetensors: return load_safetensors_rows(model, ck.dir);
    }
    return absl::InternalError("?");
  };
  const std::vector<Seen> got = RunAll(backend, c, [](int r) { return 3 + static_cast<std::uint64_t>(r); }, load);
  const std::vector<Seen> want = RunAll(backend, c, [](int) { return 1; });
  for (std::size_t r = 0; r < got.size(); ++r) {
    ASSERT_TRUE(got[r].first.ok()) << "rank " << r << ": " << got[r].first;
    ASSERT_TRUE(got[r].second.ok()) << "rank " << r << ": " << got[r].second;
    EXPECT_TRUE(got[r].values == want[r].values) << "rank " << r << ": not the checkpoint's model trained";
  }
}

// A partial load (strict = false, wte.weight only: lm_head.weight is the same tensor) when the ranks' models
// differ everywhere clears only what it wrote: still told, naming the next differing parameter (not wte.weight).
class FsdpSameValuesPartialLoad : public ::testing::TestWithParam<std::tuple<std::string, Case>> {};

TEST_P(FsdpSameValuesPartialLoad, APartialLoadClearsOnlyWhatItWrote) {
  const auto& [backend, c] = GetParam();
  const Checkpoint& ck = World4Checkpoint();
  nn::StateDict part;
  for (const auto& [name, t] : ck.full) {
    if (name == "wte.weight" || name == "lm_head.weight") part.emplace_back(name, t);
  }
  ASSERT_FALSE(part.empty());
  Load load = [&](nn::GPT& model) { return load_full_state_dict(model, part, /*strict=*/false); };
  const std::vector<Seen> got = RunAll(backend, c, [](int r) { return 3 + static_cast<std::uint64_t>(r); }, load);
  for (std::size_t r = 0; r < got.size(); ++r) {
    EXPECT_EQ(got[r].first.code(), absl::StatusCode::kInvalidArgument) << "rank " << r << ": " << got[r].first;
    EXPECT_THAT(std::string(got[r].first.message()), HasSubstr("differs from rank 0's"));
    EXPECT_THAT(std::string(got[r].first.message()), ::testing::Not(HasSubstr("'wte.weight'")));
  }
}

const std::vector<Case>& LoadCases() {
  static const std::vector<Case> cases = {
      {.name = "plain", .g = {.shards = 2}},
      {.name = "hsdp_2x2", .g = {.replicas = 2, .shards = 2}},
      {.name = "n3_k_nested", .g = {.shards = 3}, .nested = true},
      {.name = "k2_n4_offload_bf16", .g = {.shards = 4, .bf16 = true, .offload = true, .block_reshard = 2}},
      {.name = "auto_shard_tied", .g = {.shards = 2}, .auto_shard = true},
      {.name = "deferred_keep", .g = {.shards = 2, .accumulate = Accumulate::no_sync}, .deferred = true, .keep = true},
  };
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Loads, FsdpSameValuesPartialLoad,
                         ::testing::Combine(::testing::Values(std::string("inproc"), std::string("tcp"),
                                                              std::string("shm")),
                                            ::testing::ValuesIn(LoadCases())),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param).name; });

INSTANTIATE_TEST_SUITE_P(
    Loads, FsdpSameValuesLoadCombo,
    ::testing::Combine(::testing::Values(std::string("inproc"), std::string("tcp"), std::string("shm")),
                       ::testing::Values(Loader::full, Loader::sharded, Loader::safetensors),
                       ::testing::ValuesIn(LoadCases())),
    [](const auto& info) {
      const Loader l = std::get<1>(info.param);
      return std::get<0>(info.param) + "_" +
             (l == Loader::full ? "full" : l == Loader::sharded ? "sharded" : "safetensors") + "_" +
             std::get<2>(info.param).name;
    });

// ---- different units of one size on different ranks -------------------------------------------------------------

class Branches : public nn::Module {
 public:
  Branches(Generator& gen, bool skip_a) : Module("Branches"), skip_a_(skip_a) {
    a = std::make_shared<nn::Linear>(4, 4, gen);
    b = std::make_shared<nn::Linear>(4, 4, gen);
    c = std::make_shared<nn::Linear>(4, 4, gen);
    register_module("a", a);
    register_module("b", b);
    register_module("c", c);
  }
  std::shared_ptr<nn::Linear> a, b, c;

 protected:
  Tensor forward(const Tensor& x) override { return (*b)(skip_a_ ? (*c)(x) : (*a)(x)); }

 private:
  bool skip_a_;
};

class FsdpFingerprintCombo : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

// Mode 0: 1-D over 2 ranks, rank 1 runs c where rank 0 runs a (the forward's all-gather pairs them). Mode 1: HSDP
// 2x2, ranks 1 and 3 run c. Mode 2: HSDP 2x2, replica 1 (ranks 2, 3) runs c: each shard group agrees within itself,
// so only the replicate all-reduce of a's / c's gradients (same size) pairs different units. Mode 3: 1-D over 4
// ranks with reshard_after_forward = 2 (k-groups). Every rank fails (no silent pairing, no hang).
TEST_P(FsdpFingerprintCombo, DifferentUnitsOfOneSizeAreToldOnEveryRank) {
  const auto& [backend, mode] = GetParam();
  const int world = mode == 0 ? 2 : 4;
  std::vector<absl::Status> seen(static_cast<std::size_t>(world));
  auto one = [&](const std::shared_ptr<comm::ProcessGroup>& pg) -> absl::Status {
    const int rank = pg->rank();
    const bool skip = mode == 0 ? rank == 1 : mode == 1 ? rank % 2 == 1 : mode == 2 ? rank >= 2 : rank == 1;
    Generator gen(1);
    Branches model(gen, skip);
    std::optional<comm::DeviceMesh> mesh;
    if (mode == 1 || mode == 2) {
      auto m = comm::DeviceMesh::create(pg, {2, 2}, {"replicate", "shard"});
      if (!m.ok()) return m.status();
      mesh.emplace(std::move(*m));
    }
    FullyShardOptions o{.timeout = absl::Seconds(2)};
    if (mode == 3) o.reshard_after_forward = 2;
    for (nn::Module* m : {static_cast<nn::Module*>(model.a.get()), static_cast<nn::Module*>(model.b.get()),
                          static_cast<nn::Module*>(model.c.get()), static_cast<nn::Module*>(&model)}) {
      FullyShardOptions mo = o;
      if (m == &model) mo.reshard_after_forward = std::nullopt;
      auto s = mesh ? fully_shard(*m, *mesh, mo) : fully_shard(*m, pg, mo);
      if (!s.ok()) return s.status();
    }
    seen[static_cast<std::size_t>(rank)] = Caught([&]() -> absl::Status {
      for (int step = 0; step < 2; ++step) {
        // The input requires grad, so that a's / c's reduce runs from its own post-backward hook, in the order the
        // ranks ran the units (Note [post-backward on a unit's inputs]).
        Tensor x = Tensor::full({2, 4}, 1.0f + static_cast<float>(rank));
        x.set_requires_grad(true);
        if (absl::Status b = autograd::try_backward(autograd::sum(model(x))); !b.ok()) return b;
      }
      return absl::OkStatus();
    });
    return absl::OkStatus();
  };
  absl::Status st;
  if (backend == "inproc") {
    st = comm::RunRanks(world, [&](comm::RankEnv& env) { return one(env.group_ptr); }, {.timeout = absl::Seconds(20)});
  } else {
    st = tcp_ranks::RunTcpRanks(world, backend, "fingerprint_combo", one);
  }
  (void)st;  // a rank that departs first makes the others' error; every rank must fail
  std::string all;
  for (int r = 0; r < world; ++r) {
    EXPECT_FALSE(seen[static_cast<std::size_t>(r)].ok()) << backend << " mode " << mode << ": rank " << r << " was not told";
    absl::StrAppend(&all, seen[static_cast<std::size_t>(r)].ToString(), "\n");
  }
  EXPECT_THAT(all, HasSubstr("fingerprint")) << all;
  EXPECT_THAT(all, ::testing::Not(HasSubstr("DEADLINE_EXCEEDED: fsdp"))) << all;
}

INSTANTIATE_TEST_SUITE_P(Backends, FsdpFingerprintCombo,
                         ::testing::Combine(::testing::Values(std::string("inproc"), std::string("tcp"),
                                                              std::string("shm")),
                                            ::testing::Values(0, 1, 2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_mode" + std::to_string(std::get<1>(info.param));
                         });


// ---- ignored parameters and loads; a load after the refusal, over the process backends ---------------------------

// ln_f.weight in the root's ignored_params, 2 on rank 1 only, over `backend`; `load` then runs on every rank.
// Whatever a loader does with ignored parameters, a user must not get a false refusal nor a model whose ranks hold
// other values: either both steps pass and ln_f.weight is equal on both ranks, or the refusal names ln_f.weight and
// its values do differ.
enum class After { full, sharded, safetensors, full_after_error, sharded_after_error };

std::string AfterName(After a) {
  switch (a) {
    case After::full: return "full";
    case After::sharded: return "sharded";
    case After::safetensors: return "safetensors";
    case After::full_after_error: return "full_after_error";
    case After::sharded_after_error: return "sharded_after_error";
  }
  return "?";
}

class FsdpSameValuesIgnoredLoad : public ::testing::TestWithParam<std::tuple<std::string, After>> {};

TEST_P(FsdpSameValuesIgnoredLoad, ALoadNeverRefusesWhatItMadeEqual) {
  const auto& [backend, after] = GetParam();
  const Checkpoint& ck = World4Checkpoint();
  std::vector<absl::Status> steps(2), refused(2);
  std::vector<std::vector<float>> ln_f(2);
  auto one = [&](const std::shared_ptr<comm::ProcessGroup>& pg) -> absl::Status {
    const std::size_t r = static_cast<std::size_t>(pg->rank());
    nn::GPT model(gpt_tiny::TinyConfig(), 1);
    if (r == 1) model.ln_f->parameter("weight").fill_(2.0);
    for (nn::Module* b : modules_of_type(model, "TransformerBlock")) {
      if (auto s = fully_shard(*b, pg, {.timeout = absl::Seconds(2)}); !s.ok()) return s.status();
    }
    FullyShardOptions root{.timeout = absl::Seconds(2)};
    root.ignored_params = {model.ln_f->parameter("weight")};
    if (auto s = fully_shard(model, pg, root); !s.ok()) return s.status();
    if (after == After::full_after_error || after == After::sharded_after_error) {
      auto [x, y] = gpt_tiny::Batch(0, pg->rank() * 12, 12);
      refused[r] = Caught([&] { return autograd::try_backward(model.loss(x, y)); });
    }
    absl::Status loaded;
    switch (after) {
      case After::full:
      case After::full_after_error: loaded = load_full_state_dict(model, ck.full); break;
      case After::sharded:
      case After::sharded_after_error: loaded = load_sharded_state_dict(model, ck.pieces); break;
      case After::safetensors: loaded = load_safetensors_rows(model, ck.dir); break;
    }
    if (!loaded.ok()) return loaded;
    ln_f[r] = gpt_tiny::Values(*model.ln_f)[0];  // as loaded (training moves it by each rank's own gradient)
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    steps[r] = Caught([&] { return test_util::TrainRows(model, **opt, pg->rank(), 2, 0, 1); });
    return absl::OkStatus();
  };
  absl::Status st;
  if (backend == "inproc") {
    st = comm::RunRanks(2, [&](comm::RankEnv& env) { return one(env.group_ptr); }, {.timeout = absl::Seconds(20)});
  } else {
    st = tcp_ranks::RunTcpRanks(2, backend, "same_values_ignored", one);
  }
  ASSERT_TRUE(st.ok()) << st;
  if (after == After::full_after_error || after == After::sharded_after_error) {
    for (std::size_t r = 0; r < 2; ++r) EXPECT_EQ(refused[r].code(), absl::StatusCode::kInvalidArgument) << refused[r];
  }
  for (std::size_t r = 0; r < 2; ++r) {
    if (steps[r].ok()) {
      EXPECT_EQ(ln_f[r], ln_f[0]) << "rank " << r << " trains from its own ln_f.weight, not told";
    } else {
      EXPECT_EQ(steps[r].code(), absl::StatusCode::kInvalidArgument) << steps[r];
      EXPECT_THAT(std::string(steps[r].message()), HasSubstr("ignored parameter 'ln_f.weight' on rank 1"));
      EXPECT_NE(ln_f[1], ln_f[0]) << "refused although the load made ln_f.weight equal";
    }
    EXPECT_EQ(steps[r].ok(), steps[0].ok()) << "told on some ranks only";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Loads, FsdpSameValuesIgnoredLoad,
    ::testing::Combine(::testing::Values(std::string("inproc"), std::string("tcp"), std::string("shm")),
                       ::testing::Values(After::full, After::sharded, After::safetensors, After::full_after_error,
                                         After::sharded_after_error)),
    [](const auto& info) { return std::get<0>(info.param) + "_" + AfterName(std::get<1>(info.param)); });

// A load after the refusal over the process backends under HSDP and k-groups: every rank refused, loads the
// world-4 checkpoint, and trains to the bits of the case built from its seed.
class FsdpSameValuesLoadAfterError : public ::testing::TestWithParam<std::tuple<std::string, Case>> {};

TEST_P(FsdpSameValuesLoadAfterError, TrainsAsTheCheckpointsModel) {
  const auto& [backend, c] = GetParam();
  const Checkpoint& ck = World4Checkpoint();
  std::vector<absl::Status> refused(static_cast<std::size_t>(c.g.world()));
  Load load = [&](nn::GPT& model) -> absl::Status {
    const int rank = state_of(model)->state().process_group().global_ranks()[static_cast<std::size_t>(
        state_of(model)->state().process_group().rank())];
    const int rows = gpt_tiny::kBatch / c.g.world();
    auto [x, y] = gpt_tiny::Batch(0, rank * rows, rows);
    refused[static_cast<std::size_t>(rank)] = Caught([&] { return autograd::try_backward(model.loss(x, y)); });
    return load_sharded_state_dict(model, ck.pieces);
  };
  const std::vector<Seen> got = RunAll(backend, c, [](int r) { return 3 + static_cast<std::uint64_t>(r); }, load);
  const std::vector<Seen> want = RunAll(backend, c, [](int) { return 1; });
  for (std::size_t r = 0; r < got.size(); ++r) {
    EXPECT_EQ(refused[r].code(), absl::StatusCode::kInvalidArgument) << "rank " << r << ": " << refused[r];
    ASSERT_TRUE(got[r].first.ok()) << "rank " << r << ": " << got[r].first;
    ASSERT_TRUE(got[r].second.ok()) << "rank " << r << ": " << got[r].second;
    EXPECT_TRUE(got[r].values == want[r].values) << "rank " << r << ": not the checkpoint's model trained";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Loads, FsdpSameValuesLoadAfterError,
    ::testing::Combine(::testing::Values(std::string("inproc"), std::string("tcp"), std::string("shm")),
                       ::testing::Values(Case{.name = "hsdp_2x2_nested", .g = {.replicas = 2, .shards = 2}, .nested = true},
                                         Case{.name = "k2_n4_ckpt", .g = {.shards = 4, .block_reshard = 2}, .ckpt = true},
                                         Case{.name = "auto_shard_tied_keep",
                                              .g = {.shards = 2, .accumulate = Accumulate::no_sync},
                                              .auto_shard = true,
                                              .keep = true})),
    [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param).name; });

// ---- units gathered before the root's lazy initialisation ------------------------------------------------------

// FSDPModule::unshard on block 0 and on the root before the first forward (FSDP2's manual prefetch), on every rank:
// those all-gathers run before the root names its units (fingerprint 0 on every rank), the first forward then finds
// them unsharded. Nothing is told, and training equals the same case without the early unshard, bitwise.
class FsdpFingerprintEarlyUnshard : public ::testing::TestWithParam<std::tuple<std::string, Case>> {};

TEST_P(FsdpFingerprintEarlyUnshard, AnUnshardBeforeTheFirstForwardTrainsAsWithout) {
  const auto& [backend, c] = GetParam();
  Load early = [](nn::GPT& model) -> absl::Status {
    for (nn::Module* m : {static_cast<nn::Module*>((*model.blocks)[0].get()), static_cast<nn::Module*>(&model)}) {
      auto h = state_of(*m)->unshard(/*async_op=*/m != &model);
      if (!h.ok()) return h.status();
      if (absl::Status s = h->wait(); !s.ok()) return s;
    }
    return absl::OkStatus();
  };
  const std::vector<Seen> got = RunAll(backend, c, [](int) { return 1; }, nullptr, early);
  const std::vector<Seen> want = RunAll(backend, c, [](int) { return 1; });
  for (std::size_t r = 0; r < got.size(); ++r) {
    ASSERT_TRUE(got[r].first.ok()) << "rank " << r << ": " << got[r].first;
    ASSERT_TRUE(got[r].second.ok()) << "rank " << r << ": " << got[r].second;
    EXPECT_TRUE(got[r].values == want[r].values) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Early, FsdpFingerprintEarlyUnshard,
    ::testing::Combine(::testing::Values(std::string("inproc"), std::string("tcp"), std::string("shm")),
                       ::testing::Values(Case{.name = "plain", .g = {.shards = 2}},
                                         Case{.name = "hsdp_2x2_nested", .g = {.replicas = 2, .shards = 2}, .nested = true},
                                         Case{.name = "k2_n4_ckpt", .g = {.shards = 4, .block_reshard = 2}, .ckpt = true},
                                         Case{.name = "keep_no_sync_bf16",
                                              .g = {.shards = 2, .bf16 = true, .accumulate = Accumulate::no_sync},
                                              .keep = true})),
    [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param).name; });

// ---- two roots ------------------------------------------------------------------------------------------------

// Two models of one shape, each fully_shard'ed as its own root (a generator and a discriminator, say), run in
// another order on rank 1 than on rank 0: each rank's first all-gather pairs one model's rows with the other's.
// Expected: told on every rank (Note [unit fingerprints]), or else each rank's sum(g(x) + 2 d(x)) that of the models.
TEST(FsdpFingerprintTwoRoots, TwoRootsOfOneSizeRunInAnotherOrderAreTold) {
  float want = 0;
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    Generator gen(1);
    nn::Linear g(4, 4, gen), d(4, 4, gen);
    Tensor x = Tensor::full({2, 4}, 1.0f);
    want = static_cast<float>(autograd::sum(autograd::add(g(x), autograd::scale(d(x), 2.0f))).item());
  }
  for (const std::string backend : {"inproc", "tcp", "shm"}) {
    SCOPED_TRACE(backend);
    std::vector<absl::Status> seen(2);
    std::vector<float> got(2, 0.f);
    auto one = [&](const std::shared_ptr<comm::ProcessGroup>& pg) -> absl::Status {
      Generator gen(1);
      nn::Linear g(4, 4, gen), d(4, 4, gen);
      for (nn::Module* m : {static_cast<nn::Module*>(&g), static_cast<nn::Module*>(&d)}) {
        if (auto s = fully_shard(*m, pg, {.timeout = absl::Seconds(2)}); !s.ok()) return s.status();
      }
      const std::size_t r = static_cast<std::size_t>(pg->rank());
      seen[r] = Caught([&]() -> absl::Status {
        Tensor x = Tensor::full({2, 4}, 1.0f);
        nn::Module& first = r == 0 ? static_cast<nn::Module&>(g) : d;
        nn::Module& second = r == 0 ? static_cast<nn::Module&>(d) : g;
        Tensor a = first(x);   // g on rank 0, d on rank 1
        Tensor b = second(x);  // d on rank 0, g on rank 1
        Tensor loss = autograd::sum(r == 0 ? autograd::add(a, autograd::scale(b, 2.0f))
                                           : autograd::add(b, autograd::scale(a, 2.0f)));
        got[r] = static_cast<float>(loss.item());
        return autograd::try_backward(loss);
      });
      return absl::OkStatus();
    };
    absl::Status st;
    if (backend == "inproc") {
      st = comm::RunRanks(2, [&](comm::RankEnv& env) { return one(env.group_ptr); }, {.timeout = absl::Seconds(20)});
    } else {
      st = tcp_ranks::RunTcpRanks(2, backend, "fingerprint_two_roots", one);
    }
    (void)st;
    for (std::size_t r = 0; r < 2; ++r) {
      if (seen[r].ok()) {
        EXPECT_FLOAT_EQ(got[r], want) << "rank " << r << " computed with another model's rows, not told";
      }
      EXPECT_FALSE(seen[r].ok()) << "rank " << r << " was not told";
    }
  }
}

}  // namespace
}  // namespace shardkit::fsdp
