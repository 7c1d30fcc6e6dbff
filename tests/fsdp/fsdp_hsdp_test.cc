// HSDP: fully_shard on a 2-D DeviceMesh (replicate × shard; Note [hybrid sharding] in fsdp/param_group.cc):
// equality with single-rank training, accumulation with set_requires_all_reduce, the ledger (shards over the
// row only), the collectives per step, the state dicts on the 2-D mesh, and gradient clipping.
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "common/autograd/ops/elementwise.h"
#include "common/comm/device_mesh.h"
#include "common/comm/testing/run_ranks.h"
#include "common/optim/adam.h"
#include "common/optim/sgd.h"
#include "fsdp/clip_grad.h"
#include "fsdp/fully_shard.h"
#include "fsdp/state_dict.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp {
namespace {

using gpt_tiny::Batch;
using gpt_tiny::kBatch;
using gpt_tiny::TinyConfig;

// fully_shard bottom-up on the mesh: (nested: every MLP,) every block, then the root.
absl::Status ShardGptOnMesh(nn::GPT& model, const comm::DeviceMesh& mesh, bool nested = false) {
  std::vector<const char*> types = {"TransformerBlock"};
  if (nested) types.insert(types.begin(), "MLP");
  for (const char* type : types) {
    for (nn::Module* m : modules_of_type(model, type)) {
      if (auto s = fully_shard(*m, mesh); !s.ok()) return s.status();
    }
  }
  return fully_shard(model, mesh).status();
}

absl::StatusOr<comm::DeviceMesh> Mesh(comm::RankEnv& env, int replicas, int shards) {
  return comm::DeviceMesh::create(env.group_ptr, {replicas, shards}, {"replicate", "shard"});
}

class HsdpGpt : public ::testing::TestWithParam<std::tuple<int, int, bool>> {};

// 20 steps, each rank of the R × S mesh on its rows of the batch: every rank equal to one rank trained on the whole
// batch, and all ranks bit-identical.
TEST_P(HsdpGpt, EqualsSingleRankOnTheWholeBatch) {
  const auto [replicas, shards, nested] = GetParam();
  const int world = replicas * shards;
  static const auto want = gpt_tiny::Reference(20);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    auto mesh = Mesh(env, replicas, shards);
    if (!mesh.ok()) return mesh.status();
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = ShardGptOnMesh(model, *mesh, nested); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, world, 0, 20); !s.ok()) return s;
    return test_util::StoreFullValues(model, got, env.rank);
  });
  ASSERT_TRUE(st.ok()) << st;
  gpt_tiny::ExpectMatches(got, want, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(Meshes, HsdpGpt,
                         ::testing::Combine(::testing::Values(2), ::testing::Values(2, 3), ::testing::Bool()),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) + "x" + std::to_string(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_nested" : "");
                         });

// Each rank's two half-batches, the first backward without the all-reduce across replicas: equal to one backward
// of the whole rows, with one all-reduce per unit per step on the replicate group (not two) and a reduce-scatter
// per unit per backward on the shard group.
TEST(HsdpAccumulation, RequiresAllReduceFalseDefersTheAllReduce) {
  static const auto want = gpt_tiny::Reference(6);
  std::vector<std::vector<std::vector<float>>> got(4);
  absl::Status st = comm::RunRanks(4, [&](comm::RankEnv& env) -> absl::Status {
    auto mesh = Mesh(env, 2, 2);
    if (!mesh.ok()) return mesh.status();
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = ShardGptOnMesh(model, *mesh); !s.ok()) return s;
    FSDPModule root = *state_of(model);
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    const int rows = kBatch / 4;
    for (int step = 0; step < 6; ++step) {
      const comm::CommCounters column = mesh->group(0).counters(), row = mesh->group(1).counters();
      (*opt)->zero_grad();
      for (int half = 0; half < 2; ++half) {
        root.set_requires_all_reduce(half == 1);
        auto [x, y] = Batch(step, env.rank * rows + half * rows / 2, rows / 2);
        if (absl::Status s = autograd::try_backward(autograd::scale(model.loss(x, y), 0.5f)); !s.ok()) return s;
      }
      // 4 units, each one all-reduce of its rows and one of its "used" flags (Note [parameters no rank used] in
      // fsdp/param_group.cc), once per step: the first half deferred both.
      EXPECT_EQ(mesh->group(0).counters().since(column).of(comm::CollectiveKind::all_reduce).calls, 2 * 4) << "4 units";
      EXPECT_EQ(mesh->group(1).counters().since(row).of(comm::CollectiveKind::reduce_scatter).calls, 8);
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    }
    return test_util::StoreFullValues(model, got, env.rank);
  });
  ASSERT_TRUE(st.ok()) << st;
  gpt_tiny::ExpectMatches(got, want, 2e-5);
}

// At rest each rank holds its rows of the shard group's split (S = 3 on a 2 × 3 mesh), not the world's: 16Ψ/S plus
// padding of model state after a step.
TEST(HsdpMemory, ShardsAreSplitOverTheRowOnly) {
  absl::Status st = comm::RunRanks(6, [&](comm::RankEnv& env) -> absl::Status {
    auto mesh = Mesh(env, 2, 3);
    if (!mesh.ok()) return mesh.status();
    MemoryTracker& mem = *env.context.memory;
    std::unique_ptr<nn::GPT> model;
    {
      MemoryCategoryScope params(MemoryCategory::parameter);
      model = std::make_unique<nn::GPT>(TinyConfig(), 1);
    }
    const int j = mesh->coordinate()[1];
    std::int64_t padded = 0;
    for (const Tensor& p : model->parameters()) {
      const RowSplit rs = split_rows(p.shape(), j, 3);
      padded += rs.rows_per_rank * rs.row_numel;
    }
    if (absl::Status s = ShardGptOnMesh(*model, *mesh); !s.ok()) return s;
    EXPECT_EQ(mem.current(MemoryCategory::parameter), padded * 4);
    auto opt = optim::AdamW::factory()({{model->parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (absl::Status s = test_util::TrainRows(*model, **opt, env.rank, 6, 0, 1); !s.ok()) return s;
    EXPECT_EQ(mem.current(MemoryCategory::gradient), padded * 4) << "sharded gradients over the row";
    EXPECT_EQ(mem.current(MemoryCategory::communication_buffer), 0);
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// State dicts on the 2-D mesh: the full state dict of a trained HSDP model equals single-rank training's; every
// rank's sharded piece (replicas hold the same rows) loads into a fresh HSDP model and into plain FSDP at N = 2,
// both ending with the same values.
TEST(HsdpStateDict, FullAndShardedStateDictsOnTheMesh) {
  static const auto want = gpt_tiny::Reference(3);
  std::vector<ShardedStateDict> pieces(4);
  std::vector<std::vector<std::vector<float>>> full(4), reloaded(4), at_two(2);
  absl::Status st = comm::RunRanks(4, [&](comm::RankEnv& env) -> absl::Status {
    auto mesh = Mesh(env, 2, 2);
    if (!mesh.ok()) return mesh.status();
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = ShardGptOnMesh(model, *mesh); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, 4, 0, 3); !s.ok()) return s;
    auto sd = full_state_dict(model);
    if (!sd.ok()) return sd.status();
    nn::GPT single(TinyConfig(), 7);
    if (absl::Status s = single.load_state_dict(*sd); !s.ok()) return s;
    full[static_cast<std::size_t>(env.rank)] = gpt_tiny::Values(single);
    auto piece = sharded_state_dict(model);
    if (!piece.ok()) return piece.status();
    pieces[static_cast<std::size_t>(env.rank)] = std::move(*piece);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  gpt_tiny::ExpectMatches(full, want, 2e-5);
  st = comm::RunRanks(4, [&](comm::RankEnv& env) -> absl::Status {
    auto mesh = Mesh(env, 2, 2);
    if (!mesh.ok()) return mesh.status();
    nn::GPT model(TinyConfig(), 7);
    if (absl::Status s = ShardGptOnMesh(model, *mesh); !s.ok()) return s;
    if (absl::Status s = load_sharded_state_dict(model, pieces); !s.ok()) return s;
    return test_util::StoreFullValues(model, reloaded, env.rank);
  });
  ASSERT_TRUE(st.ok()) << st;
  st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 7);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    if (absl::Status s = load_sharded_state_dict(model, pieces); !s.ok()) return s;
    return test_util::StoreFullValues(model, at_two, env.rank);
  });
  ASSERT_TRUE(st.ok()) << st;
  for (int r = 0; r < 4; ++r) EXPECT_EQ(reloaded[static_cast<std::size_t>(r)], full[0]) << "rank " << r;
  for (int r = 0; r < 2; ++r) EXPECT_EQ(at_two[static_cast<std::size_t>(r)], full[0]) << "rank " << r;
}

// fsdp::clip_grad_norm under HSDP: the norm over the row's shards (replicas hold the same all-reduced rows) and the
// clip act as in single-rank training: 12 clipped SGD steps at 2 × 2 equal the single-rank clipped run.
TEST(HsdpClip, ClippedTrainingEqualsSingleRankClippedTraining) {
  const optim::OptimizerFactory sgd = optim::Sgd::factory({.lr = 0.1, .momentum = 0.9});
  constexpr double kMaxNorm = 0.05;
  static const auto want = gpt_tiny::Reference(12, -1, sgd, kMaxNorm);
  std::vector<std::vector<std::vector<float>>> got(4);
  absl::Status st = comm::RunRanks(4, [&](comm::RankEnv& env) -> absl::Status {
    auto mesh = Mesh(env, 2, 2);
    if (!mesh.ok()) return mesh.status();
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = ShardGptOnMesh(model, *mesh); !s.ok()) return s;
    auto opt = sgd({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    const int rows = kBatch / 4;
    for (int step = 0; step < 12; ++step) {
      auto [x, y] = Batch(step, env.rank * rows, rows);
      (*opt)->zero_grad();
      if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
      absl::StatusOr<double> norm = clip_grad_norm(model, kMaxNorm);
      if (!norm.ok()) return norm.status();
      EXPECT_GT(*norm, 2 * kMaxNorm) << "step " << step << ": the test needs clipping to act";
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    }
    return test_util::StoreFullValues(model, got, env.rank);
  });
  ASSERT_TRUE(st.ok()) << st;
  gpt_tiny::ExpectMatches(got, want, 2e-5);
}

}  // namespace
}  // namespace shardkit::fsdp
