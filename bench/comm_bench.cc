// comm_bench, in-process cases: all_reduce / all_gather / reduce_scatter between n = 2 and 4 rank threads.
//
// Counters (nccl-tests definitions, https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
//   bytes       = the collective's total size S (all_reduce: the tensor; all_gather: the gathered output;
//                 reduce_scatter: the scattered input)
//   algbw_GBps  = S / time
//   busbw_GBps  = algbw · 2(n−1)/n (all_reduce), algbw · (n−1)/n (all_gather, reduce_scatter)
//   frac_of_limit = busbw / memcpy bandwidth of S bytes measured in this binary (one thread,
//                 BM_Memcpy below), i.e. how close the collective gets to copying the data once.
// Default sweep 4 KiB … 256 MiB (all_reduce; the others up to 64 MiB to bound memory).
// Run: build/bench/comm_bench --benchmark_filter=InProcess
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "common/base/check.h"
#include "common/comm/in_process_group.h"
#include "common/comm/process_group.h"

namespace shardkit::comm {
namespace {

// memcpy bandwidth (bytes/s) of `bytes` bytes, measured once per size (best of a few repetitions).
double memcpy_bandwidth(std::int64_t bytes) {
  static std::mutex mu;
  static std::map<std::int64_t, double> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(bytes); it != cache.end()) return it->second;
  std::vector<char> a(static_cast<std::size_t>(bytes), 1), b(static_cast<std::size_t>(bytes), 2);
  const int reps = static_cast<int>(std::max<std::int64_t>(3, (std::int64_t{256} << 20) / std::max<std::int64_t>(bytes, 1)));
  const int inner = std::min(reps, 1000);
  double best = 0;
  for (int trial = 0; trial < 5; ++trial) {
    const absl::Time t0 = absl::Now();
    for (int i = 0; i < inner; ++i) {
      std::memcpy(trial % 2 ? a.data() : b.data(), trial % 2 ? b.data() : a.data(), a.size());
      benchmark::ClobberMemory();
    }
    const double s = absl::ToDoubleSeconds(absl::Now() - t0);
    best = std::max(best, static_cast<double>(bytes) * inner / s);
  }
  cache[bytes] = best;
  return best;
}

void BM_Memcpy(benchmark::State& state) {
  const std::int64_t bytes = state.range(0);
  std::vector<char> a(static_cast<std::size_t>(bytes), 1), b(static_cast<std::size_t>(bytes), 2);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), a.size());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

enum class Kind { all_reduce, all_gather, reduce_scatter };

// Runs one collective of total size S on n in-process ranks: this thread is rank 0 and is timed;
// ranks 1..n-1 are helper threads issuing the same number of calls.
void BM_InProcess(benchmark::State& state, Kind kind) {
  const int n = static_cast<int>(state.range(0));
  const std::int64_t bytes = state.range(1);
  const std::int64_t numel = bytes / 4;
  const std::int64_t shard = numel / n;
  auto world = InProcessWorld::create(n, {.default_timeout = absl::Minutes(2)});
  std::vector<std::shared_ptr<ProcessGroup>> groups;
  std::vector<Tensor> a, b;
  for (int r = 0; r < n; ++r) {
    groups.push_back(world->group(r));
    a.push_back(Tensor::full({kind == Kind::all_gather ? shard : shard * n}, 1.0));
    b.push_back(Tensor::full({kind == Kind::all_gather ? shard * n : shard}, 1.0));
  }
  auto once = [&](int r) {
    absl::Status s;
    switch (kind) {
      case Kind::all_reduce: s = groups[r]->all_reduce(a[r])->wait(); break;
      case Kind::all_gather: s = groups[r]->all_gather(b[r], a[r])->wait(); break;
      case Kind::reduce_scatter: s = groups[r]->reduce_scatter(b[r], a[r])->wait(); break;
    }
    SK_CHECK(s.ok()) << s.ToString();
  };
  const std::int64_t iterations = static_cast<std::int64_t>(state.max_iterations);
  std::vector<std::thread> helpers;
  for (int r = 1; r < n; ++r) {
    helpers.emplace_back([&, r] {
      for (std::int64_t i = 0; i < iterations + 1; ++i) once(r);
    });
  }
  once(0);  // warm-up (first touch of every buffer)
  for (auto _ : state) once(0);
  for (auto& t : helpers) t.join();

  const double total = static_cast<double>(shard * n * 4);
  const double factor = kind == Kind::all_reduce ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
  state.counters["bytes"] = total;
  state.counters["algbw_GBps"] =
      benchmark::Counter(total * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["busbw_GBps"] =
      benchmark::Counter(total * factor * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  // frac_of_limit needs the rate; Google Benchmark divides rate counters by the measured time, so
  // express it as a rate too: busbw / memcpy_bw per second of work.
  const double limit = memcpy_bandwidth(static_cast<std::int64_t>(total));
  state.counters["memcpy_GBps"] = limit * 1e-9;
  state.counters["frac_of_limit"] =
      benchmark::Counter(total * factor / limit, benchmark::Counter::kIsIterationInvariantRate);
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(total));
}

void register_in_process_benchmarks() {
  std::vector<std::int64_t> sizes;
  for (std::int64_t s = 4 << 10; s <= (std::int64_t{256} << 20); s *= 16) sizes.push_back(s);  // 4K..256M
  sizes.push_back(std::int64_t{64} << 20);
  std::sort(sizes.begin(), sizes.end());
  auto* memcpy_bm = benchmark::RegisterBenchmark("BM_Memcpy", BM_Memcpy);
  for (std::int64_t s : sizes) memcpy_bm->Arg(s);
  memcpy_bm->UseRealTime();
  struct Case {
    const char* name;
    Kind kind;
    std::int64_t max_bytes;
  };
  for (const Case& c : {Case{"InProcess/all_reduce", Kind::all_reduce, std::int64_t{256} << 20},
                        Case{"InProcess/all_gather", Kind::all_gather, std::int64_t{64} << 20},
                        Case{"InProcess/reduce_scatter", Kind::reduce_scatter, std::int64_t{64} << 20}}) {
    auto* bm = benchmark::RegisterBenchmark(c.name, BM_InProcess, c.kind);
    bm->ArgNames({"n", "bytes"});
    for (int n : {2, 4}) {
      for (std::int64_t s : sizes) {
        if (s <= c.max_bytes) bm->Args({n, s});
      }
    }
    bm->UseRealTime()->MinTime(0.2);
  }
}

const bool registered = (register_in_process_benchmarks(), true);

}  // namespace
}  // namespace shardkit::comm
