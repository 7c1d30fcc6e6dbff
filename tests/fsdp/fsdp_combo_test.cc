// Feature combinations of fully_shard that the other fsdp tests leave out, each against single-rank training
// (DESIGN.md section 8):
//   * a parameter that no rank uses in a step (a head used in some steps only) under AdamW, the head a unit of its
//     own or part of the root's unit;
//   * a block frozen and unfrozen mid-run, frozen before fully_shard or after (sharded either way);
//   * FSDP2's accumulation recipe (set_requires_gradient_sync, set_reshard_after_backward, set_is_last_backward)
//     with set_reduce_scatter_divide_factor, on a 1-D group and on an HSDP mesh (set_requires_all_reduce), SGD so
//     that a factor applied twice, or not at all, shows.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/autograd/ops/activation.h"
#include "common/autograd/ops/elementwise.h"
#include "common/autograd/ops/reduce.h"
#include "common/comm/device_mesh.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/layers.h"
#include "common/optim/adam.h"
#include "common/optim/sgd.h"
#include "fsdp/fsdp_param.h"
#include "fsdp/fully_shard.h"
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

// ---- a parameter no rank uses in a step ---------------------------------------------------------------------

constexpr int kHeadSteps = 4;
bool UsesB(int step) { return step == 0; }  // head b: in the first step only, on every rank

// One rank on every rank's input (the mean of their losses): AdamW skips b after step 0 (grad undefined).
std::vector<std::vector<float>> HeadReference(int world) {
  RankContext ctx;
  RankContextScope scope(ctx);
  TwoHeadNet net(3);
  auto opt = optim::AdamW::factory()({{net.parameters(), optim::AdamW::default_hyper()}});
  EXPECT_TRUE(opt.ok());
  std::vector<float> b_after_first;
  for (int step = 0; step < kHeadSteps; ++step) {
    net.use_b = UsesB(step);
    (*opt)->zero_grad();
    Tensor loss = net(HeadInput(step, 0));
    for (int r = 1; r < world; ++r) loss = autograd::add(loss, net(HeadInput(step, r)));
    autograd::backward(autograd::scale(loss, 1.0f / static_cast<float>(world)));
    EXPECT_TRUE((*opt)->step().ok());
    if (step == 0) b_after_first = net.b->weight().to_vector();
  }
  EXPECT_EQ(net.b->weight().to_vector(), b_after_first) << "the reference leaves the unused head alone";
  return gpt_tiny::Values(net);
}

class FsdpUnusedParameterCombo : public ::testing::TestWithParam<std::tuple<int, bool>> {};

// Head b is used in step 0 only, on every rank (every rank runs the same units: b's unit runs in no forward after
// step 0). FSDP2 reduces only the gradients that exist, so b's shards keep no gradient and AdamW skips them, as
// one rank does; `b_unit`: b a unit of its own, else part of the root's unit.
TEST_P(FsdpUnusedParameterCombo, AHeadNoRankUsesStaysWhereOneRankLeavesIt) {
  const auto [world, b_unit] = GetParam();
  const auto want = HeadReference(world);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    TwoHeadNet net(3);
    if (b_unit) {
      if (auto s = fully_shard(*net.b, env.group_ptr); !s.ok()) return s.status();
    }
    if (auto s = fully_shard(net, env.group_ptr); !s.ok()) return s.status();
    auto opt = optim::AdamW::factory()({{net.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    for (int step = 0; step < kHeadSteps; ++step) {
      net.use_b = UsesB(step);
      (*opt)->zero_grad();
      if (absl::Status s = autograd::try_backward(net(HeadInput(step, env.rank))); !s.ok()) return s;
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    }
    return test_util::StoreFullValues(net, got, env.rank);
  });
  ASSERT_TRUE(st.ok()) << st;
  gpt_tiny::ExpectMatches(got, want, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Ranks, FsdpUnusedParameterCombo, ::testing::Combine(::testing::Values(2, 3), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<1>(info.param) ? "b_unit" : "root_only") + "_n" +
                                  std::to_string(std::get<0>(info.param));
                         });

// ---- frozen, then unfrozen mid-run ---------------------------------------------------------------------------

constexpr int kFreezeSteps = 8;
constexpr int kUnfreezeAt = 3;

// What is frozen: block 0 (a unit of its own: all of it), or its attention (part of the unit).
enum class Frozen { block0, block0_attn };
const char* FrozenName(Frozen f) { return f == Frozen::block0 ? "blocks.0" : "blocks.0.attn"; }

void SetTrainable(nn::GPT& model, Frozen part, bool on) {
  for (const auto& [name, m] : model.named_modules()) {
    if (name == FrozenName(part)) m->set_requires_grad(on);
  }
}

std::vector<std::vector<float>> UnfreezeReference(Frozen part) {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT model(TinyConfig(), 1);
  SetTrainable(model, part, false);
  auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < kFreezeSteps; ++step) {
    if (step == kUnfreezeAt) SetTrainable(model, part, true);
    auto [x, y] = Batch(step, 0, kBatch);
    (*opt)->zero_grad();
    autograd::backward(model.loss(x, y));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return gpt_tiny::Values(model);
}

// Block 0 (or its attention) frozen from the first step, unfrozen before step 3 on every rank, as the reference.
// Frozen before fully_shard (fine-tuning a model that starts with a frozen backbone) or after it, it is sharded
// (fully_shard.h): its shards get no gradient while frozen and averaged gradients once it trains; each rank stepping
// its own gradient would leave the ranks' replicas apart.
void ExpectUnfreezingTrainsAsOnOneRank(int world, bool freeze_before_shard, Frozen part) {
  const auto want = UnfreezeReference(part);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (freeze_before_shard) SetTrainable(model, part, false);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    if (!freeze_before_shard) SetTrainable(model, part, false);
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    for (int step = 0; step < kFreezeSteps; ++step) {
      if (step == kUnfreezeAt) SetTrainable(model, part, true);
      if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, world, step, step + 1); !s.ok()) return s;
    }
    return test_util::StoreFullValues(model, got, env.rank);
  });
  ASSERT_TRUE(st.ok()) << st;
  gpt_tiny::ExpectMatches(got, want, 2e-5);
}

TEST(FsdpUnfreezeCombo, FrozenBeforeOrAfterFullyShardAndUnfrozenLaterTrainsAsOnOneRank) {
  for (const Frozen part : {Frozen::block0, Frozen::block0_attn}) {
    for (const bool before : {false, true}) {
      for (const int world : {2, 3}) {
        SCOPED_TRACE(::testing::Message() << FrozenName(part) << (before ? " frozen before" : " frozen after")
                                          << " fully_shard, n=" << world);
        ExpectUnfreezingTrainsAsOnOneRank(world, before, part);
      }
    }
  }
}

// A block frozen at fully_shard costs each rank its rows only, as a trainable one (FSDP2). A reduce moves the
// gradients of trainable parameters only: while all of block 0 is frozen its unit reduces nothing (one
// reduce_scatter and one used-parameter all_reduce fewer per step than once it trains); while its attention is
// frozen, the unit's reduce_scatter carries the rest of the block only (Note [frozen parameters are not reduced] in
// fsdp/param_group.cc).
TEST(FsdpUnfreezeCombo, FrozenParametersAreShardedAndNotReduced) {
  constexpr int kWorld = 2;
  std::int64_t trainable_numel = 0;
  {
    absl::Status st = comm::RunRanks(kWorld, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(TinyConfig(), 1);
      if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
      if (env.rank == 0) {  // (both ranks hold the same numbers of elements here)
        for (const Tensor& t : model.parameters()) trainable_numel += t.numel();
      }
      return absl::OkStatus();
    });
    ASSERT_TRUE(st.ok()) << st;
  }
  // The attention's reduced rows per rank, padding included (Note [per-parameter dim-0 shards]).
  std::int64_t attn_rows_numel = 0;
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    nn::GPT model(TinyConfig(), 1);
    for (const auto& [name, t] : model.named_parameters()) {
      if (name.rfind("blocks.0.attn.", 0) != 0) continue;
      const RowSplit rs = split_rows(t.shape(), 0, kWorld);
      attn_rows_numel += rs.rows_per_rank * rs.row_numel;
    }
    ASSERT_GT(attn_rows_numel, 0);
  }
  for (const Frozen part : {Frozen::block0, Frozen::block0_attn}) {
    SCOPED_TRACE(FrozenName(part));
    absl::Status st = comm::RunRanks(kWorld, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(TinyConfig(), 1);
      SetTrainable(model, part, false);
      if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
      std::int64_t numel = 0;
      for (const Tensor& t : model.parameters()) numel += t.numel();
      EXPECT_EQ(numel, trainable_numel) << "the frozen parameters hold this rank's rows only";
      auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
      if (!opt.ok()) return opt.status();
      comm::CommCounters before = env.group.counters();
      if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, kWorld, 0, 1); !s.ok()) return s;
      const comm::CommCounters frozen = env.group.counters().since(before);
      SetTrainable(model, part, true);
      before = env.group.counters();
      if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, kWorld, 1, 2); !s.ok()) return s;
      const comm::CommCounters trains = env.group.counters().since(before);
      const comm::KindCounters& rs_frozen = frozen.of(comm::CollectiveKind::reduce_scatter);
      const comm::KindCounters& rs_trains = trains.of(comm::CollectiveKind::reduce_scatter);
      const comm::KindCounters& ar_frozen = frozen.of(comm::CollectiveKind::all_reduce);
      const comm::KindCounters& ar_trains = trains.of(comm::CollectiveKind::all_reduce);
      if (part == Frozen::block0) {
        EXPECT_EQ(rs_frozen.calls + 1, rs_trains.calls) << "rank " << env.rank;
        EXPECT_EQ(ar_frozen.calls + 1, ar_trains.calls) << "rank " << env.rank;
      } else {
        EXPECT_EQ(rs_frozen.calls, rs_trains.calls) << "rank " << env.rank;
        EXPECT_EQ(ar_frozen.calls, ar_trains.calls) << "rank " << env.rank;
        // reduce_scatter volume: (n - 1) x output bytes (Note [ring-equivalent volume]).
        EXPECT_EQ(rs_trains.bytes_sent - rs_frozen.bytes_sent,
                  (kWorld - 1) * attn_rows_numel * static_cast<std::int64_t>(sizeof(float)))
            << "rank " << env.rank;
      }
      EXPECT_EQ(frozen.of(comm::CollectiveKind::all_gather).calls, trains.of(comm::CollectiveKind::all_gather).calls);
      return absl::OkStatus();
    });
    EXPECT_TRUE(st.ok()) << st;
  }
}

// ---- accumulation recipe x divide factor x HSDP ------------------------------------------------------------------

constexpr int kAccSteps = 6;
constexpr int kMicro = 3;  // divides every rank's rows (kBatch / world, world 2 and 4)
const optim::HyperParams kSgd{.lr = 0.05, .momentum = 0.9};

// One rank, SGD with momentum on the whole batch, the loss scaled by `loss_scale` (a power of two: exact).
std::vector<std::vector<float>> SgdReference(float loss_scale) {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT model(TinyConfig(), 1);
  auto opt = optim::Sgd::factory()({{model.parameters(), kSgd}});
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < kAccSteps; ++step) {
    auto [x, y] = Batch(step, 0, kBatch);
    (*opt)->zero_grad();
    autograd::backward(autograd::scale(model.loss(x, y), loss_scale));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return gpt_tiny::Values(model);
}

struct AccCase {
  int replicas = 1;  // > 1: HSDP on a replicas x shards mesh
  int shards = 2;
  double divide_factor = 0;  // 0: not set (the average)
  // HSDP only: reduce-scatter every micro-batch, all-reduce across replicas on the last only (instead of no sync).
  bool defer_all_reduce = false;
};

// Every rank: kMicro micro-batches of its rows per step, each loss scaled by 1/kMicro. Sync (and reshard after
// backward, and the final callback's reshard) on the last micro-batch only, FSDP2's recipe; or, deferring the
// all-reduce, a reduce-scatter each micro-batch and the all-reduce across replicas on the last. The gradient each
// shard ends with is sum over ranks / factor = (world / factor) x the average.
std::vector<std::vector<std::vector<float>>> TrainAccumulating(const AccCase& c) {
  const int world = c.replicas * c.shards;
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    std::optional<comm::DeviceMesh> mesh;
    if (c.replicas > 1) {
      auto m = comm::DeviceMesh::create(env.group_ptr, {c.replicas, c.shards}, {"replicate", "shard"});
      if (!m.ok()) return m.status();
      mesh.emplace(std::move(*m));
      for (nn::Module* b : modules_of_type(model, "TransformerBlock")) {
        if (auto s = fully_shard(*b, *mesh); !s.ok()) return s.status();
      }
      if (auto s = fully_shard(model, *mesh); !s.ok()) return s.status();
    } else if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) {
      return s;
    }
    FSDPModule root = *state_of(model);
    if (c.divide_factor > 0) root.set_reduce_scatter_divide_factor(c.divide_factor);
    auto opt = optim::Sgd::factory()({{model.parameters(), kSgd}});
    if (!opt.ok()) return opt.status();
    const int rows = kBatch / world, micro = rows / kMicro;
    if (micro * kMicro != rows) return absl::InvalidArgumentError("the micro-batches must cover the rank's rows");
    for (int step = 0; step < kAccSteps; ++step) {
      (*opt)->zero_grad();
      for (int m = 0; m < kMicro; ++m) {
        const bool last = m == kMicro - 1;
        if (c.defer_all_reduce) {
          root.set_requires_all_reduce(last);
        } else {
          root.set_requires_gradient_sync(last);
          root.set_reshard_after_backward(last);
          root.set_is_last_backward(last);
        }
        auto [x, y] = Batch(step, env.rank * rows + m * micro, micro);
        const auto before = env.group.counters();
        if (absl::Status s = autograd::try_backward(autograd::scale(model.loss(x, y), 1.0f / static_cast<float>(kMicro))); !s.ok()) {
          return s;
        }
        if (!last && !c.defer_all_reduce && c.replicas == 1) {
          EXPECT_EQ(env.group.counters().since(before).of(comm::CollectiveKind::reduce_scatter).calls, 0) << "no sync";
        }
      }
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    }
    return test_util::StoreFullValues(model, got, env.rank);
  });
  EXPECT_TRUE(st.ok()) << st;
  return got;
}

TEST(FsdpAccumulationCombo, DivideFactorWithTheAccumulationRecipeEqualsSingleRankScaled) {
  const AccCase cases[] = {
      {.shards = 2},                                                           // the average, for contrast
      {.shards = 2, .divide_factor = 1},                                       // the sum: 2 x the average
      {.shards = 4, .divide_factor = 2},                                       // 2 x the average
      {.replicas = 2, .shards = 2, .divide_factor = 2},                        // HSDP, no sync
      {.replicas = 2, .shards = 2, .divide_factor = 2, .defer_all_reduce = true},  // HSDP, one all-reduce
      {.replicas = 2, .shards = 2, .divide_factor = 4, .defer_all_reduce = true},  // HSDP, the average
  };
  static const auto once = SgdReference(1.0f);
  static const auto twice = SgdReference(2.0f);
  ASSERT_NE(once, twice);  // the scale shows (SGD's step is proportional to the gradient)
  for (const AccCase& c : cases) {
    const int world = c.replicas * c.shards;
    const double factor = c.divide_factor > 0 ? c.divide_factor : world;
    SCOPED_TRACE(::testing::Message() << c.replicas << "x" << c.shards << " divide by " << factor
                                      << (c.defer_all_reduce ? ", all-reduce deferred" : ", no sync"));
    gpt_tiny::ExpectMatches(TrainAccumulating(c), world / factor == 2 ? twice : once, 2e-5);
  }
}

// HSDP rows kept for one deferred all-reduce carry the layout of the parameters that required grad; freezing a
// parameter between the backwards of one accumulation is refused on every rank (FailedPrecondition naming it), not
// summed over mismatched rows (Note [frozen parameters are not reduced] in fsdp/param_group.cc).
TEST(FsdpAccumulationCombo, FreezingBetweenBackwardsOfADeferredAllReduceIsRefused) {
  absl::Status st = comm::RunRanks(4, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    auto mesh = comm::DeviceMesh::create(env.group_ptr, {2, 2}, {"replicate", "shard"});
    if (!mesh.ok()) return mesh.status();
    for (nn::Module* b : modules_of_type(model, "TransformerBlock")) {
      if (auto s = fully_shard(*b, *mesh); !s.ok()) return s.status();
    }
    if (auto s = fully_shard(model, *mesh); !s.ok()) return s.status();
    FSDPModule root = *state_of(model);
    const int rows = kBatch / 4;
    root.set_requires_all_reduce(false);
    auto [x0, y0] = Batch(0, env.rank * rows, rows);
    if (absl::Status s = autograd::try_backward(model.loss(x0, y0)); !s.ok()) return s;
    SetTrainable(model, Frozen::block0_attn, false);
    root.set_requires_all_reduce(true);
    auto [x1, y1] = Batch(1, env.rank * rows, rows);
    return autograd::try_backward(model.loss(x1, y1));
  });
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("was frozen or unfrozen between two backwards"));
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("TransformerBlock"));
}

}  // namespace
}  // namespace shardkit::fsdp
