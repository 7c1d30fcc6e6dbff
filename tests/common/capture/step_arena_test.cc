// StepArena (Note [step arena]): plan_arena on hand-built recordings (offsets and size asserted), and the arena
// through record -> serve cycles: a replay that follows the recording is served at the planned offsets; a range
// still held, a changed size or an extra allocation come from the heap; a departed replay is recorded again; heap
// blocks given back are reused by the next fallback of their size.
#include "common/capture/step_arena.h"

#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::capture {
namespace {

using ::testing::ElementsAre;

TEST(PlanArena, BlocksWhoseLifetimesOverlapGetDisjointRangesLargestFirst) {
  // a [0, 3) 256 B, b [1, 2) 128 B, c [4, 6) 256 B (after a: reuses offset 0), d [5, 7) 64 B, e never given back.
  const std::vector<ArenaBlock> blocks = {
      {256, 0, 3}, {128, 1, 2}, {256, 4, 6}, {64, 5, 7}, {512, 8, -1}};
  const ArenaPlan plan = plan_arena(blocks);
  EXPECT_THAT(plan.offsets, ElementsAre(0, 256, 0, 256, -1));
  EXPECT_EQ(plan.bytes, 384);
}

TEST(PlanArena, ASmallBlockFillsAGapLeftBetweenLargerOnes) {
  // x [0, 10) and z [0, 10), 128 B: 0 and 128; y [0, 4) 64 B: 256; w [5, 9) 64 B: the range y gave back.
  const std::vector<ArenaBlock> blocks = {{128, 0, 10}, {64, 0, 4}, {128, 0, 10}, {64, 5, 9}};
  const ArenaPlan plan = plan_arena(blocks);
  EXPECT_THAT(plan.offsets, ElementsAre(0, 256, 128, 256));
  EXPECT_EQ(plan.bytes, 320);
}

// One "replay": takes 256 B (a), 128 B (b), gives b back, takes 256 B (c), gives a (unless `keep_a`: a value held
// past the replay) and c back.
std::vector<void*> replay(StepArena& arena, bool keep_a = false) {
  arena.begin_replay();
  void* a = arena.allocate(256);
  void* b = arena.allocate(128);
  arena.free(b, 128);
  void* c = arena.allocate(256);
  if (!keep_a) arena.free(a, 256);
  arena.free(c, 256);
  arena.end_replay();
  return {a, b, c};
}

TEST(StepArena, TheFirstReplayIsRecordedAndTheNextServedAtThePlannedOffsets) {
  StepArena arena;
  replay(arena);
  EXPECT_EQ(arena.stats().recordings, 1);
  EXPECT_EQ(arena.stats().from_heap, 3);
  EXPECT_EQ(arena.stats().arena_bytes, 512);  // a [0, 4) at 0; c [3, 5) overlaps a: 256; b [1, 2) beside a only: 256
  const std::vector<void*> p = replay(arena);
  EXPECT_EQ(arena.stats().from_arena, 3);
  EXPECT_EQ(arena.stats().from_heap, 0);
  const auto* base = static_cast<const std::byte*>(p[0]);
  EXPECT_EQ(static_cast<const std::byte*>(p[1]) - base, 256);
  EXPECT_EQ(static_cast<const std::byte*>(p[2]) - base, 256);
  EXPECT_EQ(replay(arena), p);  // the same places every replay
  EXPECT_EQ(arena.stats().recordings, 1);
}

TEST(StepArena, ARangeStillHeldIsNeverHandedOutAgain) {
  StepArena arena;
  replay(arena);
  // A replay that keeps its first block past the end (a value held by someone), then a replay beside it.
  void* kept = replay(arena, /*keep_a=*/true)[0];
  const std::vector<void*> next = replay(arena);
  EXPECT_NE(next[0], kept);  // the held range went to the heap instead
  EXPECT_EQ(arena.stats().from_heap, 1);
  EXPECT_EQ(arena.stats().from_arena, 2);
  arena.free(kept, 256);
  replay(arena);
  EXPECT_EQ(arena.stats().from_arena, 3);
}

TEST(StepArena, AReplayThatDepartsFromTheRecordingIsServedFromTheHeapAndRecordedAgain) {
  StepArena arena;
  replay(arena);
  arena.begin_replay();
  void* a = arena.allocate(256);
  void* b = arena.allocate(192);  // the recording says 128
  void* extra1 = arena.allocate(64);
  void* extra2 = arena.allocate(64);  // beyond the recording
  for (auto [p, n] : {std::pair{a, 256}, {b, 192}, {extra1, 64}, {extra2, 64}}) arena.free(p, n);
  arena.end_replay();
  EXPECT_EQ(arena.stats().from_arena, 1);
  EXPECT_EQ(arena.stats().from_heap, 3);
  arena.begin_replay();  // recorded again: from the heap
  void* big = arena.allocate(1024);
  arena.free(big, 1024);
  arena.end_replay();
  EXPECT_EQ(arena.stats().recordings, 2);
  EXPECT_EQ(arena.stats().arena_bytes, 1024);
  arena.begin_replay();
  big = arena.allocate(1024);
  std::thread([&] { arena.free(big, 1024); }).join();  // given back on another thread
  arena.end_replay();
  EXPECT_EQ(arena.stats().from_arena, 1);
}

// Note [arena spares]: a block that fell back to the heap (its range still held) and was given back is kept, and the
// next fallback of the same size takes it instead of the heap's; spares stay under a quarter of the arena.
TEST(StepArena, AHeapBlockGivenBackIsTheNextFallbackOfItsSize) {
  StepArena arena;
  auto step = [&arena](bool keep_small) {
    arena.begin_replay();
    void* small = arena.allocate(256);
    void* big = arena.allocate(4096);
    arena.free(big, 4096);
    if (!keep_small) arena.free(small, 256);
    arena.end_replay();
    return small;
  };
  step(false);  // recorded: arena of 4352 bytes, spares up to 1088
  void* held = step(true);  // from the arena, held past the replay
  void* first = step(false);  // its range is busy: from the heap, then given back
  EXPECT_NE(first, held);
  EXPECT_EQ(arena.stats().from_heap, 1);
  EXPECT_EQ(arena.stats().from_spares, 0);
  EXPECT_EQ(arena.stats().spare_bytes, 256);
  void* second = step(false);
  EXPECT_EQ(second, first);  // the spare, not a new block
  EXPECT_EQ(arena.stats().from_heap, 1);
  EXPECT_EQ(arena.stats().from_spares, 1);
  EXPECT_EQ(arena.stats().spare_bytes, 256);
  // A block over the bound is freed, not kept: 2048 > 1088 - 256.
  arena.begin_replay();
  void* over = arena.allocate(2048);  // departs from the recording: the heap
  arena.free(over, 2048);
  arena.end_replay();
  EXPECT_EQ(arena.stats().spare_bytes, 256);
  arena.free(held, 256);
}

}  // namespace
}  // namespace shardkit::capture
