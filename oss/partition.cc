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

std::int64_t FlatGroup::begin(int rank) const { return std::min(total, shard_size * rank); }
std::int64_t FlatGroup::end(int rank) const { return std::min(total, shard_size * (rank + 1)); }

std::int64_t FlatPartition::owned_numel(int rank) const {
  std::int64_t n = 0;
  for (const FlatGroup& g : groups) n += g.end(rank) - g.begin(rank);
  return n;
}

FlatPartition partition_flat(const GroupSizes& sizes, int world) {
  SK_CHECK_GE(world, 1);
  FlatPartition p;
  p.slices.resize(static_cast<std::size_t>(world));
  for (std::size_t gi = 0; gi < sizes.size(); ++gi) {
    FlatGroup fg;
    for (std::int64_t n : sizes[gi]) {
      SK_CHECK_GE(n, 0);
      fg.total += n;
    }
    fg.shard_size = (fg.total + world - 1) / world;
    std::int64_t flat = 0;
    for (std::size_t pi = 0; pi < sizes[gi].size(); ++pi) {
      const std::int64_t n = sizes[gi][pi];
      for (std::int64_t done = 0; done < n;) {
        const int rank = static_cast<int>((flat + done) / fg.shard_size);
        const std::int64_t len = std::min(fg.end(rank) - (flat + done), n - done);
        p.slices[static_cast<std::size_t>(rank)].push_back(
            Slice{static_cast<int>(gi), static_cast<int>(pi), done, len, flat + done});
        done += len;
      }
      flat += n;
    }
    p.groups.push_back(fg);
  }
  return p;
}

}  // namespace shardkit::oss
