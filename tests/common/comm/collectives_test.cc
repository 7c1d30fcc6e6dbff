// Every collective x op x dtype against a scalar reference at n = 1, 2, 3, 4, 8 and sizes 0, 1, 7, 1,000,003,
// with a tiny reduction chunk so the multi-chunk paths run, over each backend whose ranks can be threads of
// this process: in-process (RunRanks), TCP (TcpProcessGroup over loopback, SHARDKIT_TRANSPORT's "tcp") and
// shared memory (the same group with transport "shm", tiny rings so that bytes and elements wrap around the
// rings' ends), and MPI, whose ranks are processes: this file built with SHARDKIT_COLLECTIVES_OVER_MPI
// (comm_mpi_collectives_test) instantiates the suite over MPI alone, and each of its tests starts itself under
// `mpirun -np n` (Note [collectives over mpi]). Process ranks of TCP and shared memory and their faults (a killed
// rank, a stopped one) are in shm_process_test.cc, tcp_multiprocess_test.cc and stall_test.cc; MPI's in
// mpi_test.cc.
//
// The in-process backend reduces in rank order and rounds bf16/f16 once, so the reference (same order,
// same f32 arithmetic) must match bit for bit; so must MPI's (it reduces with the same arithmetic, Note [mpi
// reductions] in mpi_process_group.cc). The TCP and shared-memory backends reduce in ring / chain order and round
// bf16/f16 at every hop (process_group.h allows it): their float sums are checked to within (n + 1) units of
// the last place of the sum of magnitudes; min, max, i64 and every copy (broadcast, all_gather) stay exact.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/comm/hash_store.h"
#include "common/comm/process_group.h"
#include "common/comm/tcp_process_group.h"
#include "common/comm/testing/run_ranks.h"
#include "gtest/gtest.h"
#ifdef SHARDKIT_COLLECTIVES_OVER_MPI
#include <unistd.h>

#include "common/comm/mpi_process_group.h"
#include "tests/tools/subprocess.h"
#endif

namespace shardkit::comm {
namespace {

std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The inputs of every rank: element i of rank r, rounded to the dtype. Computed once per test (before
// the rank threads start) so that the reference costs n table reads per element, not n hashes.
struct Inputs {
  int n = 0;
  std::int64_t m = 0;  // elements per rank
  DType dt = DType::f32;
  std::vector<float> f;
  std::vector<std::int64_t> i;

  Inputs(int n_, std::int64_t m_, DType dt_) : n(n_), m(m_), dt(dt_) {
    const auto total = static_cast<std::size_t>(n) * static_cast<std::size_t>(m);
    if (dt == DType::i64) {
      i.resize(total);
    } else {
      f.resize(total);
    }
    for (int r = 0; r < n; ++r) {
      for (std::int64_t k = 0; k < m; ++k) {
        const std::uint64_t h = mix((static_cast<std::uint64_t>(r) << 40) ^ static_cast<std::uint64_t>(k));
        const std::size_t at = static_cast<std::size_t>(r) * m + k;
        if (dt == DType::i64) {
          i[at] = static_cast<std::int64_t>(h % 2000001) - 1000000;
        } else {
          const float v = static_cast<float>(h >> 40) * (1.0f / 8388608.0f) - 1.0f;  // [-1, 1), full mantissa
          f[at] = dt == DType::bf16 ? bf16_to_f32(f32_to_bf16(v)) : dt == DType::f16 ? f16_to_f32(f32_to_f16(v)) : v;
        }
      }
    }
  }
  float vf(int r, std::int64_t k) const { return f[static_cast<std::size_t>(r) * m + k]; }
  std::int64_t vi(int r, std::int64_t k) const { return i[static_cast<std::size_t>(r) * m + k]; }
  double value(int r, std::int64_t k) const { return dt == DType::i64 ? static_cast<double>(vi(r, k)) : vf(r, k); }

  // Rank r's elements [0, numel) as a new tensor.
  Tensor make(int r, std::int64_t numel) const {
    const TensorOptions o = TensorOptions{}.with_dtype(dt);
    if (dt == DType::i64) {
      return Tensor::from_int64(std::vector<std::int64_t>(i.begin() + r * m, i.begin() + r * m + numel), {numel}, o);
    }
    return Tensor::from_vector(std::vector<float>(f.begin() + r * m, f.begin() + r * m + numel), {numel}, o);
  }
};

float round_to(float v, DType dt) {
  switch (dt) {
    case DType::bf16: return bf16_to_f32(f32_to_bf16(v));
    case DType::f16: return f16_to_f32(f32_to_f16(v));
    default: return v;
  }
}

// Reference reduction of element k over the n ranks: ranks in order, f32 accumulation.
double reference(const ReduceOp& op, const Inputs& in, std::int64_t k) {
  const int n = in.n;
  if (in.dt == DType::i64) {
    std::uint64_t acc = 0;
    std::int64_t mn = 0, mx = 0;
    const auto f = static_cast<std::uint64_t>(static_cast<std::int64_t>(op.factor));
    for (int r = 0; r < n; ++r) {
      const std::int64_t x = in.vi(r, k);
      acc += op.kind == ReduceKind::premul_sum ? f * static_cast<std::uint64_t>(x) : static_cast<std::uint64_t>(x);
      mn = r == 0 ? x : std::min(mn, x);
      mx = r == 0 ? x : std::max(mx, x);
    }
    switch (op.kind) {
      case ReduceKind::min: return static_cast<double>(mn);
      case ReduceKind::max: return static_cast<double>(mx);
      case ReduceKind::avg: return static_cast<double>(static_cast<std::int64_t>(acc) / n);
      default: return static_cast<double>(static_cast<std::int64_t>(acc));
    }
  }
  const float f = static_cast<float>(op.factor);
  float acc = 0.f;
  for (int r = 0; r < n; ++r) {
    const float x = in.vf(r, k);
    switch (op.kind) {
      case ReduceKind::sum:
      case ReduceKind::avg: acc = r == 0 ? x : acc + x; break;
      case ReduceKind::premul_sum: acc = r == 0 ? f * x : acc + f * x; break;
      case ReduceKind::min: acc = r == 0 ? x : (x < acc ? x : acc); break;
      case ReduceKind::max: acc = r == 0 ? x : (x > acc ? x : acc); break;
    }
  }
  if (op.kind == ReduceKind::avg) acc = acc / static_cast<float>(n);
  return round_to(acc, in.dt);
}

// How far a ring / chain backend's float reduction of element k may be from `reference` (0: exact).
double tolerance(const ReduceOp& op, const Inputs& in, std::int64_t k, bool exact) {
  if (exact || in.dt == DType::i64 || op.kind == ReduceKind::min || op.kind == ReduceKind::max) return 0;
  const double ulp = in.dt == DType::f32 ? std::ldexp(1.0, -23) : in.dt == DType::bf16 ? std::ldexp(1.0, -7)
                                                                                       : std::ldexp(1.0, -10);
  double mag = 0;
  for (int r = 0; r < in.n; ++r) mag += std::abs(in.vf(r, k));
  if (op.kind == ReduceKind::premul_sum) mag *= std::abs(op.factor);
  if (op.kind == ReduceKind::avg) mag /= in.n;
  return (in.n + 1) * ulp * mag;
}

double got_at(const Tensor& t, std::int64_t i) {
  switch (t.dtype()) {
    case DType::f32: return t.data<float>()[i];
    case DType::bf16: return bf16_to_f32(t.data<bf16_t>()[i]);
    case DType::f16: return f16_to_f32(t.data<f16_t>()[i]);
    case DType::i64: return static_cast<double>(t.data<std::int64_t>()[i]);
  }
  return 0;
}

// Checks t[i] == expect(i) (within tol(i)) for i in [0, numel) with the given stride; reports the first mismatch.
template <typename F, typename T>
void expect_near_all(const Tensor& t, std::int64_t numel, std::int64_t stride, F expect, T tol, const std::string& what) {
  std::int64_t bad = 0, first = -1;
  double want0 = 0, got0 = 0;
  for (std::int64_t i = 0; i < numel; i += stride) {
    const double want = expect(i), got = got_at(t, i);
    if (want != got && !(std::abs(want - got) <= tol(i))) {
      if (bad++ == 0) {
        first = i;
        want0 = want;
        got0 = got;
      }
    }
  }
  EXPECT_EQ(bad, 0) << what << ": first mismatch at " << first << ": expected " << want0 << ", found " << got0;
}

template <typename F>
void expect_all(const Tensor& t, std::int64_t numel, std::int64_t stride, F expect, const std::string& what) {
  expect_near_all(t, numel, stride, expect, [](std::int64_t) { return 0.0; }, what);
}

enum class Backend { kInProcess, kTcp, kShm, kMpi };

using RankFn = std::function<absl::Status(ProcessGroup&, int)>;

#ifdef SHARDKIT_COLLECTIVES_OVER_MPI
// Note [collectives over mpi]
// MPI ranks are processes of one mpirun job, and MPI can be initialised once per process, so an MPI test runs as
// a launcher and n rank processes. The launcher (this test, as ctest starts it) runs
//   mpirun -np n --oversubscribe --bind-to none <this binary> --gtest_filter=<this test>
// with kMpiRankEnv set. In each rank process the same test body runs, and RunOn hands fn this process's rank of
// the MPI world: the body's expectations are checked on every rank, which exits non-zero when one fails. The
// launcher passes when mpirun exits 0 and every rank printed gtest's OK line for the test (a filter that matched
// nothing would pass silently otherwise); it fails quoting the ranks' output.
constexpr char kMpiRankEnv[] = "SHARDKIT_COLLECTIVES_MPI_RANK";

absl::Status RunOnMpi(int n, absl::Duration timeout, const RankFn& fn) {
  if (std::getenv(kMpiRankEnv) != nullptr) {  // a rank process
    auto world = create_mpi_world({.default_timeout = timeout});
    if (!world.ok()) return world.status();
    if ((*world)->size() != n) {
      return absl::FailedPreconditionError(absl::StrCat("expected an MPI world of ", n, " ranks, found ", (*world)->size()));
    }
    return fn(**world, (*world)->rank());
  }
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string test = absl::StrCat(info->test_suite_name(), ".", info->name());
  char self[4096];
  const ssize_t len = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (len <= 0) return absl::InternalError("cannot read /proc/self/exe");
  // Open MPI leaves allocations behind at exit: no leak check in the rank processes (sanitizer builds).
  const char* asan = std::getenv("ASAN_OPTIONS");
  const std::string asan_options = absl::StrCat(asan != nullptr ? asan : "", asan != nullptr ? ":" : "", "detect_leaks=0");
  const auto r = shardkit::testing::run_command(
      {MPIEXEC_PATH, "-np", std::to_string(n), "--oversubscribe", "--bind-to", "none", std::string(self, len),
       "--gtest_filter=" + test, "--gtest_color=no"},
      absl::ToDoubleSeconds(timeout) + 60,
      {{kMpiRankEnv, "1"}, {"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"},
       {"ASAN_OPTIONS", asan_options}});
  int passed = 0;
  const std::string ok_line = absl::StrCat("[       OK ] ", test, " (");
  for (auto at = r.out.find(ok_line); at != std::string::npos; at = r.out.find(ok_line, at + 1)) ++passed;
  if (r.timed_out || r.exit_code != 0 || passed != n) {
    return absl::InternalError(absl::StrCat("mpirun -np ", n, " ", test, ": ",
                                            r.timed_out ? "timed out" : absl::StrCat("exit code ", r.exit_code), ", ",
                                            passed, " of ", n, " ranks passed; their output:\n", r.out, r.err));
  }
  return absl::OkStatus();
}
#endif

// Runs fn(group, rank) on n ranks over `backend` (threads of this process; MPI: Note [collectives over mpi]); the
// first failure (by rank order) is returned.
absl::Status RunOn(Backend backend, int n, std::size_t chunk_bytes, absl::Duration timeout, const RankFn& fn) {
#ifdef SHARDKIT_COLLECTIVES_OVER_MPI
  if (backend == Backend::kMpi) return RunOnMpi(n, timeout, fn);
#endif
  if (backend == Backend::kInProcess) {
    RunRanksOptions options;
    options.timeout = timeout;
    options.chunk_bytes = static_cast<std::int64_t>(chunk_bytes);
    return RunRanks(n, [&](RankEnv& env) { return fn(env.group, env.rank); }, options);
  }
  auto store = std::make_shared<HashStore>();
  std::vector<absl::Status> results(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      TcpProcessGroupOptions o;
      o.default_timeout = timeout;
      o.chunk_bytes = chunk_bytes;
      o.spin = absl::Microseconds(5);  // ranks outnumber the cores: do not keep them from running
      o.transport = backend == Backend::kShm ? "shm" : "tcp";
      // Rings of an odd size a little over a chunk: every element size wraps around the ring's end.
      o.shm_ring_bytes = chunk_bytes * 3 + 13;
      auto pg = TcpProcessGroup::create(store, r, n, o);
      if (!pg.ok()) {
        results[static_cast<std::size_t>(r)] = pg.status();
        return;
      }
      for (int p = 0; p < n; ++p) {
        if (p != r) {
          EXPECT_EQ((*pg)->transport_to(p), backend == Backend::kShm ? "shm" : "tcp");
        }
      }
      results[static_cast<std::size_t>(r)] = fn(**pg, r);
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& st : results) {
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

struct Param {
  Backend backend;
  int n;
  DType dtype;
  std::int64_t size;
};

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return absl::StrCat("n", info.param.n, "_", std::string(dtype_name(info.param.dtype)), "_size", info.param.size);
}

class CollectivesTest : public ::testing::TestWithParam<Param> {};

TEST_P(CollectivesTest, MatchesScalarReference) {
  const auto [backend, n, dt, size] = GetParam();
  const bool big = size > 1000;
  const bool exact = backend == Backend::kInProcess || backend == Backend::kMpi;
  // 250 / 3 f32 elements per reduction step; the process backends' big case takes 4096 (still hundreds of chunks
  // per call) so that their per-chunk system calls keep the suite fast.
  const std::size_t chunk_bytes = !big ? 12 : exact ? 1000 : 4096;
  const std::vector<ReduceOp> ops = {ReduceOp::sum(), ReduceOp::avg(), ReduceOp::min(), ReduceOp::max(),
                                     ReduceOp::premul_sum(dt == DType::i64 ? 3.0 : 0.37)};
  // Per-rank shard for all_gather / reduce_scatter: `size` itself, except the big size is split (so the
  // total stays ~1M elements and odd).
  const std::int64_t shard = big ? (size + n - 1) / n : size;

  const Inputs inputs(n, std::max(size, shard * n), dt);

  absl::Status st = RunOn(
      backend, n, chunk_bytes, absl::Seconds(120),
      [&](ProcessGroup& pg, const int r) -> absl::Status {
        int c = 0;
        // Big tensors: in each case one rank (c % n) checks every element, the others every 13th.
        auto stride_for = [&](int cc) -> std::int64_t { return !big || cc % n == r ? 1 : 13; };
        for (const ReduceOp& op : ops) {
          const std::string opname = op.to_string();
          {  // all_reduce
            ++c;
            Tensor t = inputs.make(r, size);
            if (absl::Status s = pg.all_reduce(t, {.op = op})->wait(); !s.ok()) return s;
            expect_near_all(t, size, stride_for(c), [&](std::int64_t i) { return reference(op, inputs, i); },
                            [&](std::int64_t i) { return tolerance(op, inputs, i, exact); },
                            absl::StrCat("all_reduce ", opname, " rank ", r));
          }
          {  // reduce to a root other than 0 when possible
            ++c;
            const int root = n - 1;
            Tensor t = inputs.make(r, size);
            if (absl::Status s = pg.reduce(t, {.root = root, .op = op})->wait(); !s.ok()) return s;
            if (r == root) {
              expect_near_all(t, size, 1, [&](std::int64_t i) { return reference(op, inputs, i); },
                              [&](std::int64_t i) { return tolerance(op, inputs, i, exact); },
                              absl::StrCat("reduce ", opname, " root ", root));
            }
          }
          for (bool in_place : {false, true}) {  // reduce_scatter
            ++c;
            Tensor in = inputs.make(r, shard * n);
            Tensor out = in_place ? in.view(r * shard, {shard}) : Tensor::empty({shard}, TensorOptions{}.with_dtype(dt));
            if (absl::Status s = pg.reduce_scatter(out, in, {.op = op})->wait(); !s.ok()) return s;
            expect_near_all(out, shard, 1, [&](std::int64_t i) { return reference(op, inputs, r * shard + i); },
                            [&](std::int64_t i) { return tolerance(op, inputs, r * shard + i, exact); },
                            absl::StrCat("reduce_scatter ", opname, in_place ? " in place" : "", " rank ", r));
          }
        }
        for (bool in_place : {false, true}) {  // all_gather
          ++c;
          Tensor out = Tensor::empty({shard * n}, TensorOptions{}.with_dtype(dt));
          Tensor in = inputs.make(r, shard);
          if (in_place) {
            out.view(r * shard, {shard}).copy_(in);
            in = out.view(r * shard, {shard});
          }
          if (absl::Status s = pg.all_gather(out, in)->wait(); !s.ok()) return s;
          expect_all(
              out, shard * n, stride_for(c),
              [&](std::int64_t i) {
                const int src = static_cast<int>(i / std::max<std::int64_t>(shard, 1));
                return inputs.value(src, i % std::max<std::int64_t>(shard, 1));
              },
              absl::StrCat("all_gather", in_place ? " in place" : "", " rank ", r));
        }
        {  // broadcast from the middle rank
          ++c;
          const int root = n / 2;
          Tensor t = inputs.make(r, size);
          if (absl::Status s = pg.broadcast(t, {.root = root})->wait(); !s.ok()) return s;
          expect_all(t, size, stride_for(c), [&](std::int64_t i) { return inputs.value(root, i); },
                     absl::StrCat("broadcast rank ", r));
        }
        return pg.barrier()->wait();
      });
  EXPECT_TRUE(st.ok()) << st;
}

std::vector<Param> all_params(Backend backend) {
  std::vector<Param> out;
  for (int n : {1, 2, 3, 4, 8}) {
    for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::i64}) {
      for (std::int64_t size : {0, 1, 7, 1000003}) out.push_back({backend, n, dt, size});
    }
  }
  return out;
}

#ifdef SHARDKIT_COLLECTIVES_OVER_MPI
INSTANTIATE_TEST_SUITE_P(Mpi, CollectivesTest, ::testing::ValuesIn(all_params(Backend::kMpi)), param_name);
#else
INSTANTIATE_TEST_SUITE_P(InProcess, CollectivesTest, ::testing::ValuesIn(all_params(Backend::kInProcess)), param_name);
INSTANTIATE_TEST_SUITE_P(Tcp, CollectivesTest, ::testing::ValuesIn(all_params(Backend::kTcp)), param_name);
INSTANTIATE_TEST_SUITE_P(Shm, CollectivesTest, ::testing::ValuesIn(all_params(Backend::kShm)), param_name);
#endif

}  // namespace
}  // namespace shardkit::comm
