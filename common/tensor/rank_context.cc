#include "common/tensor/rank_context.h"

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

RankContext& current_rank_context() { return tl_context ? *tl_context : ThreadDefaultContext(); }

RankContextScope::RankContextScope(RankContext& ctx) : previous_(tl_context) { tl_context = &ctx; }
RankContextScope::~RankContextScope() { tl_context = previous_; }

MemoryCategory current_memory_category() { return tl_category; }

MemoryCategoryScope::MemoryCategoryScope(MemoryCategory category) : previous_(tl_category) {
  tl_category = category;
}
MemoryCategoryScope::~MemoryCategoryScope() { tl_category = previous_; }

}  // namespace shardkit
