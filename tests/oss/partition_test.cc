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

TEST(FlatPartitionTest, TensorsStraddleRanks) {
  // Total 10 over 3 ranks: shard 4 -> [0,4) [4,8) [8,10).
  FlatPartition p = partition_flat({{3, 4}, {3}}, 3);
  EXPECT_EQ(p.total, 10);
  EXPECT_EQ(p.shard_size, 4);
  EXPECT_THAT(p.slices[0], ElementsAre(Slice{0, 0, 0, 3, 0}, Slice{0, 1, 0, 1, 3}));
  EXPECT_THAT(p.slices[1], ElementsAre(Slice{0, 1, 1, 3, 4}, Slice{1, 0, 0, 1, 7}));
  EXPECT_THAT(p.slices[2], ElementsAre(Slice{1, 0, 1, 2, 8}));
  EXPECT_EQ(p.owned_numel(2), 2);
}

TEST(FlatPartitionTest, CoversEveryElementExactlyOnce) {
  for (int world : {1, 2, 3, 4, 5, 8}) {
    const GroupSizes sizes = {{7, 1, 0, 13}, {5}, {}, {2, 9}};
    FlatPartition p = partition_flat(sizes, world);
    std::int64_t expected_flat = 0;
    for (int r = 0; r < world; ++r) {
      std::int64_t owned = 0;
      for (const Slice& s : p.slices[r]) {
        EXPECT_EQ(s.flat_offset, expected_flat) << "world " << world;
        expected_flat += s.length;
        owned += s.length;
        EXPECT_GT(s.length, 0);
      }
      EXPECT_EQ(owned, p.owned_numel(r));
      EXPECT_LE(owned, p.shard_size);
    }
    EXPECT_EQ(expected_flat, 37);
  }
}

TEST(FlatPartitionTest, EmptyModel) {
  FlatPartition p = partition_flat({{}}, 4);
  EXPECT_EQ(p.total, 0);
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(p.slices[r].empty());
}

}  // namespace
}  // namespace shardkit::oss
