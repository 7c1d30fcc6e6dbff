// Second round of feature combinations of fully_shard, each against single-rank training (DESIGN.md section 8):
//   * zero_grad(set_to_none = false) (gradients zeroed, not dropped) with a parameter that no rank uses in a step,
//     on a 1-D group and on an HSDP mesh: one rank keeps the zero gradient and AdamW still moves the parameter;
//   * HSDP (a 2-D mesh) with bf16 mixed precision, bitwise against one rank with the same casts;
//   * HSDP with cpu offload (also with bf16, and with the all-reduce across replicas deferred): the same bits as
//     without offload, and single-rank training;
//   * HSDP with a parameter some ranks use and others do not, or no rank, within the deferred all-reduce;
//   * compile() with fsdp::FullyShardMode on a model with a parameter the captured step never uses.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/autograd/ops/activation.h"
#include "common/autograd/ops/elementwise.h"
#include "common/autograd/ops/reduce.h"
#include "common/capture/compile.h"
#include "common/comm/device_mesh.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/layers.h"
#include "common/optim/adam.h"
#include "fsdp/fully_shard.h"
#include "fsdp/fully_shard_mode.h"
#include "fsdp/mixed_precision.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/two_head_net.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp {
namespace {

using gpt_tiny::Batch;
using gpt_tiny::kBatch;
using gpt_tiny::TinyConfig;
using two_head::HeadInput;
using two_head::TwoHeadNet;

// ---- a model with a head some steps (or ranks) leave out ------------------------------------------------------

constexpr std::size_t kBWeight = 4;  // b.weight's index in parameters()

// Which ranks use head b in micro-batch `micro` of step `step` (a function of the step and the rank).
using UsePlan = std::function<bool(int step, int micro, int rank)>;

// One rank on every rank's inputs: each step the mean over ranks of their losses (each micro-batch's scaled by
// 1/micros), head b in a rank's loss where `uses` says so; `set_to_none` as given to zero_grad.
std::vector<std::vector<float>> HeadReference(int world, int steps, int micros, const UsePlan& uses, bool set_to_none,
                                              std::vector<float>* b_after_first = nullptr) {
  RankContext ctx;
  RankContextScope scope(ctx);
  TwoHeadNet net(3);
  auto opt = optim::AdamW::factory()({{net.parameters(), optim::AdamW::default_hyper()}});
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < steps; ++step) {
    (*opt)->zero_grad(set_to_none);
    Tensor loss;
    for (int r = 0; r < world; ++r) {
      for (int m = 0; m < micros; ++m) {
        net.use_b = uses(step, m, r);
        const Tensor l = net(HeadInput(step * micros + m, r));
        loss = loss.defined() ? autograd::add(loss, l) : l;
      }
    }
    autograd::backward(autograd::scale(loss, 1.0f / static_cast<float>(world * micros)));
    EXPECT_TRUE((*opt)->step().ok());
    if (step == 0 && b_after_first != nullptr) *b_after_first = net.b->weight().to_vector();
  }
  return gpt_tiny::Values(net);
}

// How the ranks shard TwoHeadNet: a 1-D group of `shards`, or an HSDP mesh `replicas` x `shards`; b a unit of its
// own or part of the root's unit.
struct HeadCase {
  int replicas = 1;
  int shards = 2;
  bool b_unit = false;
  int micros = 1;            // backwards per step
  bool defer_all_reduce = false;  // HSDP: the all-reduce across replicas on the last micro-batch only
  bool no_sync = false;           // no gradient sync but on the last micro-batch (set_requires_gradient_sync)
  int world() const { return replicas * shards; }
};

std::string Describe(const HeadCase& c) {
  return absl::StrCat(c.replicas, "x", c.shards, c.b_unit ? " b_unit" : " root_only", " micros ", c.micros,
                      c.defer_all_reduce ? " deferred all-reduce" : "", c.no_sync ? " no sync" : "");
}

std::vector<std::vector<std::vector<float>>> TrainHeads(const HeadCase& c, int steps, const UsePlan& uses,
                                                        bool set_to_none) {
  const int world = c.world();
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    TwoHeadNet net(3);
    std::optional<comm::DeviceMesh> mesh;
    if (c.replicas > 1) {
      auto m = comm::DeviceMesh::create(env.group_ptr, {c.replicas, c.shards}, {"replicate", "shard"});
      if (!m.ok()) return m.status();
      mesh.emplace(std::move(*m));
    }
    auto shard = [&](nn::Module& m) -> absl::Status {
      return (mesh ? fully_shard(m, *mesh) : fully_shard(m, env.group_ptr)).status();
    };
    if (c.b_unit) {
      if (absl::Status s = shard(*net.b); !s.ok()) return s;
    }
    if (absl::Status s = shard(net); !s.ok()) return s;
    FSDPModule root = *state_of(net);
    auto opt = optim::AdamW::factory()({{net.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    for (int step = 0; step < steps; ++step) {
      (*opt)->zero_grad(set_to_none);
      for (int m = 0; m < c.micros; ++m) {
        if (c.defer_all_reduce) root.set_requires_all_reduce(m == c.micros - 1);
        if (c.no_sync) root.set_requires_gradient_sync(m == c.micros - 1);
        net.use_b = uses(step, m, env.rank);
        const Tensor loss = autograd::scale(net(HeadInput(step * c.micros + m, env.rank)), 1.0f / static_cast<float>(c.micros));
        if (absl::Status s = autograd::try_backward(loss); !s.ok()) return s;
      }
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    }
    return test_util::StoreFullValues(net, got, env.rank);
  });
  EXPECT_TRUE(st.ok()) << st;
  return got;
}

// Head b in the first step only, on every rank; every rank zeroes with set_to_none = false. One rank keeps b's zero
// gradient and AdamW moves b in the later steps (its moments, weight decay); FSDP's shards of b keep their zeroed
// gradients too, on a 1-D group and on an HSDP mesh, whether b is its own unit or in the root's.
TEST(FsdpZeroGradKeepCombo, AZeroedGradientOfAnUnusedHeadIsSteppedAsOnOneRank) {
  constexpr int kSteps = 4;
  const UsePlan first_step = [](int step, int, int) { return step == 0; };
  const HeadCase cases[] = {{.shards = 2}, {.shards = 3, .b_unit = true}, {.shards = 3},
                            {.replicas = 2, .shards = 2}, {.replicas = 2, .shards = 2, .b_unit = true}};
  for (const HeadCase& c : cases) {
    SCOPED_TRACE(Describe(c));
    std::vector<float> b_after_first;
    const auto want = HeadReference(c.world(), kSteps, 1, first_step, /*set_to_none=*/false, &b_after_first);
    ASSERT_NE(want[kBWeight], b_after_first) << "the test needs one rank to move the unused head";
    gpt_tiny::ExpectMatches(TrainHeads(c, kSteps, first_step, /*set_to_none=*/false), want, 1e-6);
  }
}

// HSDP, b in the root's unit, two micro-batches per step with the all-reduce across replicas deferred to the second:
// in step 1 only replica 0's ranks use b, in its first micro-batch (their shard group reduces it, the other's reduces
// zeros that no rank of it used); in steps 2 and 3 no rank uses b. One rank: b gets replica 0's share of a gradient
// in step 1 and none after (AdamW skips it); the HSDP ranks must agree on "used" across the replicas.
TEST(HsdpUnusedParameterCombo, AHeadOneReplicaUsesInOneMicroBatchTrainsAsOnOneRank) {
  constexpr int kSteps = 4;
  const UsePlan plan = [](int step, int micro, int rank) {
    if (step == 0) return true;
    return step == 1 && micro == 0 && rank < 2;  // replica 0 = world ranks 0, 1 of the 2 x 2 mesh
  };
  for (const bool defer : {false, true}) {
    const HeadCase c{.replicas = 2, .shards = 2, .micros = 2, .defer_all_reduce = defer};
    SCOPED_TRACE(Describe(c));
    const auto want = HeadReference(c.world(), kSteps, c.micros, plan, /*set_to_none=*/true);
    // The plan matters: without step 1's use b ends elsewhere, and it does not move after step 1.
    const UsePlan first_only = [](int step, int, int) { return step == 0; };
    ASSERT_NE(want, HeadReference(c.world(), kSteps, c.micros, first_only, true));
    gpt_tiny::ExpectMatches(TrainHeads(c, kSteps, plan, /*set_to_none=*/true), want, 1e-6);
  }
}

// Two micro-batches per step, no gradient sync in the first (FSDP2's set_requires_gradient_sync). Head b: in step 0
// everywhere; in step 1 only in the first (unsynchronised) micro-batch; then nowhere (`rank_dependent`, b in the
// root's unit: in step 2 only rank 0's first micro-batch uses it). The synchronised backward must reduce the
// gradient b accumulated unsynchronised, also when b is a unit of its own that the synchronised micro-batch never
// runs, and leave b alone once no rank uses it.
TEST(FsdpNoSyncUnusedCombo, AHeadUsedOnlyInTheUnsynchronisedMicroBatchIsAveragedAndStepped) {
  constexpr int kSteps = 4;
  struct Case {
    HeadCase heads;
    bool rank_dependent;
  };
  const Case cases[] = {
      {{.shards = 2, .micros = 2, .no_sync = true}, true},
      {{.shards = 3, .micros = 2, .no_sync = true}, true},
      {{.shards = 2, .b_unit = true, .micros = 2, .no_sync = true}, false},
      {{.shards = 3, .b_unit = true, .micros = 2, .no_sync = true}, false},
      {{.replicas = 2, .shards = 2, .micros = 2, .no_sync = true}, true},
      {{.replicas = 2, .shards = 2, .b_unit = true, .micros = 2, .no_sync = true}, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(Describe(c.heads) + (c.rank_dependent ? ", rank 0 alone in step 2" : ""));
    const bool rank_dependent = c.rank_dependent;
    const UsePlan plan = [rank_dependent](int step, int micro, int rank) {
      if (step == 0) return true;
      if (step == 1) return micro == 0;
      if (step == 2) return rank_dependent && micro == 0 && rank == 0;
      return false;
    };
    const auto want = HeadReference(c.heads.world(), kSteps, c.heads.micros, plan, /*set_to_none=*/true);
    ASSERT_NE(want, HeadReference(c.heads.world(), kSteps, c.heads.micros, [](int step, int, int) { return step == 0; },
                                  true))
        << "the unsynchronised use matters";
    gpt_tiny::ExpectMatches(TrainHeads(c.heads, kSteps, plan, /*set_to_none=*/true), want, 1e-6);
  }
}

// ---- HSDP with bf16 mixed precision ----------------------------------------------------------------------------

const MixedPrecisionPolicy kBf16{.param_dtype = DType::bf16, .reduce_dtype = DType::bf16};

absl::Status ShardGptOnMesh(nn::GPT& model, const comm::DeviceMesh& mesh, FullyShardOptions options = {}) {
  for (nn::Module* b : modules_of_type(model, "TransformerBlock")) {
    if (auto s = fully_shard(*b, mesh, options); !s.ok()) return s.status();
  }
  FullyShardOptions root = options;
  root.reshard_after_forward = std::nullopt;
  return fully_shard(model, mesh, root).status();
}

// How an HSDP step accumulates two half-batches: not at all (one backward), the all-reduce across replicas deferred
// to the second (set_requires_all_reduce), or no sync at all in the first (set_requires_gradient_sync).
enum class Accumulate { none, defer_all_reduce, no_sync };

// Single-rank training with HSDP's casts done by hand, for a replicas x shards mesh (world rank i * shards + j):
// an f32 master stepped by AdamW; each step a compute model gets the master's values rounded to bf16, every
// block's input is rounded to bf16; each rank's gradient (of one backward: a half-batch's, scaled by 1/2 when
// accumulating, or under no_sync the f32 sum of both halves') is rounded to bf16; each shard group (a replica)
// averages its ranks' bf16 values as the backend does (f32 sum in rank order, divided by the count, rounded to bf16
// once), and the result is f32 again; under a deferred all-reduce the two halves' results are summed in f32; the
// replicas' results are averaged in f32 (the all-reduce across replicas moves the reduced f32 rows); the master's
// gradient is that.
std::vector<std::vector<float>> HsdpBf16Reference(int steps, int replicas, int shards,
                                                  Accumulate acc = Accumulate::none) {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT master(TinyConfig(), 1), compute(TinyConfig(), 1);
  std::vector<autograd::HookHandle> hooks;
  for (nn::Module* b : modules_of_type(compute, "TransformerBlock")) {
    hooks.push_back(b->register_forward_pre_hook([](nn::Module&, const nn::TensorList& in) -> std::optional<nn::TensorList> {
      return round_floating(in, DType::bf16);
    }));
  }
  auto opt = optim::AdamW::factory()({{master.parameters(), optim::AdamW::default_hyper()}});
  const std::vector<Tensor> mp = master.parameters(), cp = compute.parameters();
  const int world = replicas * shards, rows = kBatch / world;
  const int parts = acc == Accumulate::none ? 1 : 2;
  using Grads = std::vector<std::vector<float>>;
  auto bf16 = [](std::vector<float> v) {
    return Tensor::from_vector(v, {static_cast<std::int64_t>(v.size())}).to(DType::bf16).to(DType::f32).to_vector();
  };
  auto add = [](Grads& into, const Grads& g) {  // into += g (into empty: g)
    if (into.empty()) {
      into = g;
      return;
    }
    for (std::size_t i = 0; i < g.size(); ++i) {
      for (std::size_t k = 0; k < g[i].size(); ++k) into[i][k] += g[i][k];
    }
  };
  // Rank r's f32 gradient of half `part` (or of its whole rows).
  auto rank_grad = [&](int step, int r, int part) {
    for (const Tensor& p : cp) p.set_grad(Tensor());
    auto [x, y] = Batch(step, r * rows + part * rows / parts, rows / parts);
    autograd::backward(autograd::scale(compute.loss(x, y), 1.0f / static_cast<float>(parts)));
    Grads g;
    for (const Tensor& p : cp) g.push_back(p.grad().to_vector());
    return g;
  };
  // A shard group's reduce-scatter(avg) in bf16 of its ranks' gradients, f32 again.
  auto shard_average = [&](const std::vector<Grads>& ranks) {
    Grads sum;
    for (const Grads& g : ranks) {
      Grads rounded;
      for (const auto& v : g) rounded.push_back(bf16(v));
      add(sum, rounded);
    }
    for (auto& v : sum) {
      for (float& e : v) e /= static_cast<float>(shards);
      v = bf16(v);
    }
    return sum;
  };
  for (int step = 0; step < steps; ++step) {
    for (std::size_t i = 0; i < mp.size(); ++i) cp[i].copy_(mp[i].to(DType::bf16));
    Grads total;
    for (int rep = 0; rep < replicas; ++rep) {
      Grads replica;
      if (acc == Accumulate::no_sync) {
        std::vector<Grads> ranks;
        for (int j = 0; j < shards; ++j) {
          Grads g;
          for (int part = 0; part < parts; ++part) add(g, rank_grad(step, rep * shards + j, part));
          ranks.push_back(std::move(g));
        }
        replica = shard_average(ranks);
      } else {
        for (int part = 0; part < parts; ++part) {
          std::vector<Grads> ranks;
          for (int j = 0; j < shards; ++j) ranks.push_back(rank_grad(step, rep * shards + j, part));
          add(replica, shard_average(ranks));
        }
      }
      add(total, replica);
    }
    (*opt)->zero_grad();
    for (std::size_t i = 0; i < mp.size(); ++i) {
      for (float& v : total[i]) v /= static_cast<float>(replicas);
      mp[i].set_grad(Tensor::from_vector(total[i], mp[i].shape()));
    }
    EXPECT_TRUE((*opt)->step().ok());
  }
  return gpt_tiny::Values(master);
}

struct HsdpCase {
  int replicas = 2;
  int shards = 2;
  MixedPrecisionPolicy mp = {};
  bool offload = false;
  Accumulate accumulate = Accumulate::none;  // two half-batches per step
};

std::vector<std::vector<std::vector<float>>> TrainHsdp(const HsdpCase& c, int steps) {
  const int world = c.replicas * c.shards;
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    auto mesh = comm::DeviceMesh::create(env.group_ptr, {c.replicas, c.shards}, {"replicate", "shard"});
    if (!mesh.ok()) return mesh.status();
    MemoryTracker& mem = *env.context.memory;
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = ShardGptOnMesh(model, *mesh, {.mp_policy = c.mp, .offload_policy = {.cpu = c.offload}});
        !s.ok()) {
      return s;
    }
    FSDPModule root = *state_of(model);
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    const int rows = kBatch / world;
    for (int step = 0; step < steps; ++step) {
      (*opt)->zero_grad();
      const int parts = c.accumulate == Accumulate::none ? 1 : 2;
      for (int part = 0; part < parts; ++part) {
        const bool last = part == parts - 1;
        if (c.accumulate == Accumulate::defer_all_reduce) root.set_requires_all_reduce(last);
        if (c.accumulate == Accumulate::no_sync) root.set_requires_gradient_sync(last);
        auto [x, y] = Batch(step, env.rank * rows + part * rows / parts, rows / parts);
        const Tensor loss = autograd::scale(model.loss(x, y), 1.0f / static_cast<float>(parts));
        if (absl::Status s = autograd::try_backward(loss); !s.ok()) return s;
      }
      EXPECT_EQ(mem.current(MemoryCategory::communication_buffer), 0) << "staging copies released after backward";
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    }
    return test_util::StoreFullValues(model, got, env.rank);
  });
  EXPECT_TRUE(st.ok()) << st;
  return got;
}

const char* AccumulateName(Accumulate a) {
  switch (a) {
    case Accumulate::none: return "one backward";
    case Accumulate::defer_all_reduce: return "all-reduce deferred";
    case Accumulate::no_sync: return "no sync";
  }
  return "?";
}

// The same casts at the same points give the same parameters, bitwise, on a 2 x 2 and a 2 x 3 mesh, with one
// backward per step and with two accumulated (the all-reduce across replicas deferred, or no sync at all).
TEST(HsdpMixedPrecisionCombo, Bf16EqualsSingleRankTrainingWithTheSameCasts) {
  constexpr int kSteps = 8;
  const HsdpCase cases[] = {
      {.shards = 2, .mp = kBf16},
      {.shards = 3, .mp = kBf16},
      {.shards = 2, .mp = kBf16, .accumulate = Accumulate::defer_all_reduce},
      {.shards = 2, .mp = kBf16, .accumulate = Accumulate::no_sync},
      {.shards = 3, .mp = kBf16, .accumulate = Accumulate::defer_all_reduce},
  };
  for (const HsdpCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.replicas << "x" << c.shards << ", " << AccumulateName(c.accumulate));
    const auto want = HsdpBf16Reference(kSteps, c.replicas, c.shards, c.accumulate);
    gpt_tiny::ExpectMatches(TrainHsdp(c, kSteps), want, 0.0);
  }
  // And the casts matter: bf16 HSDP ends away from f32 single-rank training, and where the rounding happens shows
  // (rounding each half-batch's gradient is not rounding their sum).
  EXPECT_NE(HsdpBf16Reference(3, 2, 2), gpt_tiny::Reference(3));
  EXPECT_NE(HsdpBf16Reference(3, 2, 2, Accumulate::defer_all_reduce), HsdpBf16Reference(3, 2, 2, Accumulate::no_sync));
}

// ---- HSDP with cpu offload --------------------------------------------------------------------------------------

// On CPU ranks offload moves bytes (the shards' staging copies, the reduced rows back to the host) and must never
// change them: every HSDP combination trains to the bits of the run without offload, and f32 HSDP equals one rank.
TEST(HsdpOffloadCombo, SameBitsAsWithoutOffloadAndEqualToOneRank) {
  constexpr int kSteps = 6;
  static const auto want = gpt_tiny::Reference(kSteps);
  const HsdpCase cases[] = {
      {.replicas = 2, .shards = 2},
      {.replicas = 2, .shards = 3},
      {.replicas = 2, .shards = 2, .accumulate = Accumulate::defer_all_reduce},
      {.replicas = 2, .shards = 2, .accumulate = Accumulate::no_sync},
      {.replicas = 2, .shards = 2, .mp = kBf16},
      {.replicas = 2, .shards = 2, .mp = kBf16, .accumulate = Accumulate::defer_all_reduce},
  };
  for (HsdpCase c : cases) {
    SCOPED_TRACE(::testing::Message() << c.replicas << "x" << c.shards << " bf16 " << c.mp.param_dtype.has_value()
                                      << ", " << AccumulateName(c.accumulate));
    c.offload = false;
    const auto plain = TrainHsdp(c, kSteps);
    c.offload = true;
    const auto offloaded = TrainHsdp(c, kSteps);
    gpt_tiny::ExpectMatches(offloaded, plain[0], 0.0);
    if (!c.mp.param_dtype) gpt_tiny::ExpectMatches(offloaded, want, 2e-5);
  }
}

// ---- compile() with FullyShardMode: a parameter the captured step never uses -----------------------------------

// Head b never used: the captured step has no gradient and no update for it, so the mode leaves it whole; every rank
// ends where eager single-rank training on all ranks' inputs ends, b untouched; the step ending in zero_grad with
// set_to_none true or false (a recorded zeroing of the full gradients, after the update) alike.
TEST(FullyShardModeCombo, AHeadTheCapturedStepNeverUsesEqualsEagerSingleRank) {
  constexpr int kSteps = 5;
  const UsePlan never = [](int, int, int) { return false; };
  for (const auto& [world, set_to_none] : std::vector<std::pair<int, bool>>{{1, true}, {2, true}, {3, true}, {4, true},
                                                                              {2, false}, {3, false}}) {
    SCOPED_TRACE(::testing::Message() << "n=" << world << " set_to_none " << set_to_none);
    const auto want = HeadReference(world, kSteps, 1, never, /*set_to_none=*/true);
    std::vector<float> b_initial;
    {
      RankContext ctx;
      RankContextScope scope(ctx);
      b_initial = TwoHeadNet(3).b->weight().to_vector();
    }
    ASSERT_EQ(want[kBWeight], b_initial);
    std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
    absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
      TwoHeadNet net(3);
      net.use_b = false;
      optim::AdamW opt(net.parameters());
      auto mode = std::make_shared<FullyShardMode>(env.group_ptr);
      capture::CompiledStep compiled = capture::compile(
          [&](const std::vector<Tensor>& batch) {
            Tensor loss = net(batch[0]);
            autograd::backward(loss);
            EXPECT_TRUE(opt.step().ok());
            opt.zero_grad(set_to_none);
            return loss;
          },
          net, opt, {.parallel_mode = mode});
      for (int step = 0; step < kSteps; ++step) {
        absl::StatusOr<Tensor> loss = compiled({HeadInput(step, env.rank)});
        if (!loss.ok()) return loss.status();
      }
      EXPECT_EQ(compiled.captures(), 1);
      if (absl::Status s = mode->unshard_parameters(); !s.ok()) return s;
      got[static_cast<std::size_t>(env.rank)] = gpt_tiny::Values(net);
      return absl::OkStatus();
    });
    ASSERT_TRUE(st.ok()) << st;
    gpt_tiny::ExpectMatches(got, want, 1e-6);
  }
}

}  // namespace
}  // namespace shardkit::fsdp
