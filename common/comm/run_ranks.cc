#include "common/comm/run_ranks.h"

#include <exception>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"

namespace shardkit::comm {

absl::Status run_ranks_impl(int n, const std::function<absl::Status(ThreadRankEnv&)>& fn,
                            const RunRanksOptions& options) {
  SK_CHECK_GT(n, 0);
  InProcessOptions world_options;
  world_options.default_timeout = options.timeout;
  if (options.chunk_bytes > 0) world_options.chunk_bytes = options.chunk_bytes;
  std::shared_ptr<InProcessWorld> world = InProcessWorld::create(n, world_options);

  std::vector<RankContext> contexts(static_cast<std::size_t>(n));
  std::vector<std::shared_ptr<ProcessGroup>> groups;
  for (int r = 0; r < n; ++r) {
    set_rank(contexts[static_cast<std::size_t>(r)], r, n, options.seed, options.streams);
    groups.push_back(world->group(r));
  }

  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      const auto i = static_cast<std::size_t>(r);
      absl::Status st;
      {
        RankContextScope scope(contexts[i]);
        ThreadRankEnv env{r, n, contexts[i], groups[i], *world};
        try {
          st = fn(env);
        } catch (const std::exception& e) {
          st = absl::InternalError(absl::StrCat("threw: ", e.what()));
        } catch (...) {
          st = absl::InternalError("threw a non-standard exception");
        }
      }
      if (!st.ok()) world->abort(absl::Status(st.code(), absl::StrCat("rank ", r, ": ", st.message())));
      world->mark_departed(r);
    });
  }
  for (auto& t : threads) t.join();
  // Release the groups (and the tensors their pending Works may hold) before the contexts they charge.
  groups.clear();
  return world->status();
}

}  // namespace shardkit::comm
