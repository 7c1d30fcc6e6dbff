// The TCP backend with ranks as processes started by tools/shardrun and init_from_env(): the collective
// matrix at n = 2, 3, 4, and a rank SIGKILLed mid-all_reduce (every other rank reports an error naming it
// within its deadline and shardrun exits non-zero). Also init_from_env's environment parsing.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/comm/init_from_env.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/tools/subprocess.h"

namespace shardkit::comm {
namespace {

using ::testing::HasSubstr;
using shardkit::testing::run_command;

const std::string kShardrun = SHARDRUN_PATH;
const std::string kWorker = TCP_WORKER_PATH;
const std::string kStore = SHARDKIT_STORE_PATH;
// On one host "auto" would pick shared memory (shm_process_test.cc runs these workers over it).
const std::vector<std::pair<std::string, std::string>> kTcp = {{"SHARDKIT_TRANSPORT", "tcp"}};

// A running shardkit-store (its own process group; SIGKILLed on destruction) and the port it printed.
class StandaloneStore {
 public:
  explicit StandaloneStore(const std::string& token) {
    int out[2];
    EXPECT_EQ(::pipe2(out, O_CLOEXEC), 0);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setpgid(0, 0);
      ::dup2(out[1], 1);
      ::setenv("SHARDKIT_STORE_TOKEN", token.c_str(), 1);
      ::execl(kStore.c_str(), kStore.c_str(), "--port", "0", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(out[1]);
    // Read the "listening on host:port" line (bounded: the pipe closes if the server dies).
    std::string line;
    char c;
    pollfd p{out[0], POLLIN, 0};
    while (line.find('\n') == std::string::npos && ::poll(&p, 1, 10000) > 0 && ::read(out[0], &c, 1) == 1) line += c;
    ::close(out[0]);
    const auto colon = line.rfind(':');
    if (colon != std::string::npos) port_ = std::atoi(line.c_str() + colon + 1);
  }
  ~StandaloneStore() {
    ::kill(pid_, SIGTERM);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
  int port() const { return port_; }

 private:
  pid_t pid_ = -1;
  int port_ = 0;
};

class TcpProcesses : public ::testing::TestWithParam<int> {};

TEST_P(TcpProcesses, CollectiveMatrixThroughShardrun) {
  const int n = GetParam();
  auto r = run_command({kShardrun, "--nproc", std::to_string(n), "--", kWorker, "matrix"}, 240, kTcp);
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  for (int rank = 0; rank < n; ++rank) {
    EXPECT_THAT(r.out, HasSubstr("[rank " + std::to_string(rank) + "] MATRIX OK rank " + std::to_string(rank) +
                                 " of " + std::to_string(n)));
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, TcpProcesses, ::testing::Values(2, 3, 4));

// n ranks; `victim` SIGKILLs itself mid-all_reduce. Rank 0 hosts the store, so victim 0 also kills the store.
struct KillCase {
  int n;
  int victim;
};

class TcpKill : public ::testing::TestWithParam<KillCase> {};

TEST_P(TcpKill, SigkilledRankIsNamedByEveryOtherRankWithinTheDeadline) {
  const auto [n, victim] = GetParam();
  auto r = run_command({kShardrun, "--nproc", std::to_string(n), "--grace-seconds", "30", "--", kWorker, "kill",
                        std::to_string(victim), "3"},
                       120, kTcp);
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  EXPECT_EQ(r.exit_code, 128 + 9) << r.out << r.err;  // the victim's SIGKILL is the first failure
  for (int rank = 0; rank < n; ++rank) {
    if (rank == victim) continue;
    const std::string prefix = "[rank " + std::to_string(rank) + "] ERROR";
    const auto pos = r.out.find(prefix);
    ASSERT_NE(pos, std::string::npos) << r.out << r.err;
    const std::string line = r.out.substr(pos, r.out.find('\n', pos) - pos);
    EXPECT_THAT(line, HasSubstr("rank " + std::to_string(victim)));
    EXPECT_THAT(line, HasSubstr("all_reduce"));
    // Well within the call's 10 s deadline.
    EXPECT_LT(std::atoi(line.c_str() + prefix.size() + 1), 5000) << line;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, TcpKill,
                         ::testing::Values(KillCase{3, 1}, KillCase{3, 0}, KillCase{4, 2}),
                         [](const auto& info) {
                           return absl::StrCat("n", info.param.n, "_victim", info.param.victim);
                         });

TEST(TcpProcesses, StandaloneStoreWithToken) {
  StandaloneStore store("job-secret");
  ASSERT_GT(store.port(), 0);
  auto ok = run_command({kShardrun, "--nproc", "3", "--master-port", std::to_string(store.port()), "--", kWorker,
                         "external"},
                        60, {{"SHARDKIT_STORE_TOKEN", "job-secret"}});
  EXPECT_EQ(ok.exit_code, 0) << ok.out << ok.err;
  for (int rank = 0; rank < 3; ++rank) EXPECT_THAT(ok.out, HasSubstr("[rank " + std::to_string(rank) + "] EXTERNAL OK"));
  // A rank with the wrong token is refused at the handshake.
  auto refused = run_command({kShardrun, "--nproc", "2", "--master-port", std::to_string(store.port()), "--", kWorker,
                              "external"},
                             60, {{"SHARDKIT_STORE_TOKEN", "wrong"}});
  EXPECT_EQ(refused.exit_code, 2) << refused.out << refused.err;
  EXPECT_THAT(refused.out, HasSubstr("PERMISSION_DENIED"));
  EXPECT_THAT(refused.out, HasSubstr("wrong or missing token"));
}

TEST(InitFromEnv, ParsesTheTorchrunVariables) {
  auto env = parse_rank_env([](const char* name) -> const char* {
    const std::string n = name;
    if (n == "RANK") return "2";
    if (n == "WORLD_SIZE") return "4";
    if (n == "MASTER_ADDR") return "10.0.0.1";
    if (n == "MASTER_PORT") return "29500";
    return nullptr;
  });
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->rank, 2);
  EXPECT_EQ(env->world_size, 4);
  EXPECT_EQ(env->local_rank, 2);  // defaults to RANK
  EXPECT_EQ(env->master_addr, "10.0.0.1");
  EXPECT_EQ(env->master_port, 29500);
}

TEST(InitFromEnv, NamesTheMissingOrInvalidVariable) {
  auto with = [](std::string rank, std::string world, std::string port, const char* addr) {
    return parse_rank_env([=](const char* name) -> const char* {
      const std::string n = name;
      if (n == "RANK") return rank.empty() ? nullptr : rank.c_str();
      if (n == "WORLD_SIZE") return world.empty() ? nullptr : world.c_str();
      if (n == "MASTER_PORT") return port.empty() ? nullptr : port.c_str();
      if (n == "MASTER_ADDR") return addr;
      return nullptr;
    });
  };
  EXPECT_THAT(std::string(with("0", "", "1", "h").status().message()),
              HasSubstr("expected environment variable WORLD_SIZE to be an integer >= 1, found it unset"));
  EXPECT_THAT(std::string(with("7", "4", "1", "h").status().message()),
              HasSubstr("expected environment variable RANK to be an integer in [0, WORLD_SIZE=4), found '7'"));
  EXPECT_THAT(std::string(with("x", "4", "1", "h").status().message()), HasSubstr("RANK"));
  EXPECT_THAT(std::string(with("0", "4", "70000", "h").status().message()),
              HasSubstr("MASTER_PORT to be a port number in [1, 65535], found '70000'"));
  EXPECT_THAT(std::string(with("0", "4", "1", nullptr).status().message()), HasSubstr("MASTER_ADDR"));
}

TEST(InitFromEnv, FailsCleanlyWithoutTheEnvironment) {
  auto r = run_command({kWorker, "latency"}, 30);  // goes through init_from_env()
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.out, HasSubstr("INIT FAILED: INVALID_ARGUMENT: init_from_env: expected environment variable WORLD_SIZE"));
}

}  // namespace
}  // namespace shardkit::comm
