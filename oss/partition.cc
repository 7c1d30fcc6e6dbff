#include "oss/partition.h"

#include <algorithm>
#include <numeric>

#include "common/base/check.h"

namespace shardkit::oss {

std::vector<int> GreedyPartition::owned(int group, int rank) const {
  std::vector<int> out;
  const auto& g = owner.at(static_cast<std::size_t>(group));
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (g[i] == rank) out.push_back(static_cast<int>(i));
  }
  return out;
}

GreedyPartition partition_greedy(const GroupSizes& sizes, int world) {
  SK_CHECK_GE(world, 1);
  GreedyPartition p;
  p.rank_numel.assign(static_cast<std::size_t>(world), 0);
  for (const auto& group : sizes) {
    std::vector<int> order(group.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return group[a] > group[b]; });
    std::vector<int> owner(group.size(), 0);
    for (int i : order) {
      const auto smallest = std::min_element(p.rank_numel.begin(), p.rank_numel.end());  // first = lowest rank
      owner[static_cast<std::size_t>(i)] = static_cast<int>(smallest - p.rank_numel.begin());
      *smallest += group[static_cast<std::size_t>(i)];
    }
    p.owner.push_back(std::move(owner));
  }
  return p;
}

std::int64_t FlatPartition::rank_begin(int rank) const { return std::min(total, shard_size * rank); }
std::int64_t FlatPartition::rank_end(int rank) const { return std::min(total, shard_size * (rank + 1)); }

FlatPartition partition_flat(const GroupSizes& sizes, int world) {
  SK_CHECK_GE(world, 1);
  FlatPartition p;
  for (const auto& g : sizes) {
    for (std::int64_t n : g) {
      SK_CHECK_GE(n, 0);
      p.total += n;
    }
  }
  p.shard_size = (p.total + world - 1) / world;
  p.slices.resize(static_cast<std::size_t>(world));
  std::int64_t flat = 0;
  for (std::size_t gi = 0; gi < sizes.size(); ++gi) {
    for (std::size_t pi = 0; pi < sizes[gi].size(); ++pi) {
      const std::int64_t n = sizes[gi][pi];
      std::int64_t done = 0;
      while (done < n) {
        const int rank = static_cast<int>((flat + done) / p.shard_size);
        const std::int64_t room = p.rank_end(rank) - (flat + done);
        const std::int64_t len = std::min(room, n - done);
        p.slices[static_cast<std::size_t>(rank)].push_back(
            Slice{static_cast<int>(gi), static_cast<int>(pi), done, len, flat + done});
        done += len;
      }
      flat += n;
    }
  }
  return p;
}

}  // namespace shardkit::oss
