// The shared-memory transport with ranks as processes started by tools/shardrun (SHARDKIT_TRANSPORT=shm, so a
// pair that could not use shared memory is an error, never a silent TCP fallback): the collective matrix at
// n = 2, 3, 4 (tcp_worker matrix: tiny chunks and rings of the default size), a rank SIGKILLed mid-all_reduce
// (every other rank names it within seconds of its 10 s deadline: the dead process's connection closes and
// the waiting ranks notice it on their next liveness check), a rank SIGSTOPped (named by the heartbeat
// watchdog on every survivor within seconds, though the collective deadline is 300 s), and a bad
// SHARDKIT_TRANSPORT value; the matrix and the killed rank again with single copy on (SHARDKIT_SHM_SINGLE_COPY=1,
// Note [shm single copy] in shm_transport.cc: the matrix's 1,000,003-element calls go by process_vm_readv between
// the rank processes). The same workers run over TCP in tcp_multiprocess_test.cc and stall_test.cc.
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/tools/subprocess.h"

namespace shardkit::comm {
namespace {

using ::testing::HasSubstr;
using shardkit::testing::run_command;

const std::vector<std::pair<std::string, std::string>> kShm = {{"SHARDKIT_TRANSPORT", "shm"}};
const std::vector<std::pair<std::string, std::string>> kShmSingleCopy = {{"SHARDKIT_TRANSPORT", "shm"},
                                                                         {"SHARDKIT_SHM_SINGLE_COPY", "1"}};

void expect_matrix_ok(int n, const std::vector<std::pair<std::string, std::string>>& env) {
  auto r = run_command({SHARDRUN_PATH, "--nproc", std::to_string(n), "--", TCP_WORKER_PATH, "matrix"}, 240, env);
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  for (int rank = 0; rank < n; ++rank) {
    EXPECT_THAT(r.out, HasSubstr(absl::StrCat("[rank ", rank, "] MATRIX OK rank ", rank, " of ", n)));
  }
}

class ShmProcesses : public ::testing::TestWithParam<int> {};

TEST_P(ShmProcesses, CollectiveMatrixThroughShardrun) { expect_matrix_ok(GetParam(), kShm); }

INSTANTIATE_TEST_SUITE_P(Ranks, ShmProcesses, ::testing::Values(2, 3, 4));

class ShmProcessesSingleCopy : public ::testing::TestWithParam<int> {};

TEST_P(ShmProcessesSingleCopy, CollectiveMatrixThroughShardrun) { expect_matrix_ok(GetParam(), kShmSingleCopy); }

INSTANTIATE_TEST_SUITE_P(Ranks, ShmProcessesSingleCopy, ::testing::Values(2, 3));

struct KillCase {
  int n;
  int victim;
};

class ShmKill : public ::testing::TestWithParam<KillCase> {};

// The victim dies mid-all_reduce (4 MiB, default chunks); with single copy on, the survivors may be
// waiting for their descriptor to be read, or reading the victim's memory (ESRCH), when it goes.
void expect_kill_named(int n, int victim, const std::vector<std::pair<std::string, std::string>>& env) {
  auto r = run_command({SHARDRUN_PATH, "--nproc", std::to_string(n), "--grace-seconds", "30", "--", TCP_WORKER_PATH,
                        "kill", std::to_string(victim), "3"},
                       120, env);
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  EXPECT_EQ(r.exit_code, 128 + 9) << r.out << r.err;  // the victim's SIGKILL is the first failure
  for (int rank = 0; rank < n; ++rank) {
    if (rank == victim) continue;
    const std::string prefix = absl::StrCat("[rank ", rank, "] ERROR");
    const auto pos = r.out.find(prefix);
    ASSERT_NE(pos, std::string::npos) << r.out << r.err;
    const std::string line = r.out.substr(pos, r.out.find('\n', pos) - pos);
    EXPECT_THAT(line, HasSubstr(absl::StrCat("rank ", victim)));
    EXPECT_THAT(line, HasSubstr("all_reduce"));
    EXPECT_LT(std::atoi(line.c_str() + prefix.size() + 1), 5000) << line;  // well within the 10 s deadline
  }
}

TEST_P(ShmKill, SigkilledRankIsNamedByEveryOtherRankWithinTheDeadline) {
  expect_kill_named(GetParam().n, GetParam().victim, kShm);
}

INSTANTIATE_TEST_SUITE_P(Cases, ShmKill, ::testing::Values(KillCase{2, 1}, KillCase{3, 1}, KillCase{4, 2}),
                         [](const auto& info) { return absl::StrCat("n", info.param.n, "_victim", info.param.victim); });

class ShmKillSingleCopy : public ::testing::TestWithParam<KillCase> {};

TEST_P(ShmKillSingleCopy, SigkilledRankIsNamedByEveryOtherRankWithinTheDeadline) {
  expect_kill_named(GetParam().n, GetParam().victim, kShmSingleCopy);
}

INSTANTIATE_TEST_SUITE_P(Cases, ShmKillSingleCopy, ::testing::Values(KillCase{2, 1}, KillCase{3, 1}),
                         [](const auto& info) { return absl::StrCat("n", info.param.n, "_victim", info.param.victim); });

class ShmStoppedRank : public ::testing::TestWithParam<int> {};

TEST_P(ShmStoppedRank, EverySurvivorNamesItWithinTheHeartbeatWindow) {
  const int n = GetParam();
  const int victim = n - 1;
  auto r = run_command({SHARDRUN_PATH, "--nproc", std::to_string(n), "--timeout", "300", "--heartbeat-window", "2",
                        "--grace-seconds", "5", "--", STALL_WORKER_PATH, std::to_string(victim), "3"},
                       240, kShm);
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  EXPECT_NE(r.exit_code, 0);
  int errors = 0;
  for (absl::string_view line : absl::StrSplit(r.out, '\n')) {
    if (!absl::StrContains(line, "ERROR")) continue;
    ++errors;
    EXPECT_THAT(std::string(line), HasSubstr(absl::StrCat("watchdog: rank ", victim, " stopped: no heartbeat for 2s (pid ")));
    const auto at = line.find("ERROR ") + 6;
    EXPECT_LT(std::stoll(std::string(line.substr(at))), 60000) << "named long after the 2 s window: " << line;
  }
  EXPECT_EQ(errors, n - 1) << r.out << r.err;
}

INSTANTIATE_TEST_SUITE_P(Ranks, ShmStoppedRank, ::testing::Values(2, 3));

TEST(ShmProcessesEnv, UnknownTransportIsAnErrorOnEveryRank) {
  auto r = run_command({SHARDRUN_PATH, "--nproc", "2", "--", TCP_WORKER_PATH, "latency"}, 60,
                       {{"SHARDKIT_TRANSPORT", "infiniband"}});
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.out, HasSubstr("to be tcp, shm or auto, found 'infiniband'"));
}

}  // namespace
}  // namespace shardkit::comm
