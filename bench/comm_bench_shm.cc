// comm_bench, shared-memory cases: the process group with SHARDKIT_TRANSPORT's "shm" (shm_transport.h) between
// n = 2 and 4 processes on this host (this benchmark process is rank 0; forked peer processes are the others),
// against the limit measured in the same binary: memcpy between the processes through shared memory (RawCopy:
// each rank copies the bytes it sends in the call into a shared buffer, and its ring successor copies them out,
// every rank at once; at n = 2 both directions between the two processes). Every iteration runs that raw
// exchange right before the call, and the ratio is taken over the same iterations, so both see the same
// machine load; the reported time is the call's alone. The TCP cases (comm_bench_tcp.cc) are the same with
// sockets: run both in one invocation to compare them under the same load.
//
// Counters (nccl-tests definitions, S = the bytes that define the call):
//   all_reduce(S = tensor bytes)              busbw = S/t · 2(n−1)/n
//   all_gather(S = output bytes)              busbw = S/t · (n−1)/n
//   reduce_scatter(S = input bytes)           busbw = S/t · (n−1)/n
//   frac_of_limit = busbw / the raw exchange's per-direction bandwidth with the same bytes per direction.
//
// A ring all_reduce over shared memory copies each byte into a ring once and reduces it straight out of the
// ring (no copy out: Note [chunk pipeline] in stream_runner.cc); the raw exchange copies in and out. So
// frac_of_limit near 1 means the collective moves its bytes about as fast as the processes can copy them
// through shared memory at all. It can pass 1: the rings (1 MiB) stay in cache between the copy in and the
// reduction, while the raw exchange copies whole blocks (up to 64 MiB) through memory.
//
// SHARDKIT_SHM_SINGLE_COPY=1 measures the single-copy path (Note [shm single copy] in shm_transport.cc: sends of
// 64 KiB and more read by the peer with process_vm_readv instead of through the ring); the peers inherit it.
// COMM_BENCH_SHM_CHUNK_BYTES and COMM_BENCH_SHM_RING_BYTES set the group's chunk and ring sizes.
//
// Peers are forked on first use of each world size and follow commands ("op bytes iterations") posted through
// a TcpStore; they die with this process (PR_SET_PDEATHSIG).
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
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
#include "common/comm/tcp_store.h"

namespace shardkit::comm {
namespace {

// The transport's ring size: its default, or COMM_BENCH_SHM_RING_BYTES (to measure other sizes).
std::size_t ring_bytes() {
  std::size_t v = TcpProcessGroupOptions{}.shm_ring_bytes;
  if (const char* e = std::getenv("COMM_BENCH_SHM_RING_BYTES")) (void)absl::SimpleAtoi(e, &v);
  return v;
}

double shm_factor(const std::string& op, int n) {
  return op == "all_reduce" ? 2.0 * (n - 1) / n : 1.0 * (n - 1) / n;
}

// The raw limit, RawCopy: each rank memcpys the bytes it would send into a shared buffer of its own (in blocks
// of at most kRawBlock), and its ring successor memcpys them out, every rank at once: two memcpys per byte
// between processes through shared memory, with one hand-over per block (a counter in the buffer's header;
// a 30 us spin, then futex waits, as the transport waits).
constexpr std::size_t kRawBlock = std::size_t{64} << 20;

struct RawHeader {
  std::atomic<std::uint32_t> filled;   // blocks this rank has copied in
  std::atomic<std::uint32_t> drained;  // blocks its successor has copied out
};

long bench_futex(std::atomic<std::uint32_t>* w, int op, std::uint32_t v, const timespec* ts) {
  return ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(w), op, v, ts, nullptr, 0);
}

// Waits until *w >= want.
void wait_at_least(std::atomic<std::uint32_t>& w, std::uint32_t want) {
  const auto spin_end = std::chrono::steady_clock::now() + std::chrono::microseconds(30);
  for (;;) {
    const std::uint32_t v = w.load(std::memory_order_acquire);
    if (v >= want) return;
    if (std::chrono::steady_clock::now() < spin_end) {
      sched_yield();
      continue;
    }
    const timespec ts{1, 0};
    bench_futex(&w, FUTEX_WAIT, v, &ts);
  }
}

void publish(std::atomic<std::uint32_t>& w, std::uint32_t v) {
  w.store(v, std::memory_order_release);
  bench_futex(&w, FUTEX_WAKE, INT_MAX, nullptr);
}

class RawCopy {
 public:
  static RawCopy connect(Store& store, int rank, int n) {
    RawCopy r;
    const std::string name = absl::StrCat("/shardkit.bench.", ::getpid(), ".", rank);
    r.own_ = map(name, true);
    if (!store.set(absl::StrCat("raw/", rank), name).ok()) std::abort();
    auto prev = store.get(absl::StrCat("raw/", (rank + n - 1) % n), absl::Seconds(60));
    if (!prev.ok()) std::abort();
    r.prev_ = map(*prev, false);
    auto arrived = store.add("raw/mapped", 1);
    if (!arrived.ok()) std::abort();
    if (*arrived == n && !store.set("raw/all_mapped", "1").ok()) std::abort();
    if (!store.wait({"raw/all_mapped"}, absl::Seconds(60)).ok()) std::abort();
    ::shm_unlink(name.c_str());
    return r;
  }

  // Copies `bytes` of `out` in for the successor and the predecessor's `bytes` out into `in`; returns seconds.
  double exchange(const char* out, char* in, std::size_t bytes) {
    const auto t0 = std::chrono::steady_clock::now();
    RawHeader* own = header(own_);
    RawHeader* prev = header(prev_);
    for (std::size_t at = 0; at < bytes; at += kRawBlock) {
      const std::size_t k = std::min(kRawBlock, bytes - at);
      wait_at_least(own->drained, blocks_);  // the successor has copied the last block out
      std::memcpy(data(own_), out + at, k);
      publish(own->filled, blocks_ + 1);
      wait_at_least(prev->filled, blocks_ + 1);
      std::memcpy(in + at, data(prev_), k);
      publish(prev->drained, blocks_ + 1);
      ++blocks_;
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

 private:
  static constexpr std::size_t kHeader = 4096;
  static void* map(const std::string& name, bool create) {
    const int fd = ::shm_open(name.c_str(), create ? O_RDWR | O_CREAT | O_EXCL : O_RDWR, 0600);
    if (fd < 0) std::abort();
    if (create && ::posix_fallocate(fd, 0, static_cast<off_t>(kHeader + kRawBlock)) != 0) std::abort();
    void* p = ::mmap(nullptr, kHeader + kRawBlock, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) std::abort();
    if (create) new (p) RawHeader{};
    return p;
  }
  static RawHeader* header(void* base) { return static_cast<RawHeader*>(base); }
  static char* data(void* base) { return static_cast<char*>(base) + kHeader; }

  void* own_ = nullptr;   // this rank's buffer (read by the successor)
  void* prev_ = nullptr;  // the predecessor's
  std::uint32_t blocks_ = 0;
};

struct ShmBuffers {
  ShmBuffers(std::int64_t bytes, int n)
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

TcpProcessGroupOptions shm_group_options() {
  TcpProcessGroupOptions o;
  o.store_prefix = "bench_shm";
  o.default_timeout = absl::Seconds(120);
  o.transport = "shm";
  o.shm_ring_bytes = ring_bytes();
  // The chunk size: its default, or COMM_BENCH_SHM_CHUNK_BYTES (to measure others, e.g. with single copy).
  if (const char* e = std::getenv("COMM_BENCH_SHM_CHUNK_BYTES")) (void)absl::SimpleAtoi(e, &o.chunk_bytes);
  return o;
}

void peer_loop(Store& store, ProcessGroup& pg, RawCopy& raw, int n) {
  std::vector<char> out, in;
  for (std::int64_t k = 0;; ++k) {
    auto cmd = store.get(absl::StrCat("cmd/", k), absl::Hours(24));
    if (!cmd.ok()) ::_exit(7);
    std::vector<std::string> parts = absl::StrSplit(*cmd, ' ');
    if (parts[0] == "quit") ::_exit(0);
    std::int64_t bytes = 0, iters = 0;
    if (parts.size() != 3 || !absl::SimpleAtoi(parts[1], &bytes) || !absl::SimpleAtoi(parts[2], &iters)) ::_exit(8);
    const std::int64_t per_direction =
        parts[0] == "raw" ? bytes : static_cast<std::int64_t>(static_cast<double>(bytes) * shm_factor(parts[0], n));
    // Buffers first, then the barrier: rank 0 has made its own before posting the command, and the first timed
    // raw exchange must not include the peers' allocation.
    out.resize(static_cast<std::size_t>(per_direction));
    in.resize(static_cast<std::size_t>(per_direction));
    std::optional<ShmBuffers> buffers;
    if (parts[0] != "raw") buffers.emplace(bytes, n);
    if (!pg.barrier()->wait().ok()) ::_exit(9);
    if (parts[0] == "raw") {
      for (std::int64_t i = 0; i < iters; ++i) raw.exchange(out.data(), in.data(), out.size());
      continue;
    }
    for (std::int64_t i = 0; i < iters; ++i) {
      raw.exchange(out.data(), in.data(), out.size());
      (void)buffers->run(pg, parts[0]);
    }
  }
}

[[noreturn]] void shm_peer_main(int port_pipe, int rank, int n) {
  std::uint16_t port = 0;
  if (::read(port_pipe, &port, sizeof(port)) != sizeof(port)) ::_exit(2);
  ::close(port_pipe);
  TcpStoreOptions so;
  so.port = port;
  auto store = TcpStore::create(so);
  if (!store.ok()) ::_exit(3);
  std::shared_ptr<Store> shared(std::move(*store));
  RawCopy raw = RawCopy::connect(*shared, rank, n);
  auto pg = TcpProcessGroup::create(shared, rank, n, shm_group_options());
  if (!pg.ok()) ::_exit(6);
  peer_loop(*shared, **pg, raw, n);
  ::_exit(0);
}

// Rank 0's side for one world size: the peer processes, the store, the group and the raw buffers.
class ShmBench {
 public:
  static ShmBench& get(int n) {
    auto it = benches().find(n);
    if (it == benches().end()) {
      if (benches().empty()) {
        std::atexit([] {
          for (auto& [world, b] : benches()) b->quit();
        });
      }
      it = benches().emplace(n, new ShmBench(n)).first;
    }
    return *it->second;
  }

  void start(const std::string& op, std::int64_t bytes, std::int64_t iters) {
    if (!store_->set(absl::StrCat("cmd/", next_cmd_++), absl::StrCat(op, " ", bytes, " ", iters)).ok()) std::abort();
    if (!pg_->barrier()->wait().ok()) std::abort();
  }
  ProcessGroup& pg() { return *pg_; }
  RawCopy& raw() { return raw_; }
  std::vector<char> out, in;

 private:
  static std::map<int, ShmBench*>& benches() {
    static auto* m = new std::map<int, ShmBench*>();  // leaked on purpose: the peers are told to quit at exit
    return *m;
  }

  explicit ShmBench(int n) {
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
        shm_peer_main(fds[0], r, n);
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
    raw_ = RawCopy::connect(*store_, 0, n);
    auto pg = TcpProcessGroup::create(store_, 0, n, shm_group_options());
    if (!pg.ok()) {
      std::fprintf(stderr, "comm_bench: shm group: %s\n", pg.status().ToString().c_str());
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
  RawCopy raw_;
  std::int64_t next_cmd_ = 0;
};

// Each iteration times the raw exchange of the bytes each rank sends in the call (the limit) and then the call
// itself, so the two see the same machine load; the reported time is the collective's alone (manual time).
void run_shm_collective(benchmark::State& state, const std::string& op) {
  const std::int64_t bytes = state.range(0);
  const int n = static_cast<int>(state.range(1));
  ShmBench& b = ShmBench::get(n);
  const double factor = shm_factor(op, n);
  const std::int64_t per_direction = static_cast<std::int64_t>(static_cast<double>(bytes) * factor);
  b.out.resize(static_cast<std::size_t>(per_direction));
  b.in.resize(static_cast<std::size_t>(per_direction));
  ShmBuffers buffers(bytes, n);
  b.start(op, bytes, static_cast<std::int64_t>(state.max_iterations));
  double raw_seconds = 0, coll_seconds = 0;
  for (auto _ : state) {
    raw_seconds += b.raw().exchange(b.out.data(), b.in.data(), b.out.size());
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

void BM_ShmAllReduce(benchmark::State& state) { run_shm_collective(state, "all_reduce"); }
void BM_ShmAllGather(benchmark::State& state) { run_shm_collective(state, "all_gather"); }
void BM_ShmReduceScatter(benchmark::State& state) { run_shm_collective(state, "reduce_scatter"); }
// all_gather whose input is this rank's slice of the output (no local copy), as FSDP uses it.
void BM_ShmAllGatherInPlace(benchmark::State& state) { run_shm_collective(state, "all_gather_in_place"); }

// The limit itself, as its own row.
void BM_ShmRawMemcpyBetweenProcesses(benchmark::State& state) {
  const std::int64_t bytes = state.range(0);
  const int n = static_cast<int>(state.range(1));
  ShmBench& b = ShmBench::get(n);
  b.start("raw", bytes, static_cast<std::int64_t>(state.max_iterations));
  b.out.resize(static_cast<std::size_t>(bytes));
  b.in.resize(static_cast<std::size_t>(bytes));
  for (auto _ : state) b.raw().exchange(b.out.data(), b.in.data(), static_cast<std::size_t>(bytes));
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["per_direction_GBps"] =
      benchmark::Counter(static_cast<double>(bytes) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void shm_sizes(benchmark::internal::Benchmark* b) {
  for (int n : {2, 4}) {
    for (std::int64_t bytes = 4 << 10; bytes <= (256 << 20); bytes *= 4) b->Args({bytes, n});
  }
  b->ArgNames({"bytes", "n"})->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_ShmRawMemcpyBetweenProcesses)->Apply(shm_sizes)->UseRealTime();
BENCHMARK(BM_ShmAllReduce)->Apply(shm_sizes)->UseManualTime();
BENCHMARK(BM_ShmAllGather)->Apply(shm_sizes)->UseManualTime();
BENCHMARK(BM_ShmAllGatherInPlace)->Apply(shm_sizes)->UseManualTime();
BENCHMARK(BM_ShmReduceScatter)->Apply(shm_sizes)->UseManualTime();

}  // namespace
}  // namespace shardkit::comm
