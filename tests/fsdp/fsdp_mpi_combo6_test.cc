// fully_shard and HSDP over the MPI backend (common/comm/mpi_process_group.h), each against the in-process backend
// and single-rank training (DESIGN.md section 8): GPT-tiny on a 1-D group of 2 and 3 ranks and on a 2 x 2 HSDP mesh
// (its sub-groups are MPI communicators), plain, bf16 mixed precision, cpu offload, the all-reduce across replicas
// deferred, no gradient sync, no prefetch and explicit prefetch lists.
//
// The MPI backend reduces in rank order with the in-process backend's arithmetic (Note [mpi reductions]), so every
// case must give the in-process backend's bits, bf16 included, at any rank count.
//
// MPI ranks are processes of one mpirun job (done as tests/sddp/sddp_mpi_combo5_test.cc does): each test, as ctest
// starts it, runs `mpirun -np n` on this binary filtered to itself with kMpiRankEnv set; in each rank process the body
// trains on its MPI rank, rank 0 also runs the same case over the in-process backend (threads) and broadcasts its
// values, and every rank checks its own values against them bit for bit. The launcher passes when mpirun exits 0 and
// every rank printed gtest's OK line for the test.

#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/comm/mpi_process_group.h"
#include "gtest/gtest.h"
#include "tests/fsdp/fsdp_combo6_util.h"
#include "tests/testing/gpt_tiny_data.h"
#include "tests/testing/run_under_mpi.h"

namespace shardkit::fsdp {
namespace {

using combo6::Accumulate;
using combo6::GptCase;
using combo6::Params;
using combo6::Prefetch;

constexpr char kMpiRankEnv[] = "SHARDKIT_FSDP_COMBO6_MPI_RANK";
constexpr int kSteps = 3;

// Runs the current test under `mpirun -np n` (see the top of the file); in a rank process, fn(world).
void RunUnderMpi(int n, const std::function<void(std::shared_ptr<comm::ProcessGroup>)>& fn) {
  shardkit::testing::RunUnderMpi(kMpiRankEnv, n, fn);
}

// In a rank process: trains each case over MPI; rank 0 runs it over the in-process backend too (and checks f32 cases
// against single-rank training) and broadcasts its values; every rank's values must be those bits.
void ExpectCasesMatchInProcess(comm::ProcessGroup& pg, const std::shared_ptr<comm::ProcessGroup>& world,
                               const std::vector<GptCase>& cases) {
  for (const GptCase& c : cases) {
    SCOPED_TRACE(combo6::Describe(c));
    ASSERT_EQ(c.world(), pg.size());
    absl::StatusOr<Params> got = combo6::RunGpt(world, c, kSteps);
    ASSERT_TRUE(got.ok()) << got.status();
    const std::vector<float> mine = combo6::Flat(*got);
    std::vector<float> expected(mine.size());
    if (pg.rank() == 0) {
      const std::vector<Params> threads = combo6::InProcess(c, kSteps);
      ASSERT_FALSE(threads.empty() || threads[0].empty());
      expected = combo6::Flat(threads[0]);
      if (!c.bf16) gpt_tiny::ExpectMatches({threads[0]}, gpt_tiny::Reference(kSteps), 2e-5);
    }
    ASSERT_EQ(expected.size(), mine.size());
    Tensor t = Tensor::from_vector(expected, {static_cast<std::int64_t>(expected.size())});
    ASSERT_TRUE(pg.broadcast(t, {.root = 0})->wait().ok());
    EXPECT_TRUE(t.to_vector() == mine) << "rank " << pg.rank() << ": MPI values differ from the in-process backend's";
  }
}

// A 1-D group of two ranks: plain, bf16, offload with explicit prefetch, no sync without prefetch, bf16 offload with
// no sync and the blocks kept unsharded after forward.
TEST(FsdpMpiCombo, OneDimensionalGroupOfTwoTrainsAsInProcess) {
  RunUnderMpi(2, [](std::shared_ptr<comm::ProcessGroup> pg) {
    ExpectCasesMatchInProcess(*pg, pg,
                              {{.shards = 2},
                               {.shards = 2, .bf16 = true},
                               {.shards = 2, .offload = true, .prefetch = Prefetch::explicit_two},
                               {.shards = 2, .accumulate = Accumulate::no_sync, .prefetch = Prefetch::off},
                               {.shards = 2, .bf16 = true, .offload = true, .accumulate = Accumulate::no_sync,
                                .block_reshard = false}});
  });
}

// Three ranks (uneven rows, sums of three): f32 with offload and explicit prefetch, bf16 with no sync.
TEST(FsdpMpiCombo, OneDimensionalGroupOfThreeTrainsAsInProcess) {
  RunUnderMpi(3, [](std::shared_ptr<comm::ProcessGroup> pg) {
    ExpectCasesMatchInProcess(*pg, pg,
                              {{.shards = 3, .offload = true, .prefetch = Prefetch::explicit_two},
                               {.shards = 3, .bf16 = true, .accumulate = Accumulate::no_sync}});
  });
}

// HSDP on a 2 x 2 mesh of MPI sub-communicators: plain, bf16 with offload and the all-reduce deferred, no sync with
// offload and explicit prefetch; and four ranks whose blocks reshard to pairs (a sub-communicator) after forward.
TEST(FsdpMpiCombo, HsdpMeshAndKGroupsTrainAsInProcess) {
  RunUnderMpi(4, [](std::shared_ptr<comm::ProcessGroup> pg) {
    ExpectCasesMatchInProcess(
        *pg, pg,
        {{.replicas = 2, .shards = 2},
         {.replicas = 2, .shards = 2, .bf16 = true, .offload = true, .accumulate = Accumulate::defer_all_reduce},
         {.replicas = 2, .shards = 2, .offload = true, .accumulate = Accumulate::no_sync, .prefetch = Prefetch::explicit_two},
         {.shards = 4, .bf16 = true, .offload = true, .block_reshard = 2}});
  });
}

}  // namespace
}  // namespace shardkit::fsdp
