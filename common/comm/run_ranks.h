// run_ranks: runs n ranks as threads of this process, each with its own rank context and its own handle on
// an in-process world group (DESIGN.md section 8). For programs (examples, tools) and, through
// comm/testing/run_ranks.h, for every layer's tests.
//
//   absl::Status st = comm::run_ranks(4, [&](comm::ThreadRankEnv& env) -> absl::Status {
//     nn::GPT model(config, /*seed=*/1);
//     auto opt = oss::Oss::create(..., env.group);
//     ...
//     return absl::OkStatus();           // or return nothing (void)
//   });
//   if (!st.ok()) ...                    // the first failure, naming its rank
//
// Each rank thread gets:
//   * a RankContext {rank, world_size, its own MemoryTracker, its own Generator} installed with
//     RankContextScope for the whole call, so tensors it allocates are charged to its own ledger and
//     the randomness it draws (dropout, ...) comes from its own stream: Generator(seed).fork(rank) by
//     default, so it differs across ranks; RankStreams::same_on_every_rank gives every rank Generator(seed);
//   * its own ProcessGroup handle on the world (env.group), created by an InProcessWorld.
// fn may return void or absl::Status.
//
// Failure: when a rank's fn throws or returns a non-OK Status, the world is aborted with
// "rank r: <what>" (a throw reads "rank r: threw: <what()>"), so every other rank's pending and later
// collectives fail at once, naming it; when a rank's fn returns, the rank is marked departed (collectives of
// other ranks that wait for it fail at once instead of waiting for their deadline). run_ranks joins every
// thread and returns OK, or the FIRST failure (the origin, not the consequences it caused on other ranks).
// Collectives have a default timeout (RunRanksOptions::timeout) so nothing waits forever; code in fn that
// waits on something else must use deadlines too.
//
// Lifetime: the contexts, groups and world live until run_ranks returns; nothing may use references to them
// after that (tensors a rank made stay valid: their storage keeps its rank's tracker alive).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/comm/in_process_group.h"
#include "common/comm/process_group.h"
#include "common/tensor/rank_context.h"

namespace shardkit::comm {

// What one rank thread of run_ranks is handed.
struct ThreadRankEnv {
  int rank;
  int world_size;
  RankContext& context;                 // this rank's context (also current_rank_context() on this thread)
  std::shared_ptr<ProcessGroup> group;  // this rank's handle on the world group
  InProcessWorld& world;
};

struct RunRanksOptions {
  // Default timeout of every collective (the group's default_timeout).
  absl::Duration timeout = absl::Seconds(60);
  // The in-process backend's reduction chunk; 0 = its default. Tests set e.g. 16 to run multi-chunk paths.
  std::int64_t chunk_bytes = 0;
  // Seed of every rank's Generator: rank r uses rank_generator(seed, r, streams).
  std::uint64_t seed = 0;
  RankStreams streams = RankStreams::per_rank;
};

absl::Status run_ranks_impl(int n, const std::function<absl::Status(ThreadRankEnv&)>& fn,
                            const RunRanksOptions& options);

template <typename F>
absl::Status run_ranks(int n, F&& fn, const RunRanksOptions& options = {}) {
  using R = std::invoke_result_t<F&, ThreadRankEnv&>;
  if constexpr (std::is_void_v<R>) {
    return run_ranks_impl(
        n,
        [&fn](ThreadRankEnv& env) {
          fn(env);
          return absl::OkStatus();
        },
        options);
  } else {
    static_assert(std::is_convertible_v<R, absl::Status>, "run_ranks: fn must return void or absl::Status");
    return run_ranks_impl(n, [&fn](ThreadRankEnv& env) -> absl::Status { return fn(env); }, options);
  }
}

}  // namespace shardkit::comm
