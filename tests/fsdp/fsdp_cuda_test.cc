// fully_shard on one GPU (issue 14 acceptance; Note [unit on a device] in fsdp/param_group.cc): simulated ranks
// (threads) whose models all live on cuda:0, collectives through the in-process group's CUDA path (Note [in-process
// CUDA tensors]), against single-rank training on that GPU and against the same sharded run on CPU ranks. Every case
// skips without a CUDA device; CI's sanitizer build runs them against the CUDA emulator (Note [cuda emulator]).
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "common/comm/device_mesh.h"
#include "common/comm/testing/run_ranks.h"
#include "common/optim/adam.h"
#include "common/optim/clip_grad.h"
#include "common/tensor/memory_tracker.h"
#include "fsdp/clip_grad.h"
#include "fsdp/fully_shard.h"
#include "fsdp/mixed_precision.h"
#include "fsdp/state_dict.h"
#include "tests/testing/device_only_ranks.h"
#include "gtest/gtest.h"
#include "tests/common/tensor/cuda_test_util.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"
#include "tests/testing/one_rank_nccl.h"

namespace shardkit::fsdp {
namespace {

using gpt_tiny::Batch;
using gpt_tiny::kBatch;
using gpt_tiny::TinyConfig;

struct TrainCase {
  int world = 1;
  Device device = Device::cuda(0);
  bool shard = true;  // world 1 without sharding: the plain model, the reference
  std::optional<std::variant<bool, int>> reshard_after_forward = std::nullopt;
  bool nested = false;
  MixedPrecisionPolicy mp = {};
  double clip = 0;  // > 0: clip the gradients' global 2-norm to it before each step
};

// `steps` AdamW steps of GPT-tiny, each rank on its rows of every batch; every rank's full parameter values.
std::vector<std::vector<std::vector<float>>> Train(const TrainCase& run, int steps) {
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(run.world));
  absl::Status st = comm::RunRanks(run.world, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    model.to(run.device);
    if (run.shard) {
      const FullyShardOptions options{.reshard_after_forward = run.reshard_after_forward, .mp_policy = run.mp};
      if (absl::Status s = test_util::ShardGpt(model, env, options, run.nested); !s.ok()) return s;
    }
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    const int rows = kBatch / run.world;
    for (int step = 0; step < steps; ++step) {
      auto [x, y] = Batch(step, env.rank * rows, rows);
      (*opt)->zero_grad();
      if (absl::Status s = autograd::try_backward(model.loss(x.to(run.device), y.to(run.device))); !s.ok()) return s;
      if (run.clip > 0 && run.shard) {
        if (auto norm = clip_grad_norm(model, run.clip); !norm.ok()) return norm.status();
      } else if (run.clip > 0) {
        optim::clip_grad_norm(model.parameters(), run.clip);
      }
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    }
    if (!run.shard) {
      got[static_cast<std::size_t>(env.rank)] = gpt_tiny::Values(model);
      return absl::OkStatus();
    }
    return test_util::StoreFullValues(model, got, env.rank);
  });
  EXPECT_TRUE(st.ok()) << st;
  return got;
}

// (world, reshard_after_forward, nested)
class FsdpGptCuda : public ::testing::TestWithParam<std::tuple<int, bool, bool>> {};

// 20 steps on one GPU equal one rank trained on the whole batch on that GPU (tolerance as SddpGptCuda's: fp32
// reduction order and the GPU's kernels), all ranks identical.
TEST_P(FsdpGptCuda, TwentyStepsOnOneGpuEqualSingleRankGpuTraining) {
  SK_REQUIRE_CUDA_DEVICE("fully_shard with simulated ranks on one GPU");
  const auto [world, reshard, nested] = GetParam();
  static const auto want = Train({.world = 1, .shard = false}, 20)[0];
  gpt_tiny::ExpectMatches(Train({.world = world, .reshard_after_forward = reshard, .nested = nested}, 20), want, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Ranks, FsdpGptCuda,
                         ::testing::Combine(::testing::Values(2, 4), ::testing::Bool(), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<1>(info.param) ? "reshard" : "keep") +
                                  (std::get<2>(info.param) ? "_nested" : "") + "_n" +
                                  std::to_string(std::get<0>(info.param));
                         });

// The paths with buffers of their own, each on the GPU against the same sharded run on CPU ranks: the k-group
// reshard (reshard_after_forward = 2 at N = 4: k-shards, zero-filled padding), bf16 all-gathers and reduce-scatters
// (MixedPrecisionPolicy: casts on the device), and the sharded gradient clip (a norm over device shards).
TEST(FsdpGptCudaPaths, GroupReshardMixedPrecisionAndClippingEqualTheCpuRun) {
  SK_REQUIRE_CUDA_DEVICE("fully_shard's k-group, bf16 and clipping paths on one GPU");
  const TrainCase cases[] = {
      {.world = 4, .reshard_after_forward = 2},
      {.world = 2, .mp = {.param_dtype = DType::bf16, .reduce_dtype = DType::bf16}},
      {.world = 2, .reshard_after_forward = true, .clip = 0.05},
  };
  for (const TrainCase& gpu : cases) {
    SCOPED_TRACE(::testing::Message() << "world " << gpu.world << ", bf16 " << (gpu.mp.param_dtype.has_value())
                                      << ", clip " << gpu.clip);
    TrainCase cpu = gpu;
    cpu.device = Device::cpu();
    const auto want = Train(cpu, 10)[0];
    gpt_tiny::ExpectMatches(Train(gpu, 10), want, gpu.mp.param_dtype.has_value() ? 2e-3 : 1e-4);
  }
}

// HSDP on one GPU: a 2 x 2 mesh (replicate x shard), each step's gradient accumulated over two half batches with
// the replicas' all-reduce held back for the first (set_requires_all_reduce(false)), the infinity-norm clip, equal
// to the same run on CPU ranks.
std::vector<std::vector<std::vector<float>>> TrainHsdp(Device device) {
  std::vector<std::vector<std::vector<float>>> got(4);
  absl::Status st = comm::RunRanks(4, [&](comm::RankEnv& env) -> absl::Status {
    auto mesh = comm::DeviceMesh::create(env.group_ptr, {2, 2}, {"replicate", "shard"});
    if (!mesh.ok()) return mesh.status();
    nn::GPT model(TinyConfig(), 1);
    model.to(device);
    for (nn::Module* b : modules_of_type(model, "TransformerBlock")) {
      if (auto s = fully_shard(*b, *mesh, {.reshard_after_forward = true}); !s.ok()) return s.status();
    }
    auto root = fully_shard(model, *mesh);
    if (!root.ok()) return root.status();
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    const int rows = kBatch / 4;
    for (int step = 0; step < 6; ++step) {
      (*opt)->zero_grad();
      for (int half = 0; half < 2; ++half) {
        root->set_requires_all_reduce(half == 1);
        auto [x, y] = Batch(step, env.rank * rows + half * rows / 2, rows / 2);
        if (absl::Status s = autograd::try_backward(autograd::scale(model.loss(x.to(device), y.to(device)), 0.5f));
            !s.ok()) {
          return s;
        }
      }
      if (auto n = clip_grad_norm(model, 0.05, std::numeric_limits<double>::infinity()); !n.ok()) return n.status();
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    }
    return test_util::StoreFullValues(model, got, env.rank);
  });
  EXPECT_TRUE(st.ok()) << st;
  return got;
}

TEST(FsdpGptCudaPaths, HsdpWithHeldBackAllReduceEqualsTheCpuRun) {
  SK_REQUIRE_CUDA_DEVICE("HSDP on one GPU");
  gpt_tiny::ExpectMatches(TrainHsdp(Device::cuda(0)), TrainHsdp(Device::cpu())[0], 1e-4);
}

// Checkpointing on the GPU: after 2 of 4 steps, the model's full state dict and the optimizer's full state (as
// returned: on the device; and copied to the host) are saved and loaded back; the run ends where the run without
// the round trip does (within 1e-6: the embedding gradient's atomic adds may sum in another order). The optimizer
// state lands on the parameters' device, where the step's kernels read it.
std::vector<std::vector<std::vector<float>>> TrainWithReload(bool reload, bool host_copy) {
  const Device dev = Device::cuda(0);
  std::vector<std::vector<std::vector<float>>> got(2);
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    model.to(dev);
    if (absl::Status s = test_util::ShardGpt(model, env, {.reshard_after_forward = true}); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    const int rows = kBatch / 2;
    for (int step = 0; step < 4; ++step) {
      if (step == 2 && reload) {
        auto weights = full_state_dict(model);
        if (!weights.ok()) return weights.status();
        auto state = full_optimizer_state(model, **opt);
        if (!state.ok()) return state.status();
        if (host_copy) {
          for (auto& [index, ps] : state->state) {
            for (auto& [key, t] : ps.tensors) t = t.to(Device::cpu());
          }
        }
        if (absl::Status s = load_full_state_dict(model, *weights); !s.ok()) return s;
        if (absl::Status s = load_full_optimizer_state(model, **opt, *state); !s.ok()) return s;
      }
      auto [x, y] = Batch(step, env.rank * rows, rows);
      (*opt)->zero_grad();
      if (absl::Status s = autograd::try_backward(model.loss(x.to(dev), y.to(dev))); !s.ok()) return s;
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    }
    return test_util::StoreFullValues(model, got, env.rank);
  });
  EXPECT_TRUE(st.ok()) << st;
  return got;
}

TEST(FsdpGptCudaPaths, FullStateDictsReloadedOnTheGpuContinueTheRun) {
  SK_REQUIRE_CUDA_DEVICE("fsdp state dicts on one GPU");
  const auto want = TrainWithReload(false, false)[0];
  for (const bool host_copy : {false, true}) {
    SCOPED_TRACE(host_copy ? "optimizer state copied to the host" : "optimizer state as returned (on the device)");
    gpt_tiny::ExpectMatches(TrainWithReload(true, host_copy), want, 1e-6);
  }
}

// CPU offload on a GPU (Note [cpu offload] in fsdp/param_group.cc): the shards, their gradients and the AdamW state
// live in host memory (the device side of the ledger holds none of them at rest), the optimizer steps there with
// the CPU kernels, and 10 steps equal the run without offload (AdamW's CPU and CUDA kernels may round differently).
TEST(FsdpGptCudaPaths, CpuOffloadEqualsNoOffloadWithTheModelStateOnTheHost) {
  SK_REQUIRE_CUDA_DEVICE("fully_shard with cpu offload on one GPU");
  auto train = [](bool offload) {
    std::vector<std::vector<std::vector<float>>> got(2);
    absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
      const MemoryTracker& mem = *env.context.memory;
      nn::GPT model(TinyConfig(), 1);
      model.to(Device::cuda(0));
      const FullyShardOptions options{.reshard_after_forward = true, .offload_policy = {.cpu = offload}};
      if (absl::Status s = test_util::ShardGpt(model, env, options); !s.ok()) return s;
      std::unique_ptr<optim::Optimizer> opt;
      {
        MemoryCategoryScope cat(MemoryCategory::optimizer_state);
        auto made = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
        if (!made.ok()) return made.status();
        opt = std::move(*made);
      }
      const int rows = kBatch / 2;
      for (int step = 0; step < 10; ++step) {
        auto [x, y] = Batch(step, env.rank * rows, rows);
        opt->zero_grad();
        if (absl::Status s = autograd::try_backward(model.loss(x.to(Device::cuda(0)), y.to(Device::cuda(0)))); !s.ok()) {
          return s;
        }
        MemoryCategoryScope cat(MemoryCategory::optimizer_state);
        if (absl::Status s = opt->step(); !s.ok()) return s;
      }
      const MemorySnapshot at_rest = mem.snapshot();
      EXPECT_EQ(sharded_parameters(model).front().local.storage()->pinned(), offload) << "the host shards are pinned";
      for (const MemoryCategory c : {MemoryCategory::parameter, MemoryCategory::gradient, MemoryCategory::optimizer_state}) {
        const MemoryLocation moved = offload ? MemoryLocation::device : MemoryLocation::host;
        EXPECT_EQ(at_rest.at(moved).current_of(c), 0) << "category " << static_cast<int>(c) << ", offload " << offload;
        EXPECT_GT(at_rest.at(offload ? MemoryLocation::host : MemoryLocation::device).current_of(c), 0);
      }
      return test_util::StoreFullValues(model, got, env.rank);
    });
    EXPECT_TRUE(st.ok()) << st;
    return got;
  };
  gpt_tiny::ExpectMatches(train(true), train(false)[0], 1e-5);
}

// Over the NCCL backend, one rank on cuda:0 (NCCL takes one rank per GPU): the unit's all-gathers and
// reduce-scatters on device tensors, and the clip's norm partial staged on the device (Note [host tensors over
// device-only groups] in common/comm/host_staged.h); 10 steps equal the same run over the in-process group.
TEST(FsdpGptNccl, OneRankOverNcclEqualsTheInProcessGroup) {
  SK_REQUIRE_CUDA_DEVICE("fully_shard over the NCCL backend");
  auto train = [](std::shared_ptr<comm::ProcessGroup> pg) -> absl::StatusOr<std::vector<std::vector<float>>> {
    nn::GPT model(TinyConfig(), 1);
    model.to(Device::cuda(0));
    for (nn::Module* b : modules_of_type(model, "TransformerBlock")) {
      if (auto s = fully_shard(*b, pg, {.reshard_after_forward = true}); !s.ok()) return s.status();
    }
    if (auto s = fully_shard(model, pg); !s.ok()) return s.status();
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    for (int step = 0; step < 10; ++step) {
      auto [x, y] = Batch(step, 0, kBatch);
      (*opt)->zero_grad();
      if (absl::Status s = autograd::try_backward(model.loss(x.to(Device::cuda(0)), y.to(Device::cuda(0)))); !s.ok()) {
        return s;
      }
      if (auto norm = clip_grad_norm(model, 0.05); !norm.ok()) return norm.status();
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    }
    return test_util::FullValues(model);
  };
  gpt_tiny::ExpectOneRankOverNcclEqualsInProcess(train, 1e-6);
}

// Over a group that moves only device tensors, as NCCL, with several simulated ranks on one GPU
// (tests/testing/device_only_group.h): the all-gathers and reduce-scatters, the clip's norm partial and the full
// state dicts' gathers (model and optimizer state, built on the host: Note [host tensors over device-only groups])
// all travel on the device. 6 clipped steps at N = 2 and 3, with a full state round trip after 3, equal the same
// over the in-process group, which the wrapper forwards to (within 1e-6: the embedding gradient's atomic adds).
TEST(FsdpGptDeviceOnly, ClippedTrainingWithAStateRoundTripEqualsTheInProcessGroup) {
  SK_REQUIRE_CUDA_DEVICE("fully_shard over a device-only group");
  auto train = [](std::shared_ptr<comm::ProcessGroup> pg) -> absl::StatusOr<std::vector<std::vector<float>>> {
    const Device dev = Device::cuda(0);
    nn::GPT model(TinyConfig(), 1);
    model.to(dev);
    for (nn::Module* b : modules_of_type(model, "TransformerBlock")) {
      if (auto s = fully_shard(*b, pg, {.reshard_after_forward = true}); !s.ok()) return s.status();
    }
    if (auto s = fully_shard(model, pg); !s.ok()) return s.status();
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    for (int step = 0; step < 6; ++step) {
      if (step == 3) {
        auto weights = full_state_dict(model);
        if (!weights.ok()) return weights.status();
        auto state = full_optimizer_state(model, **opt);
        if (!state.ok()) return state.status();
        if (absl::Status s = load_full_state_dict(model, *weights); !s.ok()) return s;
        if (absl::Status s = load_full_optimizer_state(model, **opt, *state); !s.ok()) return s;
      }
      auto [x, y] = Batch(step, 0, kBatch);
      (*opt)->zero_grad();
      if (absl::Status s = autograd::try_backward(model.loss(x.to(dev), y.to(dev))); !s.ok()) return s;
      if (auto norm = clip_grad_norm(model, 0.05); !norm.ok()) return norm.status();
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    }
    return test_util::FullValues(model);
  };
  gpt_tiny::ExpectDeviceOnlyEqualsInProcess(train, 1e-6);
}

}  // namespace
}  // namespace shardkit::fsdp
