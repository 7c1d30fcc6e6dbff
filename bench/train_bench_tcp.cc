// train_bench_tcp: train_bench's cases (train_bench.cc: every strategy at N = 2 and 4 on GPT "gpt-10m",
// interleaved with the DDP step, the same counters) with the ranks as processes over the process group, once
// over TCP (names ending "/tcp") and once over shared memory (SHARDKIT_TRANSPORT's "shm", names ending "/shm").
//
//   build/bench/train_bench_tcp [--benchmark_filter=fsdp]
//   build/bench/train_bench_tcp --benchmark_filter='sddp_flat/gpt-10m/n2/'   # against train_bench's threads
//
// This process is rank 0 of every case and reports; each rank runs the same per-rank code as train_bench
// (train_step.h: RunTrainRank), so the two measure the same step and differ only in the backend and in ranks
// being processes instead of threads. Per case, rank 0 hosts a TcpStore on 127.0.0.1 (ephemeral port),
// starts ranks 1..N-1 as processes of this executable (`train_bench_tcp --train-bench-peer STRATEGY PID`)
// with the torchrun environment tools/shardrun gives its ranks (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), which join through comm::init_from_env, and creates its own
// TcpProcessGroup on that store. Peers write to this process's stderr (never stdout, which carries the
// benchmark's output). Fewer iterations than in process (kIterations): the ranks of N = 4 share 2 cores.
//
// Note [train_bench_tcp failures]: a case never hangs. Every collective has a deadline (kCallTimeout) and the
// mesh a connect deadline; a peer that dies closes its sockets, which fails rank 0's next collective at once
// naming it (tcp_process_group.h). When rank 0's part fails it aborts its group (so the peers' collectives
// fail too), waits at most kPeerGrace for the peers to exit, SIGKILLs the rest, and reports the case as an
// error (SkipWithError) with its own status and every peer's exit; the next case starts afresh. Peers also die
// with this process (PR_SET_PDEATHSIG, set by the peer itself and checked against the PID it was given).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/train_step.h"
#include "benchmark/benchmark.h"
#include "common/comm/init_from_env.h"
#include "common/comm/tcp_process_group.h"
#include "common/comm/tcp_store.h"

extern char** environ;

namespace shardkit {
namespace {

using bench::TrainStrategy;

constexpr char kPeerFlag[] = "--train-bench-peer";
constexpr int kIterations = 3;
// Deadlines (Note [train_bench_tcp failures]): one collective (a barrier waits for the slowest rank's whole
// step, about 1 s at N = 4 here), connecting the store and the mesh, and the peers' exit after the case.
constexpr absl::Duration kCallTimeout = absl::Seconds(60);
constexpr absl::Duration kConnectTimeout = absl::Seconds(60);
constexpr absl::Duration kPeerGrace = absl::Seconds(30);

// Rank 0's group and the peers' (through init_from_env) agree on these; `transport` is "tcp" or "shm".
comm::TcpProcessGroupOptions GroupOptions(const std::string& transport) {
  comm::TcpProcessGroupOptions o;
  o.transport = transport;
  o.listen_host = "127.0.0.1";
  o.store_prefix = "train_bench";
  o.default_timeout = kCallTimeout;
  o.connect_timeout = kConnectTimeout;
  return o;
}

// Ranks 1..N-1 of one case, as child processes. Finish() (or the destructor) ends and reaps them.
class PeerProcesses {
 public:
  PeerProcesses() = default;
  PeerProcesses(const PeerProcesses&) = delete;
  PeerProcesses& operator=(const PeerProcesses&) = delete;
  ~PeerProcesses() { (void)Finish(absl::ZeroDuration()); }

  // Starts ranks 1..world-1 of `strategy_label` against the store at 127.0.0.1:port. On error the peers
  // started so far stay in *this (Finish ends them).
  absl::Status Start(int world, std::uint16_t port, std::string_view strategy_label, const std::string& transport) {
    char exe[4096];
    const ssize_t len = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (len <= 0) {
      return absl::InternalError(absl::StrCat("train_bench_tcp: readlink /proc/self/exe: ", std::strerror(errno)));
    }
    exe[len] = '\0';
    const std::string parent = std::to_string(::getpid());
    // The environment without the launcher's variables, which each peer gets its own of.
    std::vector<std::string> base_env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string_view kv = *e;
      bool launcher = false;
      for (const char* name :
           {"RANK=", "WORLD_SIZE=", "LOCAL_RANK=", "LOCAL_WORLD_SIZE=", "MASTER_ADDR=", "MASTER_PORT="}) {
        launcher = launcher || kv.starts_with(name);
      }
      if (!launcher) base_env.emplace_back(kv);
    }
    for (int rank = 1; rank < world; ++rank) {
      std::vector<std::string> args = {exe, kPeerFlag, std::string(strategy_label), parent, transport};
      std::vector<std::string> env = base_env;
      env.push_back(absl::StrCat("RANK=", rank));
      env.push_back(absl::StrCat("LOCAL_RANK=", rank));
      env.push_back(absl::StrCat("WORLD_SIZE=", world));
      env.push_back(absl::StrCat("LOCAL_WORLD_SIZE=", world));
      env.push_back("MASTER_ADDR=127.0.0.1");
      env.push_back(absl::StrCat("MASTER_PORT=", port));
      if (absl::Status s = Spawn(rank, args, env); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // Waits until every peer has exited, for at most `grace`; SIGKILLs and reaps those still running then.
  // OK when every peer exited with code 0; otherwise an error listing each other peer's end.
  absl::Status Finish(absl::Duration grace) {
    const absl::Time deadline = absl::Now() + grace;
    for (;;) {
      std::vector<pollfd> fds;
      for (const Peer& p : peers_) {
        if (!p.reaped) fds.push_back(pollfd{p.pidfd, POLLIN, 0});
      }
      if (fds.empty()) break;
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) break;
      const int ms = static_cast<int>(std::min<std::int64_t>(absl::ToInt64Milliseconds(left) + 1, 60'000));
      if (::poll(fds.data(), fds.size(), ms) < 0 && errno != EINTR) break;
      for (Peer& p : peers_) {
        if (!p.reaped) Reap(p, WNOHANG);
      }
    }
    std::string failures;
    for (Peer& p : peers_) {
      if (!p.reaped) {
        ::kill(p.pid, SIGKILL);
        Reap(p, 0);
        p.end = absl::StrCat("still running after ", absl::FormatDuration(grace), ", killed");
      }
      if (p.end != "exit 0") absl::StrAppend(&failures, failures.empty() ? "" : "; ", "rank ", p.rank, ": ", p.end);
      ::close(p.pidfd);
    }
    peers_.clear();
    if (failures.empty()) return absl::OkStatus();
    return absl::InternalError(absl::StrCat("train_bench_tcp: expected every peer rank to exit 0, found ", failures));
  }

 private:
  struct Peer {
    int rank = 0;
    pid_t pid = -1;
    int pidfd = -1;
    bool reaped = false;
    std::string end;  // "exit N" or "signal N" once reaped
  };

  absl::Status Spawn(int rank, std::vector<std::string>& args, std::vector<std::string>& env) {
    std::vector<char*> argv, envp;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, 2, 1);  // stdout carries the benchmark's output
    pid_t pid = -1;
    const int rc = ::posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) {
      return absl::InternalError(absl::StrCat("train_bench_tcp: posix_spawn of rank ", rank, " (", argv[0],
                                              "): ", std::strerror(rc)));
    }
    const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
    if (pidfd < 0) {
      const int err = errno;
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      return absl::InternalError(absl::StrCat("train_bench_tcp: pidfd_open of rank ", rank, ": ", std::strerror(err)));
    }
    peers_.push_back(Peer{.rank = rank, .pid = pid, .pidfd = pidfd, .reaped = false, .end = ""});
    return absl::OkStatus();
  }

  static void Reap(Peer& p, int flags) {
    int status = 0;
    const pid_t r = ::waitpid(p.pid, &status, flags);
    if (r != p.pid) return;
    p.reaped = true;
    p.end = WIFEXITED(status) ? absl::StrCat("exit ", WEXITSTATUS(status)) : absl::StrCat("signal ", WTERMSIG(status));
  }

  std::vector<Peer> peers_;
};

// Rank 0 of one case (Note [train_bench_tcp failures]).
void BM_TrainStepTcp(benchmark::State& state, int world, TrainStrategy strategy, const char* label,
                     const std::string& transport) {
  auto fail = [&](const absl::Status& s) { state.SkipWithError(s.ToString().c_str()); };
  comm::TcpStoreOptions so;
  so.is_server = true;
  so.connect_timeout = kConnectTimeout;
  auto store = comm::TcpStore::create(so);
  if (!store.ok()) return fail(store.status());
  const std::uint16_t port = (*store)->port();
  std::shared_ptr<comm::Store> shared_store(std::move(*store));
  PeerProcesses peers;
  if (absl::Status s = peers.Start(world, port, label, transport); !s.ok()) return fail(s);
  auto group = comm::TcpProcessGroup::create(shared_store, 0, world, GroupOptions(transport));
  if (!group.ok()) {
    const absl::Status ends = peers.Finish(absl::ZeroDuration());
    return fail(absl::Status(group.status().code(), absl::StrCat(group.status().message(), " [", ends.message(), "]")));
  }
  std::shared_ptr<comm::ProcessGroup> pg = *group;
  bench::TrainCaseResult result;
  const absl::Status st = bench::RunTrainRank(pg, strategy, &state, result);
  if (!st.ok()) pg->abort(st);
  const absl::Status ends = peers.Finish(kPeerGrace);
  if (!st.ok()) return fail(absl::Status(st.code(), absl::StrCat(st.message(), " [", ends.message(), "]")));
  if (!ends.ok()) return fail(ends);
  bench::ReportTrainCounters(state, strategy, world, result);
  state.counters["n"] = world;
}

int PeerMain(int argc, char** argv) {
  // Die with rank 0; it may have died before the line above took effect, leaving this process re-parented.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  int parent = 0;
  if (argc != 5 || !absl::SimpleAtoi(argv[3], &parent) || ::getppid() != parent) {
    std::fprintf(stderr, "train_bench_tcp: expected `%s STRATEGY PARENT_PID TRANSPORT` from a running parent\n",
                 kPeerFlag);
    return 2;
  }
  auto strategy = bench::TrainStrategyNamed(argv[2]);
  comm::InitFromEnvOptions options;
  options.group = GroupOptions(argv[4]);
  options.store_connect_timeout = kConnectTimeout;
  absl::Status st = strategy.status();
  if (st.ok()) {
    absl::StatusOr<std::shared_ptr<comm::ProcessGroup>> group = comm::init_from_env(options);
    st = group.status();
    bench::TrainCaseResult unused;
    if (st.ok()) st = bench::RunTrainRank(*group, *strategy, nullptr, unused);
  }
  if (!st.ok()) {
    std::fprintf(stderr, "train_bench_tcp rank %s: %s\n", std::getenv("RANK") ? std::getenv("RANK") : "?",
                 st.ToString().c_str());
    return 1;
  }
  return 0;
}

void RegisterAll() {
  for (const std::string transport : {"tcp", "shm"}) {
    for (int world : {2, 4}) {
      for (const auto& [strategy, label] : bench::TrainStrategies()) {
        const std::string name = absl::StrCat(label, "/gpt-10m/n", world, "/", transport);
        benchmark::RegisterBenchmark(name.c_str(), BM_TrainStepTcp, world, strategy, label, transport)
            ->UseManualTime()
            ->Iterations(kIterations)
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
}

}  // namespace
}  // namespace shardkit

int main(int argc, char** argv) {
  if (argc > 1 && std::string_view(argv[1]) == shardkit::kPeerFlag) return shardkit::PeerMain(argc, argv);
  shardkit::RegisterAll();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
