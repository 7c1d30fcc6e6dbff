#include "oss/partition.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::oss {
namespace {

using ::testing::ElementsAre;

TEST(GreedyPartitionTest, LargestFirstToLeastLoadedRank) {
  // Sizes 5, 9, 3, 7 on 2 ranks: 9 -> r0, 7 -> r1, 5 -> r1 (7 < 9), 3 -> r0 (9 < 12).
  GreedyPartition p = partition_greedy({{5, 9, 3, 7}}, 2);
  EXPECT_THAT(p.owner[0], ElementsAre(1, 0, 0, 1));
  EXPECT_THAT(p.rank_numel, ElementsAre(12, 12));
  EXPECT_THAT(p.owned(0, 0), ElementsAre(1, 2));
  EXPECT_THAT(p.owned(0, 1), ElementsAre(0, 3));
}

TEST(GreedyPartitionTest, TotalsCarryAcrossGroupsAndTiesGoToLowerRankAndIndex) {
  GreedyPartition p = partition_greedy({{4, 4, 4}, {2, 2}}, 3);
  EXPECT_THAT(p.owner[0], ElementsAre(0, 1, 2));
  EXPECT_THAT(p.owner[1], ElementsAre(0, 1));
  EXPECT_THAT(p.rank_numel, ElementsAre(6, 6, 4));
}

TEST(GreedyPartitionTest, MoreRanksThanParametersLeavesRanksEmpty) {
  GreedyPartition p = partition_greedy({{10}}, 4);
  EXPECT_THAT(p.owner[0], ElementsAre(0));
  EXPECT_THAT(p.rank_numel, ElementsAre(10, 0, 0, 0));
  EXPECT_TRUE(p.owned(0, 3).empty());
}

TEST(FlatPartitionTest, TensorsStraddleRanksWithinEachGroup) {
  // Group 0: total 10 over 3 ranks, shard 4 -> [0,4) [4,8) [8,10). Group 1: total 3, shard 1.
  FlatPartition p = partition_flat({{3, 7}, {3}}, 3);
  EXPECT_EQ(p.groups[0].total, 10);
  EXPECT_EQ(p.groups[0].shard_size, 4);
  EXPECT_EQ(p.groups[1].shard_size, 1);
  EXPECT_THAT(p.slices[0], ElementsAre(Slice{0, 0, 0, 3, 0}, Slice{0, 1, 0, 1, 3}, Slice{1, 0, 0, 1, 0}));
  EXPECT_THAT(p.slices[1], ElementsAre(Slice{0, 1, 1, 4, 4}, Slice{1, 0, 1, 1, 1}));
  EXPECT_THAT(p.slices[2], ElementsAre(Slice{0, 1, 5, 2, 8}, Slice{1, 0, 2, 1, 2}));
  EXPECT_EQ(p.owned_numel(2), 3);
}

TEST(FlatPartitionTest, CoversEveryElementExactlyOnce) {
  for (int world : {1, 2, 3, 4, 5, 8}) {
    const GroupSizes sizes = {{7, 1, 0, 13}, {5}, {}, {2, 9}};
    FlatPartition p = partition_flat(sizes, world);
    std::vector<std::int64_t> next_flat(sizes.size(), 0);  // per group, where the next slice must start
    std::int64_t covered = 0;
    for (int r = 0; r < world; ++r) {
      std::int64_t owned = 0;
      for (const Slice& s : p.slices[r]) {
        EXPECT_EQ(s.flat_offset, next_flat[s.group]) << "world " << world;
        EXPECT_GE(s.flat_offset, p.groups[s.group].begin(r));
        EXPECT_LE(s.flat_offset + s.length, p.groups[s.group].end(r));
        next_flat[s.group] += s.length;
        owned += s.length;
        EXPECT_GT(s.length, 0);
      }
      EXPECT_EQ(owned, p.owned_numel(r));
      covered += owned;
    }
    EXPECT_EQ(covered, 37);
    for (std::size_t g = 0; g < sizes.size(); ++g) EXPECT_EQ(next_flat[g], p.groups[g].total);
  }
}

TEST(FlatPartitionTest, EmptyModel) {
  FlatPartition p = partition_flat({{}}, 4);
  EXPECT_EQ(p.groups[0].total, 0);
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(p.slices[r].empty());
}

}  // namespace
}  // namespace shardkit::oss
