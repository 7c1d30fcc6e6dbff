// Second round of feature combinations of DDP, OSS + DDP and OSS + ShardedDDP (greedy, flat reduce-scatter, flat
// reduce to owner), each against single-rank training (DESIGN.md section 8):
//   * zero_grad(set_to_none = false) (gradients zeroed, not dropped) with a parameter that no rank uses in a step:
//     one rank keeps its zero gradient and AdamW still moves it (moments, weight decay), so every strategy must too;
//   * OSS flat + DDP (left out of tests/sddp/sddp_gpt_test.cc's SddpGptOptions and of
//     tests/sddp/sddp_mixed_precision_test.cc): no_sync accumulation under SGD (a factor applied twice or not at
//     all shows), freezing a block mid-run, bf16 mixed precision bitwise;
//   * two synchronised backwards per step (accumulation without no_sync), SGD;
//   * a parameter used only in a no_sync micro-batch (on every rank, or on one), then by none;
//   * no_sync accumulation under bf16 mixed precision (reduce dtype bf16) in every mode, bitwise against one rank
//     with the same casts;
//   * compile() with sddp::ReplicateMode on a model with a parameter the captured step never uses, with gradient
//     clipping that acts in some steps only, against eager single-rank training.
#include <algorithm>
#include <cmath>
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
#include "common/comm/testing/run_ranks.h"
#include "common/nn/layers.h"
#include "common/nn/mixed_precision.h"
#include "common/optim/clip_grad.h"
#include "common/optim/sgd.h"
#include "oss/oss.h"
#include "sddp/data_parallel.h"
#include "sddp/replicate_mode.h"
#include "tests/sddp/sddp_test_util.h"
#include "tests/sddp/sddp_trainer.h"
#include "tests/testing/two_head_net.h"

namespace shardkit::sddp {
namespace {

using test_util::Batch;
using test_util::kBatch;
using test_util::TinyConfig;
using test_util::Values;
using test_util::CaseName;
using test_util::kModes;
using test_util::Mode;
using test_util::ModeName;
using test_util::Trainer;
using two_head::HeadInput;
using two_head::TwoHeadNet;

// ---- zero_grad(set_to_none = false) with a parameter no rank uses in a step -------------------------------------

constexpr int kHeadSteps = 4;
bool UsesB(int step) { return step == 0; }  // head b: in the first step only, on every rank

// One rank on every rank's input (the mean of their losses), zero_grad(set_to_none = false): from step 1 on, b keeps
// a zero gradient, and AdamW steps it (its first moment from step 0 and the weight decay move it), as PyTorch does
// for a parameter whose .grad is a zero tensor.
std::vector<std::vector<float>> KeepGradsReference(int world, bool* b_moved) {
  RankContext ctx;
  RankContextScope scope(ctx);
  TwoHeadNet net(3);
  auto opt = optim::AdamW::factory()({{net.parameters(), optim::AdamW::default_hyper()}});
  EXPECT_TRUE(opt.ok());
  std::vector<float> b_after_first;
  for (int step = 0; step < kHeadSteps; ++step) {
    net.use_b = UsesB(step);
    (*opt)->zero_grad(/*set_to_none=*/false);
    Tensor loss = net(HeadInput(step, 0));
    for (int r = 1; r < world; ++r) loss = autograd::add(loss, net(HeadInput(step, r)));
    autograd::backward(autograd::scale(loss, 1.0f / static_cast<float>(world)));
    EXPECT_TRUE((*opt)->step().ok());
    if (step == 0) b_after_first = net.b->weight().to_vector();
  }
  *b_moved = net.b->weight().to_vector() != b_after_first;
  return Values(net);
}

class ZeroGradKeepCombo : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

// Head b is used in step 0 only, on every rank; every rank zeroes its gradients with set_to_none = false. One rank
// keeps b's zero gradient and AdamW moves b in steps 1..3; every strategy must end where that run ends.
TEST_P(ZeroGradKeepCombo, AZeroedGradientOfAnUnusedHeadIsSteppedAsOnOneRank) {
  const auto [world, mode] = GetParam();
  bool b_moved = false;
  const auto want = KeepGradsReference(world, &b_moved);
  ASSERT_TRUE(b_moved) << "the test needs one rank to move the unused head (zero gradient, AdamW)";
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    TwoHeadNet net(3);
    auto t = Trainer::make(mode, net, {{net.parameters(), optim::AdamW::default_hyper()}}, optim::AdamW::factory(),
                           env.group_ptr, {.reduce_buffer_size = 16});
    if (!t.ok()) return t.status();
    for (int step = 0; step < kHeadSteps; ++step) {
      net.use_b = UsesB(step);
      t->zero_grad(/*set_to_none=*/false);
      if (absl::Status s = autograd::try_backward(net(HeadInput(step, env.rank))); !s.ok()) return s;
      const std::vector<float> b_before = net.b->weight().to_vector();
      if (absl::Status s = t->step(); !s.ok()) return s;
      EXPECT_NE(net.b->weight().to_vector(), b_before)
          << "rank " << env.rank << ": head b did not move in step " << step
          << "; one rank moves it (a zeroed gradient, AdamW's moments and weight decay)";
    }
    got[static_cast<std::size_t>(env.rank)] = Values(net);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(got, want, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Modes, ZeroGradKeepCombo,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::ValuesIn(kModes)), CaseName);

// GPT-tiny, every parameter used, set_to_none = false in every mode: the same as dropping the gradients.
class ZeroGradKeepGpt : public ::testing::TestWithParam<Mode> {};

TEST_P(ZeroGradKeepGpt, ZeroingInsteadOfDroppingTrainsAsOnOneRank) {
  static const auto want = test_util::Reference(5);
  constexpr int kWorld = 3;
  std::vector<std::vector<std::vector<float>>> got(kWorld);
  absl::Status st = comm::RunRanks(kWorld, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    auto t = Trainer::make(GetParam(), model, {{model.parameters(), optim::AdamW::default_hyper()}},
                           optim::AdamW::factory(), env.group_ptr, {.reduce_buffer_size = 300});
    if (!t.ok()) return t.status();
    const int rows = kBatch / kWorld;
    for (int step = 0; step < 5; ++step) {
      auto [x, y] = Batch(step, env.rank * rows, rows);
      t->zero_grad(/*set_to_none=*/false);
      if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
      if (absl::Status s = t->step(); !s.ok()) return s;
    }
    got[static_cast<std::size_t>(env.rank)] = Values(model);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(got, want, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(Modes, ZeroGradKeepGpt, ::testing::ValuesIn(kModes),
                         [](const auto& info) { return ModeName(info.param); });

// ---- a parameter used only inside no_sync ----------------------------------------------------------------------

// Which ranks use head b in micro-batch `micro` of step `step`.
using UsePlan = std::function<bool(int step, int micro, int rank)>;

// One rank on every rank's inputs: each step the mean over ranks and micro-batches of their losses, head b in a
// rank's loss where `uses` says so.
std::vector<std::vector<float>> HeadReference(int world, int steps, int micros, const UsePlan& uses) {
  RankContext ctx;
  RankContextScope scope(ctx);
  TwoHeadNet net(3);
  auto opt = optim::AdamW::factory()({{net.parameters(), optim::AdamW::default_hyper()}});
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < steps; ++step) {
    (*opt)->zero_grad();
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
  }
  return Values(net);
}

class NoSyncUnusedCombo : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

// Two micro-batches per step, the first inside no_sync(). Head b: in step 0 everywhere; in step 1 only in the first
// (no_sync) micro-batch, on every rank, and in step 2 only there on rank 0; in step 3 nowhere. The synchronised
// backward must count a gradient accumulated under no_sync as used (Note [parameters no rank used]: "accumulated
// over no_sync backwards too"), so b is averaged and stepped in steps 1 and 2, and left alone in step 3.
TEST_P(NoSyncUnusedCombo, AHeadUsedOnlyInsideNoSyncIsAveragedAndStepped) {
  const auto [world, mode] = GetParam();
  constexpr int kSteps = 4, kMicros = 2;
  const UsePlan plan = [](int step, int micro, int rank) {
    if (step == 0) return true;
    if (step == 1) return micro == 0;
    if (step == 2) return micro == 0 && rank == 0;
    return false;
  };
  const auto want = HeadReference(world, kSteps, kMicros, plan);
  ASSERT_NE(want, HeadReference(world, kSteps, kMicros, [](int step, int, int) { return step == 0; }))
      << "the use inside no_sync matters";
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    TwoHeadNet net(3);
    auto t = Trainer::make(mode, net, {{net.parameters(), optim::AdamW::default_hyper()}}, optim::AdamW::factory(),
                           env.group_ptr, {.reduce_buffer_size = 16});
    if (!t.ok()) return t.status();
    for (int step = 0; step < kSteps; ++step) {
      t->zero_grad();
      for (int m = 0; m < kMicros; ++m) {
        net.use_b = plan(step, m, env.rank);
        const Tensor loss = autograd::scale(net(HeadInput(step * kMicros + m, env.rank)), 1.0f / kMicros);
        absl::Status s;
        if (m < kMicros - 1) {
          auto scope = t->dp->no_sync();
          s = autograd::try_backward(loss);
        } else {
          s = autograd::try_backward(loss);
        }
        if (!s.ok()) return s;
      }
      if (absl::Status s = t->step(); !s.ok()) return s;
    }
    got[static_cast<std::size_t>(env.rank)] = Values(net);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(got, want, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Modes, NoSyncUnusedCombo,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::ValuesIn(kModes)), CaseName);

// ---- OSS flat + DDP: no_sync, freezing mid-run, bf16 ----------------------------------------------------------

const optim::HyperParams kSgd{.lr = 0.05, .momentum = 0.9};
constexpr int kMicro = 4;

// One rank, SGD with momentum on the whole batch.
std::vector<std::vector<float>> SgdReference(int steps) {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT model(TinyConfig(), 1);
  auto opt = optim::Sgd::factory()({{model.parameters(), kSgd}});
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = Batch(step, 0, kBatch);
    (*opt)->zero_grad();
    autograd::backward(model.loss(x, y));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return Values(model);
}

// kMicro micro-batches per rank and step, each loss scaled by 1/kMicro, the first kMicro - 1 inside no_sync()
// (`by_hand`: all of them, then reduce()). SGD: the update is proportional to the gradient, so an accumulation
// reduced twice, scaled twice or lost shows.
TEST(OssFlatDdpCombo, NoSyncAccumulationUnderSgdEqualsOneLargeBatch) {
  constexpr int kSteps = 4;
  static const auto want = SgdReference(kSteps);
  for (const bool by_hand : {false, true}) {
    for (const int world : {2, 3}) {
      SCOPED_TRACE(::testing::Message() << "n=" << world << (by_hand ? " reduce() by hand" : " last backward syncs"));
      std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
      absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
        nn::GPT model(TinyConfig(), 1);
        auto t = Trainer::make(Mode::oss_flat_ddp, model, {{model.parameters(), kSgd}}, optim::Sgd::factory(),
                               env.group_ptr, {.reduce_buffer_size = 300});
        if (!t.ok()) return t.status();
        const int rows = kBatch / world, micro = rows / kMicro;
        for (int step = 0; step < kSteps; ++step) {
          t->zero_grad();
          const auto before = env.group.counters();
          for (int m = 0; m < kMicro; ++m) {
            auto [x, y] = Batch(step, env.rank * rows + m * micro, micro);
            const Tensor loss = autograd::scale(model.loss(x, y), 1.0f / kMicro);
            absl::Status s;
            if (m < kMicro - 1 || by_hand) {
              auto scope = t->dp->no_sync();
              s = autograd::try_backward(loss);
            } else {
              s = autograd::try_backward(loss);
            }
            if (!s.ok()) return s;
          }
          if (by_hand) {
            const auto c = env.group.counters().since(before);
            EXPECT_EQ(c.of(comm::CollectiveKind::all_reduce).calls, 0) << "nothing reduced inside no_sync";
            if (absl::Status s = t->dp->reduce(); !s.ok()) return s;
          }
          if (absl::Status s = t->step(); !s.ok()) return s;
        }
        got[static_cast<std::size_t>(env.rank)] = Values(model);
        return absl::OkStatus();
      });
      ASSERT_TRUE(st.ok()) << st;
      test_util::ExpectMatches(got, want, 2e-5);
    }
  }
}

// Block 0 frozen before step 5 on every rank: OSS's flat shards stop stepping it, DDP stops reducing it.
TEST(OssFlatDdpCombo, FreezingABlockMidRunEqualsOneRankThatFreezesToo) {
  static const auto want = test_util::Reference(10, 5);
  for (const int world : {2, 3}) {
    SCOPED_TRACE(::testing::Message() << "n=" << world);
    std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
    absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(TinyConfig(), 1);
      auto t = Trainer::make(Mode::oss_flat_ddp, model, {{model.parameters(), optim::AdamW::default_hyper()}},
                             optim::AdamW::factory(), env.group_ptr,
                             {.reduce_buffer_size = 300, .warn_on_trainable_params_changed = false});
      if (!t.ok()) return t.status();
      const int rows = kBatch / world;
      for (int step = 0; step < 10; ++step) {
        if (step == 5) test_util::FreezeBlock0(model);
        auto [x, y] = Batch(step, env.rank * rows, rows);
        t->zero_grad();
        if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
        if (absl::Status s = t->step(); !s.ok()) return s;
      }
      got[static_cast<std::size_t>(env.rank)] = Values(model);
      return absl::OkStatus();
    });
    ASSERT_TRUE(st.ok()) << st;
    test_util::ExpectMatches(got, want, 2e-5);
  }
}

class TwoSyncedBackwardsCombo : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

// PyTorch's other accumulation recipe: zero_grad, then two synchronised backwards (each half of the rank's rows, the
// loss scaled by 1/2), then step. One rank (and DDP, whose .grad accumulates the averaged first half and the local
// second half, averaged again) ends as with one backward of the whole batch; SGD, so a lost or rescaled half shows.
// ShardedDataParallel keeps only each rank's share of what it reduced, so it refuses the second synchronised backward
// on every rank with FailedPrecondition pointing to no_sync() (Note [one synchronised backward per step] in
// sddp/data_parallel.cc); before, greedy and the flat strategies silently mis-accumulated.
TEST_P(TwoSyncedBackwardsCombo, TwoSynchronisedBackwardsPerStepEqualOneLargeBatch) {
  const auto [world, mode] = GetParam();
  const bool sharded = mode == Mode::sddp_greedy || mode == Mode::sddp_flat || mode == Mode::sddp_flat_owner;
  constexpr int kSteps = 4;
  static const auto want = SgdReference(kSteps);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    auto t = Trainer::make(mode, model, {{model.parameters(), kSgd}}, optim::Sgd::factory(), env.group_ptr,
                           {.reduce_buffer_size = 300});
    if (!t.ok()) return t.status();
    const int rows = kBatch / world;
    for (int step = 0; step < kSteps; ++step) {
      t->zero_grad();
      for (int half = 0; half < 2; ++half) {
        auto [x, y] = Batch(step, env.rank * rows + half * rows / 2, rows / 2);
        if (absl::Status s = autograd::try_backward(autograd::scale(model.loss(x, y), 0.5f)); !s.ok()) return s;
      }
      if (absl::Status s = t->step(); !s.ok()) return s;
    }
    got[static_cast<std::size_t>(env.rank)] = Values(model);
    return absl::OkStatus();
  });
  if (sharded) {
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(std::string(st.message()).find("second synchronised backward"), std::string::npos) << st;
    EXPECT_NE(std::string(st.message()).find("no_sync()"), std::string::npos) << st;
    return;
  }
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(got, want, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(Modes, TwoSyncedBackwardsCombo,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::ValuesIn(kModes)), CaseName);

const nn::MixedPrecisionPolicy kBf16{.param_dtype = DType::bf16, .reduce_dtype = DType::bf16};

// Single-rank training with the wrappers' casts done by hand (as tests/sddp/sddp_mixed_precision_test.cc), for
// `world` ranks' rows, each rank's rows in `micro` micro-batches (each loss scaled by 1/micro): an f32 master model
// stepped by AdamW; each step a compute model gets the master's values rounded to bf16; each micro-batch's f32
// gradient is accumulated in f32 in micro-batch order (the rank's .grad over its no_sync backwards); the reducer
// scales the rank's sum by 1/world in f32 and rounds it to bf16; the backend sums the ranks' bf16 values in f32 in
// rank order and rounds once; the master's gradient is that, f32.
std::vector<std::vector<float>> Bf16Reference(int steps, int world, int micro) {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT master(TinyConfig(), 1), compute(TinyConfig(), 1);
  auto opt = optim::AdamW::factory()({{master.parameters(), optim::AdamW::default_hyper()}});
  const std::vector<Tensor> mp = master.parameters(), cp = compute.parameters();
  const int rows = kBatch / world, mrows = rows / micro;
  const float scale = 1.0f / static_cast<float>(world);
  for (int step = 0; step < steps; ++step) {
    for (std::size_t i = 0; i < mp.size(); ++i) cp[i].copy_(mp[i].to(DType::bf16));
    std::vector<std::vector<float>> sum(mp.size());
    for (int r = 0; r < world; ++r) {
      std::vector<std::vector<float>> acc(mp.size());
      for (int m = 0; m < micro; ++m) {
        for (const Tensor& p : cp) p.set_grad(Tensor());
        auto [x, y] = Batch(step, r * rows + m * mrows, mrows);
        Tensor loss = compute.loss(x, y);
        if (micro > 1) loss = autograd::scale(loss, 1.0f / static_cast<float>(micro));
        autograd::backward(loss);
        for (std::size_t i = 0; i < mp.size(); ++i) {
          const std::vector<float> g = cp[i].grad().to_vector();
          if (m == 0) {
            acc[i] = g;
          } else {
            for (std::size_t k = 0; k < g.size(); ++k) acc[i][k] += g[k];
          }
        }
      }
      for (std::size_t i = 0; i < mp.size(); ++i) {
        std::vector<float> g = acc[i];
        for (float& v : g) v *= scale;
        g = Tensor::from_vector(g, {static_cast<std::int64_t>(g.size())}, TensorOptions{}.with_dtype(DType::bf16))
                .to_vector();
        if (r == 0) {
          sum[i] = g;
        } else {
          for (std::size_t k = 0; k < g.size(); ++k) sum[i][k] += g[k];
        }
      }
    }
    (*opt)->zero_grad();
    for (std::size_t i = 0; i < mp.size(); ++i) {
      mp[i].set_grad(Tensor::from_vector(sum[i], mp[i].shape()).to(DType::bf16).to(DType::f32));
    }
    EXPECT_TRUE((*opt)->step().ok());
  }
  return Values(master);
}

// Trains `mode` with bf16 mixed precision; `micro` > 1: that many micro-batches per rank and step, all but the last
// inside no_sync().
std::vector<std::vector<std::vector<float>>> TrainBf16(Mode mode, int world, int steps, int micro) {
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    auto t = Trainer::make(mode, model, {{model.parameters(), optim::AdamW::default_hyper()}}, optim::AdamW::factory(),
                           env.group_ptr, {.reduce_buffer_size = 300, .mixed_precision = kBf16});
    if (!t.ok()) return t.status();
    const int rows = kBatch / world, mrows = rows / micro;
    for (int step = 0; step < steps; ++step) {
      t->zero_grad();
      for (int m = 0; m < micro; ++m) {
        auto [x, y] = Batch(step, env.rank * rows + m * mrows, mrows);
        Tensor loss = model.loss(x, y);
        if (micro > 1) loss = autograd::scale(loss, 1.0f / static_cast<float>(micro));
        absl::Status s;
        if (m < micro - 1) {
          auto scope = t->dp->no_sync();
          s = autograd::try_backward(loss);
        } else {
          s = autograd::try_backward(loss);
        }
        if (!s.ok()) return s;
      }
      if (absl::Status s = t->step(); !s.ok()) return s;
    }
    got[static_cast<std::size_t>(env.rank)] = Values(model);
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
  return got;
}

// OSS flat + DDP in bf16: bitwise the single-rank run with the same casts.
TEST(OssFlatDdpCombo, Bf16EqualsSingleRankTrainingWithTheSameCasts) {
  for (const int world : {2, 3, 4}) {
    SCOPED_TRACE(::testing::Message() << "n=" << world);
    test_util::ExpectMatches(TrainBf16(Mode::oss_flat_ddp, world, 8, 1), Bf16Reference(8, world, 1), 0.0);
  }
}

class Bf16NoSyncCombo : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

// no_sync accumulation under bf16 reduction: each rank's micro-batch gradients accumulate in f32 (the masters'
// .grad) and only their sum is rounded to bf16 on its way to the reduction, so the result is bitwise the single-rank
// run that accumulates in f32 and rounds once; rounding each micro-batch's gradient, or reducing each, ends elsewhere.
TEST_P(Bf16NoSyncCombo, AccumulatedInF32AndReducedOnceInBf16) {
  const auto [world, mode] = GetParam();
  constexpr int kSteps = 4;
  const auto want = Bf16Reference(kSteps, world, kMicro);
  test_util::ExpectMatches(TrainBf16(mode, world, kSteps, kMicro), want, 0.0);
}

INSTANTIATE_TEST_SUITE_P(Modes, Bf16NoSyncCombo,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::ValuesIn(kModes)), CaseName);

// ---- compile() with ReplicateMode: an unused parameter, clipping --------------------------------------------

constexpr int kCompiledSteps = 6;

// The max norm: between the smallest and the largest of the steps' gradient norms, so that clipping acts in some
// steps and not in others (a replay that clipped by the captured step's decision would show).
constexpr double kCompiledMaxNorm = 0.47;

// One rank on every rank's input (the mean of their losses), head b never used, the gradients clipped to
// kCompiledMaxNorm before each step. Returns the parameters and each step's norm before clipping.
std::vector<std::vector<float>> CompiledReference(int world, std::vector<double>* norms) {
  RankContext ctx;
  RankContextScope scope(ctx);
  TwoHeadNet net(3);
  net.use_b = false;
  auto opt = optim::AdamW::factory()({{net.parameters(), optim::AdamW::default_hyper()}});
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < kCompiledSteps; ++step) {
    (*opt)->zero_grad();
    Tensor loss = net(HeadInput(step, 0));
    for (int r = 1; r < world; ++r) loss = autograd::add(loss, net(HeadInput(step, r)));
    autograd::backward(autograd::scale(loss, 1.0f / static_cast<float>(world)));
    norms->push_back(optim::clip_grad_norm(net.parameters(), kCompiledMaxNorm));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return Values(net);
}

class ReplicateModeCombo : public ::testing::TestWithParam<std::tuple<int, bool>> {};

// compile() with ReplicateMode, the single-rank step clipping before the update, head b never used (no gradient, no
// update, no all_reduce), the step ending in zero_grad(set_to_none) (false: a recorded zeroing the replays repeat):
// every rank ends where eager single-rank training on all ranks' inputs ends, b untouched.
TEST_P(ReplicateModeCombo, UnusedHeadAndClippingEqualEagerSingleRank) {
  const auto [world, set_to_none] = GetParam();
  std::vector<double> norms;
  const auto want = CompiledReference(world, &norms);
  const auto [lo, hi] = std::minmax_element(norms.begin(), norms.end());
  ASSERT_LT(*lo, kCompiledMaxNorm) << "the test needs a step that does not clip";
  ASSERT_GT(*hi, kCompiledMaxNorm) << "the test needs a step that clips";
  std::vector<float> b_initial;
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    b_initial = TwoHeadNet(3).b->weight().to_vector();
  }
  ASSERT_EQ(want[4], b_initial) << "the reference leaves the unused head alone";
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    TwoHeadNet net(3);
    net.use_b = false;
    optim::AdamW opt(net.parameters());
    auto mode = std::make_shared<ReplicateMode>(env.group_ptr, ReplicateModeOptions{.bucket_cap_bytes = 64});
    capture::CompiledStep compiled = capture::compile(
        [&](const std::vector<Tensor>& batch) {
          Tensor loss = net(batch[0]);
          autograd::backward(loss);
          optim::clip_grad_norm(net.parameters(), kCompiledMaxNorm);
          EXPECT_TRUE(opt.step().ok());
          opt.zero_grad(set_to_none);
          return loss;
        },
        net, opt, {.parallel_mode = mode});
    for (int step = 0; step < kCompiledSteps; ++step) {
      absl::StatusOr<Tensor> loss = compiled({HeadInput(step, env.rank)});
      if (!loss.ok()) return loss.status();
    }
    EXPECT_EQ(compiled.captures(), 1);
    got[static_cast<std::size_t>(env.rank)] = Values(net);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(got, want, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Worlds, ReplicateModeCombo, ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Bool()),
                         [](const auto& info) {
                           return absl::StrCat("n", std::get<0>(info.param),
                                               std::get<1>(info.param) ? "_set_to_none" : "_zeroed");
                         });

}  // namespace
}  // namespace shardkit::sddp
