// comm::run_ranks, the public thread launcher: contexts and groups per rank, the failure semantics (a failing
// or throwing rank aborts the world naming itself, a returning rank departs; the first failure is returned),
// and the per-rank RNG streams (also through the RunRanks test harness built on it).
#include "common/comm/run_ranks.h"

#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/comm/testing/run_ranks.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::comm {
namespace {

using ::testing::HasSubstr;

// A deadline the tests never reach: a rank released by it, not by the abort or departure, fails the wall-time
// check.
RunRanksOptions long_timeout() {
  RunRanksOptions o;
  o.timeout = absl::Minutes(5);
  return o;
}

struct PerRank {
  std::mutex mu;
  std::vector<absl::Status> status;
  std::vector<std::vector<float>> draws;
  explicit PerRank(int n) : status(static_cast<std::size_t>(n)), draws(static_cast<std::size_t>(n)) {}
};

std::vector<float> draw(Generator& g) {
  std::vector<float> v(8);
  g.fill_uniform(v.data(), static_cast<std::int64_t>(v.size()));
  return v;
}

TEST(RunRanksTest, AllRanksSucceedGivesOkAndEachRankItsOwnContextAndGroup) {
  const int n = 3;
  PerRank seen(n);
  absl::Status st = run_ranks(n, [&](ThreadRankEnv& env) -> absl::Status {
    if (&current_rank_context() != &env.context) return absl::InternalError("context not installed");
    if (env.context.rank != env.rank || env.context.world_size != n || env.world_size != n) {
      return absl::InternalError("wrong rank or world size in the context");
    }
    if (env.group == nullptr || env.group->rank() != env.rank || env.group->size() != n) {
      return absl::InternalError("wrong group");
    }
    Tensor t = Tensor::full({4}, static_cast<double>(env.rank + 1));
    if (absl::Status s = env.group->all_reduce(t)->wait(); !s.ok()) return s;
    std::lock_guard<std::mutex> l(seen.mu);
    seen.draws[static_cast<std::size_t>(env.rank)] = {static_cast<float>(t.item_at(0))};
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  for (int r = 0; r < n; ++r) EXPECT_EQ(seen.draws[static_cast<std::size_t>(r)], std::vector<float>{6.f}) << r;
}

TEST(RunRanksTest, VoidFunctionsAreAccepted) {
  int ranks_run = 0;
  std::mutex mu;
  absl::Status st = run_ranks(2, [&](ThreadRankEnv&) {
    std::lock_guard<std::mutex> l(mu);
    ++ranks_run;
  });
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(ranks_run, 2);
}

TEST(RunRanksTest, ThrowingRankAbortsTheOthersNamingIt) {
  const int n = 3;
  PerRank got(n);
  const absl::Time start = absl::Now();
  absl::Status st = run_ranks(
      n,
      [&](ThreadRankEnv& env) -> absl::Status {
        if (env.rank == 1) throw std::runtime_error("bad batch");
        absl::Status s = env.group->barrier({.tag = "step"})->wait();
        std::lock_guard<std::mutex> l(got.mu);
        got.status[static_cast<std::size_t>(env.rank)] = s;
        return s;
      },
      long_timeout());
  EXPECT_LT(absl::Now() - start, absl::Seconds(60));
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("rank 1: threw: bad batch"));
  for (int r : {0, 2}) {
    const absl::Status& s = got.status[static_cast<std::size_t>(r)];
    EXPECT_FALSE(s.ok()) << r;
    EXPECT_THAT(std::string(s.message()), HasSubstr("rank 1: threw: bad batch")) << r;
  }
}

TEST(RunRanksTest, FailingStatusIsReturnedWithItsCodeNamingTheRank) {
  absl::Status st = run_ranks(
      2,
      [&](ThreadRankEnv& env) -> absl::Status {
        if (env.rank == 0) return absl::InvalidArgumentError("expected 4 columns, found 3");
        return env.group->barrier()->wait();
      },
      long_timeout());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("rank 0: expected 4 columns, found 3"));
}

TEST(RunRanksTest, ReturningRankDepartsAndReleasesTheOthers) {
  const absl::Time start = absl::Now();
  absl::Status st = run_ranks(
      2,
      [&](ThreadRankEnv& env) -> absl::Status {
        if (env.rank == 1) return absl::OkStatus();
        return env.group->barrier({.tag = "end"})->wait();
      },
      long_timeout());
  EXPECT_LT(absl::Now() - start, absl::Seconds(60));
  EXPECT_EQ(st.code(), absl::StatusCode::kAborted) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("rank 1 returned from its function"));
}

// Rank r draws from Generator(seed).fork(r): the streams differ across ranks; same_on_every_rank gives
// every rank Generator(seed).
TEST(RunRanksTest, EachRankDrawsFromItsOwnStreamUnlessAskedOtherwise) {
  const int n = 3;
  for (RankStreams streams : {RankStreams::per_rank, RankStreams::same_on_every_rank}) {
    PerRank got(n);
    RunRanksOptions o;
    o.seed = 11;
    o.streams = streams;
    absl::Status st = run_ranks(
        n,
        [&](ThreadRankEnv& env) {
          std::vector<float> v = draw(current_rank_context().generator);
          std::lock_guard<std::mutex> l(got.mu);
          got.draws[static_cast<std::size_t>(env.rank)] = v;
        },
        o);
    ASSERT_TRUE(st.ok()) << st;
    for (int r = 0; r < n; ++r) {
      Generator expected = streams == RankStreams::per_rank ? Generator(11).fork(static_cast<std::uint64_t>(r))
                                                            : Generator(11);
      EXPECT_EQ(got.draws[static_cast<std::size_t>(r)], draw(expected)) << r;
    }
    if (streams == RankStreams::per_rank) {
      EXPECT_NE(got.draws[0], got.draws[1]);
      EXPECT_NE(got.draws[1], got.draws[2]);
    } else {
      EXPECT_EQ(got.draws[0], got.draws[1]);
    }
  }
}

// The test harness is the same launcher: its ranks draw from the same per-rank streams.
TEST(RunRanksTest, HarnessRanksDrawFromThePerRankStreams) {
  PerRank got(2);
  RunRanksOptions o;
  o.seed = 3;
  absl::Status st = RunRanks(
      2,
      [&](RankEnv& env) {
        std::vector<float> v = draw(env.context.generator);
        std::lock_guard<std::mutex> l(got.mu);
        got.draws[static_cast<std::size_t>(env.rank)] = v;
      },
      o);
  ASSERT_TRUE(st.ok()) << st;
  Generator g0 = Generator(3).fork(0), g1 = Generator(3).fork(1);
  EXPECT_EQ(got.draws[0], draw(g0));
  EXPECT_EQ(got.draws[1], draw(g1));
  EXPECT_NE(got.draws[0], got.draws[1]);
}

}  // namespace
}  // namespace shardkit::comm
