// The MPI backend with ranks as processes started by mpirun (mpi_worker.cc): the collective matrix at n = 1..4
// (world and a split sub-group), ranks that disagree about a call, an aborting rank, and a stalled rank (a
// deadline, not a hang). Built when shardkit has MPI (label `mpi`).
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "common/comm/mpi_process_group.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/tools/subprocess.h"

namespace shardkit::comm {
namespace {

using ::testing::HasSubstr;
using shardkit::testing::run_command;
using shardkit::testing::RunResult;

// mpirun -np n mpi_worker <mode>, oversubscribed on this machine's cores, allowed to run as root (CI containers).
RunResult mpirun(int n, const std::string& mode) {
  return run_command({MPIEXEC_PATH, "-np", std::to_string(n), "--oversubscribe", "--bind-to", "none", MPI_WORKER_PATH,
                      mode},
                     180, {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}});
}

std::vector<std::string> lines_with(const std::string& out, const std::string& prefix) {
  std::vector<std::string> found;
  for (absl::string_view l : absl::StrSplit(out, '\n')) {
    if (absl::StartsWith(l, prefix)) found.emplace_back(l);
  }
  return found;
}

TEST(MpiBackend, IsBuilt) { EXPECT_TRUE(mpi_backend_built()); }

class MpiProcesses : public ::testing::TestWithParam<int> {};

TEST_P(MpiProcesses, CollectiveMatrixOnTheWorldAndASubGroup) {
  const int n = GetParam();
  RunResult r = mpirun(n, "matrix");
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(lines_with(r.out, "MPI MATRIX OK").size(), static_cast<std::size_t>(n)) << r.out << r.err;
}

INSTANTIATE_TEST_SUITE_P(Ranks, MpiProcesses, ::testing::Values(1, 2, 3, 4));

TEST(MpiFaults, RanksThatDisagreeFailOnEveryRankNamingBothCalls) {
  RunResult r = mpirun(3, "disagree");
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  const auto errors = lines_with(r.out, "ERROR");
  ASSERT_EQ(errors.size(), 3u) << r.out << r.err;
  for (const std::string& e : errors) {
    EXPECT_THAT(e, HasSubstr("INVALID_ARGUMENT"));
    EXPECT_THAT(e, HasSubstr("ranks disagree: rank 0 issued all_reduce #0 (f32[10] per rank, sum), rank 1 issued "
                             "all_reduce #0 (f32[11] per rank, sum)"));
  }
}

TEST(MpiFaults, AnAbortReachesEveryRankWithItsReason) {
  RunResult r = mpirun(3, "abort");
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  EXPECT_EQ(lines_with(r.out, "ABORTED").size(), 1u) << r.out << r.err;
  const auto errors = lines_with(r.out, "ERROR");
  ASSERT_EQ(errors.size(), 2u) << r.out << r.err;
  for (const std::string& e : errors) {
    EXPECT_THAT(e, HasSubstr("ABORTED"));
    EXPECT_THAT(e, HasSubstr("group 'world' aborted by rank 2: rank 2 aborted: the trainer found a NaN"));
  }
}

TEST(MpiFaults, AStalledRankIsADeadlineOnTheOthersNotAHang) {
  RunResult r = mpirun(3, "stall");
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  EXPECT_EQ(lines_with(r.out, "STALLED").size(), 1u) << r.out << r.err;
  const auto errors = lines_with(r.out, "ERROR");
  ASSERT_EQ(errors.size(), 2u) << r.out << r.err;
  for (const std::string& e : errors) {
    // Its own deadline, or the notice of a rank whose deadline passed first (both quote the deadline).
    EXPECT_THAT(e, ::testing::AnyOf(HasSubstr("DEADLINE_EXCEEDED"), HasSubstr("ABORTED")));
    EXPECT_THAT(e, HasSubstr("all_reduce #0 (f32[1000] cpu, sum)"));
    EXPECT_THAT(e, HasSubstr("not complete after its timeout of 2s (MPI cannot tell which ranks did not join)"));
    // Within the deadline plus the time to notice it (generous: sanitizer builds on a loaded machine).
    const long long ms = std::stoll(e.substr(6));
    EXPECT_GE(ms, 1900);
    EXPECT_LT(ms, 30000);
  }
}

}  // namespace
}  // namespace shardkit::comm
