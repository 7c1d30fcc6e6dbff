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
//  * Flat: per param group, the group's parameters concatenated in order form a flat index space, cut
//    into chunks (Note [flat chunks]); each chunk is split into `world` contiguous ranges of
//    ceil(chunk / world) elements (the last ranges may be shorter or empty). A tensor may straddle ranks:
//    each rank owns a list of slices. This is what makes one reduce-scatter / all-gather per chunk
//    possible. Per group (not over the whole model) so that adding a param group never moves ownership of
//    existing parameters.
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

// Note [flat chunks]
// A param group's flat index space is cut, at parameter boundaries, into chunks of about `chunk_numel`
// elements, and every chunk is split evenly over the ranks: each rank owns 1/world of every chunk (FSDP's
// flat parameter per wrapped unit, llm.c's per-tensor shards). Why not one range per rank per group: with
// ShardedDataParallel's reduce-scatter (ZeRO-2), a collective can only start when every rank's part of it
// is ready. With one range per rank, rank 0's range holds the first layers, whose gradients are ready
// last, so every reduce-scatter would wait for the end of backward and every gradient would sit in a bucket
// until then. With chunks, the parameters of one chunk are neighbours in the model, their gradients are
// ready together, and each chunk is reduce-scattered while backward goes on. chunk_numel <= 0 keeps one
// chunk per group (one range per rank: the fewest collectives when nothing overlaps them).

// One chunk: flat elements [base, base + total) of group `group`, a run of whole parameters. Rank r owns
// [begin(r), end(r)), up to shard_size = ceil(total / world) elements (the last ranks may own fewer or none).
struct FlatChunk {
  int group = 0;
  std::int64_t base = 0;
  std::int64_t total = 0;
  std::int64_t shard_size = 0;
  std::int64_t begin(int rank) const;
  std::int64_t end(int rank) const;
};

struct FlatPartition {
  std::vector<FlatChunk> chunks;           // in (group, base) order; every group has at least one
  std::vector<std::vector<Slice>> slices;  // slices[rank], in (group, flat) order

  std::int64_t owned_numel(int rank) const;
  // Index (in `chunks`) of the chunk of group `group` that holds flat element `flat_offset`: the last one
  // starting at or before it (so an empty parameter belongs to a neighbouring chunk).
  int chunk_of(int group, std::int64_t flat_offset) const;
};

// chunk_numel: a chunk is closed before a parameter that would take it past chunk_numel elements (a larger
// parameter is a chunk of its own); <= 0: one chunk per group. See Note [flat chunks].
FlatPartition partition_flat(const GroupSizes& sizes, int world, std::int64_t chunk_numel = 0);

}  // namespace shardkit::oss
