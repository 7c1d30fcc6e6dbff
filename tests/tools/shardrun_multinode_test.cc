// shardrun across hosts (Note [several hosts] in tools/shardrun.cc): two shardrun processes on this machine
// act as two nodes of two ranks each and train shardkit-train over TCP to the loss of --ranks 4 threads; what
// the nodes must agree on (--node-rank, --master-addr / --master-port, a shared SHARDKIT_STORE_TOKEN) is an error
// when missing.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/tools/subprocess.h"
#include "tests/tools/train_output.h"

namespace shardkit {
namespace {

using shardkit::testing::Field;

using ::testing::HasSubstr;

constexpr double kDeadline = 240;

// A port the kernel just handed out (free now; the test's two nodes use it right away).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    return 0;
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

std::vector<std::string> node(int node_rank, int port, const std::vector<std::string>& program) {
  std::vector<std::string> argv = {SHARDRUN_PATH, "--nnodes", "2", "--node-rank", std::to_string(node_rank),
                                   "--nproc", "2", "--master-addr", "127.0.0.1", "--master-port",
                                   std::to_string(port), "--"};
  argv.insert(argv.end(), program.begin(), program.end());
  return argv;
}

TEST(ShardrunNodes, TwoNodesOfTwoRanksTrainLikeFourThreads) {
  // --backend tcp: the two "nodes" share this host, where the default would pick shared memory.
  const std::vector<std::string> train = {SHARDKIT_TRAIN_PATH, "--backend", "tcp", "--strategy", "sddp", "--steps",
                                          "12", "--model", "tiny", "--sample", "0"};
  const int port = free_port();
  ASSERT_GT(port, 0);
  const std::vector<std::pair<std::string, std::string>> token = {{"SHARDKIT_STORE_TOKEN", "shared-by-both-nodes"}};
  testing::RunResult second;
  std::thread node1([&] { second = testing::run_command(node(1, port, train), kDeadline, token); });
  const testing::RunResult first = testing::run_command(node(0, port, train), kDeadline, token);
  node1.join();
  ASSERT_EQ(first.exit_code, 0) << first.out << first.err;
  ASSERT_EQ(second.exit_code, 0) << second.out << second.err;
  EXPECT_THAT(first.out, HasSubstr("on 4 ranks (processes, TCP)"));
  std::vector<std::string> threads = {SHARDKIT_TRAIN_PATH, "--ranks", "4"};
  threads.insert(threads.end(), train.begin() + 1, train.end());
  const auto in_process = testing::run_command(threads, kDeadline);
  ASSERT_EQ(in_process.exit_code, 0) << in_process.err;
  const double want = std::stod(Field(in_process.out, "final loss: "));
  const double got = std::stod(Field(first.out, "final loss: "));
  EXPECT_NEAR(got, want, 1e-5 * want);  // a TCP ring sums in another order than threads: fp32 tolerance
}

// shardkit-train's --backend on one host: shm for every pair (and the default, which picks it here) train to
// the loss of threads; --backend tcp is what the two-node test above uses.
TEST(ShardkitTrainBackends, SharedMemoryProcessesTrainLikeThreads) {
  const std::vector<std::string> args = {"--strategy", "fsdp", "--steps", "12", "--model", "tiny", "--sample", "0"};
  std::vector<std::string> threads = {SHARDKIT_TRAIN_PATH, "--ranks", "2"};
  threads.insert(threads.end(), args.begin(), args.end());
  const auto in_process = testing::run_command(threads, kDeadline);
  ASSERT_EQ(in_process.exit_code, 0) << in_process.err;
  const double want = std::stod(Field(in_process.out, "final loss: "));
  for (const std::string backend : {"shm", ""}) {
    SCOPED_TRACE(backend);
    std::vector<std::string> argv = {SHARDRUN_PATH, "--nproc", "2", "--", SHARDKIT_TRAIN_PATH};
    if (!backend.empty()) argv.insert(argv.end(), {"--backend", backend});
    argv.insert(argv.end(), args.begin(), args.end());
    const auto r = testing::run_command(argv, kDeadline);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_THAT(r.out, HasSubstr(backend.empty() ? "(processes, shared memory on a host, TCP between hosts)"
                                                 : "(processes, shared memory)"));
    EXPECT_NEAR(std::stod(Field(r.out, "final loss: ")), want, 1e-5 * want);
  }
}

TEST(ShardrunNodes, NodeOneRunsGlobalRanksTwoAndThree) {
  const std::vector<std::string> show = {"/bin/sh", "-c",
                                         "echo RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK "
                                         "LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE GROUP_RANK=$GROUP_RANK"};
  const auto r = testing::run_command(node(1, 29999, show), kDeadline, {{"SHARDKIT_STORE_TOKEN", "t"}});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("[rank 2] RANK=2 WORLD_SIZE=4 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 GROUP_RANK=1"));
  EXPECT_THAT(r.out, HasSubstr("[rank 3] RANK=3 WORLD_SIZE=4 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 GROUP_RANK=1"));
}

TEST(ShardrunNodes, WhatTheNodesMustAgreeOnIsRequired) {
  auto no_rank = testing::run_command({SHARDRUN_PATH, "--nnodes", "2", "--nproc", "1", "--master-addr", "127.0.0.1",
                                       "--master-port", "29999", "--", "/bin/true"},
                                      kDeadline, {{"SHARDKIT_STORE_TOKEN", "t"}});
  EXPECT_EQ(no_rank.exit_code, 2);
  EXPECT_THAT(no_rank.err, HasSubstr("expected --node-rank in [0, 2), found none"));
  auto no_port = testing::run_command({SHARDRUN_PATH, "--nnodes", "2", "--node-rank", "1", "--nproc", "1",
                                       "--master-addr", "127.0.0.1", "--", "/bin/true"},
                                      kDeadline, {{"SHARDKIT_STORE_TOKEN", "t"}});
  EXPECT_EQ(no_port.exit_code, 2);
  EXPECT_THAT(no_port.err, HasSubstr("found no --master-port"));
  // No shared token: each node would make up its own, and the store would refuse the other node's ranks.
  auto env_without_token = testing::run_command(
      {"/usr/bin/env", "-u", "SHARDKIT_STORE_TOKEN", SHARDRUN_PATH, "--nnodes", "2", "--node-rank", "0", "--nproc",
       "1", "--master-addr", "127.0.0.1", "--master-port", "29999", "--", "/bin/true"},
      kDeadline);
  EXPECT_EQ(env_without_token.exit_code, 2);
  EXPECT_THAT(env_without_token.err, HasSubstr("expected SHARDKIT_STORE_TOKEN set to the same value on every node"));
  auto bad_rank = testing::run_command({SHARDRUN_PATH, "--nnodes", "2", "--node-rank", "2", "--nproc", "1",
                                        "--master-addr", "127.0.0.1", "--master-port", "29999", "--", "/bin/true"},
                                       kDeadline, {{"SHARDKIT_STORE_TOKEN", "t"}});
  EXPECT_EQ(bad_rank.exit_code, 2);
  EXPECT_THAT(bad_rank.err, HasSubstr("found 2"));
}

}  // namespace
}  // namespace shardkit
