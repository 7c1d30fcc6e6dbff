// RunRanks: the test harness over comm::run_ranks (common/comm/run_ranks.h, which documents the rank
// threads, their contexts and RNG streams, and the failure semantics: a failing or throwing rank aborts the
// world naming itself, a returning rank departs, the first failure is returned). RunRanks only hands fn the
// richer RankEnv below (references to the context, group and world) that the tests are written against.
//
//   absl::Status st = RunRanks(4, [](RankEnv& env) {
//     Tensor t = Tensor::full({8}, env.rank);
//     absl::Status s = env.group.all_reduce(t)->wait();
//     ...                                  // gtest EXPECT_* / ASSERT_* work here too
//     return s;                            // or return nothing (void)
//   });
//   EXPECT_TRUE(st.ok()) << st;
//
// gtest: assertion failures inside fn are recorded by gtest as usual (gtest is thread-safe), but the
// harness does not see them: an ASSERT_* that returns early from fn makes the rank depart, which fails
// the others' collectives (reported by RunRanks). This library does not depend on gtest.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/comm/in_process_group.h"
#include "common/comm/process_group.h"
#include "common/comm/run_ranks.h"
#include "common/tensor/rank_context.h"

namespace shardkit::comm {

struct RankEnv {
  int rank;
  int world_size;
  RankContext& context;  // this rank's context (also current_rank_context() on this thread)
  ProcessGroup& group;   // this rank's world group handle
  std::shared_ptr<ProcessGroup> group_ptr;  // the same handle, shared (to hand to layers that keep it)
  InProcessWorld& world;
};

// RunRanksOptions: comm::RunRanksOptions (run_ranks.h).

// The harness's view of a run_ranks thread.
RankEnv to_rank_env(ThreadRankEnv& env);

// fn(RankEnv&) returns void or absl::Status, as for run_ranks.
template <typename F>
absl::Status RunRanks(int n, F&& fn, const RunRanksOptions& options = {}) {
  return run_ranks(
      n,
      [&fn](ThreadRankEnv& t) -> decltype(auto) {
        RankEnv env = to_rank_env(t);
        return fn(env);
      },
      options);
}

}  // namespace shardkit::comm
