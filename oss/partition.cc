#include "oss/partition.h"

#include <algorithm>
#include <iterator>
#include <numeric>
#include <utility>

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

std::int64_t FlatChunk::begin(int rank) const { return base + std::min(total, shard_size * rank); }
std::int64_t FlatChunk::end(int rank) const { return base + std::min(total, shard_size * (rank + 1)); }

std::int64_t FlatPartition::owned_numel(int rank) const {
  std::int64_t n = 0;
  for (const FlatChunk& c : chunks) n += c.end(rank) - c.begin(rank);
  return n;
}

int FlatPartition::chunk_of(int group, std::int64_t flat_offset) const {
  // Chunks are sorted by (group, base): the last one at or before (group, flat_offset).
  const auto after = std::upper_bound(chunks.begin(), chunks.end(), std::pair{group, flat_offset},
                                      [](const std::pair<int, std::int64_t>& key, const FlatChunk& c) {
                                        return key.first != c.group ? key.first < c.group : key.second < c.base;
                                      });
  SK_CHECK(after != chunks.begin() && std::prev(after)->group == group)
      << "no chunk of group " << group << " holds flat element " << flat_offset;
  return static_cast<int>(std::prev(after) - chunks.begin());
}

FlatPartition partition_flat(const GroupSizes& sizes, int world, std::int64_t chunk_numel) {
  SK_CHECK_GE(world, 1);
  FlatPartition p;
  p.slices.resize(static_cast<std::size_t>(world));
  for (std::size_t gi = 0; gi < sizes.size(); ++gi) {
    const auto& group = sizes[gi];
    // Cut the group into chunks of whole parameters: [first, last) parameter indices per chunk.
    std::vector<std::pair<std::size_t, std::size_t>> runs;
    std::int64_t run_numel = 0;
    for (std::size_t pi = 0; pi < group.size(); ++pi) {
      SK_CHECK_GE(group[pi], 0);
      if (runs.empty() || (chunk_numel > 0 && run_numel > 0 && run_numel + group[pi] > chunk_numel)) {
        runs.emplace_back(pi, pi);
        run_numel = 0;
      }
      runs.back().second = pi + 1;
      run_numel += group[pi];
    }
    if (runs.empty()) runs.emplace_back(0, 0);
    std::int64_t flat = 0;
    for (const auto& [first, last] : runs) {
      FlatChunk c{static_cast<int>(gi), flat, 0, 0};
      for (std::size_t pi = first; pi < last; ++pi) c.total += group[pi];
      c.shard_size = (c.total + world - 1) / world;
      for (std::size_t pi = first; pi < last; ++pi) {
        const std::int64_t n = group[pi];
        for (std::int64_t done = 0; done < n;) {
          const int rank = static_cast<int>((flat + done - c.base) / c.shard_size);
          const std::int64_t len = std::min(c.end(rank) - (flat + done), n - done);
          p.slices[static_cast<std::size_t>(rank)].push_back(
              Slice{static_cast<int>(gi), static_cast<int>(pi), done, len, flat + done});
          done += len;
        }
        flat += n;
      }
      p.chunks.push_back(c);
    }
  }
  // Each rank's slices in (group, flat) order.
  for (auto& mine : p.slices) {
    std::stable_sort(mine.begin(), mine.end(), [](const Slice& a, const Slice& b) {
      return a.group != b.group ? a.group < b.group : a.flat_offset < b.flat_offset;
    });
  }
  return p;
}

}  // namespace shardkit::oss
