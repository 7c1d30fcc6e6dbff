// OSS state: consolidate at one world size, load at another, continue: equal to the uninterrupted
// single-rank run. Bad state dicts: clear errors on every rank and no change.
#include <cmath>

#include "common/comm/testing/run_ranks.h"
#include "common/optim/adam.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "oss/oss.h"
#include "tests/common/tensor/cuda_test_util.h"
#include "tests/testing/device_only_group.h"

namespace shardkit::oss {
namespace {

using ::testing::HasSubstr;

const std::vector<Shape> kShapes = {{7, 3}, {5}, {13}, {2, 2}, {1}, {11}};
using Values = std::vector<std::vector<float>>;

Values InitialValues() {
  RankContext ctx;
  RankContextScope scope(ctx);
  Generator gen(7);
  Values out;
  for (const Shape& s : kShapes) out.push_back(Tensor::normal(s, gen, 0.f, 1.f).to_vector());
  return out;
}

std::vector<Tensor> MakeParams(const Values& v) {
  std::vector<Tensor> out;
  for (std::size_t i = 0; i < kShapes.size(); ++i) {
    out.push_back(Tensor::from_vector(v[i], kShapes[i], TensorOptions{}.with_category(MemoryCategory::parameter)));
    out.back().set_requires_grad(true);
  }
  return out;
}

// The averaged gradient all ranks agree on at `step` (independent of world size here, so runs at different
// world sizes see the same data; what differs is which rank owns which state).
Tensor Grad(const Tensor& p, int step, int i) {
  Generator gen(500 + static_cast<std::uint64_t>(step), static_cast<std::uint64_t>(i));
  std::vector<float> d(static_cast<std::size_t>(p.numel()));
  gen.fill_normal(d.data(), p.numel());
  const std::vector<float> v = p.to_vector();
  for (std::size_t k = 0; k < d.size(); ++k) d[k] += 0.3f * v[k];
  return Tensor::from_vector(d, p.shape());
}

Values Reference(int steps) {
  RankContext ctx;
  RankContextScope scope(ctx);
  std::vector<Tensor> params = MakeParams(InitialValues());
  optim::AdamW opt(params);
  for (int step = 0; step < steps; ++step) {
    for (std::size_t i = 0; i < params.size(); ++i) params[i].set_grad(Grad(params[i], step, static_cast<int>(i)));
    EXPECT_TRUE(opt.step().ok());
  }
  Values out;
  for (const Tensor& p : params) out.push_back(p.to_vector());
  return out;
}

struct RunResult {
  Values params;                             // rank 0's final parameters
  std::optional<optim::OptimizerStateDict> state;  // consolidated on rank 0 at the end
};

// `device`: where the parameters live (their gradients are made on the CPU and moved there). `device_only`: the
// OSS runs over a group that moves only tensors on the device, as NCCL (tests/testing/device_only_group.h).
RunResult RunSharded(int world, PartitionPolicy policy, const Values& init, int first_step, int last_step,
                     const optim::OptimizerStateDict* load, Device device = Device::cpu(), bool device_only = false) {
  RunResult result;
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    std::shared_ptr<comm::ProcessGroup> group = env.group_ptr;
    if (device_only) group = std::make_shared<comm::testing::DeviceOnlyGroup>(group, device);
    std::vector<Tensor> params = MakeParams(init);
    for (Tensor& p : params) {
      if (device.is_cpu()) continue;
      p = p.to(device, MemoryCategory::parameter);
      p.set_requires_grad(true);
    }
    auto oss = Oss::create({{params, optim::AdamW::default_hyper()}}, optim::AdamW::factory(), group,
                           {.policy = policy});
    if (!oss.ok()) return oss.status();
    if (load != nullptr) {
      if (absl::Status s = (*oss)->load_state_dict(*load); !s.ok()) return s;
    }
    for (int step = first_step; step < last_step; ++step) {
      for (std::size_t i = 0; i < params.size(); ++i) {
        const Tensor& p = params[i];
        p.set_grad(device.is_cpu() ? Grad(p, step, static_cast<int>(i))
                                   : Grad(p.to(Device::cpu()), step, static_cast<int>(i)).to(device));
      }
      if (absl::Status s = (*oss)->step(); !s.ok()) return s;
    }
    if (absl::Status s = (*oss)->consolidate_state_dict(0); !s.ok()) return s;
    absl::StatusOr<optim::OptimizerStateDict> sd = (*oss)->state_dict();
    if (env.rank == 0) {
      if (!sd.ok()) return sd.status();
      result.state = *sd;
      for (const Tensor& p : params) result.params.push_back(p.to(Device::cpu()).to_vector());
    } else {
      EXPECT_EQ(sd.status().code(), absl::StatusCode::kFailedPrecondition);
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
  return result;
}

void ExpectClose(const Values& got, const Values& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    for (std::size_t k = 0; k < got[i].size(); ++k) {
      // Same gradients, same kernels: only the optimizer state's round trip could differ, and it is exact.
      ASSERT_EQ(got[i][k], want[i][k]) << "param " << i << "[" << k << "]";
    }
  }
}

class OssResume : public ::testing::TestWithParam<PartitionPolicy> {};

TEST_P(OssResume, ConsolidateAtFourLoadAtTwoAndThreeContinue) {
  const Values want = Reference(20);
  const RunResult first = RunSharded(4, GetParam(), InitialValues(), 0, 10, nullptr);
  ASSERT_TRUE(first.state.has_value());
  EXPECT_EQ(first.state->state.size(), kShapes.size());
  for (int world : {2, 3}) {
    const RunResult second = RunSharded(world, GetParam(), first.params, 10, 20, &*first.state);
    ExpectClose(second.params, want);
  }
}

// The same on a CUDA device (simulated ranks on one GPU): the state travels to the host for consolidation and
// back onto the device parameters at load; equal to the uninterrupted single-rank CPU run within the device
// AdamW's rounding.
TEST_P(OssResume, OnACudaDeviceConsolidateAtTwoLoadAtThreeContinue) {
  SK_REQUIRE_CUDA_DEVICE("OSS state dicts on a device");
  const Values want = Reference(10);
  const RunResult first = RunSharded(2, GetParam(), InitialValues(), 0, 5, nullptr, Device::cuda(0));
  ASSERT_TRUE(first.state.has_value());
  const RunResult second = RunSharded(3, GetParam(), first.params, 5, 10, &*first.state, Device::cuda(0));
  ASSERT_EQ(second.params.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    for (std::size_t k = 0; k < want[i].size(); ++k) EXPECT_NEAR(second.params[i][k], want[i][k], 1e-5) << i << "[" << k << "]";
  }
}

// Over a group that moves only device tensors (NCCL's kind; several simulated ranks on one GPU through
// DeviceOnlyGroup): consolidation's messages, built on the host, travel through the device too.
TEST_P(OssResume, OverADeviceOnlyGroupConsolidateAtTwoLoadAtThreeContinue) {
  SK_REQUIRE_CUDA_DEVICE("OSS state dicts over a device-only group");
  const Values want = Reference(10);
  const RunResult first = RunSharded(2, GetParam(), InitialValues(), 0, 5, nullptr, Device::cuda(0), true);
  ASSERT_TRUE(first.state.has_value());
  const RunResult second = RunSharded(3, GetParam(), first.params, 5, 10, &*first.state, Device::cuda(0), true);
  ASSERT_EQ(second.params.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    for (std::size_t k = 0; k < want[i].size(); ++k) EXPECT_NEAR(second.params[i][k], want[i][k], 1e-5) << i << "[" << k << "]";
  }
}

TEST_P(OssResume, MergeOfShardedStateDictsEqualsConsolidation) {
  std::vector<ShardedStateDict> shards(3);
  std::optional<optim::OptimizerStateDict> consolidated;
  absl::Status st = comm::RunRanks(3, [&](comm::RankEnv& env) -> absl::Status {
    std::vector<Tensor> params = MakeParams(InitialValues());
    auto oss = Oss::create({{params, optim::AdamW::default_hyper()}}, optim::AdamW::factory(), env.group_ptr,
                           {.policy = GetParam()});
    if (!oss.ok()) return oss.status();
    for (std::size_t i = 0; i < params.size(); ++i) params[i].set_grad(Grad(params[i], 0, static_cast<int>(i)));
    if (absl::Status s = (*oss)->step(); !s.ok()) return s;
    shards[static_cast<std::size_t>(env.rank)] = (*oss)->sharded_state_dict();
    if (absl::Status s = (*oss)->consolidate_state_dict(2); !s.ok()) return s;
    if (env.rank == 2) consolidated = *(*oss)->state_dict();
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  absl::StatusOr<optim::OptimizerStateDict> merged = merge_sharded_state_dicts(shards);
  ASSERT_TRUE(merged.ok()) << merged.status();
  ASSERT_EQ(merged->state.size(), consolidated->state.size());
  for (const auto& [index, ps] : consolidated->state) {
    EXPECT_EQ(merged->state.at(index).step, ps.step);
    for (const auto& [key, t] : ps.tensors) EXPECT_EQ(merged->state.at(index).tensors.at(key).to_vector(), t.to_vector());
  }
  shards.pop_back();
  EXPECT_THAT(merge_sharded_state_dicts(shards).status().message(), HasSubstr("expected 3 shards, found 2"));
}

INSTANTIATE_TEST_SUITE_P(Policies, OssResume, ::testing::Values(PartitionPolicy::greedy, PartitionPolicy::flat),
                         [](const auto& info) { return partition_policy_name(info.param); });

// Bad dicts are refused by every rank with the message any optimizer gives (Note [state dict validation]),
// naming the entry, and every rank keeps its state. The last case goes to rank 2 only (the others get a good
// dict with other values): they refuse too, and keep their state rather than load theirs.
TEST(OssLoadTest, BadStateDictsAreRejectedEverywhereAndChangeNothing) {
  const RunResult saved = RunSharded(3, PartitionPolicy::greedy, InitialValues(), 0, 3, nullptr);
  ASSERT_TRUE(saved.state.has_value());
  struct Case {
    std::string expect;
    std::function<void(optim::OptimizerStateDict&)> corrupt;
    int only_rank = -1;  // >= 0: only this rank gets the bad dict
  };
  const std::string missing_key =
      "load_state_dict: parameter 5 (f32[11] cpu): missing state key 'exp_avg_sq' (expected keys: exp_avg, exp_avg_sq)";
  const std::vector<Case> cases = {
      {"load_state_dict: expected a state dict of AdamW, found one of SGD", [](auto& d) { d.optimizer = "SGD"; }},
      {"load_state_dict: expected 1 param groups, found 2", [](auto& d) { d.param_groups.push_back(d.param_groups[0]); }},
      {"load_state_dict: param group 0: expected 6 parameters, found 5", [](auto& d) { d.param_groups[0].params.pop_back(); }},
      {"load_state_dict: param group 0: expected lr >= 0, found -1", [](auto& d) { d.param_groups[0].hyper.lr = -1; }},
      {"load_state_dict: param group 0, entry 2: expected a parameter index >= 0, found -1",
       [](auto& d) { d.param_groups[0].params[2] = -1; }},
      {"load_state_dict: expected each parameter index once, found index 0 twice",
       [](auto& d) { d.param_groups[0].params[3] = 0; }},
      {"load_state_dict: unexpected state for parameter index 6, which no param group lists",
       [](auto& d) { d.state[6] = d.state.at(0); }},
      {"load_state_dict: parameter 1 (f32[5] cpu): state 'exp_avg': expected shape [5], found [4]",
       [](auto& d) { d.state.at(1).tensors.at(optim::kExpAvg) = Tensor::zeros({4}); }},
      {"load_state_dict: parameter 3 (f32[2, 2] cpu): state 'exp_avg_sq': expected an f32 CPU tensor, found bf16[2, 2] cpu",
       [](auto& d) { d.state.at(3).tensors.at(optim::kExpAvgSq) = Tensor::zeros({2, 2}, TensorOptions{}.with_dtype(DType::bf16)); }},
      {"load_state_dict: parameter 4 (f32[1] cpu): expected a step count >= 0, found -2", [](auto& d) { d.state.at(4).step = -2; }},
      // Greedy puts the 11-element parameter on rank 2: every rank checks it all the same.
      {missing_key, [](auto& d) { d.state.at(5).tensors.erase(optim::kExpAvgSq); }},
      {missing_key, [](auto& d) { d.state.at(5).tensors.erase(optim::kExpAvgSq); }, /*only_rank=*/2},
  };
  // A good dict with other values than the state loaded first.
  optim::OptimizerStateDict other = saved.state->clone();
  for (auto& [index, ps] : other.state) ps.tensors.at(optim::kExpAvg).fill_(0.5f);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.expect);
    optim::OptimizerStateDict bad = saved.state->clone();
    c.corrupt(bad);
    std::vector<absl::Status> errors(3);
    std::vector<optim::OptimizerStateDict> after(1);
    absl::Status st = comm::RunRanks(3, [&](comm::RankEnv& env) -> absl::Status {
      std::vector<Tensor> params = MakeParams(saved.params);
      auto oss = Oss::create({{params, optim::AdamW::default_hyper()}}, optim::AdamW::factory(), env.group_ptr);
      if (!oss.ok()) return oss.status();
      if (absl::Status s = (*oss)->load_state_dict(*saved.state); !s.ok()) return s;
      const bool gets_bad = c.only_rank < 0 || c.only_rank == env.rank;
      absl::Status s = (*oss)->load_state_dict(gets_bad ? bad : other);
      errors[static_cast<std::size_t>(env.rank)] = s;
      if (s.ok()) return absl::InternalError("a bad state dict was accepted");
      if (absl::Status c2 = (*oss)->consolidate_state_dict(0); !c2.ok()) return c2;
      if (env.rank == 0) after[0] = *(*oss)->state_dict();
      return absl::OkStatus();
    });
    ASSERT_TRUE(st.ok()) << st;
    for (int r = 0; r < 3; ++r) {
      const absl::Status& e = errors[static_cast<std::size_t>(r)];
      EXPECT_EQ(e.code(), absl::StatusCode::kInvalidArgument) << "rank " << r << ": " << e;
      const bool got_bad = c.only_rank < 0 || c.only_rank == r;
      EXPECT_THAT(std::string(e.message()), HasSubstr(got_bad ? c.expect : "load_state_dict: rank 2 rejected the state dict"))
          << "rank " << r;
    }
    // The state is the good one loaded before.
    ASSERT_EQ(after[0].state.size(), saved.state->state.size());
    for (const auto& [index, ps] : saved.state->state) {
      EXPECT_EQ(after[0].state.at(index).step, ps.step);
      for (const auto& [key, t] : ps.tensors) {
        EXPECT_EQ(after[0].state.at(index).tensors.at(key).to_vector(), t.to_vector());
      }
    }
  }
}

// The consolidated state is handed over once; the rank does not keep a full copy afterwards.
TEST(OssStateDictTest, ConsolidatedStateIsHandedOverOnce) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    std::vector<Tensor> params = MakeParams(InitialValues());
    auto oss = Oss::create({{params, optim::AdamW::default_hyper()}}, optim::AdamW::factory(), env.group_ptr);
    if (!oss.ok()) return oss.status();
    for (std::size_t i = 0; i < params.size(); ++i) params[i].set_grad(Grad(params[i], 0, static_cast<int>(i)));
    if (absl::Status s = (*oss)->step(); !s.ok()) return s;
    const std::int64_t before = env.context.memory->total_current();
    if (absl::Status s = (*oss)->consolidate_state_dict(1); !s.ok()) return s;
    if (env.rank == 1) {
      absl::StatusOr<optim::OptimizerStateDict> sd = (*oss)->state_dict();
      EXPECT_TRUE(sd.ok()) << sd.status();
      EXPECT_EQ(sd->state.size(), kShapes.size());
      sd = absl::StatusOr<optim::OptimizerStateDict>(absl::UnknownError("dropped"));  // release it
      EXPECT_EQ((*oss)->state_dict().status().code(), absl::StatusCode::kFailedPrecondition);
    }
    // The barrier makes sure the receiver is done with the sender's buffers (a send completes when queued).
    if (absl::Status s = env.group.barrier()->wait(); !s.ok()) return s;
    EXPECT_EQ(env.context.memory->total_current(), before) << "a full copy of the state is still held";
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace shardkit::oss
