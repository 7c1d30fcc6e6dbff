// Feature combinations of DDP, OSS + DDP and OSS + ShardedDDP that the other sddp tests leave out, each against
// single-rank training (DESIGN.md section 8):
//   * the unused-parameter flags (Note [parameters no rank used] in sddp/reducer.cc) over the process backends
//     (TcpProcessGroup with the TCP transport and with the shared-memory transport; ranks are threads of this
//     process, as in sddp_tcp_test.cc), whose collectives complete asynchronously on a communication thread: a head
//     every rank uses, one rank uses, or no rank uses in a step;
//   * the same over a device-only group (NCCL-like, tests/testing/device_only_group.h) with the model on CUDA (the
//     emulator build; skipped without a CUDA device): the flags must travel on the parameters' device.
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/autograd/ops/activation.h"
#include "common/autograd/ops/elementwise.h"
#include "common/autograd/ops/loss.h"
#include "common/comm/hash_store.h"
#include "common/comm/tcp_process_group.h"
#include "common/comm/testing/run_ranks.h"
#include "tests/common/tensor/cuda_test_util.h"
#include "tests/sddp/sddp_test_util.h"
#include "tests/sddp/sddp_trainer.h"
#include "tests/testing/device_only_group.h"
#include "tests/testing/tcp_ranks.h"
#include "tests/testing/two_head_net.h"

namespace shardkit::sddp {
namespace {

using test_util::kModes;
using test_util::Mode;
using test_util::ModeName;
using test_util::Trainer;
using test_util::Values;
using two_head::HeadInput;
using tcp_ranks::RunTcpRanks;
using two_head::DeviceHeadNet;
using two_head::TwoHeadNet;

constexpr int kSteps = 5;
// DeviceHeadNet's head b per step and rank: every rank in step 0, rank 0 only in step 1, the last rank only in step 2, no rank after.
bool UsesB(int step, int rank, int world) {
  if (step == 0) return true;
  if (step == 1) return rank == 0;
  if (step == 2) return rank == world - 1;
  return false;
}
constexpr int kLastUse = 2;

// One rank on every rank's input (the mean of their losses, each with its rank's use of b): AdamW skips b in the
// steps no rank used it in.
std::vector<std::vector<float>> Reference(int world) {
  RankContext ctx;
  RankContextScope scope(ctx);
  DeviceHeadNet net(3);
  auto opt = optim::AdamW::factory()({{net.parameters(), optim::AdamW::default_hyper()}});
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < kSteps; ++step) {
    (*opt)->zero_grad();
    Tensor loss;
    for (int r = 0; r < world; ++r) {
      net.use_b = UsesB(step, r, world);
      Tensor l = net(HeadInput(step, r));
      loss = r == 0 ? l : autograd::add(loss, l);
    }
    autograd::backward(autograd::scale(loss, 1.0f / static_cast<float>(world)));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return Values(net);
}

// One rank's training of the head pattern in `mode` over `pg`, the model on `device`; checks that b stays put
// (exactly) once no rank uses it.
absl::StatusOr<std::vector<std::vector<float>>> TrainHeads(Mode mode, std::shared_ptr<comm::ProcessGroup> pg,
                                                           Device device) {
  const int rank = pg->rank(), world = pg->size();
  DeviceHeadNet net(3);
  net.to(device);
  auto t = Trainer::make(mode, net, {{net.parameters(), optim::AdamW::default_hyper()}}, optim::AdamW::factory(), pg,
                         {.reduce_buffer_size = 16});
  if (!t.ok()) return t.status();
  std::vector<float> b_after_last_use;
  for (int step = 0; step < kSteps; ++step) {
    net.use_b = UsesB(step, rank, world);
    t->zero_grad();
    if (absl::Status s = autograd::try_backward(net(HeadInput(step, rank).to(device))); !s.ok()) return s;
    if (absl::Status s = t->step(); !s.ok()) return s;
    const std::vector<float> b = Values(*net.b)[0];
    if (step == kLastUse) b_after_last_use = b;
    if (step > kLastUse && b != b_after_last_use) {
      return absl::InternalError(absl::StrCat("rank ", rank, ": head b moved in step ", step, ", which no rank used it in"));
    }
  }
  return Values(net);
}

// ---- process backends ------------------------------------------------------------------------------------------

class ProcessBackendHeadCombo : public ::testing::TestWithParam<std::tuple<std::string, int, Mode>> {};

// Head b used by every rank, one rank, another rank, then none, over TCP or shared memory (tiny chunks and rings so
// that the flags and buckets are split across many chunks, in flight while backward continues): equal to one rank
// on every rank's input; b stays put bitwise once no rank uses it.
TEST_P(ProcessBackendHeadCombo, AHeadSomeOrNoRankUsesTrainsAsOnOneRank) {
  const auto& [transport, world, mode] = GetParam();
  const auto want = Reference(world);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  static int variant = 0;
  absl::Status st = RunTcpRanks(world, transport, absl::StrCat("combo4_", variant++),
                                [&](std::shared_ptr<comm::ProcessGroup> pg) -> absl::Status {
                                  auto v = TrainHeads(mode, pg, Device::cpu());
                                  if (!v.ok()) return v.status();
                                  got[static_cast<std::size_t>(pg->rank())] = std::move(*v);
                                  return absl::OkStatus();
                                });
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(got, want, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Transports, ProcessBackendHeadCombo,
                         ::testing::Combine(::testing::Values(std::string("tcp"), std::string("shm")),
                                            ::testing::Values(2, 3), ::testing::ValuesIn(kModes)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + ModeName(std::get<2>(info.param)) + "_n" +
                                  std::to_string(std::get<1>(info.param));
                         });

// ---- device-only groups (NCCL-like) on CUDA parameters ----------------------------------------------------------

class DeviceOnlyHeadCombo : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

// The same pattern with the model on cuda:0 and a group that refuses host tensors: the "had a gradient" flags, the
// buckets and OSS's broadcasts travel on the device; equal to one rank on the host.
TEST_P(DeviceOnlyHeadCombo, AHeadSomeOrNoRankUsesTrainsAsOnOneRank) {
  SK_REQUIRE_CUDA_DEVICE("DDP / OSS / ShardedDDP with an unused head over a device-only group");
  const auto [world, mode] = GetParam();
  const auto want = Reference(world);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    auto pg = std::make_shared<comm::testing::DeviceOnlyGroup>(env.group_ptr);
    auto v = TrainHeads(mode, pg, Device::cuda(0));
    if (!v.ok()) return v.status();
    got[static_cast<std::size_t>(env.rank)] = std::move(*v);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(got, want, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Modes, DeviceOnlyHeadCombo,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::ValuesIn(kModes)), test_util::CaseName);

}  // namespace
}  // namespace shardkit::sddp
