// Checkpoints across strategies (fsdp/state_dict.h): FSDP's full model and optimizer state continue training on
// one rank or under FSDP at another world size, and a single-rank checkpoint continues under FSDP, all equal to
// uninterrupted single-rank training.
#include <functional>
#include <memory>
#include <string>
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
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, env.world_size, 0, kHalf); !s.ok()) return s;
    auto full = full_optimizer_state(model, **opt);
    if (!full.ok()) return full.status();
    auto msd = full_state_dict(model);
    if (!msd.ok()) return msd.status();
    if (env.rank == 0) {  // (copies charged to rank 0's ledger, which they keep alive)
      model_sd = Copy(*msd);
      opt_sd = full->clone();
    }
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
      if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
      auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
      if (!opt.ok()) return opt.status();
      if (absl::Status s = load_full_optimizer_state(model, **opt, opt_sd); !s.ok()) return s;
      if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, env.world_size, kHalf, 2 * kHalf); !s.ok()) return s;
      return test_util::StoreFullValues(model, got, env.rank);
    });
    ASSERT_TRUE(st.ok()) << st;
    gpt_tiny::ExpectMatches(got, want, 2e-5);
  }
}

// A checkpoint written under FSDP at N = 4 continues at N = 2 and 3 (full state dicts), equal to the
// uninterrupted single-rank run.
TEST(FsdpState, CheckpointAtFourContinuesAtTwoAndThree) {
  static const auto want = gpt_tiny::Reference(2 * kHalf);
  nn::StateDict model_sd;
  optim::OptimizerStateDict opt_sd;
  absl::Status st = comm::RunRanks(4, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env, {}, /*nested=*/true); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, 4, 0, kHalf); !s.ok()) return s;
    auto msd = full_state_dict(model);
    if (!msd.ok()) return msd.status();
    auto osd = full_optimizer_state(model, **opt);
    if (!osd.ok()) return osd.status();
    if (env.rank == 0) model_sd = Copy(*msd), opt_sd = osd->clone();
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  for (const int world : {2, 3}) {
    std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
    st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(TinyConfig(), 7);
      if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
      auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
      if (!opt.ok()) return opt.status();
      if (absl::Status s = load_full_state_dict(model, model_sd); !s.ok()) return s;
      if (absl::Status s = load_full_optimizer_state(model, **opt, opt_sd); !s.ok()) return s;
      if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, world, kHalf, 2 * kHalf); !s.ok()) return s;
      return test_util::StoreFullValues(model, got, env.rank);
    });
    ASSERT_TRUE(st.ok()) << st;
    gpt_tiny::ExpectMatches(got, want, 2e-5);
  }
}

// A full optimizer state that does not fit (a state tensor of the wrong shape) is refused naming the entry, and
// the optimizer is unchanged.
TEST(FsdpState, BadFullOptimizerStateIsRefused) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, 2, 0, 1); !s.ok()) return s;
    auto full = full_optimizer_state(model, **opt);
    if (!full.ok()) return full.status();
    const optim::OptimizerStateDict before = (*opt)->state_dict();
    optim::OptimizerStateDict bad = full->clone();
    bad.state.at(0).tensors.at("exp_avg") = Tensor::zeros({3});
    absl::Status s = load_full_optimizer_state(model, **opt, bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("exp_avg"));
    EXPECT_EQ((*opt)->state_dict().state.at(0).tensors.at("exp_avg").to_vector(),
              before.state.at(0).tensors.at("exp_avg").to_vector());
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// Loading a model state dict into a sharded module: summon_full_params(), load on every rank, reshard() keeps it.
TEST(FsdpState, LoadStateDictBetweenUnshardAndReshard) {
  std::vector<std::vector<float>> want;
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    want = gpt_tiny::Values(nn::GPT(TinyConfig(), 2));
  }
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1), other(TinyConfig(), 2);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    FSDPModule root = *state_of(model);
    if (absl::Status s = root.summon_full_params(); !s.ok()) return s;
    if (absl::Status s = model.load_state_dict(other.state_dict()); !s.ok()) return s;
    if (absl::Status s = root.reshard(true); !s.ok()) return s;
    auto values = test_util::FullValues(model);  // gathered from the shards again
    if (!values.ok()) return values.status();
    EXPECT_EQ(*values, want) << "rank " << env.rank;
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

TEST(FsdpState, OptimizerOverOtherTensorsIsRefused) {
  absl::Status st = comm::RunRanks(1, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    Tensor other = Tensor::zeros({3});
    other.set_requires_grad(true);
    auto opt = optim::AdamW::factory()({{{other}, optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    auto full = full_optimizer_state(model, **opt);
    EXPECT_EQ(full.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(full.status().message()), ::testing::HasSubstr("that is not one of them"));
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace shardkit::fsdp
