// comm_bench, TCP cases: the TCP process group between 2 processes on this host (this benchmark process is
// rank 0; a forked peer process is rank 1), against the limit measured in the same binary: the
// bidirectional throughput of one raw loopback TCP connection with both ends sending and receiving the same
// number of bytes at once (per-direction bytes/s). Every iteration runs the raw exchange (the bytes each
// rank sends in the call) right before the call, and the ratio is taken over the same iterations, so both
// see the same machine load; the reported time is the call's alone.
//
// Counters (nccl-tests definitions, S = the bytes that define the call):
//   all_reduce(S = tensor bytes)              busbw = S/t · 2(n−1)/n
//   all_gather(S = output bytes)              busbw = S/t · (n−1)/n
//   reduce_scatter(S = input bytes)           busbw = S/t · (n−1)/n
//   frac_of_limit = busbw / raw per-direction bandwidth with the same bytes per direction as each rank sends.
// At n = 2 busbw equals the bytes each rank sends (and receives) per second, so frac_of_limit = 1 means the
// collective moves data as fast as two raw sockets can.
//
// The peer is forked on first use (before this process creates any thread of its own) and follows commands
// ("op bytes iterations") posted through the TcpStore; it dies with this process (PR_SET_PDEATHSIG).
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
#include <memory>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "benchmark/benchmark.h"
#include "common/comm/tcp_process_group.h"
#include "common/comm/tcp_socket.h"
#include "common/comm/tcp_store.h"

namespace shardkit::comm {
namespace {

constexpr int kWorld = 2;

// Sends and receives `bytes` on `fd` at the same time; returns seconds.
double raw_exchange(int fd, char* out, char* in, std::size_t bytes) {
  const auto t0 = std::chrono::steady_clock::now();
  std::size_t s = 0, r = 0;
  while (s < bytes || r < bytes) {
    bool progress = false;
    if (s < bytes) {
      const ssize_t k = ::send(fd, out + s, bytes - s, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0) {
        s += static_cast<std::size_t>(k);
        progress = true;
      } else if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        std::abort();
      }
    }
    if (r < bytes) {
      const ssize_t k = ::recv(fd, in + r, bytes - r, MSG_DONTWAIT);
      if (k > 0) {
        r += static_cast<std::size_t>(k);
        progress = true;
      } else if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        std::abort();
      }
    }
    if (!progress) {
      pollfd p{fd, static_cast<short>((s < bytes ? POLLOUT : 0) | (r < bytes ? POLLIN : 0)), 0};
      ::poll(&p, 1, 1000);
    }
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double factor_of(const std::string& op) {
  return op == "all_reduce" ? 2.0 * (kWorld - 1) / kWorld : 1.0 * (kWorld - 1) / kWorld;
}

// One collective call on tensors prepared for `bytes`.
struct CollectiveBuffers {
  CollectiveBuffers(std::int64_t bytes)
      : full(Tensor::full({std::max<std::int64_t>(kWorld, bytes / 4)}, 1.0, {})),
        half(Tensor::full({std::max<std::int64_t>(kWorld, bytes / 4) / kWorld}, 1.0, {})) {}
  absl::Status run(ProcessGroup& pg, const std::string& op) {
    if (op == "all_reduce") return pg.all_reduce(full)->wait();
    if (op == "all_gather") return pg.all_gather(full, half)->wait();
    if (op == "all_gather_in_place") {
      const std::int64_t m = half.numel();
      return pg.all_gather(full, full.narrow0(pg.rank() * m, m))->wait();
    }
    return pg.reduce_scatter(half, full)->wait();
  }
  Tensor full, half;
};

// Executes one command on the peer: `iters` times, a raw exchange of the bytes each rank sends in the
// collective, then the collective (rank 0 does the same, timing both; see run_collective).
void run_command(ProcessGroup& pg, int raw_fd, const std::string& op, std::int64_t bytes, std::int64_t iters,
                 std::vector<char>& raw_out, std::vector<char>& raw_in) {
  const std::int64_t per_direction =
      op == "raw" ? bytes : static_cast<std::int64_t>(static_cast<double>(bytes) * factor_of(op));
  raw_out.resize(static_cast<std::size_t>(per_direction));
  raw_in.resize(static_cast<std::size_t>(per_direction));
  if (op == "raw") {
    for (std::int64_t i = 0; i < iters; ++i) raw_exchange(raw_fd, raw_out.data(), raw_in.data(), raw_out.size());
    return;
  }
  CollectiveBuffers buffers(bytes);
  for (std::int64_t i = 0; i < iters; ++i) {
    raw_exchange(raw_fd, raw_out.data(), raw_in.data(), raw_out.size());
    (void)buffers.run(pg, op);
  }
}

TcpProcessGroupOptions group_options() {
  TcpProcessGroupOptions o;
  o.store_prefix = "bench";
  o.default_timeout = absl::Seconds(120);
  o.transport = "tcp";  // on one host "auto" would pick shared memory (comm_bench_shm.cc)
  return o;
}

[[noreturn]] void peer_main(int port_pipe) {
  std::uint16_t port = 0;
  if (::read(port_pipe, &port, sizeof(port)) != sizeof(port)) ::_exit(2);
  ::close(port_pipe);
  TcpStoreOptions so;
  so.port = port;
  auto store = TcpStore::create(so);
  if (!store.ok()) ::_exit(3);
  std::shared_ptr<Store> shared(std::move(*store));
  auto raw_port = shared->get("raw_port", absl::Seconds(60));
  int rp = 0;
  if (!raw_port.ok() || !absl::SimpleAtoi(*raw_port, &rp)) ::_exit(4);
  auto raw = tcp::connect_with_retry("127.0.0.1", static_cast<std::uint16_t>(rp), absl::Now() + absl::Seconds(60), "raw");
  if (!raw.ok()) ::_exit(5);
  auto pg = TcpProcessGroup::create(shared, 1, kWorld, group_options());
  if (!pg.ok()) ::_exit(6);
  std::vector<char> raw_out, raw_in;
  for (std::int64_t k = 0;; ++k) {
    auto cmd = shared->get(absl::StrCat("cmd/", k), absl::Hours(24));
    if (!cmd.ok()) ::_exit(7);
    std::vector<std::string> parts = absl::StrSplit(*cmd, ' ');
    if (parts[0] == "quit") ::_exit(0);
    std::int64_t bytes = 0, iters = 0;
    if (parts.size() != 3 || !absl::SimpleAtoi(parts[1], &bytes) || !absl::SimpleAtoi(parts[2], &iters)) ::_exit(8);
    if (!(*pg)->barrier()->wait().ok()) ::_exit(9);
    run_command(**pg, raw->fd(), parts[0], bytes, iters, raw_out, raw_in);
  }
}

// Rank 0's side: the peer process, the store, the group and the raw connection.
class TcpBench {
 public:
  static TcpBench& get() {
    static TcpBench* bench = new TcpBench();  // leaked on purpose: the peer is told to quit at exit
    return *bench;
  }

  // Runs `op` on both ranks for `iters` iterations; returns after rank 0's part (the peer's ends with it).
  void start(const std::string& op, std::int64_t bytes, std::int64_t iters) {
    if (!store_->set(absl::StrCat("cmd/", next_cmd_++), absl::StrCat(op, " ", bytes, " ", iters)).ok()) std::abort();
    if (!pg_->barrier()->wait().ok()) std::abort();
  }
  ProcessGroup& pg() { return *pg_; }
  int raw_fd() const { return raw_.fd(); }
  std::vector<char>& raw_out() { return raw_out_; }
  std::vector<char>& raw_in() { return raw_in_; }

 private:
  TcpBench() {
    int fds[2];
    if (::pipe(fds) != 0) std::abort();
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);
      ::close(fds[1]);
      peer_main(fds[0]);
    }
    ::close(fds[0]);
    peer_ = pid;
    TcpStoreOptions so;
    so.is_server = true;
    auto store = TcpStore::create(so);
    if (!store.ok()) std::abort();
    store_ = std::shared_ptr<Store>(std::move(*store));
    const std::uint16_t port = static_cast<TcpStore&>(*store_).port();
    if (::write(fds[1], &port, sizeof(port)) != sizeof(port)) std::abort();
    ::close(fds[1]);
    auto listener = tcp::listen_on("127.0.0.1", 0);
    if (!listener.ok()) std::abort();
    if (!store_->set("raw_port", std::to_string(*tcp::local_port(*listener))).ok()) std::abort();
    auto raw = tcp::accept_one(*listener, absl::Now() + absl::Seconds(60));
    if (!raw.ok()) std::abort();
    raw_ = std::move(*raw);
    auto pg = TcpProcessGroup::create(store_, 0, kWorld, group_options());
    if (!pg.ok()) {
      std::fprintf(stderr, "comm_bench: TCP group: %s\n", pg.status().ToString().c_str());
      std::abort();
    }
    pg_ = *pg;
    std::atexit([] {
      TcpBench& b = get();
      (void)b.store_->set(absl::StrCat("cmd/", b.next_cmd_++), "quit");
      ::waitpid(b.peer_, nullptr, 0);
    });
  }

  pid_t peer_ = -1;
  std::shared_ptr<Store> store_;
  std::shared_ptr<ProcessGroup> pg_;
  tcp::Socket raw_;
  std::int64_t next_cmd_ = 0;
  std::vector<char> raw_out_, raw_in_;
};

// Each iteration times a raw exchange of the bytes each rank sends in the call (the limit) and then the
// call itself, so the two see the same machine load (other processes share these 2 cores); the reported
// time is the collective's alone (manual time).
void run_collective(benchmark::State& state, const std::string& op) {
  const std::int64_t bytes = state.range(0);
  TcpBench& b = TcpBench::get();
  const double factor = factor_of(op);
  const std::int64_t per_direction = static_cast<std::int64_t>(static_cast<double>(bytes) * factor);
  b.raw_out().resize(static_cast<std::size_t>(per_direction));
  b.raw_in().resize(static_cast<std::size_t>(per_direction));
  CollectiveBuffers buffers(bytes);
  b.start(op, bytes, static_cast<std::int64_t>(state.max_iterations));
  double raw_seconds = 0, coll_seconds = 0;
  for (auto _ : state) {
    raw_seconds += raw_exchange(b.raw_fd(), b.raw_out().data(), b.raw_in().data(), b.raw_out().size());
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
  state.counters["n"] = kWorld;
}

void BM_TcpAllReduce(benchmark::State& state) { run_collective(state, "all_reduce"); }
void BM_TcpAllGather(benchmark::State& state) { run_collective(state, "all_gather"); }
void BM_TcpReduceScatter(benchmark::State& state) { run_collective(state, "reduce_scatter"); }
// all_gather whose input is this rank's slice of the output (no local copy), as FSDP uses it.
void BM_TcpAllGatherInPlace(benchmark::State& state) { run_collective(state, "all_gather_in_place"); }

// The limit itself, as its own row.
void BM_TcpRawLoopbackBidirectional(benchmark::State& state) {
  const std::int64_t bytes = state.range(0);
  TcpBench& b = TcpBench::get();
  b.start("raw", bytes, static_cast<std::int64_t>(state.max_iterations));
  b.raw_out().resize(static_cast<std::size_t>(bytes));
  b.raw_in().resize(static_cast<std::size_t>(bytes));
  for (auto _ : state) raw_exchange(b.raw_fd(), b.raw_out().data(), b.raw_in().data(), static_cast<std::size_t>(bytes));
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["per_direction_GBps"] =
      benchmark::Counter(static_cast<double>(bytes) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

#define SK_TCP_SIZES RangeMultiplier(4)->Range(4 << 10, 256 << 20)->Unit(benchmark::kMillisecond)
BENCHMARK(BM_TcpRawLoopbackBidirectional)->SK_TCP_SIZES->UseRealTime();
BENCHMARK(BM_TcpAllReduce)->SK_TCP_SIZES->UseManualTime();
BENCHMARK(BM_TcpAllGather)->SK_TCP_SIZES->UseManualTime();
BENCHMARK(BM_TcpAllGatherInPlace)->SK_TCP_SIZES->UseManualTime();
BENCHMARK(BM_TcpReduceScatter)->SK_TCP_SIZES->UseManualTime();
#undef SK_TCP_SIZES

}  // namespace
}  // namespace shardkit::comm
