// Call fingerprints (process_group.h, THE CONTRACT): ranks that pass different fingerprints to one call fail with
// InvalidArgument naming both fingerprints, on every rank, in bounded time; equal fingerprints (and 0, none) work
// as before. Over the backends that compare them with ranks as threads of this process: in-process (RunRanks),
// TCP and shared memory (TcpProcessGroup over loopback with transport "tcp" / "shm"). MPI and NCCL do not compare
// fingerprints (no call header travels with their calls) and are not covered.
#include <cstdint>
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
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::comm {
namespace {

using ::testing::HasSubstr;

enum class Backend { kInProcess, kTcp, kShm };

std::string backend_name(const ::testing::TestParamInfo<Backend>& info) {
  switch (info.param) {
    case Backend::kInProcess: return "InProcess";
    case Backend::kTcp: return "Tcp";
    case Backend::kShm: return "Shm";
  }
  return "?";
}

// Runs fn(group, rank) on n ranks as threads over `backend`; returns each rank's status (every rank runs to its
// end: RunRanks' own first-failure report is not used, so that each rank's status can be checked).
std::vector<absl::Status> run_on(Backend backend, int n, const std::function<absl::Status(ProcessGroup&, int)>& fn) {
  std::vector<absl::Status> results(static_cast<std::size_t>(n));
  const absl::Duration timeout = absl::Seconds(10);
  if (backend == Backend::kInProcess) {
    RunRanksOptions options;
    options.timeout = timeout;
    (void)RunRanks(n, [&](RankEnv& env) {
      results[static_cast<std::size_t>(env.rank)] = fn(env.group, env.rank);
      return absl::OkStatus();
    }, options);
    return results;
  }
  auto store = std::make_shared<HashStore>();
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      TcpProcessGroupOptions o;
      o.default_timeout = timeout;
      o.chunk_bytes = 24;  // several chunks per call
      o.spin = absl::Microseconds(5);
      o.transport = backend == Backend::kShm ? "shm" : "tcp";
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
  return results;
}

Tensor ramp(int r, std::int64_t numel) {
  std::vector<float> v(static_cast<std::size_t>(numel));
  for (std::int64_t i = 0; i < numel; ++i) v[static_cast<std::size_t>(i)] = static_cast<float>(100 * r + i);
  return Tensor::from_vector(v, {numel});
}

class FingerprintTest : public ::testing::TestWithParam<Backend> {};

// A disagreement as process_group.h reports it (Note [group failure]): a rank that found it has InvalidArgument,
// one told through the abort has Aborted quoting it; at least one found it; every message names `names`.
void expect_disagreement(const std::vector<absl::Status>& st, const std::vector<std::string>& names) {
  bool found = false;
  for (std::size_t r = 0; r < st.size(); ++r) {
    const absl::Status& s = st[r];
    EXPECT_TRUE(s.code() == absl::StatusCode::kInvalidArgument || s.code() == absl::StatusCode::kAborted)
        << "rank " << r << ": " << s;
    found = found || s.code() == absl::StatusCode::kInvalidArgument;
    EXPECT_THAT(std::string(s.message()), HasSubstr("ranks disagree")) << "rank " << r;
    for (const std::string& n : names) EXPECT_THAT(std::string(s.message()), HasSubstr(n)) << "rank " << r;
  }
  EXPECT_TRUE(found) << "no rank has InvalidArgument";
}

// Two ranks, one all_gather of one size, two fingerprints: both ranks are told, naming both fingerprints.
TEST_P(FingerprintTest, DifferentFingerprintsFailOnEveryRankNamingBoth) {
  const std::uint32_t fp[2] = {0x0000abcdu, 0x12345678u};
  const std::vector<absl::Status> st = run_on(GetParam(), 2, [&](ProcessGroup& pg, int r) {
    Tensor out = Tensor::empty({2 * 10});
    return pg.all_gather(out, ramp(r, 10), {.tag = "unit", .fingerprint = fp[r]})->wait();
  });
  expect_disagreement(st, {"fingerprint 0x0000abcd", "fingerprint 0x12345678"});
}

// 0 (none) is a value like any other: 0 on one rank and a fingerprint on another disagree.
TEST_P(FingerprintTest, NoneAgainstAFingerprintFailsOnEveryRank) {
  const std::vector<absl::Status> st = run_on(GetParam(), 2, [&](ProcessGroup& pg, int r) {
    Tensor t = ramp(r, 7);
    return pg.all_reduce(t, {.fingerprint = r == 0 ? 0u : 0x00000007u})->wait();
  });
  expect_disagreement(st, {"fingerprint 0x00000007"});
}

// Three ranks, only rank 2 differs: every rank fails (some through the abort), and the origin names both values.
TEST_P(FingerprintTest, OneRankOfThreeDifferingFailsEveryRank) {
  const std::vector<absl::Status> st = run_on(GetParam(), 3, [&](ProcessGroup& pg, int r) {
    Tensor in = ramp(r, 3 * 5);
    Tensor out = Tensor::empty({5});
    return pg.reduce_scatter(out, in, {.fingerprint = r == 2 ? 0xdeadbeefu : 0x0badf00du})->wait();
  });
  bool named = false;
  for (int r = 0; r < 3; ++r) {
    const absl::Status& s = st[static_cast<std::size_t>(r)];
    EXPECT_FALSE(s.ok()) << "rank " << r << " was not told";
    const std::string m(s.message());
    named = named || (m.find("0xdeadbeef") != std::string::npos && m.find("0x0badf00d") != std::string::npos);
  }
  EXPECT_TRUE(named) << st[0] << "\n" << st[1] << "\n" << st[2];
}

// Equal fingerprints, and none, change nothing: every collective gives its result, the group stays usable.
TEST_P(FingerprintTest, EqualFingerprintsAndNoneWork) {
  for (int n : {2, 3}) {
    const std::vector<absl::Status> st = run_on(GetParam(), n, [&](ProcessGroup& pg, int r) -> absl::Status {
      for (std::uint32_t fp : {0u, 0x0000002au, 0xffffffffu}) {
        Tensor out = Tensor::empty({n * 10});
        if (absl::Status s = pg.all_gather(out, ramp(r, 10), {.fingerprint = fp})->wait(); !s.ok()) return s;
        const std::vector<float> got = out.to_vector();
        for (int src = 0; src < n; ++src) {
          for (int i = 0; i < 10; ++i) {
            EXPECT_EQ(got[static_cast<std::size_t>(src * 10 + i)], static_cast<float>(100 * src + i)) << "rank " << r;
          }
        }
        Tensor t = ramp(r, 7);
        if (absl::Status s = pg.all_reduce(t, {.fingerprint = fp})->wait(); !s.ok()) return s;
        Tensor rs = Tensor::empty({4});
        if (absl::Status s = pg.reduce_scatter(rs, ramp(r, n * 4), {.fingerprint = fp})->wait(); !s.ok()) return s;
        Tensor b = ramp(r, 5);
        if (absl::Status s = pg.broadcast(b, {.root = n - 1, .fingerprint = fp})->wait(); !s.ok()) return s;
        if (absl::Status s = pg.reduce(ramp(r, 3), {.root = 0, .fingerprint = fp})->wait(); !s.ok()) return s;
        if (absl::Status s = pg.barrier({.fingerprint = fp})->wait(); !s.ok()) return s;
      }
      return absl::OkStatus();
    });
    for (int r = 0; r < n; ++r) {
      const absl::Status& s = st[static_cast<std::size_t>(r)];
      EXPECT_TRUE(s.ok()) << "n " << n << " rank " << r << ": " << s;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, FingerprintTest,
                         ::testing::Values(Backend::kInProcess, Backend::kTcp, Backend::kShm), backend_name);

// In-process point to point: a send and a recv with different fingerprints fail both ends, naming both.
TEST(FingerprintInProcess, SendAndRecvWithDifferentFingerprintsFail) {
  const std::vector<absl::Status> st = run_on(Backend::kInProcess, 2, [&](ProcessGroup& pg, int r) {
    Tensor t = ramp(r, 4);
    return r == 0 ? pg.send(t, 1, {.fingerprint = 0x00000011u})->wait()
                  : pg.recv(t, 0, {.fingerprint = 0x00000022u})->wait();
  });
  for (int r = 0; r < 2; ++r) {
    const absl::Status& s = st[static_cast<std::size_t>(r)];
    EXPECT_TRUE(s.code() == absl::StatusCode::kInvalidArgument || s.code() == absl::StatusCode::kAborted)
        << "rank " << r << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("fingerprint 0x00000011")) << "rank " << r;
    EXPECT_THAT(std::string(s.message()), HasSubstr("fingerprint 0x00000022")) << "rank " << r;
  }
}

TEST(Fingerprint, OfTextIsStableAndNeverNone) {
  EXPECT_EQ(fingerprint_of("fsdp unit 'a' unshard"), fingerprint_of("fsdp unit 'a' unshard"));
  EXPECT_NE(fingerprint_of("fsdp unit 'a' unshard"), fingerprint_of("fsdp unit 'c' unshard"));
  EXPECT_NE(fingerprint_of(""), 0u);
  EXPECT_EQ(fingerprint_str(0x2a), "0x0000002a");
}

}  // namespace
}  // namespace shardkit::comm
