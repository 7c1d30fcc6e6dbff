#include "common/comm/testing/run_ranks.h"

namespace shardkit::comm {

RankEnv to_rank_env(ThreadRankEnv& env) {
  return RankEnv{env.rank, env.world_size, env.context, *env.group, env.group, env.world};
}

}  // namespace shardkit::comm
