// Feature combinations of DDP, OSS + DDP and OSS + ShardedDDP over the MPI backend (common/comm/mpi_process_group.h),
// each against single-rank training (DESIGN.md section 8): a head every rank uses, one rank uses, or no rank uses in
// a step (Note [parameters no rank used] in sddp/reducer.cc), with the gradients dropped (zero_grad()) or zeroed
// (zero_grad(set_to_none = false)).
//
// MPI ranks are processes of one mpirun job (Note [collectives over mpi] in tests/common/comm/collectives_test.cc,
// done the same way here): each test, as ctest starts it, runs `mpirun -np n` on this binary filtered to itself with
// kMpiRankEnv set; in each rank process the body trains on its MPI rank and checks its own parameters against the
// single-rank run (computed in the process) and against rank 0's (broadcast). The launcher passes when mpirun exits 0
// and every rank printed gtest's OK line for the test.
#include <cmath>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/autograd/ops/activation.h"
#include "common/autograd/ops/elementwise.h"
#include "common/autograd/ops/loss.h"
#include "common/comm/mpi_process_group.h"
#include "tests/sddp/sddp_test_util.h"
#include "tests/sddp/sddp_trainer.h"
#include "tests/testing/two_head_net.h"
#include "tests/testing/run_under_mpi.h"

namespace shardkit::sddp {
namespace {

using test_util::kModes;
using test_util::Mode;
using test_util::Trainer;
using test_util::Values;
using two_head::DeviceHeadNet;
using two_head::HeadInput;

using Params = std::vector<std::vector<float>>;

constexpr char kMpiRankEnv[] = "SHARDKIT_SDDP_COMBO5_MPI_RANK";
constexpr int kSteps = 5;

// Head b per step and rank: every rank in step 0, rank 0 only in step 1, the last rank only in step 2, no rank after.
bool UsesB(int step, int rank, int world) {
  if (step == 0) return true;
  if (step == 1) return rank == 0;
  if (step == 2) return rank == world - 1;
  return false;
}
constexpr int kLastUse = 2;

// One rank on every rank's input (the mean of their losses, each with its rank's use of b). With set_to_none, AdamW
// skips b in the steps no rank used it in; without, b keeps a zero gradient and AdamW moves it.
Params Reference(int world, bool set_to_none, bool* b_moved_after_last_use) {
  RankContext ctx;
  RankContextScope scope(ctx);
  DeviceHeadNet net(3);
  auto opt = optim::AdamW::factory()({{net.parameters(), optim::AdamW::default_hyper()}});
  EXPECT_TRUE(opt.ok());
  std::vector<float> b_after_last_use;
  for (int step = 0; step < kSteps; ++step) {
    (*opt)->zero_grad(set_to_none);
    Tensor loss;
    for (int r = 0; r < world; ++r) {
      net.use_b = UsesB(step, r, world);
      Tensor l = net(HeadInput(step, r));
      loss = r == 0 ? l : autograd::add(loss, l);
    }
    autograd::backward(autograd::scale(loss, 1.0f / static_cast<float>(world)));
    EXPECT_TRUE((*opt)->step().ok());
    if (step == kLastUse) b_after_last_use = net.b->weight().to_vector();
  }
  *b_moved_after_last_use = net.b->weight().to_vector() != b_after_last_use;
  return Values(net);
}

// This rank's training of the head pattern in `mode` over `pg`.
absl::StatusOr<Params> TrainHeads(Mode mode, std::shared_ptr<comm::ProcessGroup> pg, bool set_to_none) {
  const int rank = pg->rank(), world = pg->size();
  DeviceHeadNet net(3);
  auto t = Trainer::make(mode, net, {{net.parameters(), optim::AdamW::default_hyper()}}, optim::AdamW::factory(), pg,
                         {.reduce_buffer_size = 16});
  if (!t.ok()) return t.status();
  for (int step = 0; step < kSteps; ++step) {
    net.use_b = UsesB(step, rank, world);
    t->zero_grad(set_to_none);
    if (absl::Status s = autograd::try_backward(net(HeadInput(step, rank))); !s.ok()) return s;
    if (absl::Status s = t->step(); !s.ok()) return s;
  }
  return Values(net);
}

// In a rank process: this rank's parameters equal `want` within tol, and rank 0's bit for bit.
void ExpectRankMatches(comm::ProcessGroup& pg, const Params& got, const Params& want, double tol,
                       const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  std::vector<float> flat;
  for (std::size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i].size(), want[i].size()) << what;
    for (std::size_t k = 0; k < got[i].size(); ++k) {
      ASSERT_NEAR(got[i][k], want[i][k], tol + tol * std::abs(want[i][k]))
          << what << ": rank " << pg.rank() << " param " << i << "[" << k << "]";
    }
    flat.insert(flat.end(), got[i].begin(), got[i].end());
  }
  Tensor rank0 = Tensor::from_vector(flat, {static_cast<std::int64_t>(flat.size())});
  ASSERT_TRUE(pg.broadcast(rank0, {.root = 0})->wait().ok());
  EXPECT_EQ(rank0.to_vector(), flat) << what << ": rank " << pg.rank() << " differs from rank 0";
}

// Runs the current test under `mpirun -np n` (see the top of the file); in a rank process, fn(world).
void RunUnderMpi(int n, const std::function<void(std::shared_ptr<comm::ProcessGroup>)>& fn) {
  shardkit::testing::RunUnderMpi(kMpiRankEnv, n, fn);
}

class MpiHeadCombo : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

// Head b used by every rank, one rank, another rank, then none, over MPI; gradients dropped, then (a second model)
// zeroed: each equal to one rank on every rank's input with the same zero_grad, and to rank 0 bit for bit.
TEST_P(MpiHeadCombo, AHeadSomeOrNoRankUsesTrainsAsOnOneRankWithGradientsDroppedOrZeroed) {
  const auto [world, mode] = GetParam();
  RunUnderMpi(world, [&, world = world, mode = mode](std::shared_ptr<comm::ProcessGroup> pg) {
    for (const bool set_to_none : {true, false}) {
      const std::string what = absl::StrCat("set_to_none ", set_to_none);
      bool b_moved = false;
      const Params want = Reference(world, set_to_none, &b_moved);
      // Dropped: b stays put once no rank uses it; zeroed: AdamW moves it (its moments, weight decay).
      ASSERT_EQ(b_moved, !set_to_none) << what;
      absl::StatusOr<Params> got = TrainHeads(mode, pg, set_to_none);
      ASSERT_TRUE(got.ok()) << what << ": " << got.status();
      ExpectRankMatches(*pg, *got, want, 1e-6, what);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Modes, MpiHeadCombo, ::testing::Combine(::testing::Values(2, 3), ::testing::ValuesIn(kModes)),
                         test_util::CaseName);

}  // namespace
}  // namespace shardkit::sddp
