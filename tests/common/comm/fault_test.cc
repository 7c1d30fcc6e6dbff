// Failure handling of the in-process backend and RunRanks: every fault ends in a clear error on every
// rank, in bounded time (each test asserts its wall time), and RunRanks reports the origin rank.
#include <algorithm>
#include <atomic>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/comm/process_group.h"
#include "common/comm/testing/run_ranks.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::comm {
namespace {

using ::testing::HasSubstr;

// Per-rank statuses collected by a test.
struct Statuses {
  std::mutex mu;
  std::vector<absl::Status> of;
  explicit Statuses(int n) : of(static_cast<std::size_t>(n)) {}
  void set(int r, absl::Status s) {
    std::lock_guard<std::mutex> l(mu);
    of[r] = std::move(s);
  }
};

TEST(FaultTest, RankThrowsMidCollectiveFailsOthersNamingIt) {
  const int n = 4;
  Statuses st(n);
  const absl::Time start = absl::Now();
  absl::Status result = RunRanks(n, [&](RankEnv& env) -> absl::Status {
    Tensor t = Tensor::full({1000}, 1.0);
    for (int step = 0; step < 3; ++step) {
      if (env.rank == 2 && step == 2) throw std::runtime_error("boom in step 2");
      absl::Status s = env.group.all_reduce(t, {.tag = "grads"})->wait();
      if (!s.ok()) {
        st.set(env.rank, s);
        return s;
      }
    }
    return absl::OkStatus();
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(result.code(), absl::StatusCode::kInternal) << result;
  EXPECT_THAT(std::string(result.message()), HasSubstr("rank 2: threw: boom in step 2"));
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(st.of[r].code(), absl::StatusCode::kAborted) << st.of[r];
    EXPECT_THAT(std::string(st.of[r].message()), HasSubstr("all_reduce #2 'grads'"));
    EXPECT_THAT(std::string(st.of[r].message()), HasSubstr("rank 2: threw: boom"));
  }
}

TEST(FaultTest, RankThatStopsCallingIsNamedByTheDeadlineError) {
  const int n = 3;
  Statuses st(n);
  absl::Notification others_failed;
  std::atomic<int> failed_count{0};
  const absl::Time start = absl::Now();
  absl::Status result = RunRanks(n, [&](RankEnv& env) -> absl::Status {
    Tensor t = Tensor::full({16}, 1.0);
    if (env.rank == 1) {
      // Busy elsewhere: does not join the all_reduce until the others have given up on it.
      EXPECT_TRUE(others_failed.WaitForNotificationWithTimeout(absl::Seconds(20)));
      absl::Status late = env.group.all_reduce(t)->wait();
      st.set(1, late);
      return late;
    }
    // The deadline also bounds how late ranks 0 and 2 may join (their threads start and their calls are
    // entered by a worker thread): on a loaded machine 300 ms was not enough, and the error then rightly named
    // rank 2 as well ("rank 1, rank 2 did not join within 300ms").
    absl::Status s = env.group.all_reduce(t, {.timeout = absl::Seconds(2)})->wait();
    st.set(env.rank, s);
    if (++failed_count == n - 1) others_failed.Notify();
    return s;
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(result.code(), absl::StatusCode::kDeadlineExceeded) << result;
  EXPECT_THAT(std::string(result.message()), HasSubstr("rank 1 did not join within 2s"));
  EXPECT_THAT(std::string(result.message()), HasSubstr("all_reduce #0"));
  for (int r : {0, 2}) {
    EXPECT_FALSE(st.of[r].ok());
    EXPECT_THAT(std::string(st.of[r].message()), HasSubstr("rank 1 did not join")) << st.of[r];
  }
  // The late rank's call fails at once, naming the origin.
  EXPECT_EQ(st.of[1].code(), absl::StatusCode::kAborted) << st.of[1];
  EXPECT_THAT(std::string(st.of[1].message()), HasSubstr("rank 1 did not join"));
}

TEST(FaultTest, RankThatReturnsEarlyReleasesTheOthersAtOnce) {
  const absl::Time start = absl::Now();
  Statuses st(2);
  absl::Status result = RunRanks(2, [&](RankEnv& env) -> absl::Status {
    if (env.rank == 1) return absl::OkStatus();  // forgets the barrier
    absl::Status s = env.group.barrier({.tag = "end of step"})->wait();
    st.set(0, s);
    return s;
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));  // not the 60 s default timeout
  EXPECT_EQ(result.code(), absl::StatusCode::kAborted) << result;
  EXPECT_THAT(std::string(result.message()),
              HasSubstr("barrier #0 'end of step' on group 'world', rank 0: rank 1 returned from its function"));
}

TEST(FaultTest, RanksDisagreeingOnSizesFailEverywhereNamingBoth) {
  Statuses st(3);
  absl::Status result = RunRanks(3, [&](RankEnv& env) -> absl::Status {
    Tensor t = Tensor::zeros({env.rank == 2 ? 8 : 7});
    absl::Status s = env.group.all_reduce(t)->wait();
    st.set(env.rank, s);
    return s;
  });
  EXPECT_EQ(result.code(), absl::StatusCode::kInvalidArgument) << result;
  EXPECT_THAT(std::string(result.message()),
              HasSubstr("expected all_reduce #0 (f32[7] cpu, sum) (as rank 0), found all_reduce #0 (f32[8] cpu, sum) on "
                        "rank 2"));
  for (int r = 0; r < 3; ++r) EXPECT_FALSE(st.of[r].ok());
}

TEST(FaultTest, RanksDisagreeingOnTheCollectiveFail) {
  absl::Status result = RunRanks(2, [&](RankEnv& env) -> absl::Status {
    Tensor t = Tensor::zeros({4});
    if (env.rank == 0) return env.group.all_reduce(t)->wait();
    return env.group.broadcast(t)->wait();
  });
  EXPECT_EQ(result.code(), absl::StatusCode::kInvalidArgument) << result;
  EXPECT_THAT(std::string(result.message()), HasSubstr("found broadcast #0"));
}

TEST(FaultTest, LocalArgumentErrorAbortsTheGroup) {
  Statuses st(2);
  absl::Status result = RunRanks(2, [&](RankEnv& env) -> absl::Status {
    Tensor in = Tensor::zeros({4});
    Tensor out = Tensor::zeros({env.rank == 0 ? 8 : 9});
    absl::Status s = env.group.all_gather(out, in)->wait();
    st.set(env.rank, s);
    // Later calls fail at once too.
    absl::Status later = env.group.barrier()->wait();
    EXPECT_FALSE(later.ok());
    return s;
  });
  EXPECT_EQ(result.code(), absl::StatusCode::kInvalidArgument) << result;
  EXPECT_THAT(std::string(result.message()), HasSubstr("rank 1: expected output numel = 2 x 4 = 8, found 9"));
  EXPECT_EQ(st.of[0].code(), absl::StatusCode::kAborted) << st.of[0];
}

TEST(FaultTest, ExplicitAbortFailsPendingCalls) {
  absl::Status result = RunRanks(2, [&](RankEnv& env) -> absl::Status {
    if (env.rank == 1) {
      env.group.abort(absl::CancelledError("user stopped training"));
      return absl::OkStatus();
    }
    return env.group.barrier()->wait();
  });
  EXPECT_EQ(result.code(), absl::StatusCode::kCancelled) << result;
  EXPECT_THAT(std::string(result.message()), HasSubstr("user stopped training"));
}

TEST(FaultTest, UnmatchedRecvFailsAtItsDeadlineNamingThePeer) {
  const absl::Time start = absl::Now();
  absl::Notification done;
  absl::Status result = RunRanks(2, [&](RankEnv& env) -> absl::Status {
    if (env.rank == 1) {
      EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(20)));
      return absl::OkStatus();
    }
    Tensor t = Tensor::zeros({4});
    // 2 s: the 1 ms wait below must come before the call's own deadline even when the loaded machine (CI runs the
    // suite two at a time, under sanitizers) pauses this thread for a while.
    auto work = env.group.recv(t, 1, {.timeout = absl::Seconds(2), .tag = "activations"});
    // A short wait times out without failing the call...
    absl::Status early = work->wait(absl::Milliseconds(1));
    EXPECT_EQ(early.code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_FALSE(work->is_completed());
    // ...the call's own deadline fails it.
    absl::Status s = work->wait();
    done.Notify();
    return s;
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(result.code(), absl::StatusCode::kDeadlineExceeded) << result;
  EXPECT_THAT(std::string(result.message()),
              HasSubstr("recv 'activations' (f32[4] cpu from rank 1) on group 'world', rank 0: rank 1 did not post "
                        "the matching send within 2s"));
}

TEST(FaultTest, RecvFromARankThatLeftFailsAtOnce) {
  const absl::Time start = absl::Now();
  absl::Status result = RunRanks(2, [&](RankEnv& env) -> absl::Status {
    if (env.rank == 1) return absl::OkStatus();
    Tensor t = Tensor::zeros({4});
    return env.group.recv(t, 1)->wait();
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_FALSE(result.ok());
  EXPECT_THAT(std::string(result.message()), HasSubstr("rank 1 returned from its function"));
}

TEST(FaultTest, GtestAssertionThatReturnsEarlyDoesNotHang) {
  // Simulates ASSERT_* returning early from one rank: the others' collectives fail fast.
  const absl::Time start = absl::Now();
  absl::Status result = RunRanks(3, [&](RankEnv& env) {
    if (env.rank == 0) return;
    Tensor t = Tensor::zeros({4});
    (void)env.group.all_reduce(t)->wait();
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_THAT(std::string(result.message()), HasSubstr("rank 0 returned from its function without joining it"));
}

// ---- no rank returns while a peer can still touch its buffers ----
//
// A collective that fails (an abort from another thread, a deadline, a failure of another sub-group of the
// world) must not return on one rank while a peer is still copying into that rank's buffers: the caller
// may free or reuse them the moment the call returns. Each scenario runs big all_reduces (so the data phase
// is long and ranks are preempted inside it on 2 cores) until the failure, at varied points of the call:
//   * freed: the rank drops its buffer as soon as the call returns (AddressSanitizer reports a late write as
//     a heap-use-after-free);
//   * kept: the rank fills the buffer it got back with a sentinel and keeps it; once every thread has been
//     joined, a buffer whose sentinel was overwritten proves a late write (this fails without a sanitizer).

constexpr std::int64_t kBigNumel = std::int64_t{1} << 21;  // 8 MiB of f32 per rank
constexpr float kSentinel = -7.0f;

enum class Injection { abort_from_thread, short_deadline, two_subgroups_fail };

std::string InjectionName(Injection how) {
  switch (how) {
    case Injection::abort_from_thread: return "abort_from_thread";
    case Injection::short_deadline: return "short_deadline";
    case Injection::two_subgroups_fail: return "two_subgroups_fail";
  }
  return "?";
}

struct LateWriteProbe {
  std::mutex mu;
  std::vector<Tensor> kept;  // buffers whose call returned an error, filled with the sentinel
  void keep(Tensor t) {
    t.fill_(kSentinel);
    std::lock_guard<std::mutex> l(mu);
    kept.push_back(std::move(t));
  }
  // Called after every rank thread has been joined.
  void expect_untouched(int trial) {
    for (const Tensor& t : kept) {
      const std::vector<float> v = t.to_vector();
      const auto bad = std::find_if(v.begin(), v.end(), [](float x) { return x != kSentinel; });
      EXPECT_TRUE(bad == v.end()) << "trial " << trial << ": a peer wrote element " << (bad - v.begin())
                                  << " after the call returned";
    }
  }
};

// One rank's loop of up to `calls` all_reduces on `group`; returns the first failure (OK if none).
// fail_at >= 0: this rank disagrees on the size of that call (its group fails there). `announced` counts
// the calls ranks are about to make; `timeout` is this rank's deadline per call.
absl::Status BigAllReduces(ProcessGroup& group, int rank, int calls, int fail_at, bool keep, LateWriteProbe& probe,
                           std::atomic<int>& announced, absl::Duration timeout,
                           const std::function<void(int)>& before_call = nullptr) {
  for (int i = 0; i < calls; ++i) {
    Tensor t = Tensor::full({i == fail_at ? kBigNumel + 1 : kBigNumel}, static_cast<double>(rank));
    if (before_call) before_call(i);
    announced.fetch_add(1);
    absl::Status s = group.all_reduce(t, {.timeout = timeout})->wait();
    if (!s.ok()) {
      if (keep) probe.keep(std::move(t));
      return s;  // (freed: t is released here)
    }
  }
  return absl::OkStatus();
}

void RunInjection(Injection how, int trial, bool keep) {
  const int n = 4;
  LateWriteProbe probe;
  std::atomic<int> announced{0};
  const absl::Time start = absl::Now();
  absl::Status result = RunRanks(n, [&](RankEnv& env) -> absl::Status {
    switch (how) {
      case Injection::abort_from_thread: {
        std::thread aborter;
        if (env.rank == 0) {
          aborter = std::thread([&] {
            // Once every rank is in its third call, vary the point of the abort (the spin only moves the
            // injection point across the call; nothing waits on it).
            while (announced.load() < 3 * n) std::this_thread::yield();
            const absl::Time until = absl::Now() + absl::Microseconds(400 * trial);
            while (absl::Now() < until) std::this_thread::yield();
            env.world.abort(absl::CancelledError("stopped from another thread"));
          });
        }
        absl::Status s = BigAllReduces(env.group, env.rank, 1000, -1, keep, probe, announced, absl::Seconds(60));
        if (aborter.joinable()) aborter.join();
        return s;
      }
      case Injection::short_deadline: {
        // Rank 0 joins each call last, with a deadline far shorter than the data phase: once its share is
        // done it must wait for its peers' copies into its buffer, not leave at its deadline. (If it joins
        // before a peer, its call fails at the enter point, which is fine too.)
        const bool late = env.rank == 0;
        return BigAllReduces(env.group, env.rank, 4, -1, keep, probe, announced,
                             late ? absl::Microseconds(200) : absl::Seconds(60), [&](int i) {
                               if (late) {
                                 while (announced.load() < (i + 1) * n - 1) std::this_thread::yield();
                               }
                             });
      }
      case Injection::two_subgroups_fail: {
        // Sub-groups {0, 1} and {2, 3}; each fails (a size disagreement) at its own call, while the other may
        // be inside a data phase.
        auto sub = env.group.split(env.rank / 2, env.rank);
        if (!sub.ok()) return sub.status();
        const int fail_at = env.rank % 2 == 1 ? 2 + (env.rank / 2 + trial) % 2 : -1;
        return BigAllReduces(**sub, env.rank, 1000, fail_at, keep, probe, announced, absl::Seconds(60));
      }
    }
    return absl::InternalError("unknown injection");
  });
  if (how != Injection::short_deadline) {
    EXPECT_FALSE(result.ok()) << "trial " << trial;
  }
  EXPECT_NE(result.code(), absl::StatusCode::kInternal) << result;
  EXPECT_LT(absl::Now() - start, absl::Seconds(60));
  probe.expect_untouched(trial);
}

class LateWriteTest : public ::testing::TestWithParam<std::tuple<Injection, bool>> {};

TEST_P(LateWriteTest, NoRankReturnsWhileAPeerStillWritesItsBuffer) {
  const auto [how, keep] = GetParam();
  for (int trial = 0; trial < 8; ++trial) RunInjection(how, trial, keep);
}

INSTANTIATE_TEST_SUITE_P(Injections, LateWriteTest,
                         ::testing::Combine(::testing::Values(Injection::abort_from_thread, Injection::short_deadline,
                                                              Injection::two_subgroups_fail),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return InjectionName(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_kept" : "_freed");
                         });

}  // namespace
}  // namespace shardkit::comm
