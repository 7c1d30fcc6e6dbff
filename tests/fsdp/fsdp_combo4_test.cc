// Feature combinations of fully_shard that the other fsdp tests leave out, each against single-rank training
// (DESIGN.md section 8):
//   * the unused-parameter flags (Note [parameters no rank used] in fsdp/param_group.cc) over the process backends
//     (TcpProcessGroup with the TCP transport and with the shared-memory transport; ranks are threads of this
//     process, as in tests/sddp/sddp_tcp_test.cc): a head every rank, one rank or no rank uses in a step;
//   * the same over a device-only group (NCCL-like, tests/testing/device_only_group.h) with the model on CUDA (the
//     emulator build; skipped without a CUDA device): the flags must travel on the parameters' device;
//   * bf16 mixed precision with full and with sharded state dicts: saved mid-run, resumed at another world size,
//     bitwise equal to uninterrupted single-rank training with the same casts;
//   * activation checkpointing (nn::checkpoint_blocks) with HSDP on a 2 x 2 mesh.
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/autograd/ops/activation.h"
#include "common/autograd/ops/elementwise.h"
#include "common/autograd/ops/loss.h"
#include "common/comm/device_mesh.h"
#include "common/comm/hash_store.h"
#include "common/comm/tcp_process_group.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/checkpoint.h"
#include "common/optim/adam.h"
#include "fsdp/fully_shard.h"
#include "fsdp/mixed_precision.h"
#include "fsdp/state_dict.h"
#include "gtest/gtest.h"
#include "tests/common/tensor/cuda_test_util.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/device_only_group.h"
#include "tests/testing/gpt_tiny_data.h"
#include "tests/testing/tcp_ranks.h"
#include "tests/testing/two_head_net.h"

namespace shardkit::fsdp {
namespace {

using gpt_tiny::Batch;
using gpt_tiny::kBatch;
using gpt_tiny::TinyConfig;
using two_head::HeadInput;
using tcp_ranks::RunTcpRanks;
using two_head::DeviceHeadNet;
using two_head::TwoHeadNet;
using Params = std::vector<std::vector<float>>;

// ---- a head some or no rank uses, over process backends and device-only groups ----------------------------------

constexpr int kHeadSteps = 5;
constexpr int kLastUse = 2;
// Head b per step and rank. `uniform` (b a unit of its own: every rank must run the same units): every rank in
// steps 0 and 2, none otherwise. Else (b in the root's unit): every rank in step 0, rank 0 only in step 1, the last
// rank only in step 2, no rank after.
bool UsesB(int step, int rank, int world, bool uniform) {
  if (uniform) return step == 0 || step == 2;
  if (step == 0) return true;
  if (step == 1) return rank == 0;
  if (step == 2) return rank == world - 1;
  return false;
}

Params HeadReference(int world, bool uniform) {
  RankContext ctx;
  RankContextScope scope(ctx);
  DeviceHeadNet net(3);
  auto opt = optim::AdamW::factory()({{net.parameters(), optim::AdamW::default_hyper()}});
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < kHeadSteps; ++step) {
    (*opt)->zero_grad();
    Tensor loss;
    for (int r = 0; r < world; ++r) {
      net.use_b = UsesB(step, r, world, uniform);
      Tensor l = net(HeadInput(step, r));
      loss = r == 0 ? l : autograd::add(loss, l);
    }
    autograd::backward(autograd::scale(loss, 1.0f / static_cast<float>(world)));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return gpt_tiny::Values(net);
}

// One rank's run of the head pattern over `pg`, the model on `device`, b a unit of its own when `b_unit` (then the
// uniform pattern); fails when b's shard moves once no rank uses it. Returns the full values.
absl::StatusOr<Params> TrainHeads(std::shared_ptr<comm::ProcessGroup> pg, Device device, bool b_unit) {
  const int rank = pg->rank(), world = pg->size();
  DeviceHeadNet net(3);
  net.to(device);
  if (b_unit) {
    if (auto s = fully_shard(*net.b, pg); !s.ok()) return s.status();
  }
  if (auto s = fully_shard(net, pg); !s.ok()) return s.status();
  auto opt = optim::AdamW::factory()({{net.parameters(), optim::AdamW::default_hyper()}});
  if (!opt.ok()) return opt.status();
  std::vector<float> b_after_last_use;
  for (int step = 0; step < kHeadSteps; ++step) {
    net.use_b = UsesB(step, rank, world, b_unit);
    (*opt)->zero_grad();
    if (absl::Status s = autograd::try_backward(net(HeadInput(step, rank).to(device))); !s.ok()) return s;
    if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    const std::vector<float> b = gpt_tiny::Values(*net.b)[0];  // this rank's shard of b.weight
    if (step == kLastUse) b_after_last_use = b;
    if (step > kLastUse && b != b_after_last_use) {
      return absl::InternalError(absl::StrCat("rank ", rank, ": b's shard moved in step ", step, ", which no rank used it in"));
    }
  }
  return test_util::FullValues(net);
}

std::string HeadCaseName(bool b_unit, int world) {
  return std::string(b_unit ? "b_unit" : "root_only") + "_n" + std::to_string(world);
}

class FsdpProcessBackendHeadCombo : public ::testing::TestWithParam<std::tuple<std::string, int, bool>> {};

// Over TCP or shared memory (tiny chunks and rings: the flags' all-reduce and the reduce-scatters split into many
// chunks): equal to one rank on every rank's input; b's shards stay put bitwise once no rank uses b.
TEST_P(FsdpProcessBackendHeadCombo, AHeadSomeOrNoRankUsesTrainsAsOnOneRank) {
  const auto& [transport, world, b_unit] = GetParam();
  const Params want = HeadReference(world, b_unit);
  std::vector<Params> got(static_cast<std::size_t>(world));
  static int variant = 0;
  absl::Status st = RunTcpRanks(world, transport, absl::StrCat("fsdp_combo4_", variant++),
                                [&](std::shared_ptr<comm::ProcessGroup> pg) -> absl::Status {
                                  auto v = TrainHeads(pg, Device::cpu(), b_unit);
                                  if (!v.ok()) return v.status();
                                  got[static_cast<std::size_t>(pg->rank())] = std::move(*v);
                                  return absl::OkStatus();
                                });
  ASSERT_TRUE(st.ok()) << st;
  gpt_tiny::ExpectMatches(got, want, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Transports, FsdpProcessBackendHeadCombo,
                         ::testing::Combine(::testing::Values(std::string("tcp"), std::string("shm")),
                                            ::testing::Values(2, 3), ::testing::Bool()),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" +
                                  HeadCaseName(std::get<2>(info.param), std::get<1>(info.param));
                         });

class FsdpDeviceOnlyHeadCombo : public ::testing::TestWithParam<std::tuple<int, bool>> {};

// The model on cuda:0 over a group that refuses host tensors: the flags travel on the device; equal to one rank on
// the host.
TEST_P(FsdpDeviceOnlyHeadCombo, AHeadSomeOrNoRankUsesTrainsAsOnOneRank) {
  SK_REQUIRE_CUDA_DEVICE("fully_shard with an unused head over a device-only group");
  const auto [world, b_unit] = GetParam();
  const Params want = HeadReference(world, b_unit);
  std::vector<Params> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    auto v = TrainHeads(std::make_shared<comm::testing::DeviceOnlyGroup>(env.group_ptr), Device::cuda(0), b_unit);
    if (!v.ok()) return v.status();
    got[static_cast<std::size_t>(env.rank)] = std::move(*v);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  gpt_tiny::ExpectMatches(got, want, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Ranks, FsdpDeviceOnlyHeadCombo, ::testing::Combine(::testing::Values(2, 3), ::testing::Bool()),
                         [](const auto& info) { return HeadCaseName(std::get<1>(info.param), std::get<0>(info.param)); });

// ---- bf16 mixed precision with full and sharded state dicts, resumed at another world size ------------------------

const MixedPrecisionPolicy kBf16{.param_dtype = DType::bf16, .reduce_dtype = DType::bf16};
constexpr int kMpSteps = 6, kMpSaveAt = 3;

// What one run hands the next: rank 0's full state dicts, or every rank's sharded pieces.
struct Bf16Checkpoint {
  nn::StateDict model;
  optim::OptimizerStateDict opt;
  std::vector<ShardedStateDict> model_pieces;
  std::vector<ShardedOptimizerState> opt_pieces;
};

// Steps [first, last) of bf16 FSDP GPT-tiny at `world`: from `in` when given (a model built from another seed, so a
// load that misses a tensor shows), saving into `out` when given (full or sharded).
absl::Status TrainBf16Span(int world, int first, int last, bool sharded, const Bf16Checkpoint* in, Bf16Checkpoint* out,
                           std::vector<Params>* got) {
  if (out != nullptr && sharded) {
    out->model_pieces.assign(static_cast<std::size_t>(world), {});
    out->opt_pieces.assign(static_cast<std::size_t>(world), {});
  }
  return comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), in != nullptr ? 7 : 1);
    if (absl::Status s = test_util::ShardGpt(model, env, {.mp_policy = kBf16}); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (in != nullptr) {
      if (sharded) {
        if (absl::Status s = load_sharded_state_dict(model, in->model_pieces); !s.ok()) return s;
        if (absl::Status s = load_sharded_optimizer_state(model, **opt, in->opt_pieces); !s.ok()) return s;
      } else {
        if (absl::Status s = load_full_state_dict(model, in->model); !s.ok()) return s;
        if (absl::Status s = load_full_optimizer_state(model, **opt, in->opt); !s.ok()) return s;
      }
    }
    if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, world, first, last); !s.ok()) return s;
    if (out != nullptr) {
      const auto r = static_cast<std::size_t>(env.rank);
      if (sharded) {
        auto m = sharded_state_dict(model);
        if (!m.ok()) return m.status();
        auto o = sharded_optimizer_state(model, **opt);
        if (!o.ok()) return o.status();
        out->model_pieces[r] = std::move(*m);
        out->opt_pieces[r] = std::move(*o);
      } else {
        auto m = full_state_dict(model);
        if (!m.ok()) return m.status();
        auto o = full_optimizer_state(model, **opt);
        if (!o.ok()) return o.status();
        if (env.rank == 0) {
          for (const auto& [name, t] : *m) out->model.emplace_back(name, t.clone());
          out->opt = o->clone();
        }
      }
    }
    if (got != nullptr) return test_util::StoreFullValues(model, *got, env.rank);
    return absl::OkStatus();
  });
}

class FsdpBf16ResumeCombo : public ::testing::TestWithParam<std::tuple<bool, int, int>> {};

// bf16 FSDP, steps 0..2 at world A, a full (or sharded) checkpoint of the f32 master and AdamW's state, steps 3..5
// at world B from it: bitwise the single-rank run with the same casts (A's ranks' rows, then B's).
TEST_P(FsdpBf16ResumeCombo, ResumedAtAnotherWorldSizeIsBitwiseTheSameCasts) {
  const auto [sharded, world_a, world_b] = GetParam();
  const Params want =
      test_util::Bf16Reference(kMpSteps, [&](int step) { return step < kMpSaveAt ? world_a : world_b; });
  Bf16Checkpoint ckpt;
  absl::Status st = TrainBf16Span(world_a, 0, kMpSaveAt, sharded, nullptr, &ckpt, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  std::vector<Params> got(static_cast<std::size_t>(world_b));
  st = TrainBf16Span(world_b, kMpSaveAt, kMpSteps, sharded, &ckpt, nullptr, &got);
  ASSERT_TRUE(st.ok()) << st;
  gpt_tiny::ExpectMatches(got, want, 0.0);
}

INSTANTIATE_TEST_SUITE_P(Layouts, FsdpBf16ResumeCombo,
                         ::testing::Values(std::make_tuple(false, 2, 3), std::make_tuple(false, 3, 1),
                                           std::make_tuple(true, 2, 3), std::make_tuple(true, 3, 2),
                                           std::make_tuple(true, 4, 1)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "sharded" : "full") + "_n" +
                                  std::to_string(std::get<1>(info.param)) + "_to_n" +
                                  std::to_string(std::get<2>(info.param));
                         });

// ---- activation checkpointing with HSDP ---------------------------------------------------------------------------

constexpr int kCkptSteps = 4;

// GPT-tiny on a 2 x 2 HSDP mesh (blocks, then the root), its blocks and ln_f checkpointed when `ckpt` (before or
// after fully_shard), kCkptSteps AdamW steps on each rank's rows.
std::vector<Params> TrainHsdp(bool ckpt, bool ckpt_first) {
  constexpr int kWorld = 4;
  std::vector<Params> got(kWorld);
  absl::Status st = comm::RunRanks(kWorld, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    auto checkpoint = [&]() -> absl::Status {
      if (absl::Status s = nn::checkpoint_blocks(model); !s.ok()) return s;
      return nn::checkpoint(*model.ln_f);
    };
    if (ckpt && ckpt_first) {
      if (absl::Status s = checkpoint(); !s.ok()) return s;
    }
    auto mesh = comm::DeviceMesh::create(env.group_ptr, {2, 2}, {"replicate", "shard"});
    if (!mesh.ok()) return mesh.status();
    for (nn::Module* b : modules_of_type(model, "TransformerBlock")) {
      if (auto s = fully_shard(*b, *mesh, {.reshard_after_forward = true}); !s.ok()) return s.status();
    }
    if (auto s = fully_shard(model, *mesh); !s.ok()) return s.status();
    if (ckpt && !ckpt_first) {
      if (absl::Status s = checkpoint(); !s.ok()) return s;
    }
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, kWorld, 0, kCkptSteps); !s.ok()) return s;
    return test_util::StoreFullValues(model, got, env.rank);
  });
  EXPECT_TRUE(st.ok()) << st;
  return got;
}

// Checkpointed blocks (wrapped before or after fully_shard on the mesh) train bitwise as without checkpointing, and
// equal to one rank on the whole batch (fp32 reduction-order tolerance).
TEST(HsdpActivationCheckpointCombo, CheckpointedBlocksOnA2x2MeshEqualUncheckpointedAndOneRank) {
  const Params want = gpt_tiny::Reference(kCkptSteps);
  const std::vector<Params> plain = TrainHsdp(false, false);
  gpt_tiny::ExpectMatches(plain, want, 2e-5);
  for (const bool first : {true, false}) {
    SCOPED_TRACE(first ? "checkpoint, then fully_shard" : "fully_shard, then checkpoint");
    const std::vector<Params> ckpt = TrainHsdp(true, first);
    ASSERT_EQ(ckpt.size(), plain.size());
    for (std::size_t r = 0; r < ckpt.size(); ++r) EXPECT_EQ(ckpt[r], plain[r]) << "rank " << r;
    gpt_tiny::ExpectMatches(ckpt, want, 2e-5);
  }
}

}  // namespace
}  // namespace shardkit::fsdp
