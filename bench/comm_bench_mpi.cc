// comm_bench_mpi: all_reduce / all_gather / reduce_scatter over the MPI backend (mpi_process_group.h) between n
// processes started by mpirun, 4 KiB to 256 MiB (all_gather / reduce_scatter to 64 MiB).
//
//   mpirun -np 2 --oversubscribe --bind-to none build/bench/comm_bench_mpi
//   (as root add --allow-run-as-root; -np 4 for n = 4)
//
// Rank 0 runs Google Benchmark and prints; before each timed case it broadcasts the case (kind, bytes,
// iterations) and the other ranks run the same calls, so every rank issues the same collectives. Counters as in
// comm_bench (nccl-tests definitions): bytes = the collective's total size S; busbw_GBps = S/t · 2(n−1)/n for
// all_reduce, S/t · (n−1)/n for the others; frac_of_limit = busbw / the bandwidth of one memcpy of S bytes
// measured in this process (how close the collective gets to copying its data once); p2p_GBps = the rate of a
// send / recv exchange between ranks 0 and 1 through the same group with the bytes each rank sends in the call
// (what MPI's point-to-point path gives, measured in the same iteration as the call; n = 2 compares directly).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "common/base/check.h"
#include "common/comm/mpi_process_group.h"

namespace shardkit::comm {
namespace {

enum class Kind : std::int64_t { all_reduce = 0, all_gather, reduce_scatter, done };

double memcpy_bandwidth(std::int64_t bytes) {
  std::vector<char> a(static_cast<std::size_t>(bytes), 1), b(static_cast<std::size_t>(bytes), 2);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), a.size());
    benchmark::DoNotOptimize(b.data());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, static_cast<double>(bytes) / std::max(s, 1e-9));
  }
  return best;
}

struct Buffers {
  Tensor a, b, p2p_out, p2p_in;
};

Buffers buffers_for(Kind kind, int n, std::int64_t bytes) {
  const std::int64_t shard = bytes / 4 / n;
  Buffers buf;
  buf.a = Tensor::full({kind == Kind::all_gather ? shard : shard * n}, 1.0);
  buf.b = Tensor::full({kind == Kind::all_gather ? shard * n : shard}, 1.0);
  // The bytes each rank sends in the call: all_reduce 2(n-1)/n S, the others (n-1)/n S.
  const std::int64_t sent = (kind == Kind::all_reduce ? 2 : 1) * (n - 1) * shard;
  buf.p2p_out = Tensor::full({std::max<std::int64_t>(sent, 1)}, 1.0);
  buf.p2p_in = Tensor::full({std::max<std::int64_t>(sent, 1)}, 0.0);
  return buf;
}

void call(ProcessGroup& pg, Kind kind, const Buffers& buf) {
  absl::Status s;
  switch (kind) {
    case Kind::all_reduce: s = pg.all_reduce(buf.a)->wait(); break;
    case Kind::all_gather: s = pg.all_gather(buf.b, buf.a)->wait(); break;
    case Kind::reduce_scatter: s = pg.reduce_scatter(buf.b, buf.a)->wait(); break;
    case Kind::done: break;
  }
  SK_CHECK(s.ok()) << s.ToString();
}

// Ranks 0 and 1 exchange the p2p buffers (rank 0 sends first, rank 1 receives first); returns seconds.
double p2p_exchange(ProcessGroup& pg, const Buffers& buf) {
  const auto t0 = std::chrono::steady_clock::now();
  if (pg.rank() == 0) {
    auto sent = pg.send(buf.p2p_out, 1);
    SK_CHECK(pg.recv(buf.p2p_in, 1)->wait().ok());
    SK_CHECK(sent->wait().ok());
  } else if (pg.rank() == 1) {
    auto got = pg.recv(buf.p2p_in, 0);
    SK_CHECK(pg.send(buf.p2p_out, 0)->wait().ok());
    SK_CHECK(got->wait().ok());
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Every rank: the warm-up and `iterations` timed rounds of one case (rank 0 times them).
void run_case(ProcessGroup& pg, Kind kind, std::int64_t bytes, std::int64_t iterations, benchmark::State* state) {
  const int n = pg.size();
  Buffers buf = buffers_for(kind, n, bytes);
  call(pg, kind, buf);  // warm-up: first touch of every buffer
  double p2p_seconds = 0;
  if (state == nullptr) {
    for (std::int64_t i = 0; i < iterations; ++i) {
      p2p_exchange(pg, buf);
      call(pg, kind, buf);
    }
    return;
  }
  for (auto _ : *state) {
    state->PauseTiming();
    p2p_seconds += p2p_exchange(pg, buf);
    state->ResumeTiming();
    call(pg, kind, buf);
  }
  const double total = static_cast<double>(bytes / 4 / n * n * 4);
  const double factor = kind == Kind::all_reduce ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
  state->counters["n"] = n;
  state->counters["bytes"] = total;
  state->counters["algbw_GBps"] = benchmark::Counter(total * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state->counters["busbw_GBps"] =
      benchmark::Counter(total * factor * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  const double limit = memcpy_bandwidth(static_cast<std::int64_t>(total));
  state->counters["memcpy_GBps"] = limit * 1e-9;
  state->counters["frac_of_limit"] =
      benchmark::Counter(total * factor / limit, benchmark::Counter::kIsIterationInvariantRate);
  if (n > 1 && p2p_seconds > 0) {
    state->counters["p2p_GBps"] =
        static_cast<double>(buf.p2p_out.nbytes()) * static_cast<double>(state->iterations()) / p2p_seconds * 1e-9;
  }
}

// Rank 0 announces a case to the others: {kind, bytes, iterations}.
void announce(ProcessGroup& pg, Kind kind, std::int64_t bytes, std::int64_t iterations) {
  Tensor cmd = Tensor::from_int64({static_cast<std::int64_t>(kind), bytes, iterations}, {3},
                                  TensorOptions{}.with_dtype(DType::i64));
  SK_CHECK(pg.broadcast(cmd, {.root = 0})->wait().ok());
}

void BM_Mpi(benchmark::State& state, Kind kind, ProcessGroup* world) {
  ProcessGroup& pg = *world;
  announce(pg, kind, state.range(0), static_cast<std::int64_t>(state.max_iterations));
  run_case(pg, kind, state.range(0), static_cast<std::int64_t>(state.max_iterations), &state);
}

void register_benchmarks(ProcessGroup* world) {
  std::vector<std::int64_t> sizes;
  for (std::int64_t s = 4 << 10; s <= (std::int64_t{256} << 20); s *= 16) sizes.push_back(s);  // 4K..256M
  sizes.push_back(std::int64_t{64} << 20);
  std::sort(sizes.begin(), sizes.end());
  struct Case {
    const char* name;
    Kind kind;
    std::int64_t max_bytes;
  };
  for (const Case& c : {Case{"Mpi/all_reduce", Kind::all_reduce, std::int64_t{256} << 20},
                        Case{"Mpi/all_gather", Kind::all_gather, std::int64_t{64} << 20},
                        Case{"Mpi/reduce_scatter", Kind::reduce_scatter, std::int64_t{64} << 20}}) {
    auto* bm = benchmark::RegisterBenchmark(c.name, BM_Mpi, c.kind, world);
    bm->ArgNames({"bytes"});
    for (std::int64_t s : sizes) {
      if (s <= c.max_bytes) bm->Arg(s);
    }
    bm->UseRealTime()->MinTime(0.2);
  }
}

}  // namespace
}  // namespace shardkit::comm

int main(int argc, char** argv) {
  using namespace shardkit;
  using namespace shardkit::comm;
  auto world = create_mpi_world({.default_timeout = absl::Minutes(5)});
  if (!world.ok()) {
    std::fprintf(stderr, "comm_bench_mpi: %s\n", world.status().ToString().c_str());
    return 2;
  }
  if ((*world)->rank() != 0) {
    // Follow rank 0's cases until it says done.
    for (;;) {
      Tensor cmd = Tensor::from_int64({0, 0, 0}, {3}, TensorOptions{}.with_dtype(DType::i64));
      SK_CHECK((*world)->broadcast(cmd, {.root = 0})->wait().ok());
      const auto kind = static_cast<Kind>(cmd.data<std::int64_t>()[0]);
      if (kind == Kind::done) break;
      run_case(**world, kind, cmd.data<std::int64_t>()[1], cmd.data<std::int64_t>()[2], nullptr);
    }
    return 0;
  }
  register_benchmarks(world->get());
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  announce(**world, Kind::done, 0, 0);
  return 0;
}
