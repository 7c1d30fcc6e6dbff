// The rule "every rank builds the same model (same seed) before fully_shard" is checked (Note [same values on every
// rank] in fsdp/same_values.cc): the same values pass and train, under every way of building and sharding GPT-tiny
// (1-D, HSDP 2x2, deferred init, frozen parameters, ignored_params, bf16 mixed precision, cpu offload); other values,
// compared by each fully_shard call, are told on every rank, in bounded time, naming the parameter and the ranks, at
// the first forward (or summon, unshard, sharded_state_dict), and again at every later one, until FSDP's loaders
// replace them.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/autograd/engine.h"
#include "common/comm/device_mesh.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/deferred_init.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "fsdp/fully_shard.h"
#include "fsdp/state_dict.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/tensor/cuda_test_util.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp {
namespace {

using ::testing::HasSubstr;

// How the ranks build and shard GPT-tiny.
struct VCase {
  std::string name;
  int replicas = 1;  // > 1: HSDP on a replicas x shards mesh
  int shards = 2;
  bool deferred = false;  // built and sharded inside an nn::DeferredInitScope
  bool frozen = false;    // block 0 frozen before fully_shard
  bool ignored = false;   // ln_f.weight in the root's ignored_params
  bool bf16 = false;      // bf16 all-gathers, compute and reduce-scatters
  bool offload = false;   // cpu offload
  int world() const { return replicas * shards; }
};

void PrintTo(const VCase& c, std::ostream* os) { *os << c.name; }

// Runs between building and sharding (eager builds only): makes a rank's values differ.
using Tweak = std::function<void(nn::GPT&, int rank)>;

// What one rank saw.
struct Seen {
  absl::Status first;   // sharding and the first step (forward, backward, optimizer step)
  absl::Status second;  // a second step, after the first (whatever it gave)
  std::int64_t compared = -1;  // all_gathers during sharding, over the world or the mesh's groups (-1: unknown)
};

// The status of `fn`, an FsdpError / StatusError thrown by it included.
absl::Status Caught(const std::function<absl::Status()>& fn) {
  try {
    return fn();
  } catch (const autograd::StatusError& e) {
    return e.status();
  }
}

absl::Status Step(nn::GPT& model, optim::Optimizer& opt, int rank, int world, int step) {
  return Caught([&]() -> absl::Status {
    const int rows = gpt_tiny::kBatch / world;
    auto [x, y] = gpt_tiny::Batch(step, rank * rows, rows);
    opt.zero_grad();
    if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
    return opt.step();
  });
}

absl::Status Shard(nn::GPT& model, comm::RankEnv& env, const std::optional<comm::DeviceMesh>& mesh, const VCase& c) {
  FullyShardOptions o{.timeout = absl::Seconds(1)};
  if (c.bf16) o.mp_policy = {.param_dtype = DType::bf16, .reduce_dtype = DType::bf16};
  o.offload_policy.cpu = c.offload;
  auto shard = [&](nn::Module& m, const FullyShardOptions& opts) -> absl::Status {
    return (mesh ? fully_shard(m, *mesh, opts) : fully_shard(m, env.group_ptr, opts)).status();
  };
  for (nn::Module* b : modules_of_type(model, "TransformerBlock")) {
    if (absl::Status s = shard(*b, o); !s.ok()) return s;
  }
  FullyShardOptions root = o;
  if (c.ignored) root.ignored_params = {model.ln_f->parameter("weight")};
  return shard(model, root);
}

// Every rank of `c` builds GPT-tiny from seed_of(rank), `tweak`s it, shards it and runs two steps of AdamW.
std::vector<Seen> RunCase(const VCase& c, const std::function<std::uint64_t(int)>& seed_of, const Tweak& tweak = nullptr) {
  std::vector<Seen> seen(static_cast<std::size_t>(c.world()));
  absl::Status st = comm::RunRanks(c.world(), [&](comm::RankEnv& env) -> absl::Status {
    Seen& mine = seen[static_cast<std::size_t>(env.rank)];
    std::optional<comm::DeviceMesh> mesh;
    if (c.replicas > 1) {
      auto m = comm::DeviceMesh::create(env.group_ptr, {c.replicas, c.shards}, {"replicate", "shard"});
      if (!m.ok()) return m.status();
      mesh.emplace(std::move(*m));
    }
    nn::DeferredInit init;
    std::unique_ptr<nn::GPT> model;
    {
      std::optional<nn::DeferredInitScope> scope;
      if (c.deferred) scope.emplace(init);
      model = std::make_unique<nn::GPT>(gpt_tiny::TinyConfig(), seed_of(env.rank));
      if (c.frozen) gpt_tiny::FreezeBlock0(*model);
      if (tweak) tweak(*model, env.rank);
      std::vector<comm::ProcessGroup*> groups = {&env.group};
      if (mesh) groups = {&mesh->group(0), &mesh->group(1)};
      std::vector<comm::CommCounters> before;
      for (comm::ProcessGroup* g : groups) before.push_back(g->counters());
      mine.first = Shard(*model, env, mesh, c);
      mine.compared = 0;
      for (std::size_t i = 0; i < groups.size(); ++i) {
        mine.compared += groups[i]->counters().since(before[i]).of(comm::CollectiveKind::all_gather).calls;
      }
    }
    if (!mine.first.ok()) return absl::OkStatus();
    auto opt = optim::AdamW::factory()({{model->parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    mine.first = Step(*model, **opt, env.rank, c.world(), 0);
    mine.second = Step(*model, **opt, env.rank, c.world(), 1);
    return absl::OkStatus();
  }, {.timeout = absl::Seconds(2)});
  EXPECT_TRUE(st.ok()) << c.name << ": " << st;
  return seen;
}

// Every rank failed its first step, and its second, with InvalidArgument containing `want` (and the advice).
void ExpectToldOnEveryRank(const std::vector<Seen>& seen, const std::string& want) {
  for (std::size_t r = 0; r < seen.size(); ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    for (const absl::Status& s : {seen[r].first, seen[r].second}) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_THAT(std::string(s.message()), HasSubstr(want));
      EXPECT_THAT(std::string(s.message()), HasSubstr("every rank must build the same model (same seed)"));
    }
  }
}

const std::vector<VCase>& Cases() {
  static const std::vector<VCase> cases = {
      {.name = "plain"},
      {.name = "hsdp_2x2", .replicas = 2},
      {.name = "deferred", .deferred = true},
      {.name = "deferred_hsdp_2x2", .replicas = 2, .deferred = true},
      {.name = "frozen", .frozen = true},
      {.name = "ignored_params", .ignored = true},
      {.name = "bf16", .bf16 = true},
      {.name = "cpu_offload", .offload = true},
  };
  return cases;
}

class FsdpSameValues : public ::testing::TestWithParam<VCase> {};

// The same seed on every rank: nothing is told, both steps train, and the comparison ran: each of the 4 fully_shard
// calls (3 blocks, the root) made one all_gather (HSDP: one over its row, one over its column).
TEST_P(FsdpSameValues, TheSameSeedTrains) {
  const VCase& c = GetParam();
  const std::vector<Seen> seen = RunCase(c, [](int) { return 1; });
  for (std::size_t r = 0; r < seen.size(); ++r) {
    EXPECT_TRUE(seen[r].first.ok()) << "rank " << r << ": " << seen[r].first;
    EXPECT_TRUE(seen[r].second.ok()) << "rank " << r << ": " << seen[r].second;
    EXPECT_EQ(seen[r].compared, c.replicas > 1 ? 8 : 4) << "rank " << r;
  }
}

// The last rank builds from another seed: every rank is told at the first step, naming the first parameter in
// named_parameters() order (wte.weight: the embedding is random, LayerNorm weights are not) and the ranks, and again
// at the second.
TEST_P(FsdpSameValues, AnotherSeedOnOneRankIsToldOnEveryRank) {
  const VCase& c = GetParam();
  const int last = c.world() - 1;
  const std::vector<Seen> seen = RunCase(c, [last](int r) { return r == last ? 2 : 1; });
  ExpectToldOnEveryRank(seen, absl::StrCat("parameter 'wte.weight' on rank ", last, " differs from rank 0's before sharding"));
}

INSTANTIATE_TEST_SUITE_P(Cases, FsdpSameValues, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<VCase>& i) { return i.param.name; });

// HSDP 2x2: ranks {0, 1} (replica 0) build from seed 1, ranks {2, 3} (replica 1) from seed 2. Each shard group
// (a row of the mesh) agrees within itself; only the comparison across the replicate group tells them apart.
TEST(FsdpSameValuesHsdp, ReplicasFromAnotherSeedAreTold) {
  for (const bool deferred : {false, true}) {
    SCOPED_TRACE(deferred ? "deferred" : "eager");
    const VCase c{.name = "hsdp", .replicas = 2, .deferred = deferred};
    const std::vector<Seen> seen = RunCase(c, [](int r) { return r < 2 ? 1 : 2; });
    ExpectToldOnEveryRank(seen, "parameter 'wte.weight' on rank 2 differs from rank 0's before sharding");
  }
}

// One value of one parameter of a block (sharded) differs on rank 1 only: told by its name, not the first one's.
TEST(FsdpSameValues, OneValueOfOneParameterIsTold) {
  const std::vector<Seen> seen = RunCase({.name = "plain"}, [](int) { return 1; }, [](nn::GPT& model, int rank) {
    if (rank != 1) return;
    const Tensor w = (*model.blocks)[1]->parameters().back();
    w.data<float>()[w.numel() - 1] += 1e-3f;
  });
  std::string name;
  {
    nn::GPT m(gpt_tiny::TinyConfig(), 1);
    const Tensor w = (*m.blocks)[1]->parameters().back();
    for (const auto& [n, t] : m.named_parameters()) {
      if (t.is_same(w)) name = n;
    }
  }
  ASSERT_FALSE(name.empty());
  ExpectToldOnEveryRank(seen, absl::StrCat("parameter '", name, "' on rank 1 differs from rank 0's before sharding"));
}

// An ignored parameter (whole and replicated, never synchronised by FSDP) that differs is told too.
TEST(FsdpSameValues, AnIgnoredParameterThatDiffersIsTold) {
  const std::vector<Seen> seen = RunCase({.name = "ignored", .ignored = true}, [](int) { return 1; },
                                     [](nn::GPT& model, int rank) {
                                       if (rank == 1) model.ln_f->parameter("weight").fill_(2.0);
                                     });
  ExpectToldOnEveryRank(seen, "ignored parameter 'ln_f.weight' on rank 1 differs from rank 0's");
}

// Whatever reaches the units first tells it: summon_full_params (reading the model, a full state dict),
// FSDPModule::unshard or sharded_state_dict before the first forward; then the forward too.
TEST(FsdpSameValues, ASummonAnUnshardOrAShardedStateDictBeforeTheFirstForwardIsTold) {
  enum class First { summon, unshard, sharded_state_dict };
  for (const First first : {First::summon, First::unshard, First::sharded_state_dict}) {
    SCOPED_TRACE(static_cast<int>(first));
    std::vector<absl::Status> early(2), forward(2);
    absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(gpt_tiny::TinyConfig(), env.rank == 0 ? 1 : 2);
      if (absl::Status s = test_util::ShardGpt(model, env, {.timeout = absl::Seconds(1)}); !s.ok()) return s;
      const std::size_t r = static_cast<std::size_t>(env.rank);
      switch (first) {
        case First::summon: early[r] = test_util::FullValues(model).status(); break;
        case First::unshard: early[r] = state_of(*(*model.blocks)[0])->unshard().status(); break;
        case First::sharded_state_dict: early[r] = sharded_state_dict(model).status(); break;
      }
      auto [x, y] = gpt_tiny::Batch(0, env.rank * 12, 12);
      forward[r] = Caught([&] { return autograd::try_backward(model.loss(x, y)); });
      return absl::OkStatus();
    }, {.timeout = absl::Seconds(2)});
    EXPECT_TRUE(st.ok()) << st;
    for (std::size_t r = 0; r < 2; ++r) {
      // The unshard names block 0's first differing parameter (under the block); the others the model's.
      const std::string want =
          first != First::unshard ? "parameter 'wte.weight' on rank 1 differs" : "on rank 1 differs from rank 0's";
      EXPECT_EQ(early[r].code(), absl::StatusCode::kInvalidArgument) << early[r];
      EXPECT_THAT(std::string(early[r].message()), HasSubstr(want));
      EXPECT_EQ(forward[r].code(), absl::StatusCode::kInvalidArgument) << forward[r];
    }
  }
}

// Values a loader writes are one checkpoint's, the same on every rank: ranks built from different seeds that load a
// full state dict, or every rank's sharded pieces (before the first forward, or after it was refused), train
// without being told, and end equal to ranks that built the checkpoint's model (seed 1) and loaded nothing.
TEST(FsdpSameValues, ValuesLoadedBeforeTheFirstForwardAreNotCompared) {
  nn::StateDict full;
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    nn::GPT m(gpt_tiny::TinyConfig(), 1);
    for (const auto& [name, t] : m.state_dict()) full.emplace_back(name, t.clone());
  }
  std::vector<ShardedStateDict> pieces(2);
  std::vector<std::vector<std::vector<float>>> want(2);
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(gpt_tiny::TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    auto piece = sharded_state_dict(model);
    if (!piece.ok()) return piece.status();
    pieces[static_cast<std::size_t>(env.rank)] = std::move(*piece);
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, 2, 0, 2); !s.ok()) return s;
    return test_util::StoreFullValues(model, want, env.rank);
  });
  ASSERT_TRUE(st.ok()) << st;
  for (const bool sharded : {false, true}) {
   for (const bool after_error : {false, true}) {
    SCOPED_TRACE(absl::StrCat(sharded ? "load_sharded_state_dict" : "load_full_state_dict",
                              after_error ? " after the error" : ""));
    std::vector<std::vector<std::vector<float>>> got(2);
    st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(gpt_tiny::TinyConfig(), env.rank == 0 ? 3 : 4);
      if (absl::Status s = test_util::ShardGpt(model, env, {.timeout = absl::Seconds(1)}); !s.ok()) return s;
      if (after_error) {
        auto [x, y] = gpt_tiny::Batch(0, env.rank * 12, 12);
        const absl::Status refused = Caught([&] { return autograd::try_backward(model.loss(x, y)); });
        EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
      }
      if (absl::Status s = sharded ? load_sharded_state_dict(model, pieces) : load_full_state_dict(model, full); !s.ok()) {
        return s;
      }
      auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
      if (!opt.ok()) return opt.status();
      if (absl::Status s = Caught([&] { return test_util::TrainRows(model, **opt, env.rank, 2, 0, 2); }); !s.ok()) {
        return s;
      }
      return test_util::StoreFullValues(model, got, env.rank);
    }, {.timeout = absl::Seconds(2)});
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_TRUE(got == want) << "not the values of the checkpoint's model trained the same steps";
   }
  }
}

// On a CUDA device, where each parameter is hashed through a host copy: the same seed trains; another seed on rank 1
// is told on every rank, naming the parameter.
TEST(FsdpSameValuesCuda, TheSameSeedTrainsAndAnotherSeedIsTold) {
  SK_REQUIRE_CUDA_DEVICE("fully_shard's value hashes of CUDA parameters");
  for (const bool same : {true, false}) {
    SCOPED_TRACE(same ? "same seed" : "another seed on rank 1");
    std::vector<absl::Status> seen(2);
    absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(gpt_tiny::TinyConfig(), same || env.rank == 0 ? 1 : 2);
      model.to(Device::cuda(0));
      if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
      auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
      if (!opt.ok()) return opt.status();
      auto [x, y] = gpt_tiny::Batch(0, env.rank * 12, 12);
      seen[static_cast<std::size_t>(env.rank)] = Caught([&]() -> absl::Status {
        (*opt)->zero_grad();
        if (absl::Status s = autograd::try_backward(model.loss(x.to(Device::cuda(0)), y.to(Device::cuda(0)))); !s.ok()) {
          return s;
        }
        return (*opt)->step();
      });
      return absl::OkStatus();
    });
    EXPECT_TRUE(st.ok()) << st;
    for (std::size_t r = 0; r < 2; ++r) {
      if (same) {
        EXPECT_TRUE(seen[r].ok()) << "rank " << r << ": " << seen[r];
      } else {
        EXPECT_EQ(seen[r].code(), absl::StatusCode::kInvalidArgument) << "rank " << r << ": " << seen[r];
        EXPECT_THAT(std::string(seen[r].message()), HasSubstr("parameter 'wte.weight' on rank 1 differs from rank 0's"));
      }
    }
  }
}

}  // namespace
}  // namespace shardkit::fsdp
