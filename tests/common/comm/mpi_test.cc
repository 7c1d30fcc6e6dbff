// The MPI backend with ranks as processes started by mpirun (mpi_worker.cc): the collective matrix at n = 1..4
// (world and a split sub-group), ranks that disagree about a call, an aborting rank, a stalled rank (a deadline,
// not a hang), and the process faults of the other process backends' tests (shm_process_test.cc,
// tcp_multiprocess_test.cc, stall_test.cc): a rank SIGKILLed mid-all_reduce and one SIGSTOPped (Note [mpi
// failure] in mpi_process_group.h says what MPI can and cannot abort). Built when shardkit has MPI (label `mpi`);
// the collectives suite over MPI is comm_mpi_collectives_test (collectives_test.cc).
#include <unistd.h>

#include <cstdio>
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

// mpirun -np n [flags] mpi_worker <mode> [args], oversubscribed on this machine's cores, allowed to run as root (CI
// containers).
RunResult mpirun(int n, const std::string& mode, const std::vector<std::string>& args = {},
                 const std::vector<std::string>& flags = {}) {
  std::vector<std::string> argv = {MPIEXEC_PATH, "-np", std::to_string(n), "--oversubscribe", "--bind-to", "none"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(MPI_WORKER_PATH);
  argv.push_back(mode);
  argv.insert(argv.end(), args.begin(), args.end());
  return run_command(argv, 180, {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}});
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

// Calls that match in kind and size but not in fingerprint (THE CONTRACT in process_group.h): every rank fails
// naming both, as for a size mismatch.
TEST(MpiFaults, RanksThatPassOtherFingerprintsFailOnEveryRankNamingBoth) {
  RunResult r = mpirun(3, "fingerprint");
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  const auto errors = lines_with(r.out, "ERROR");
  ASSERT_EQ(errors.size(), 3u) << r.out << r.err;
  for (const std::string& e : errors) {
    EXPECT_THAT(e, HasSubstr("INVALID_ARGUMENT"));
    EXPECT_THAT(e, HasSubstr("ranks disagree: rank 0 issued all_reduce #0 (f32[10] per rank, sum, fingerprint "
                             "0x00000007), rank 1 issued all_reduce #0 (f32[10] per rank, sum, fingerprint "
                             "0x00000009)"));
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

// A call whose deadline passes after its group already failed (here: an earlier call's deadline, while the
// communication thread was held in a blocking MPI call, so neither call was failed by it) still fails naming
// itself first, then the group's first failure. Before the fix the second call returned the first one's error
// unchanged; a SIGCONTed rank then printed a line that named another rank's call (MpiStoppedRank failed under ASan).
TEST(MpiFaults, ACallFailingAfterItsGroupFailedNamesItselfFirst) {
  const std::string printed = ::testing::TempDir() + "mpi_late_" + std::to_string(::getpid());
  std::remove(printed.c_str());
  RunResult r = mpirun(2, "late", {printed});
  std::remove(printed.c_str());
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  const auto first = lines_with(r.out, "FIRST ");
  const auto second = lines_with(r.out, "SECOND ");
  ASSERT_EQ(first.size(), 1u) << r.out << r.err;
  ASSERT_EQ(second.size(), 1u) << r.out << r.err;
  // "FIRST DEADLINE_EXCEEDED: all_reduce #k (f32[1000] cpu, sum) on group 'world' (mpi, rank 0): not complete ..."
  const std::string first_message = first[0].substr(first[0].find(": ") + 2);
  const std::string first_call = first_message.substr(0, first_message.find(": "));
  EXPECT_THAT(first_message, HasSubstr("not complete after its timeout of 1s")) << r.out;
  EXPECT_THAT(second[0], HasSubstr("DEADLINE_EXCEEDED: all_reduce #")) << r.out;
  const std::string second_message = second[0].substr(second[0].find(": ") + 2);
  EXPECT_NE(second_message.substr(0, second_message.find(": ")), first_call) << r.out;
  EXPECT_THAT(second_message, HasSubstr(absl::StrCat(": ", first_message))) << r.out;
}

struct ProcessFault {
  int n;
  int victim;
};

std::string fault_name(const ::testing::TestParamInfo<ProcessFault>& info) {
  return absl::StrCat("n", info.param.n, "_victim", info.param.victim);
}

// Every rank but the victim printed one ERROR line for the all_reduce the victim issued and then died or stopped
// in: its own deadline (T = 4 s) or the abort notice of a survivor whose deadline passed first, at about
// T after the call was issued: an error within the deadline, not a hang.
void ExpectEverySurvivorFailedAtTheDeadline(const RunResult& r, int n, int victim) {
  for (int q = 0; q < n; ++q) {
    if (q == victim) continue;
    std::vector<std::string> mine;
    for (const std::string& e : lines_with(r.out, "ERROR")) {
      // The line's own call (a notice quotes the call of the rank it came from after it).
      const std::string own = "(f32[262144] cpu, sum) on group 'world' (mpi, rank ";
      const auto at = e.find(own);
      if (at != std::string::npos && absl::StartsWith(e.substr(at + own.size()), absl::StrCat(q, "): "))) {
        mine.push_back(e);
      }
    }
    ASSERT_EQ(mine.size(), 1u) << "rank " << q << " (mpirun exited " << r.exit_code << " after " << r.seconds
                               << " s):\n" << r.out << r.err;
    EXPECT_THAT(mine[0], ::testing::AnyOf(HasSubstr("DEADLINE_EXCEEDED"), HasSubstr("ABORTED"))) << mine[0];
    EXPECT_THAT(mine[0], HasSubstr("not complete after its timeout of 4s")) << mine[0];
    const long long ms = std::stoll(mine[0].substr(6));
    EXPECT_GE(ms, 3900) << mine[0];
    EXPECT_LT(ms, 30000) << mine[0];  // generous: sanitizer builds on a loaded machine
  }
}

class MpiKilledRank : public ::testing::TestWithParam<ProcessFault> {};

// Open MPI's default: mpirun ends the whole job as soon as a rank process dies, naming it; shardkit is not told
// and the other ranks are killed before any deadline (T = 30 s here) could pass.
TEST_P(MpiKilledRank, MpirunEndsTheJobAtOnceNamingTheRank) {
  const auto [n, victim] = GetParam();
  RunResult r = mpirun(n, "kill", {std::to_string(victim), "3", "30"});
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  EXPECT_NE(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out + r.err, HasSubstr(absl::StrCat("process rank ", victim, " with PID")));
  EXPECT_THAT(r.out + r.err, HasSubstr("exited on signal 9 (Killed)"));
  EXPECT_TRUE(lines_with(r.out, "NO ERROR").empty()) << r.out;
  EXPECT_LT(r.seconds, 30) << "the job outlived the survivors' deadline: " << r.out << r.err;
}

// mpirun --enable-recovery keeps the job running without the dead rank: the survivors' all_reduce can never
// complete, and fails at its deadline on every one of them.
TEST_P(MpiKilledRank, WithRecoveryEnabledEverySurvivorFailsAtItsDeadline) {
  const auto [n, victim] = GetParam();
  RunResult r = mpirun(n, "kill", {std::to_string(victim), "3", "4"}, {"--enable-recovery"});
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  ExpectEverySurvivorFailedAtTheDeadline(r, n, victim);
}

INSTANTIATE_TEST_SUITE_P(Cases, MpiKilledRank, ::testing::Values(ProcessFault{2, 1}, ProcessFault{3, 1}),
                         fault_name);

class MpiStoppedRank : public ::testing::TestWithParam<ProcessFault> {};

// A SIGSTOPped rank is still alive to mpirun: the survivors' call fails at its deadline (there is no heartbeat
// watchdog over MPI: no Store), they report it and exit, and mpirun then ends the job, the stopped rank with it.
TEST_P(MpiStoppedRank, EverySurvivorFailsAtItsDeadline) {
  const auto [n, victim] = GetParam();
  RunResult r = mpirun(n, "stop", {std::to_string(victim), "3", "4"});
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  EXPECT_NE(r.exit_code, 0) << r.out << r.err;
  ExpectEverySurvivorFailedAtTheDeadline(r, n, victim);
}

INSTANTIATE_TEST_SUITE_P(Cases, MpiStoppedRank, ::testing::Values(ProcessFault{2, 1}, ProcessFault{3, 2}),
                         fault_name);

}  // namespace
}  // namespace shardkit::comm
