// comm_bench, TCP cases: the TCP process group between n = 2 and 4 processes on this host (this benchmark
// process is rank 0; forked peer processes are the others), against the limit measured in the same binary: raw
// loopback TCP in the collective's ring, every rank sending the bytes it sends in the call to its ring successor
// while receiving as many from its predecessor, all at once (per-direction bytes/s). At n = 2 that is one
// connection with both ends sending and receiving, as the group's pair of ranks uses it; at n = 4 a ring of
// four connections. Every iteration runs the raw exchange right before the call, and the ratio is taken over
// the same iterations, so both see the same machine load; the reported time is the call's alone.
//
// Counters (nccl-tests definitions, S = the bytes that define the call):
//   all_reduce(S = tensor bytes)              busbw = S/t · 2(n−1)/n
//   all_gather(S = output bytes)              busbw = S/t · (n−1)/n
//   reduce_scatter(S = input bytes)           busbw = S/t · (n−1)/n
//   frac_of_limit = busbw / raw per-direction bandwidth with the same bytes per direction as each rank sends.
// busbw is the bytes each rank sends (and receives) per second, so frac_of_limit = 1 means the collective moves
// data as fast as the raw sockets of its ring can.
//
// Rows are named <benchmark>/<bytes>/<n>. The peers of a world size are forked on its first use and follow
// commands ("op bytes iterations") posted through a TcpStore of their own; they die with this process
// (PR_SET_PDEATHSIG). The first world is forked before this process creates any thread of its own unless other
// cases (shared memory, in-process) ran first in the same invocation; the children only use the TcpStore and the
// group after the fork.
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "benchmark/benchmark.h"
#include "common/comm/tcp_process_group.h"
#include "common/comm/tcp_socket.h"
#include "common/comm/tcp_store.h"

namespace shardkit::comm {
namespace {

// Sends `bytes` on `send_fd` while receiving `bytes` on `recv_fd` (the same fd at n = 2); returns seconds.
double raw_exchange(int send_fd, int recv_fd, char* out, char* in, std::size_t bytes) {
  const auto t0 = std::chrono::steady_clock::now();
  std::size_t s = 0, r = 0;
  while (s < bytes || r < bytes) {
    bool progress = false;
    if (s < bytes) {
      const ssize_t k = ::send(send_fd, out + s, bytes - s, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0) {
        s += static_cast<std::size_t>(k);
        progress = true;
      } else if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        std::abort();
      }
    }
    if (r < bytes) {
      const ssize_t k = ::recv(recv_fd, in + r, bytes - r, MSG_DONTWAIT);
      if (k > 0) {
        r += static_cast<std::size_t>(k);
        progress = true;
      } else if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        std::abort();
      }
    }
    if (!progress) {
      pollfd p[2];
      nfds_t np = 0;
      if (send_fd == recv_fd) {
        p[np++] = {send_fd, static_cast<short>((s < bytes ? POLLOUT : 0) | (r < bytes ? POLLIN : 0)), 0};
      } else {
        if (s < bytes) p[np++] = {send_fd, POLLOUT, 0};
        if (r < bytes) p[np++] = {recv_fd, POLLIN, 0};
      }
      ::poll(p, np, 1000);
    }
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The raw sockets of one rank's ring: to its successor and from its predecessor (one connection at n = 2).
struct RawRing {
  tcp::Socket next, prev;
  int send_fd() const { return next.fd(); }
  int recv_fd() const { return prev.fd() >= 0 ? prev.fd() : next.fd(); }
};

RawRing connect_raw_ring(Store& store, int rank, int n) {
  RawRing ring;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  auto listener = tcp::listen_on("127.0.0.1", 0);
  if (!listener.ok()) std::abort();
  if (!store.set(absl::StrCat("raw_port/", rank), std::to_string(*tcp::local_port(*listener))).ok()) std::abort();
  // At n = 2 rank 1 connects to rank 0 and both use that one connection both ways; otherwise every rank connects
  // to its successor and accepts its predecessor.
  if (n > 2 || rank == 1) {
    auto port = store.get(absl::StrCat("raw_port/", (rank + 1) % n), absl::Seconds(60));
    int p = 0;
    if (!port.ok() || !absl::SimpleAtoi(*port, &p)) std::abort();
    auto s = tcp::connect_with_retry("127.0.0.1", static_cast<std::uint16_t>(p), deadline, "raw");
    if (!s.ok()) std::abort();
    ring.next = std::move(*s);
  }
  if (n > 2 || rank == 0) {
    auto s = tcp::accept_one(*listener, deadline);
    if (!s.ok()) std::abort();
    (n > 2 ? ring.prev : ring.next) = std::move(*s);
  }
  return ring;
}

double factor_of(const std::string& op, int n) {
  return op == "all_reduce" ? 2.0 * (n - 1) / n : 1.0 * (n - 1) / n;
}

// One collective call on tensors prepared for `bytes` (a multiple of n floats).
struct CollectiveBuffers {
  CollectiveBuffers(std::int64_t bytes, int n)
      : full(Tensor::full({std::max<std::int64_t>(n, bytes / 4) / n * n}, 1.0, {})),
        part(Tensor::full({std::max<std::int64_t>(n, bytes / 4) / n}, 1.0, {})) {}
  absl::Status run(ProcessGroup& pg, const std::string& op) {
    if (op == "all_reduce") return pg.all_reduce(full)->wait();
    if (op == "all_gather") return pg.all_gather(full, part)->wait();
    if (op == "all_gather_in_place") {
      const std::int64_t m = part.numel();
      return pg.all_gather(full, full.narrow0(pg.rank() * m, m))->wait();
    }
    return pg.reduce_scatter(part, full)->wait();
  }
  Tensor full, part;
};

// Executes one command on a peer: `iters` times, a raw exchange of the bytes each rank sends in the
// collective, then the collective (rank 0 does the same, timing both; see run_collective).
void run_command(ProcessGroup& pg, const RawRing& raw, const std::string& op, std::int64_t bytes, std::int64_t iters,
                 std::vector<char>& raw_out, std::vector<char>& raw_in) {
  const int n = pg.size();
  const std::int64_t per_direction =
      op == "raw" ? bytes : static_cast<std::int64_t>(static_cast<double>(bytes) * factor_of(op, n));
  // Buffers first, then the barrier: rank 0 has made its own before posting the command, and the first timed
  // raw exchange must not include the peers' allocation.
  raw_out.resize(static_cast<std::size_t>(per_direction));
  raw_in.resize(static_cast<std::size_t>(per_direction));
  std::optional<CollectiveBuffers> buffers;
  if (op != "raw") buffers.emplace(bytes, n);
  if (!pg.barrier()->wait().ok()) ::_exit(9);
  if (op == "raw") {
    for (std::int64_t i = 0; i < iters; ++i) {
      raw_exchange(raw.send_fd(), raw.recv_fd(), raw_out.data(), raw_in.data(), raw_out.size());
    }
    return;
  }
  for (std::int64_t i = 0; i < iters; ++i) {
    raw_exchange(raw.send_fd(), raw.recv_fd(), raw_out.data(), raw_in.data(), raw_out.size());
    (void)buffers->run(pg, op);
  }
}

TcpProcessGroupOptions group_options() {
  TcpProcessGroupOptions o;
  o.store_prefix = "bench";
  o.default_timeout = absl::Seconds(120);
  o.transport = "tcp";  // on one host "auto" would pick shared memory (comm_bench_shm.cc)
  return o;
}

[[noreturn]] void peer_main(int port_pipe, int rank, int n) {
  std::uint16_t port = 0;
  if (::read(port_pipe, &port, sizeof(port)) != sizeof(port)) ::_exit(2);
  ::close(port_pipe);
  TcpStoreOptions so;
  so.port = port;
  auto store = TcpStore::create(so);
  if (!store.ok()) ::_exit(3);
  std::shared_ptr<Store> shared(std::move(*store));
  RawRing raw = connect_raw_ring(*shared, rank, n);
  auto pg = TcpProcessGroup::create(shared, rank, n, group_options());
  if (!pg.ok()) ::_exit(6);
  std::vector<char> raw_out, raw_in;
  for (std::int64_t k = 0;; ++k) {
    auto cmd = shared->get(absl::StrCat("cmd/", k), absl::Hours(24));
    if (!cmd.ok()) ::_exit(7);
    std::vector<std::string> parts = absl::StrSplit(*cmd, ' ');
    if (parts[0] == "quit") ::_exit(0);
    std::int64_t bytes = 0, iters = 0;
    if (parts.size() != 3 || !absl::SimpleAtoi(parts[1], &bytes) || !absl::SimpleAtoi(parts[2], &iters)) ::_exit(8);
    run_command(**pg, raw, parts[0], bytes, iters, raw_out, raw_in);
  }
}

// Rank 0's side for one world size: the peer processes, the store, the group and the raw ring.
class TcpBench {
 public:
  static TcpBench& get(int n) {
    auto it = benches().find(n);
    if (it == benches().end()) {
      if (benches().empty()) {
        std::atexit([] {
          for (auto& [world, b] : benches()) b->quit();
        });
      }
      it = benches().emplace(n, new TcpBench(n)).first;
    }
    return *it->second;
  }

  // Runs `op` on every rank for `iters` iterations; returns after rank 0's part (the peers' end with it).
  void start(const std::string& op, std::int64_t bytes, std::int64_t iters) {
    if (!store_->set(absl::StrCat("cmd/", next_cmd_++), absl::StrCat(op, " ", bytes, " ", iters)).ok()) std::abort();
    if (!pg_->barrier()->wait().ok()) std::abort();
  }
  ProcessGroup& pg() { return *pg_; }
  const RawRing& raw() const { return raw_; }
  std::vector<char>& raw_out() { return raw_out_; }
  std::vector<char>& raw_in() { return raw_in_; }

 private:
  static std::map<int, TcpBench*>& benches() {
    static auto* m = new std::map<int, TcpBench*>();  // leaked on purpose: the peers are told to quit at exit
    return *m;
  }

  explicit TcpBench(int n) {
    std::vector<int> pipes;
    const pid_t parent = ::getpid();
    for (int r = 1; r < n; ++r) {
      int fds[2];
      if (::pipe(fds) != 0) std::abort();
      const pid_t pid = ::fork();
      if (pid == 0) {
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (::getppid() != parent) ::_exit(1);
        ::close(fds[1]);
        peer_main(fds[0], r, n);
      }
      ::close(fds[0]);
      pipes.push_back(fds[1]);
      peers_.push_back(pid);
    }
    TcpStoreOptions so;
    so.is_server = true;
    auto store = TcpStore::create(so);
    if (!store.ok()) std::abort();
    store_ = std::shared_ptr<Store>(std::move(*store));
    const std::uint16_t port = static_cast<TcpStore&>(*store_).port();
    for (int fd : pipes) {
      if (::write(fd, &port, sizeof(port)) != sizeof(port)) std::abort();
      ::close(fd);
    }
    raw_ = connect_raw_ring(*store_, 0, n);
    auto pg = TcpProcessGroup::create(store_, 0, n, group_options());
    if (!pg.ok()) {
      std::fprintf(stderr, "comm_bench: TCP group: %s\n", pg.status().ToString().c_str());
      std::abort();
    }
    pg_ = *pg;
  }

  void quit() {
    (void)store_->set(absl::StrCat("cmd/", next_cmd_++), "quit");
    for (pid_t p : peers_) ::waitpid(p, nullptr, 0);
  }

  std::vector<pid_t> peers_;
  std::shared_ptr<Store> store_;
  std::shared_ptr<ProcessGroup> pg_;
  RawRing raw_;
  std::int64_t next_cmd_ = 0;
  std::vector<char> raw_out_, raw_in_;
};

// Each iteration times a raw exchange of the bytes each rank sends in the call (the limit) and then the
// call itself, so the two see the same machine load (other processes share these 2 cores); the reported
// time is the collective's alone (manual time).
void run_collective(benchmark::State& state, const std::string& op) {
  const std::int64_t bytes = state.range(0);
  const int n = static_cast<int>(state.range(1));
  TcpBench& b = TcpBench::get(n);
  const double factor = factor_of(op, n);
  const std::int64_t per_direction = static_cast<std::int64_t>(static_cast<double>(bytes) * factor);
  b.raw_out().resize(static_cast<std::size_t>(per_direction));
  b.raw_in().resize(static_cast<std::size_t>(per_direction));
  CollectiveBuffers buffers(bytes, n);
  b.start(op, bytes, static_cast<std::int64_t>(state.max_iterations));
  double raw_seconds = 0, coll_seconds = 0;
  for (auto _ : state) {
    raw_seconds += raw_exchange(b.raw().send_fd(), b.raw().recv_fd(), b.raw_out().data(), b.raw_in().data(),
                                b.raw_out().size());
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status st = buffers.run(b.pg(), op);
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    coll_seconds += t;
    state.SetIterationTime(t);
    if (!st.ok()) {
      state.SkipWithError(st.ToString().c_str());
      break;
    }
  }
  const double iters = static_cast<double>(state.iterations());
  const double busbw = static_cast<double>(bytes) * factor * iters / coll_seconds;
  const double limit = static_cast<double>(per_direction) * iters / raw_seconds;
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["busbw_GBps"] = busbw * 1e-9;
  state.counters["limit_GBps"] = limit * 1e-9;
  state.counters["frac_of_limit"] = busbw / limit;
  state.counters["n"] = n;
}

void BM_TcpAllReduce(benchmark::State& state) { run_collective(state, "all_reduce"); }
void BM_TcpAllGather(benchmark::State& state) { run_collective(state, "all_gather"); }
void BM_TcpReduceScatter(benchmark::State& state) { run_collective(state, "reduce_scatter"); }
// all_gather whose input is this rank's slice of the output (no local copy), as FSDP uses it.
void BM_TcpAllGatherInPlace(benchmark::State& state) { run_collective(state, "all_gather_in_place"); }

// The limit itself, as its own row.
void BM_TcpRawLoopbackBidirectional(benchmark::State& state) {
  const std::int64_t bytes = state.range(0);
  TcpBench& b = TcpBench::get(static_cast<int>(state.range(1)));
  b.start("raw", bytes, static_cast<std::int64_t>(state.max_iterations));
  b.raw_out().resize(static_cast<std::size_t>(bytes));
  b.raw_in().resize(static_cast<std::size_t>(bytes));
  for (auto _ : state) {
    raw_exchange(b.raw().send_fd(), b.raw().recv_fd(), b.raw_out().data(), b.raw_in().data(),
                 static_cast<std::size_t>(bytes));
  }
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["per_direction_GBps"] =
      benchmark::Counter(static_cast<double>(bytes) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// Rows <bytes>/<n> (unnamed arguments: the filters in README.md, e.g. 'Tcp.*/67108864/', keep matching).
void tcp_sizes(benchmark::internal::Benchmark* b) {
  for (int n : {2, 4}) {
    for (std::int64_t bytes = 4 << 10; bytes <= (256 << 20); bytes *= 4) b->Args({bytes, n});
  }
  b->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_TcpRawLoopbackBidirectional)->Apply(tcp_sizes)->UseRealTime();
BENCHMARK(BM_TcpAllReduce)->Apply(tcp_sizes)->UseManualTime();
BENCHMARK(BM_TcpAllGather)->Apply(tcp_sizes)->UseManualTime();
BENCHMARK(BM_TcpAllGatherInPlace)->Apply(tcp_sizes)->UseManualTime();
BENCHMARK(BM_TcpReduceScatter)->Apply(tcp_sizes)->UseManualTime();

}  // namespace
}  // namespace shardkit::comm
