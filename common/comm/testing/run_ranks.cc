#include "common/comm/testing/run_ranks.h"

namespace shardkit::comm {

absl::Status RunRanksImpl(int n, const std::function<absl::Status(RankEnv&)>& fn, const RunRanksOptions& options) {
  return run_ranks_impl(
      n,
      [&fn](ThreadRankEnv& t) {
        RankEnv env{t.rank, t.world_size, t.context, *t.group, t.group, t.world};
        return fn(env);
      },
      options);
}

}  // namespace shardkit::comm
