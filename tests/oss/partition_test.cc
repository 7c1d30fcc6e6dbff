#include "oss/partition.h"

#include <numeric>
#include <vector>

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
  EXPECT_EQ(p.chunks[0].total, 10);
  EXPECT_EQ(p.chunks[0].shard_size, 4);
  EXPECT_EQ(p.chunks[1].shard_size, 1);
  EXPECT_THAT(p.slices[0], ElementsAre(Slice{0, 0, 0, 3, 0}, Slice{0, 1, 0, 1, 3}, Slice{1, 0, 0, 1, 0}));
  EXPECT_THAT(p.slices[1], ElementsAre(Slice{0, 1, 1, 4, 4}, Slice{1, 0, 1, 1, 1}));
  EXPECT_THAT(p.slices[2], ElementsAre(Slice{0, 1, 5, 2, 8}, Slice{1, 0, 2, 1, 2}));
  EXPECT_EQ(p.owned_numel(2), 3);
}

TEST(FlatPartitionTest, CoversEveryElementExactlyOnce) {
  const GroupSizes sizes = {{7, 1, 0, 13}, {5}, {}, {2, 9}};
  for (std::int64_t chunk_numel : {0, 1, 8, 14}) {
    for (int world : {1, 2, 3, 4, 5, 8}) {
      FlatPartition p = partition_flat(sizes, world, chunk_numel);
      std::vector<std::vector<int>> hits;  // per group, per flat element: slices covering it
      for (const auto& g : sizes) hits.emplace_back(std::accumulate(g.begin(), g.end(), std::int64_t{0}), 0);
      for (int r = 0; r < world; ++r) {
        std::int64_t owned = 0;
        for (const Slice& s : p.slices[r]) {
          const FlatChunk& c = p.chunks[p.chunk_of(s.group, s.flat_offset)];
          EXPECT_GE(s.flat_offset, c.begin(r)) << "world " << world << " chunk " << chunk_numel;
          EXPECT_LE(s.flat_offset + s.length, c.end(r)) << "world " << world << " chunk " << chunk_numel;
          EXPECT_GT(s.length, 0);
          for (std::int64_t e = s.flat_offset; e < s.flat_offset + s.length; ++e) ++hits[s.group][e];
          owned += s.length;
        }
        EXPECT_EQ(owned, p.owned_numel(r));
      }
      for (const auto& g : hits) {
        for (int h : g) EXPECT_EQ(h, 1) << "world " << world << " chunk " << chunk_numel;
      }
    }
  }
}

// Note [flat chunks]: chunks are runs of whole parameters of at most chunk_numel elements (a larger
// parameter alone), each split evenly; every rank owns a part of every chunk.
TEST(FlatPartitionTest, ChunksAreRunsOfWholeParametersEachSplitOverEveryRank) {
  // Group 0: 3, 4, 9, 2, 2 with chunks of 8 -> [3 4] [9] [2 2]; group 1: 5 -> [5].
  FlatPartition p = partition_flat({{3, 4, 9, 2, 2}, {5}}, 2, 8);
  ASSERT_EQ(p.chunks.size(), 4u);
  EXPECT_EQ(p.chunks[0].base, 0);
  EXPECT_EQ(p.chunks[0].total, 7);
  EXPECT_EQ(p.chunks[0].shard_size, 4);
  EXPECT_EQ(p.chunks[1].base, 7);
  EXPECT_EQ(p.chunks[1].total, 9);
  EXPECT_EQ(p.chunks[2].base, 16);
  EXPECT_EQ(p.chunks[2].total, 4);
  EXPECT_EQ(p.chunks[3].group, 1);
  EXPECT_EQ(p.chunks[3].base, 0);
  EXPECT_EQ(p.chunk_of(0, 6), 0);
  EXPECT_EQ(p.chunk_of(0, 7), 1);
  EXPECT_EQ(p.chunk_of(0, 19), 2);
  EXPECT_EQ(p.chunk_of(1, 0), 3);
  // Rank 0 owns the first half of every chunk: [0,4) [7,12) [16,18) and group 1's [0,3).
  EXPECT_THAT(p.slices[0], ElementsAre(Slice{0, 0, 0, 3, 0}, Slice{0, 1, 0, 1, 3}, Slice{0, 2, 0, 5, 7},
                                       Slice{0, 3, 0, 2, 16}, Slice{1, 0, 0, 3, 0}));
  EXPECT_THAT(p.slices[1], ElementsAre(Slice{0, 1, 1, 3, 4}, Slice{0, 2, 5, 4, 12}, Slice{0, 4, 0, 2, 18},
                                       Slice{1, 0, 3, 2, 3}));
  EXPECT_EQ(p.owned_numel(0), 14);
  EXPECT_EQ(p.owned_numel(1), 11);
  // chunk_numel <= 0: one chunk per group, as without chunks.
  EXPECT_EQ(partition_flat({{3, 4, 9, 2, 2}, {5}}, 2, 0).chunks.size(), 2u);
}

TEST(FlatPartitionTest, EmptyModel) {
  FlatPartition p = partition_flat({{}}, 4);
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].total, 0);
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(p.slices[r].empty());
}

}  // namespace
}  // namespace shardkit::oss
