#include "common/comm/comm_counters.h"

#include "absl/strings/str_cat.h"

namespace shardkit::comm {

Volume collective_volume(CollectiveKind kind, std::int64_t bytes, int n, int rank, int root) {
  if (n <= 1) return {};
  const std::int64_t nn = n;
  switch (kind) {
    case CollectiveKind::all_reduce: {
      const std::int64_t v = 2 * (nn - 1) * bytes / nn;
      return {v, v};
    }
    case CollectiveKind::reduce_scatter:
    case CollectiveKind::all_gather: {
      const std::int64_t v = (nn - 1) * bytes;
      return {v, v};
    }
    case CollectiveKind::broadcast: {
      const int last = (root + n - 1) % n;
      return {rank == last ? 0 : bytes, rank == root ? 0 : bytes};
    }
    case CollectiveKind::reduce: {
      const int first = (root + 1) % n;
      return {rank == root ? 0 : bytes, rank == first ? 0 : bytes};
    }
    case CollectiveKind::barrier: return {};
    case CollectiveKind::send: return {bytes, 0};
    case CollectiveKind::recv: return {0, bytes};
  }
  return {};
}

std::int64_t CommCounters::total_sent() const {
  std::int64_t t = 0;
  for (const auto& k : by_kind) t += k.bytes_sent;
  return t;
}

std::int64_t CommCounters::total_received() const {
  std::int64_t t = 0;
  for (const auto& k : by_kind) t += k.bytes_received;
  return t;
}

CommCounters CommCounters::since(const CommCounters& earlier) const {
  CommCounters d;
  for (int i = 0; i < kNumCollectiveKinds; ++i) {
    d.by_kind[i].calls = by_kind[i].calls - earlier.by_kind[i].calls;
    d.by_kind[i].bytes_sent = by_kind[i].bytes_sent - earlier.by_kind[i].bytes_sent;
    d.by_kind[i].bytes_received = by_kind[i].bytes_received - earlier.by_kind[i].bytes_received;
  }
  return d;
}

std::string CommCounters::to_string() const {
  std::string out;
  for (int i = 0; i < kNumCollectiveKinds; ++i) {
    const KindCounters& k = by_kind[i];
    if (k.calls == 0) continue;
    absl::StrAppend(&out, std::string(collective_kind_name(static_cast<CollectiveKind>(i))), " calls=", k.calls,
                    " sent=", k.bytes_sent, " received=", k.bytes_received, "\n");
  }
  return out;
}

}  // namespace shardkit::comm
