// The compiled fully-shard mode holds ranks to "every rank builds the same model (same seed)" as fully_shard does
// (Note [same values on every rank] in fsdp/same_values.cc): its expand() compares the whole parameters across the
// group before sharding them. The same seed trains bit for bit as eager fsdp, with one comparison per capture;
// another seed, one value, a frozen parameter or a parameter the mode keeps whole that differs is told on every
// rank, by name and ranks, with nothing sharded, and again at the next call; no rank hangs.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/autograd/engine.h"
#include "common/capture/compile.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "fsdp/fully_shard_mode.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/fsdp/eager_fsdp_reference.h"
#include "tests/fsdp/fsdp_test_util.h"

namespace shardkit::fsdp {
namespace {

using gpt_tiny::Batch;
using gpt_tiny::kBatch;
using gpt_tiny::TinyConfig;
using ::testing::HasSubstr;

capture::StepFn TrainStep(nn::GPT& model, optim::Optimizer& opt) {
  return [&model, &opt](const std::vector<Tensor>& batch) {
    Tensor loss = model.loss(batch[0], batch[1]);
    autograd::backward(loss);
    EXPECT_TRUE(opt.step().ok());
    opt.zero_grad();
    return loss;
  };
}

// The name of `pick(model)` in GPT-tiny's named_parameters().
std::string NameOf(const std::function<Tensor(nn::GPT&)>& pick) {
  nn::GPT m(TinyConfig(), 1);
  const Tensor w = pick(m);
  for (const auto& [n, t] : m.named_parameters()) {
    if (t.is_same(w)) return n;
  }
  return "";
}

class FullyShardModeSameValues : public ::testing::TestWithParam<int> {};

// The same seed on every rank: three compiled steps equal eager fsdp bit for bit (losses and parameters), and the
// capture made exactly one all_gather more than a replay (the comparison).
TEST_P(FullyShardModeSameValues, TheSameSeedTrainsAsEagerFsdp) {
  const int world = GetParam();
  constexpr int kSteps = 3;
  std::vector<std::vector<std::vector<float>>> eager_values(world), compiled_values(world);
  std::vector<std::vector<float>> eager_losses(world), compiled_losses(world);
  std::vector<std::int64_t> capture_gathers(world), replay_gathers(world);
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    const int rows = kBatch / env.world_size;
    const auto r = static_cast<std::size_t>(env.rank);
    if (absl::Status s = test_util::RunEagerFsdp(env, TinyConfig(), kSteps, eager_losses[r], eager_values); !s.ok()) {
      return s;
    }
    nn::GPT model(TinyConfig(), 1);
    optim::AdamW opt(model.parameters());
    auto mode = std::make_shared<FullyShardMode>(env.group_ptr);
    capture::CompiledStep compiled = capture::compile(TrainStep(model, opt), model, opt, {.parallel_mode = mode});
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = Batch(step, env.rank * rows, rows);
      const comm::CommCounters before = env.group_ptr->counters();
      absl::StatusOr<Tensor> loss = compiled({x, y});
      if (!loss.ok()) return loss.status();
      const std::int64_t gathers = env.group_ptr->counters().since(before).of(comm::CollectiveKind::all_gather).calls;
      (step == 0 ? capture_gathers : replay_gathers)[r] = gathers;
      compiled_losses[r].push_back(static_cast<float>(loss->item()));
    }
    EXPECT_EQ(compiled.captures(), 1);
    if (absl::Status s = mode->unshard_parameters(); !s.ok()) return s;
    compiled_values[r] = gpt_tiny::Values(model);
    return absl::OkStatus();
  }, {.timeout = absl::Seconds(20)});
  ASSERT_TRUE(st.ok()) << st;
  gpt_tiny::ExpectBitwiseEqualRuns(compiled_losses, eager_losses, compiled_values, eager_values);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(capture_gathers[r], replay_gathers[r] + 1) << "rank " << r << ": the capture compares once";
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, FullyShardModeSameValues, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& i) { return absl::StrCat("world", i.param); });

// Each rank builds GPT-tiny from seed_of(rank), `prepare`s it (on every rank) and `tweak`s it, compiles a step with
// the fully-shard mode and calls it twice. Both calls must fail on every rank with InvalidArgument containing `want`
// and the advice, with nothing sharded (the module's tensors keep their bytes and values). `optimized` picks the
// parameters the optimizer holds (all by default).
struct Case {
  int world = 2;
  std::function<std::uint64_t(int)> seed_of = [](int) { return 1; };
  std::function<void(nn::GPT&)> prepare = nullptr;
  std::function<void(nn::GPT&, int)> tweak = nullptr;
  std::function<std::vector<Tensor>(nn::GPT&)> optimized = nullptr;
};

void ExpectToldOnEveryRank(const Case& c, const std::string& want) {
  std::vector<std::vector<absl::Status>> seen(static_cast<std::size_t>(c.world));
  absl::Status st = comm::RunRanks(c.world, [&](comm::RankEnv& env) -> absl::Status {
    const int rows = kBatch / env.world_size;
    nn::GPT model(TinyConfig(), c.seed_of(env.rank));
    if (c.prepare) c.prepare(model);
    if (c.tweak) c.tweak(model, env.rank);
    const std::vector<std::vector<float>> built = gpt_tiny::Values(model);
    optim::AdamW opt(c.optimized ? c.optimized(model) : model.parameters());
    auto mode = std::make_shared<FullyShardMode>(env.group_ptr);
    // model.zero_grad(): a parameter the optimizer does not hold gets its gradient dropped too.
    capture::CompiledStep compiled = capture::compile(
        [&](const std::vector<Tensor>& batch) {
          Tensor loss = model.loss(batch[0], batch[1]);
          autograd::backward(loss);
          EXPECT_TRUE(opt.step().ok());
          model.zero_grad();
          return loss;
        },
        model, opt, {.parallel_mode = mode});
    for (int call = 0; call < 2; ++call) {
      auto [x, y] = Batch(call, env.rank * rows, rows);
      seen[static_cast<std::size_t>(env.rank)].push_back(compiled({x, y}).status());
    }
    for (const Tensor& p : model.parameters()) EXPECT_FALSE(p.storage_released()) << "rank " << env.rank;
    EXPECT_EQ(mode->shard_bytes(), 0) << "rank " << env.rank;
    EXPECT_TRUE(gpt_tiny::Values(model) == built) << "rank " << env.rank << ": the model is as built";
    return absl::OkStatus();
  }, {.timeout = absl::Seconds(5)});
  ASSERT_TRUE(st.ok()) << st;
  for (std::size_t r = 0; r < seen.size(); ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    ASSERT_EQ(seen[r].size(), 2u);
    for (const absl::Status& s : seen[r]) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_THAT(std::string(s.message()), HasSubstr(want));
      EXPECT_THAT(std::string(s.message()), HasSubstr("every rank must build the same model (same seed)"));
    }
  }
}

// The last rank builds from another seed: told on every rank, naming the first parameter the step reads (the
// embedding, wte.weight) and both ranks.
TEST_P(FullyShardModeSameValues, AnotherSeedOnOneRankIsToldOnEveryRank) {
  const int last = GetParam() - 1;
  ExpectToldOnEveryRank({.world = GetParam(), .seed_of = [last](int r) { return r == last ? 2 : 1; }},
                        absl::StrCat("fsdp: parameter 'wte.weight' on rank ", last,
                                     " differs from rank 0's before sharding"));
}

// One value of one parameter of block 1 differs on rank 1 of 3 only: told by that parameter's name.
TEST(FullyShardModeSameValues, OneValueOfOneParameterIsTold) {
  auto pick = [](nn::GPT& m) { return (*m.blocks)[1]->parameters().back(); };
  const std::string name = NameOf(pick);
  ASSERT_FALSE(name.empty());
  ExpectToldOnEveryRank({.world = 3, .tweak = [pick](nn::GPT& m, int rank) {
                           if (rank != 1) return;
                           const Tensor w = pick(m);
                           w.data<float>()[w.numel() - 1] += 1e-3f;
                         }},
                        absl::StrCat("parameter '", name, "' on rank 1 differs from rank 0's before sharding"));
}

// A frozen parameter (sharded too, never updated: Note [frozen parameters in the fully-shard mode]) that differs.
TEST(FullyShardModeSameValues, AFrozenParameterThatDiffersIsTold) {
  auto pick = [](nn::GPT& m) { return (*m.blocks)[0]->parameters().front(); };
  const std::string name = NameOf(pick);
  ASSERT_FALSE(name.empty());
  ExpectToldOnEveryRank({.prepare = gpt_tiny::FreezeBlock0,
                         .tweak = [pick](nn::GPT& m, int rank) {
                           if (rank == 1) pick(m).data<float>()[0] += 1e-3f;
                         }},
                        absl::StrCat("parameter '", name, "' on rank 1 differs from rank 0's before sharding"));
}

// A parameter that requires grad but that the optimizer does not hold stays whole (the mode never synchronises it):
// differing, it is told too.
TEST(FullyShardModeSameValues, AParameterKeptWholeThatDiffersIsTold) {
  ExpectToldOnEveryRank({.tweak = [](nn::GPT& m, int rank) {
                           if (rank == 1) m.ln_f->parameter("weight").fill_(2.0);
                         },
                         .optimized =
                             [](nn::GPT& m) {
                               std::vector<Tensor> held;
                               const Tensor kept = m.ln_f->parameter("weight");
                               for (const Tensor& p : m.parameters()) {
                                 if (!p.is_same(kept)) held.push_back(p);
                               }
                               return held;
                             }},
                        "parameter 'ln_f.weight' on rank 1 differs from rank 0's (the fully-shard mode keeps it whole "
                        "and never synchronises it)");
}

}  // namespace
}  // namespace shardkit::fsdp
