// Checkpoints across strategies: the full optimizer state of FSDP (fsdp/optim_state.h) plus the unsharded
// module state continue training on one rank, and a single-rank checkpoint continues under FSDP at another
// world size, both equal to uninterrupted single-rank training.
#include <memory>
#include <string>
#include <vector>

#include "common/comm/testing/run_ranks.h"
#include "fsdp/fully_shard.h"
#include "fsdp/optim_state.h"
#include "gmock/gmock.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp {
namespace {

using gpt_tiny::TinyConfig;

constexpr int kHalf = 5;  // steps before the checkpoint, and after

nn::StateDict Copy(const nn::StateDict& sd) {
  nn::StateDict out;
  for (const auto& [name, t] : sd) out.emplace_back(name, t.clone());
  return out;
}


TEST(FsdpState, FsdpCheckpointContinuesOnOneRank) {
  static const auto want = gpt_tiny::Reference(2 * kHalf);
  nn::StateDict model_sd;
  optim::OptimizerStateDict opt_sd;
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    auto fs = test_util::ShardBlocks(model, env);
    if (!fs.ok()) return fs.status();
    auto opt = optim::AdamW::factory()({{(*fs)->parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, env.world_size, 0, kHalf); !s.ok()) return s;
    auto full = full_optimizer_state(**fs, model, **opt);
    if (!full.ok()) return full.status();
    if (absl::Status s = (*fs)->unshard(); !s.ok()) return s;
    if (env.rank == 0) {  // (copies charged to rank 0's ledger, which they keep alive)
      model_sd = Copy(model.state_dict());
      opt_sd = full->clone();
    }
    (*fs)->reshard();
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT model(TinyConfig(), 2);  // another initialisation: everything comes from the checkpoint
  const absl::Status loaded = model.load_state_dict(model_sd);
  ASSERT_TRUE(loaded.ok()) << loaded;
  auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
  ASSERT_TRUE(opt.ok());
  const absl::Status opt_loaded = (*opt)->load_state_dict(opt_sd);
  ASSERT_TRUE(opt_loaded.ok()) << opt_loaded;
  ASSERT_TRUE(test_util::TrainRows(model, **opt, 0, 1, kHalf, 2 * kHalf).ok());
  gpt_tiny::ExpectMatches({gpt_tiny::Values(model)}, want, 2e-5);
}

TEST(FsdpState, SingleRankCheckpointContinuesUnderFsdp) {
  static const auto want = gpt_tiny::Reference(2 * kHalf);
  nn::StateDict model_sd;
  optim::OptimizerStateDict opt_sd;
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    nn::GPT model(TinyConfig(), 1);
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    ASSERT_TRUE(opt.ok());
    ASSERT_TRUE(test_util::TrainRows(model, **opt, 0, 1, 0, kHalf).ok());
    model_sd = Copy(model.state_dict());
    opt_sd = (*opt)->state_dict();
  }
  for (const int world : {2, 4}) {
    std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
    absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(TinyConfig(), 3);
      if (absl::Status s = model.load_state_dict(model_sd); !s.ok()) return s;  // before sharding
      auto fs = test_util::ShardBlocks(model, env);
      if (!fs.ok()) return fs.status();
      auto opt = optim::AdamW::factory()({{(*fs)->parameters(), optim::AdamW::default_hyper()}});
      if (!opt.ok()) return opt.status();
      if (absl::Status s = load_full_optimizer_state(**fs, model, **opt, opt_sd); !s.ok()) return s;
      if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, env.world_size, kHalf, 2 * kHalf); !s.ok()) return s;
      auto values = test_util::FullValues(**fs, model);
      if (!values.ok()) return values.status();
      got[static_cast<std::size_t>(env.rank)] = std::move(*values);
      return absl::OkStatus();
    });
    ASSERT_TRUE(st.ok()) << st;
    gpt_tiny::ExpectMatches(got, want, 2e-5);
  }
}

// Loading a model state dict into a sharded module: unshard(), load on every rank, reshard() keeps it.
TEST(FsdpState, LoadStateDictBetweenUnshardAndReshard) {
  std::vector<std::vector<float>> want;
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    want = gpt_tiny::Values(nn::GPT(TinyConfig(), 2));
  }
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1), other(TinyConfig(), 2);
    auto fs = test_util::ShardBlocks(model, env);
    if (!fs.ok()) return fs.status();
    if (absl::Status s = (*fs)->unshard(); !s.ok()) return s;
    if (absl::Status s = model.load_state_dict(other.state_dict()); !s.ok()) return s;
    (*fs)->reshard();
    if (absl::Status s = (*fs)->unshard(); !s.ok()) return s;  // gathered from the shards again
    EXPECT_EQ(gpt_tiny::Values(model), want) << "rank " << env.rank;
    (*fs)->reshard();
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

TEST(FsdpState, OptimizerOverOtherTensorsIsRefused) {
  absl::Status st = comm::RunRanks(1, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    auto fs = test_util::ShardBlocks(model, env);
    if (!fs.ok()) return fs.status();
    Tensor other = Tensor::zeros({3});
    other.set_requires_grad(true);
    auto opt = optim::AdamW::factory()({{{other}, optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    auto full = full_optimizer_state(**fs, model, **opt);
    EXPECT_EQ(full.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(full.status().message()), ::testing::HasSubstr("not a unit shard"));
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace shardkit::fsdp
