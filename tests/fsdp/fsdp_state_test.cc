// Checkpoints across strategies: the full optimizer state of FSDP (fsdp/optim_state.h) plus the unsharded
// module state continue training on one rank, and a single-rank checkpoint continues under FSDP at another
// world size, both equal to uninterrupted single-rank training.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
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

// Loading checks a full state the way every loader does (Note [state dict validation] in
// common/optim/state_dict_validation.h): each bad state is refused on every rank with an error naming the
// entry, and training then continues exactly as if no load had been tried. Loading is collective: in the last
// case only rank 1 gets the bad state (rank 0 a good one with other values), and rank 0 refuses too.
TEST(FsdpState, BadFullStatesAreRefusedOnEveryRankAndChangeNothing) {
  static const auto want = gpt_tiny::Reference(2 * kHalf);
  std::vector<Shape> shapes;
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    for (const Tensor& p : nn::GPT(TinyConfig(), 1).parameters()) shapes.push_back(p.shape());
  }
  const auto n = static_cast<std::int64_t>(shapes.size());
  std::int64_t k = n - 1;  // a 2-D parameter inside a block (not the first of its unit)
  while (k > 0 && (shapes[static_cast<std::size_t>(k)].size() != 2 || shapes[static_cast<std::size_t>(k - 1)].size() != 1)) --k;
  ASSERT_GT(k, 1);
  const Shape& shape = shapes[static_cast<std::size_t>(k)];
  const std::string entry = absl::StrCat("parameter ", k, " (f32", shape_str(shape), " cpu): ");
  struct Case {
    std::string expect;
    std::function<void(optim::OptimizerStateDict&)> corrupt;
    int only_rank = -1;  // >= 0: only this rank gets the bad state
  };
  using D = optim::OptimizerStateDict;
  const std::vector<Case> cases = {
      {"load_full_optimizer_state: expected a state dict of AdamW, found one of SGD", [](D& d) { d.optimizer = "SGD"; }},
      {"expected 1 param groups, found 2", [](D& d) { d.param_groups.push_back(d.param_groups[0]); }},
      {absl::StrCat("param group 0: expected ", n, " parameters, found ", n - 1),
       [](D& d) { d.param_groups[0].params.pop_back(); }},
      {"param group 0: expected lr >= 0, found -1", [](D& d) { d.param_groups[0].hyper.lr = -1; }},
      {"param group 0, entry 0: expected a parameter index >= 0, found -1", [](D& d) { d.param_groups[0].params[0] = -1; }},
      {"expected each parameter index once, found index 0 twice", [](D& d) { d.param_groups[0].params[1] = 0; }},
      // An index out of range in a group: parameter k's state is then listed by none.
      {absl::StrCat("unexpected state for parameter index ", k, ", which no param group lists"),
       [&](D& d) { d.param_groups[0].params[static_cast<std::size_t>(k)] = n + 100; }},
      {absl::StrCat("unexpected state for parameter index ", n, ", which no param group lists"),
       [&](D& d) { d.state[n] = d.state.at(0); }},
      {absl::StrCat(entry, "state 'exp_avg': expected shape ", shape_str(shape), ", found [", shape_numel(shape), "]"),
       [&](D& d) { d.state.at(k).tensors.at(optim::kExpAvg) = d.state.at(k).tensors.at(optim::kExpAvg).reshape({-1}); }},
      {absl::StrCat(entry, "state 'exp_avg_sq': expected an f32 CPU tensor, found bf16", shape_str(shape), " cpu"),
       [&](D& d) { d.state.at(k).tensors.at(optim::kExpAvgSq) = d.state.at(k).tensors.at(optim::kExpAvgSq).to(DType::bf16); }},
      {absl::StrCat(entry, "missing state key 'exp_avg_sq' (expected keys: exp_avg, exp_avg_sq)"),
       [&](D& d) { d.state.at(k).tensors.erase(optim::kExpAvgSq); }},
      {absl::StrCat(entry, "expected a step count >= 0, found -1"), [&](D& d) { d.state.at(k).step = -1; }},
      // What only FSDP asks (a unit's parameters are one optimizer parameter, its shard).
      {absl::StrCat("parameter ", k, ": expected step ", kHalf, " like the rest of unit "),
       [&](D& d) { d.state.at(k).step = kHalf + 1; }},
      {"expected state for all or none of unit ", [&](D& d) { d.state.erase(k); }},
      {absl::StrCat(entry, "missing state key 'exp_avg_sq'"), [&](D& d) { d.state.at(k).tensors.erase(optim::kExpAvgSq); },
       /*only_rank=*/1},
  };
  std::vector<std::vector<std::vector<float>>> got(2);
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    auto fs = test_util::ShardBlocks(model, env);
    if (!fs.ok()) return fs.status();
    auto opt = optim::AdamW::factory()({{(*fs)->parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, env.world_size, 0, kHalf); !s.ok()) return s;
    auto full = full_optimizer_state(**fs, model, **opt);
    if (!full.ok()) return full.status();
    D other = full->clone();  // a good state with other values
    for (auto& [index, ps] : other.state) ps.tensors.at(optim::kExpAvg).fill_(0.5);
    for (const Case& c : cases) {
      SCOPED_TRACE(absl::StrCat("rank ", env.rank, ": ", c.expect));
      D bad = full->clone();
      c.corrupt(bad);
      const bool gets_bad = c.only_rank < 0 || c.only_rank == env.rank;
      const absl::Status s = load_full_optimizer_state(**fs, model, **opt, gets_bad ? bad : other);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_THAT(std::string(s.message()),
                  ::testing::HasSubstr(gets_bad ? c.expect : "load_full_optimizer_state: rank 1 rejected the state"));
    }
    if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, env.world_size, kHalf, 2 * kHalf); !s.ok()) return s;
    auto values = test_util::FullValues(**fs, model);
    if (!values.ok()) return values.status();
    got[static_cast<std::size_t>(env.rank)] = std::move(*values);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  gpt_tiny::ExpectMatches(got, want, 2e-5);
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
