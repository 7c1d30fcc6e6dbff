// Partition policies for optimizer-state sharding (DESIGN.md section 3): pure functions from parameter
// sizes to "who owns what". No tensors, no communication: easy to test, and every rank computes the same
// answer from the same inputs.
//
// Two policies:
//  * Greedy (fairscale OSS / PyTorch ZeroRedundancyOptimizer behaviour): whole tensors. Within each param
//    group, parameters are visited largest first (ties: lower index first) and each goes to the rank whose
//    running total is smallest (ties: lower rank). Totals carry over from group to group, so the balance is
//    over the whole model. Frozen parameters are partitioned like any other (as the anchors do): ownership
//    does not move when a parameter is frozen or unfrozen.
//  * Flat: per param group, the group's parameters concatenated in order form a flat index space of
//    `total` elements, split into `world` contiguous ranges of ceil(total / world) elements (the last
//    ranges may be shorter or empty). A tensor may straddle ranks: each rank owns a list of slices. This
//    is what makes one reduce-scatter / all-gather per bucket possible. Per group (not over the whole
//    model) so that adding a param group never moves ownership of existing parameters.
#pragma once

#include <cstdint>
#include <vector>

namespace shardkit::oss {

// Sizes (numel) of the parameters of each param group, in group order.
using GroupSizes = std::vector<std::vector<std::int64_t>>;

// Greedy result: owner[g][i] is the rank owning parameter i of group g.
struct GreedyPartition {
  std::vector<std::vector<int>> owner;
  std::vector<std::int64_t> rank_numel;  // total elements owned per rank

  // Parameter indices of group g owned by `rank`, in group order.
  std::vector<int> owned(int group, int rank) const;
};

GreedyPartition partition_greedy(const GroupSizes& sizes, int world);

// A piece of parameter `param` of group `group`: elements [offset, offset + length) of that tensor.
struct Slice {
  int group = 0;
  int param = 0;
  std::int64_t offset = 0;
  std::int64_t length = 0;
  std::int64_t flat_offset = 0;  // where the slice starts in its group's flat index space
  friend bool operator==(const Slice&, const Slice&) = default;
};

// One group's flat index space and its split.
struct FlatGroup {
  std::int64_t total = 0;       // elements of the group
  std::int64_t shard_size = 0;  // ceil(total / world): every rank's range has this capacity
  std::int64_t begin(int rank) const;  // flat range [begin, end) of `rank`, clipped to total
  std::int64_t end(int rank) const;
};

struct FlatPartition {
  std::vector<FlatGroup> groups;
  std::vector<std::vector<Slice>> slices;  // slices[rank], in (group, flat) order

  std::int64_t owned_numel(int rank) const;
};

FlatPartition partition_flat(const GroupSizes& sizes, int world);

}  // namespace shardkit::oss
