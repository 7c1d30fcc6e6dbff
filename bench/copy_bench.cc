// copy_bench: copy_bytes (common/base/copy_bytes.h) and std::memcpy at every relative offset of source and
// destination within a cache line, against std::memcpy with equal offsets measured in the same iteration (the
// limit). Note [copy alignment] in common/base/copy_bytes.cc says why copy_bytes exists: glibc's `rep movsb` range
// (about 2 KiB to 1 MiB) is several times slower on some CPUs (AMD Zen 4) at some relative offsets.
//
// Each pass copies a 32 MiB source in pieces of `piece` bytes into a 1 MiB destination (a shared-memory ring, a
// collective's chunk scratch: the destination stays in cache, the source streams from memory), the destination
// `offset` bytes past the source's position within a 64-byte line.
// Counters: GBps (median pass), limit_GBps (median memcpy pass at offset 0), frac_of_limit = GBps / limit_GBps.
// copy_bytes should be near 1 at every offset; memcpy shows what it would be without it.
//
// Run: build/bench/copy_bench
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bench/thread_timing.h"
#include "benchmark/benchmark.h"
#include "common/base/copy_bytes.h"

namespace shardkit {
namespace {

constexpr std::size_t kSourceBytes = std::size_t{32} << 20;
constexpr std::size_t kDestinationBytes = std::size_t{1} << 20;

using Clock = std::chrono::steady_clock;

struct Buffers {
  Buffers()
      : src(static_cast<char*>(std::aligned_alloc(4096, kSourceBytes + 4096))),
        dst(static_cast<char*>(std::aligned_alloc(4096, kDestinationBytes + 4096))) {
    std::memset(src, 1, kSourceBytes + 4096);
    std::memset(dst, 2, kDestinationBytes + 4096);
  }
  ~Buffers() {
    std::free(src);
    std::free(dst);
  }
  char* src;
  char* dst;
};

template <typename Copy>
double pass_seconds(const Buffers& b, std::size_t piece, std::size_t offset, Copy copy) {
  const auto t0 = Clock::now();
  for (std::size_t at = 0; at + piece <= kSourceBytes; at += piece) {
    copy(b.dst + offset + at % kDestinationBytes, b.src + at, piece);
  }
  benchmark::ClobberMemory();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

template <typename Copy>
void run(benchmark::State& state, Copy copy) {
  const auto piece = static_cast<std::size_t>(state.range(0));
  const auto offset = static_cast<std::size_t>(state.range(1));
  static Buffers* buffers = new Buffers();  // one pair of buffers for the whole run (fresh pages would be timed)
  std::vector<double> copy_s, limit_s;
  for (auto _ : state) {
    limit_s.push_back(pass_seconds(*buffers, piece, 0, [](void* d, const void* s, std::size_t n) {
      std::memcpy(d, s, n);
    }));
    copy_s.push_back(pass_seconds(*buffers, piece, offset, copy));
  }
  const double bytes = static_cast<double>(kSourceBytes / piece * piece);
  const double gbps = bytes / bench::Median(copy_s) * 1e-9;
  const double limit = bytes / bench::Median(limit_s) * 1e-9;
  state.counters["GBps"] = gbps;
  state.counters["limit_GBps"] = limit;
  state.counters["frac_of_limit"] = gbps / limit;
}

void BM_CopyBytes(benchmark::State& state) { run(state, copy_bytes); }
void BM_Memcpy(benchmark::State& state) {
  run(state, [](void* d, const void* s, std::size_t n) { std::memcpy(d, s, n); });
}

void offsets(benchmark::internal::Benchmark* b) {
  for (const std::int64_t piece : {std::int64_t{16} << 10, std::int64_t{128} << 10}) {
    for (const std::int64_t offset : {0, 4, 8, 16, 24, 32, 48}) b->Args({piece, offset});
  }
  b->ArgNames({"piece", "offset"})->Unit(benchmark::kMillisecond)->Iterations(15);
}

BENCHMARK(BM_CopyBytes)->Apply(offsets);
BENCHMARK(BM_Memcpy)->Apply(offsets);

}  // namespace
}  // namespace shardkit

BENCHMARK_MAIN();
