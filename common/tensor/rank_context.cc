#include "common/tensor/rank_context.h"

#include "common/base/check.h"

namespace shardkit {
namespace {
// Thread-local, not process-global: each simulated rank is its own thread (DESIGN.md section 2).
thread_local RankContext* tl_context = nullptr;
thread_local MemoryCategory tl_category = MemoryCategory::other;

RankContext& ThreadDefaultContext() {
  thread_local RankContext ctx;
  return ctx;
}
}  // namespace

Generator rank_generator(std::uint64_t seed, int rank, RankStreams streams) {
  SK_CHECK_GE(rank, 0);
  const Generator base(seed);
  return streams == RankStreams::per_rank ? base.fork(static_cast<std::uint64_t>(rank)) : base;
}

void set_rank(RankContext& ctx, int rank, int world_size, std::uint64_t seed, RankStreams streams) {
  SK_CHECK_GE(rank, 0);
  SK_CHECK_LT(rank, world_size);
  ctx.rank = rank;
  ctx.world_size = world_size;
  ctx.generator = rank_generator(seed, rank, streams);
}

RankContext& current_rank_context() { return tl_context ? *tl_context : ThreadDefaultContext(); }

RankContextScope::RankContextScope(RankContext& ctx) : previous_(tl_context) { tl_context = &ctx; }
RankContextScope::~RankContextScope() { tl_context = previous_; }

MemoryCategory current_memory_category() { return tl_category; }

MemoryCategoryScope::MemoryCategoryScope(MemoryCategory category) : previous_(tl_category) {
  tl_category = category;
}
MemoryCategoryScope::~MemoryCategoryScope() { tl_category = previous_; }

}  // namespace shardkit
