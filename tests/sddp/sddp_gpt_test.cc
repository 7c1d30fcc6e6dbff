// GPT-tiny trained 20 steps on N simulated ranks (each its slice of the batch) with DDP, OSS + DDP and
// OSS + ShardedDDP (greedy, flat) ends equal to single-rank training on the whole batch (DESIGN.md section
// 8), with tiny buckets so that many buckets flush during backward.
#include <memory>

#include "common/comm/testing/run_ranks.h"
#include "common/optim/clip_grad.h"
#include "common/optim/sgd.h"
#include "oss/oss.h"
#include "sddp/data_parallel.h"
#include "tests/common/tensor/cuda_test_util.h"
#include "tests/testing/device_only_ranks.h"
#include "tests/sddp/sddp_test_util.h"
#include "tests/sddp/sddp_trainer.h"
#include "tests/testing/one_rank_nccl.h"

namespace shardkit::sddp {
namespace {

using test_util::Batch;
using test_util::kBatch;
using test_util::TinyConfig;
using test_util::Values;
using test_util::Mode;
using test_util::ModeName;
using test_util::Trainer;

// `device`: where the model already is; each step's batch goes there too.
absl::Status RunSteps(Mode mode, comm::RankEnv& env, nn::GPT& model, int steps, DataParallelOptions options,
                      int freeze_at = -1, Device device = Device::cpu()) {
  auto t = Trainer::make(mode, model, env.group_ptr, options);
  if (!t.ok()) return t.status();
  const int rows = kBatch / env.world_size;
  for (int step = 0; step < steps; ++step) {
    if (step == freeze_at) test_util::FreezeBlock0(model);
    auto [x, y] = Batch(step, env.rank * rows, rows);
    t->zero_grad();
    if (absl::Status s = autograd::try_backward(model.loss(x.to(device), y.to(device))); !s.ok()) return s;
    if (absl::Status s = t->step(); !s.ok()) return s;
  }
  if (t->dp->num_buckets() < 2 && options.reduce_buffer_size > 0 && options.reduce_buffer_size < t->dp->trainable_numel() / 2 && env.world_size > 1) {
    return absl::InternalError("expected several buckets");
  }
  return absl::OkStatus();
}

class SddpGpt : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

// Tolerance as in tests/oss/oss_gpt_test.cc: AdamW moves parameters by ~lr per step whatever the gradient's
// size, so reduction-order differences stay below ~1e-5 after 20 steps.
TEST_P(SddpGpt, TwentyStepsEqualSingleRankOnTheWholeBatch) {
  const auto [world, mode] = GetParam();
  static const auto want = test_util::Reference(20);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = RunSteps(mode, env, model, 20, {.reduce_buffer_size = 300}); !s.ok()) return s;
    got[static_cast<std::size_t>(env.rank)] = Values(model);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(got, want, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(Ranks, SddpGpt,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 8),
                                            ::testing::Values(Mode::ddp, Mode::oss_ddp, Mode::sddp_greedy,
                                                              Mode::sddp_flat, Mode::sddp_flat_owner)),
                         [](const auto& info) {
                           return ModeName(std::get<1>(info.param)) + "_n" + std::to_string(std::get<0>(info.param));
                         });

// The same on one GPU (Note [in-process CUDA tensors]): every rank's model and batch on cuda:0, against
// single-rank training on that GPU.
class SddpGptCuda : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

std::vector<std::vector<std::vector<float>>> TrainOnGpu(int world, Mode mode, int steps) {
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    model.to(Device::cuda(0));
    if (absl::Status s = RunSteps(mode, env, model, steps, {.reduce_buffer_size = 300}, -1, Device::cuda(0));
        !s.ok()) {
      return s;
    }
    got[static_cast<std::size_t>(env.rank)] = Values(model);
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
  return got;
}

TEST_P(SddpGptCuda, TwentyStepsOnOneGpuEqualSingleRankGpuTraining) {
  SK_REQUIRE_CUDA_DEVICE("DDP / OSS / ShardedDDP with simulated ranks on one GPU");
  const auto [world, mode] = GetParam();
  static const auto want = TrainOnGpu(1, Mode::ddp, 20)[0];
  test_util::ExpectMatches(TrainOnGpu(world, mode, 20), want, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Ranks, SddpGptCuda,
                         ::testing::Combine(::testing::Values(2, 4),
                                            ::testing::Values(Mode::ddp, Mode::oss_ddp, Mode::oss_flat_ddp,
                                                              Mode::sddp_greedy, Mode::sddp_flat,
                                                              Mode::sddp_flat_owner)),
                         [](const auto& info) {
                           return ModeName(std::get<1>(info.param)) + "_n" + std::to_string(std::get<0>(info.param));
                         });

// Over the NCCL backend: one rank on cuda:0 (NCCL takes one rank per GPU, and the machines tests run on have one).
// Each mode's own small exchanges (the reducer's ready order; OSS's sharded norm, here through clipping) reach NCCL
// as tensors on its device (Note [host tensors over device-only groups] in common/comm/host_staged.h): 10 steps
// with clipping equal the same mode over the in-process group. Not exercised by one rank: the model check (skipped
// at N = 1) and any exchange between GPUs.
class SddpGptNccl : public ::testing::TestWithParam<Mode> {};

absl::StatusOr<std::vector<std::vector<float>>> TrainWholeBatchOnGpu(Mode mode, std::shared_ptr<comm::ProcessGroup> pg,
                                                                     int steps) {
  nn::GPT model(TinyConfig(), 1);
  model.to(Device::cuda(0));
  auto t = Trainer::make(mode, model, std::move(pg), {.reduce_buffer_size = 300});
  if (!t.ok()) return t.status();
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = Batch(step, 0, kBatch);
    t->zero_grad();
    if (absl::Status s = autograd::try_backward(model.loss(x.to(Device::cuda(0)), y.to(Device::cuda(0)))); !s.ok()) {
      return s;
    }
    if (auto norm = t->clip_grad_norm(0.05); !norm.ok()) return norm.status();
    if (absl::Status s = t->step(); !s.ok()) return s;
  }
  return Values(model);
}

TEST_P(SddpGptNccl, OneRankOverNcclEqualsTheInProcessGroup) {
  SK_REQUIRE_CUDA_DEVICE("DDP / OSS / ShardedDDP over the NCCL backend");
  gpt_tiny::ExpectOneRankOverNcclEqualsInProcess(
      [](std::shared_ptr<comm::ProcessGroup> pg) { return TrainWholeBatchOnGpu(GetParam(), std::move(pg), 10); }, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Modes, SddpGptNccl,
                         ::testing::Values(Mode::ddp, Mode::oss_ddp, Mode::oss_flat_ddp, Mode::sddp_greedy,
                                           Mode::sddp_flat, Mode::sddp_flat_owner),
                         [](const auto& info) { return ModeName(info.param); });

// Over a group that moves only device tensors, as NCCL, with several simulated ranks on one GPU
// (tests/testing/device_only_group.h): the layers' own exchanges (the model check, the ready order, the sharded
// grad norm of clipping, OSS's verdicts) must travel on the device (Note [host tensors over device-only groups]).
// 10 clipped steps at N = 2 and 3 equal the same over the in-process group, which the wrapper forwards to (within
// 1e-6: the embedding gradient's atomic adds).
class SddpGptDeviceOnly : public ::testing::TestWithParam<Mode> {};

TEST_P(SddpGptDeviceOnly, ClippedTrainingEqualsTheInProcessGroup) {
  SK_REQUIRE_CUDA_DEVICE("DDP / OSS / ShardedDDP over a device-only group");
  gpt_tiny::ExpectDeviceOnlyEqualsInProcess(
      [](std::shared_ptr<comm::ProcessGroup> pg) { return TrainWholeBatchOnGpu(GetParam(), std::move(pg), 10); }, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Modes, SddpGptDeviceOnly,
                         ::testing::Values(Mode::ddp, Mode::oss_ddp, Mode::oss_flat_ddp, Mode::sddp_greedy,
                                           Mode::sddp_flat, Mode::sddp_flat_owner),
                         [](const auto& info) { return ModeName(info.param); });

class SddpGptOptions : public ::testing::TestWithParam<Mode> {};

// No buckets (reduce_buffer_size 0: each parameter alone, reduced in place) and f32 default buckets.
TEST_P(SddpGptOptions, UnbucketedAndLargeBucketsAlsoMatch) {
  static const auto want = test_util::Reference(6);
  for (const std::int64_t size : {std::int64_t{0}, std::int64_t{1} << 23}) {
    std::vector<std::vector<std::vector<float>>> got(3);
    absl::Status st = comm::RunRanks(3, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(TinyConfig(), 1);
      if (absl::Status s = RunSteps(GetParam(), env, model, 6, {.reduce_buffer_size = size}); !s.ok()) return s;
      got[static_cast<std::size_t>(env.rank)] = Values(model);
      return absl::OkStatus();
    });
    ASSERT_TRUE(st.ok()) << st;
    test_util::ExpectMatches(got, want, 2e-5);
  }
}

// Freezing block 0 before step 5 (requires_grad false on every rank): the wrapper notices before the next
// forward, rebuilds its buckets, and training continues equal to the single-rank run that freezes too.
TEST_P(SddpGptOptions, FreezingALayerMidRun) {
  static const auto want = test_util::Reference(10, 5);
  std::vector<std::vector<std::vector<float>>> got(2);
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = RunSteps(GetParam(), env, model, 10, {.reduce_buffer_size = 300}, 5); !s.ok()) return s;
    got[static_cast<std::size_t>(env.rank)] = Values(model);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(got, want, 2e-5);
}

// Four micro-batches per rank, the first three inside no_sync() (local accumulation, no communication), each
// loss scaled by 1/4: equals one step on the whole batch. The variant `by_hand` runs all four inside
// no_sync() and calls reduce() afterwards.
TEST_P(SddpGptOptions, NoSyncAccumulationEqualsOneLargeBatch) {
  static const auto want = test_util::Reference(4);
  for (const bool by_hand : {false, true}) {
    for (const int world : {2, 3}) {
      std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
      absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
        nn::GPT model(TinyConfig(), 1);
        auto t = Trainer::make(GetParam(), model, env.group_ptr, {.reduce_buffer_size = 300});
        if (!t.ok()) return t.status();
        const int rows = kBatch / world, micro = rows / 4;
        for (int step = 0; step < 4; ++step) {
          t->zero_grad();
          const auto before = env.group.counters();
          for (int m = 0; m < 4; ++m) {
            auto [x, y] = Batch(step, env.rank * rows + m * micro, micro);
            absl::Status s;
            if (m < 3 || by_hand) {
              auto scope = t->dp->no_sync();
              s = autograd::try_backward(autograd::scale(model.loss(x, y), 0.25f));
            } else {
              s = autograd::try_backward(autograd::scale(model.loss(x, y), 0.25f));
            }
            if (!s.ok()) return s;
            if (m < 3) {  // nothing was reduced inside no_sync (buffers are broadcast before forward)
              const auto c = env.group.counters().since(before);
              EXPECT_EQ(c.of(comm::CollectiveKind::all_reduce).calls + c.of(comm::CollectiveKind::reduce).calls +
                            c.of(comm::CollectiveKind::reduce_scatter).calls,
                        0);
            }
          }
          if (by_hand) {
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

INSTANTIATE_TEST_SUITE_P(Modes, SddpGptOptions,
                         ::testing::Values(Mode::ddp, Mode::oss_ddp, Mode::sddp_greedy, Mode::sddp_flat,
                                           Mode::sddp_flat_owner),
                         [](const auto& info) { return ModeName(info.param); });

// Gradient clipping in every partition policy x reducer strategy: clip_grad_norm scales exactly the gradients
// the next step() uses (with ShardedDDP's flat reduce-scatter these are the owned slices handed over with
// set_piece_grad, not the module's released gradients). SGD, whose update is proportional to the gradient, so
// a clip that scales nothing shows in the parameters (AdamW would hide it: its update does not depend on the
// gradient's scale). The groups (Trainer::make) and the reference carry AdamW::default_hyper(), which replaces
// ClipSgd's defaults: plain SGD at lr 1e-3, no momentum. Each step: the norm before clipping is above max_norm (the clip
// acts), a second clip_grad_norm finds the norm at most max_norm, and 12 steps equal single-rank training
// with clipping on the whole batch.
class SddpClip : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

constexpr double kMaxNorm = 0.05;

optim::OptimizerFactory ClipSgd() { return optim::Sgd::factory({.lr = 0.1, .momentum = 0.9}); }

TEST_P(SddpClip, ClippedTrainingEqualsSingleRankClippedTraining) {
  const auto [world, mode] = GetParam();
  static const auto want = test_util::Reference(12, -1, ClipSgd(), kMaxNorm);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    auto t = Trainer::make(mode, model, env.group_ptr, {.reduce_buffer_size = 300}, ClipSgd());
    if (!t.ok()) return t.status();
    const int rows = kBatch / world;
    for (int step = 0; step < 12; ++step) {
      auto [x, y] = Batch(step, env.rank * rows, rows);
      t->zero_grad();
      if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
      absl::StatusOr<double> before = t->clip_grad_norm(kMaxNorm);
      if (!before.ok()) return before.status();
      EXPECT_GT(*before, 2 * kMaxNorm) << "step " << step << ": the test needs clipping to act";
      absl::StatusOr<double> after = t->clip_grad_norm(kMaxNorm);
      if (!after.ok()) return after.status();
      EXPECT_LE(*after, kMaxNorm * (1 + 1e-5)) << "step " << step << ": norm before clipping " << *before;
      if (absl::Status s = t->step(); !s.ok()) return s;
    }
    got[static_cast<std::size_t>(env.rank)] = Values(model);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(got, want, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(Modes, SddpClip,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(Mode::ddp, Mode::oss_ddp, Mode::oss_flat_ddp,
                                                              Mode::sddp_greedy, Mode::sddp_flat,
                                                              Mode::sddp_flat_owner)),
                         [](const auto& info) {
                           return ModeName(std::get<1>(info.param)) + "_n" + std::to_string(std::get<0>(info.param));
                         });

}  // namespace
}  // namespace shardkit::sddp
