// RunRanks: runs n simulated ranks as threads of this process, each with its own rank context and its
// own handle on an in-process world group (DESIGN.md section 8). The harness of every layer's tests.
//
//   absl::Status st = RunRanks(4, [](RankEnv& env) {
//     Tensor t = Tensor::full({8}, env.rank);
//     absl::Status s = env.group.all_reduce(t)->wait();
//     ...                                  // gtest EXPECT_* / ASSERT_* work here too
//     return s;                            // or return nothing (void)
//   });
//   EXPECT_TRUE(st.ok()) << st;
//
// Each rank thread gets:
//   * a RankContext {rank, world_size, its own MemoryTracker, Generator(seed).fork(rank)} installed with
//     RankContextScope for the whole call, so tensors it allocates are charged to its own ledger;
//   * its own ProcessGroup handle on the world (env.group), created by an InProcessWorld.
// fn may return void or absl::Status.
//
// Failure: when a rank's fn throws or returns a non-OK Status, the world is aborted with
// "rank r: <what>" (so every other rank's pending and later collectives fail at once, naming it);
// when a rank's fn returns, the rank is marked departed (collectives of other ranks that wait for it
// fail at once instead of waiting for their deadline). RunRanks joins every thread and returns OK, or
// the FIRST failure (the origin, not the consequences it caused on other ranks), which names its rank.
// Collectives have a default timeout (RunRanksOptions::timeout) so nothing waits forever; code in fn
// that waits on something else must use deadlines too.
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

struct RunRanksOptions {
  // Default timeout of every collective (the group's default_timeout).
  absl::Duration timeout = absl::Seconds(60);
  // The in-process backend's reduction chunk; 0 = its default. Tests set e.g. 16 to run multi-chunk paths.
  std::int64_t chunk_bytes = 0;
  // Seed of every rank's Generator (rank r uses Generator(seed).fork(r)).
  std::uint64_t seed = 0;
};

absl::Status RunRanksImpl(int n, const std::function<absl::Status(RankEnv&)>& fn, const RunRanksOptions& options);

template <typename F>
absl::Status RunRanks(int n, F&& fn, const RunRanksOptions& options = {}) {
  using R = std::invoke_result_t<F&, RankEnv&>;
  if constexpr (std::is_void_v<R>) {
    return RunRanksImpl(
        n,
        [&fn](RankEnv& env) {
          fn(env);
          return absl::OkStatus();
        },
        options);
  } else {
    static_assert(std::is_convertible_v<R, absl::Status>, "RunRanks: fn must return void or absl::Status");
    return RunRanksImpl(n, [&fn](RankEnv& env) -> absl::Status { return fn(env); }, options);
  }
}

}  // namespace shardkit::comm
