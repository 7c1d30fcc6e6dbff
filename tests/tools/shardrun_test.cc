// shardrun: environment, prefixed output, exit-code propagation, stopping the other ranks (SIGTERM then
// SIGKILL), signal forwarding and the no-orphans guarantee, each run for real and bounded in time; the
// per-job store token and output without newlines (issue 17).
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "common/comm/tcp_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/tools/subprocess.h"

namespace shardkit::testing {
namespace {

using ::testing::HasSubstr;

const std::string kShardrun = SHARDRUN_PATH;
const std::string kChild = SHARDRUN_TEST_CHILD_PATH;

// A fresh scratch directory per test.
std::string make_dir() {
  std::string tmpl = ::testing::TempDir() + "shardrun_XXXXXX";
  char* d = ::mkdtemp(tmpl.data());
  EXPECT_NE(d, nullptr);
  return tmpl;
}

pid_t read_pid(const std::string& path) {
  std::ifstream f(path);
  pid_t p = -1;
  f >> p;
  return p;
}

// Polls until every pid is dead (bounded).
bool all_dead(const std::vector<pid_t>& pids, double within_seconds = 10) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(within_seconds);
  for (;;) {
    bool dead = true;
    for (pid_t p : pids) dead = dead && p > 0 && process_dead(p);
    if (dead) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::vector<pid_t> rank_pids(const std::string& dir, int n, const std::string& name = "pid") {
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) pids.push_back(read_pid(dir + "/" + name + "." + std::to_string(r)));
  return pids;
}

TEST(Shardrun, SetsTheEnvironmentAndPrefixesEveryLine) {
  auto r = run_command({kShardrun, "--nproc", "3", "--master-port", "29555", "--", kChild, "env"}, 60);
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  for (int rank = 0; rank < 3; ++rank) {
    const std::string p = "[rank " + std::to_string(rank) + "] ";
    EXPECT_THAT(r.out, HasSubstr(p + "RANK=" + std::to_string(rank) + " WORLD_SIZE=3 LOCAL_RANK=" +
                                 std::to_string(rank) + " MASTER_ADDR=127.0.0.1 MASTER_PORT=29555\n"));
    EXPECT_THAT(r.out, HasSubstr(p + "no newline\n"));
    EXPECT_THAT(r.err, HasSubstr(p + "to stderr\n"));
  }
  // Every line carries a prefix.
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) EXPECT_EQ(line.rfind("[rank ", 0), 0u) << line;
}

TEST(Shardrun, PicksAFreePortWhenNoneIsGiven) {
  auto r = run_command({kShardrun, "--nproc", "2", "--", kChild, "env"}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto pos = r.out.find("MASTER_PORT=");
  ASSERT_NE(pos, std::string::npos);
  const int port = std::atoi(r.out.c_str() + pos + 12);
  EXPECT_GT(port, 0);
  EXPECT_LT(port, 65536);
}

TEST(Shardrun, RejectsBadArguments) {
  auto r = run_command({kShardrun, "--nproc", "zero", "--", kChild, "env"}, 30);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--nproc: expected an integer in [1, 1024], found 'zero'"));
  auto missing = run_command({kShardrun, "--nproc", "2"}, 30);
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_THAT(missing.err, HasSubstr("usage: shardrun"));
}

TEST(Shardrun, AFailingRankStopsTheOthersAndItsCodeIsReturned) {
  const std::string dir = make_dir();
  auto r = run_command({kShardrun, "--nproc", "4", "--", kChild, "fail", "2", "7", dir}, 60);
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 7) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("[rank 2] rank 2 failing with 7"));
  EXPECT_THAT(r.err, HasSubstr("rank 2 exited with code 7; stopping the other ranks"));
  EXPECT_TRUE(all_dead(rank_pids(dir, 4)));
  EXPECT_LT(r.seconds, 30);
}

TEST(Shardrun, RanksIgnoringSigtermAreKilledAfterTheGracePeriod) {
  const std::string dir = make_dir();
  auto r = run_command({kShardrun, "--nproc", "3", "--grace-seconds", "0.3", "--", kChild, "stubborn", dir}, 60);
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_TRUE(all_dead(rank_pids(dir, 3)));
}

TEST(Shardrun, ChildrenOfRanksAreNotOrphaned) {
  const std::string dir = make_dir();
  auto r = run_command({kShardrun, "--nproc", "2", "--grace-seconds", "0.5", "--", kChild, "grandchild", dir}, 60);
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_TRUE(all_dead(rank_pids(dir, 2)));
  EXPECT_TRUE(all_dead(rank_pids(dir, 2, "grandchild")));
}

// Waits until every rank wrote its pid file, then calls fn (on a helper thread).
std::thread when_ready(const std::string& dir, int n, std::function<void()> fn) {
  return std::thread([dir, n, fn] {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    for (;;) {
      int k = 0;
      for (int r = 0; r < n; ++r) k += ::access((dir + "/pid." + std::to_string(r)).c_str(), F_OK) == 0;
      if (k == n || std::chrono::steady_clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    fn();
  });
}

TEST(Shardrun, ForwardsSigtermToTheRanks) {
  const std::string dir = make_dir();
  pid_t launcher = -1;
  std::thread killer;
  auto r = run_command({kShardrun, "--nproc", "3", "--", kChild, "hang", dir}, 60, [&](pid_t pid) {
    launcher = pid;
    killer = when_ready(dir, 3, [pid] { ::kill(pid, SIGTERM); });
  });
  killer.join();
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 128 + SIGTERM);
  EXPECT_TRUE(all_dead(rank_pids(dir, 3)));
}

TEST(Shardrun, RanksDieWhenTheLauncherIsKilled) {
  const std::string dir = make_dir();
  std::thread killer;
  auto r = run_command({kShardrun, "--nproc", "2", "--", kChild, "hang", dir}, 60, [&](pid_t pid) {
    // Only the launcher itself: its ranks are in their own process group (PR_SET_PDEATHSIG must act).
    killer = when_ready(dir, 2, [pid] { ::kill(pid, SIGKILL); });
  });
  killer.join();
  EXPECT_EQ(r.exit_code, 128 + SIGKILL);
  EXPECT_TRUE(all_dead(rank_pids(dir, 2)));
}


// A rank that writes 32 MiB without a newline. Before the fix shardrun kept the whole partial line, searched
// all of it again after every read (quadratic) and forwarded it as one 32 MiB line at the end; now the
// output arrives intact in prefixed pieces of 64 KiB (shardrun's kMaxLineBytes), so shardrun never holds
// more than one piece.
TEST(Shardrun, OutputWithoutNewlinesIsForwardedIntactInBoundedPieces) {
  constexpr long long kBytes = 32ll << 20;
  constexpr std::size_t kPiece = 64 << 10;
  auto r = run_command({kShardrun, "--nproc", "1", "--", kChild, "nonewline", std::to_string(kBytes)}, 120);
  ASSERT_FALSE(r.timed_out);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::string expected;
  expected.reserve(static_cast<std::size_t>(kBytes) + (kBytes / kPiece) * 10);
  std::string piece;
  for (long long i = 0; i < kBytes; ++i) {
    piece += static_cast<char>('a' + i % 26);
    if (piece.size() == kPiece || i + 1 == kBytes) {
      expected += "[rank 0] " + piece + "\n";
      piece.clear();
    }
  }
  ASSERT_EQ(r.out.size(), expected.size());
  EXPECT_TRUE(r.out == expected) << "first difference at byte "
                                 << std::mismatch(r.out.begin(), r.out.end(), expected.begin()).first - r.out.begin();
}

// A line of exactly 64 KiB is one line, however the pipe splits it: no empty piece after it.
TEST(Shardrun, ALineOfExactlyTheCapIsOneLine) {
  auto r = run_command({kShardrun, "--nproc", "1", "--", kChild, "nonewline", std::to_string(64 << 10), "end"}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::string line;
  for (int i = 0; i < (64 << 10); ++i) line += static_cast<char>('a' + i % 26);
  EXPECT_TRUE(r.out == "[rank 0] " + line + "\n[rank 0] end\n") << r.out.size() << " bytes";
}

// Each job gets its own random token, the same on every rank, 64 hex digits.
TEST(Shardrun, GivesEveryJobItsOwnStoreToken) {
  std::set<std::string> tokens;
  for (int job = 0; job < 2; ++job) {
    auto r = run_command({kShardrun, "--nproc", "2", "--", kChild, "token"}, 60);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    std::set<std::string> seen;
    for (int rank = 0; rank < 2; ++rank) {
      const std::string p = "[rank " + std::to_string(rank) + "] TOKEN=";
      const auto pos = r.out.find(p);
      ASSERT_NE(pos, std::string::npos) << r.out;
      const std::string token = r.out.substr(pos + p.size(), r.out.find('\n', pos) - pos - p.size());
      EXPECT_EQ(token.size(), 64u) << token;
      EXPECT_EQ(token.find_first_not_of("0123456789abcdef"), std::string::npos) << token;
      seen.insert(token);
    }
    EXPECT_EQ(seen.size(), 1u) << r.out;  // the ranks of one job share it
    tokens.insert(*seen.begin());
  }
  EXPECT_EQ(tokens.size(), 2u);  // two jobs do not
}

TEST(Shardrun, AnExplicitTokenOverridesTheJobToken) {
  auto r = run_command({kShardrun, "--nproc", "2", "--", kChild, "token"}, 60, {{"SHARDKIT_STORE_TOKEN", "mine"}});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("[rank 0] TOKEN=mine\n"));
  EXPECT_THAT(r.out, HasSubstr("[rank 1] TOKEN=mine\n"));
}

// The store a shardrun job's rank 0 hosts refuses a local client that does not have the job's token (one
// with no token, one with a guess), with no set-up by the user; the job's own ranks and a client given the
// token are served.
TEST(Shardrun, TheJobsStoreRefusesClientsWithoutTheJobToken) {
  const std::string dir = make_dir();
  std::thread outsider;
  std::string port_text, token;
  absl::Status no_token = absl::OkStatus(), guessed = absl::OkStatus(), with_token = absl::UnknownError("not run");
  auto r = run_command({kShardrun, "--nproc", "2", "--", kChild, "store", dir}, 90, [&](pid_t) {
    outsider = std::thread([&] {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (::access((dir + "/port").c_str(), F_OK) != 0 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      std::ifstream(dir + "/port") >> port_text;
      std::ifstream(dir + "/token") >> token;
      comm::TcpStoreOptions o;
      o.port = static_cast<std::uint16_t>(std::atoi(port_text.c_str()));
      o.connect_timeout = absl::Seconds(10);
      no_token = comm::TcpStore::create(o).status();
      o.token = "guessed";
      guessed = comm::TcpStore::create(o).status();
      o.token = token;
      auto c = comm::TcpStore::create(o);
      with_token = c.ok() ? (*c)->set("done", "1") : c.status();
    });
  });
  outsider.join();
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(token.size(), 64u);
  EXPECT_EQ(no_token.code(), absl::StatusCode::kPermissionDenied) << no_token;
  EXPECT_THAT(no_token.message(), HasSubstr("wrong or missing token"));
  EXPECT_EQ(guessed.code(), absl::StatusCode::kPermissionDenied) << guessed;
  EXPECT_TRUE(with_token.ok()) << with_token;
}

}  // namespace
}  // namespace shardkit::testing
