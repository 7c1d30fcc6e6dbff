#include "sddp/bucketing.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "common/base/check.h"

namespace shardkit::sddp {

std::vector<std::vector<int>> assign_buckets(absl::Span<const int> order, absl::Span<const std::int64_t> numel,
                                             absl::Span<const int> key, std::int64_t bucket_numel) {
  SK_CHECK_EQ(numel.size(), key.size());
  SK_CHECK_EQ(order.size(), numel.size());
  struct Open {
    std::vector<int> params;
    std::int64_t numel = 0;
  };
  std::vector<std::vector<int>> out;
  std::map<int, Open> open;  // by key
  for (const int p : order) {
    const auto n = numel[static_cast<std::size_t>(p)];
    if (bucket_numel <= 0 || n >= bucket_numel) {
      out.push_back({p});
      continue;
    }
    Open& o = open[key[static_cast<std::size_t>(p)]];
    if (!o.params.empty() && o.numel + n > bucket_numel) {
      out.push_back(std::move(o.params));
      o = Open{};
    }
    o.params.push_back(p);
    o.numel += n;
  }
  // Partly filled buckets, in the order their last member becomes ready.
  std::vector<int> position(numel.size(), 0);
  for (std::size_t i = 0; i < order.size(); ++i) position[static_cast<std::size_t>(order[i])] = static_cast<int>(i);
  std::vector<std::vector<int>> rest;
  for (auto& [k, o] : open) {
    if (!o.params.empty()) rest.push_back(std::move(o.params));
  }
  std::sort(rest.begin(), rest.end(), [&](const auto& a, const auto& b) {
    return position[static_cast<std::size_t>(a.back())] < position[static_cast<std::size_t>(b.back())];
  });
  for (auto& r : rest) out.push_back(std::move(r));
  // Full buckets were closed when a later parameter did not fit; relaunch order is by last member.
  std::vector<int> perm = launch_order(out, position);
  std::vector<std::vector<int>> sorted;
  sorted.reserve(out.size());
  for (int b : perm) sorted.push_back(std::move(out[static_cast<std::size_t>(b)]));
  return sorted;
}

std::vector<Column> assign_columns(int space, const oss::FlatChunk& chunk, absl::Span<const FlatMember> members,
                                   int world, std::int64_t width) {
  std::vector<Column> cols;
  if (chunk.total == 0) return cols;
  const std::int64_t w = width <= 0 ? chunk.shard_size : std::min(width, chunk.shard_size);
  const std::int64_t ncols = (chunk.shard_size + w - 1) / w;
  cols.resize(static_cast<std::size_t>(ncols));
  for (std::int64_t k = 0; k < ncols; ++k) {
    Column& c = cols[static_cast<std::size_t>(k)];
    c.space = space;
    c.offset = k * w;
    c.width = std::min(w, chunk.shard_size - k * w);
  }
  // Walk every rank's range and cut it at parameter and column boundaries. Members need not tile the
  // space: elements of no member (frozen parameters) are left out (gaps the reducer fills with zeros).
  std::size_t m = 0;
  for (int r = 0; r < world; ++r) {
    const std::int64_t begin = chunk.begin(r), end = chunk.end(r);
    std::int64_t pos = begin;
    while (pos < end) {
      while (m < members.size() && members[m].flat_offset + members[m].numel <= pos) ++m;
      if (m == members.size()) break;
      const FlatMember& fm = members[m];
      if (fm.flat_offset > pos) {  // a gap
        pos = std::min(end, fm.flat_offset);
        continue;
      }
      const std::int64_t local = pos - begin;
      const std::int64_t k = local / w;
      const std::int64_t col_end = begin + std::min((k + 1) * w, chunk.shard_size);
      const std::int64_t stop = std::min({end, col_end, fm.flat_offset + fm.numel});
      cols[static_cast<std::size_t>(k)].pieces.push_back(
          {fm.param, pos - fm.flat_offset, r, local - k * w, stop - pos});
      pos = stop;
    }
  }
  return cols;
}

std::vector<int> launch_order(const std::vector<std::vector<int>>& members, absl::Span<const int> position) {
  std::vector<int> last(members.size(), -1);
  for (std::size_t b = 0; b < members.size(); ++b) {
    for (int p : members[b]) last[b] = std::max(last[b], position[static_cast<std::size_t>(p)]);
  }
  std::vector<int> perm(members.size());
  std::iota(perm.begin(), perm.end(), 0);
  std::stable_sort(perm.begin(), perm.end(), [&](int a, int b) {
    return last[static_cast<std::size_t>(a)] < last[static_cast<std::size_t>(b)];
  });
  return perm;
}

}  // namespace shardkit::sddp
