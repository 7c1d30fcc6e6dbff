// Per-rank communication counters: calls, bytes sent and bytes received per collective kind.
//
// The sharding layers prove their communication volume with these (ZeRO-1/2: 2Ψ per rank per step,
// ZeRO-3: 3Ψ). So that every backend (in-process, TCP, NCCL) reports the same figures for the same call,
// the bytes are NOT what a backend happens to move: they are the *ring-equivalent volume* of the call,
// computed by collective_volume() below, whatever algorithm the backend really runs.
// See Note [ring-equivalent volume].
//
// Thread-safety: CommCounters is a plain value (a snapshot). ProcessGroup::counters() may be called
// from any thread.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace shardkit::comm {

enum class CollectiveKind : std::uint8_t {
  broadcast = 0,
  all_reduce,
  reduce,
  all_gather,
  reduce_scatter,
  barrier,
  send,
  recv,
};
inline constexpr int kNumCollectiveKinds = 8;

constexpr std::string_view collective_kind_name(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::broadcast: return "broadcast";
    case CollectiveKind::all_reduce: return "all_reduce";
    case CollectiveKind::reduce: return "reduce";
    case CollectiveKind::all_gather: return "all_gather";
    case CollectiveKind::reduce_scatter: return "reduce_scatter";
    case CollectiveKind::barrier: return "barrier";
    case CollectiveKind::send: return "send";
    case CollectiveKind::recv: return "recv";
  }
  return "?";
}

// The bytes one rank sends and receives in one call.
struct Volume {
  std::int64_t sent = 0;
  std::int64_t received = 0;
};

// Note [ring-equivalent volume]
// For a call on a group of n ranks, on group rank `rank`, with `bytes` = the byte size that defines the
// call (below), the counted volume is (integer arithmetic, rounding down):
//   all_reduce(bytes = tensor bytes B):          sent = received = 2·(n−1)·B / n
//       (ring reduce-scatter then ring all-gather; nccl-tests' busbw factor 2(n−1)/n)
//   reduce_scatter(bytes = OUTPUT bytes b):      sent = received = (n−1)·b
//   all_gather(bytes = INPUT bytes b):           sent = received = (n−1)·b
//   broadcast(bytes = B, root):  pipelined chain root → root+1 → … → root−1 (mod n):
//       sent = B except on the chain's last rank (root−1 mod n); received = B except on root
//   reduce(bytes = B, root):     pipelined chain root+1 → … → root−1 → root (mod n):
//       sent = B except on root; received = B except on the chain's first rank (root+1 mod n)
//   barrier: 0 / 0 (only `calls` counts)
//   send(B): sent = B, received = 0;  recv(B): sent = 0, received = B
//   n = 1: every volume is 0.
// Summed over ranks, sent == received for every kind. Counted when the call is issued and passes the
// local argument checks (so a call that later fails because of another rank is still counted).
Volume collective_volume(CollectiveKind kind, std::int64_t bytes, int n, int rank, int root = 0);

struct KindCounters {
  std::int64_t calls = 0;
  std::int64_t bytes_sent = 0;
  std::int64_t bytes_received = 0;
};

struct CommCounters {
  std::array<KindCounters, kNumCollectiveKinds> by_kind{};

  const KindCounters& of(CollectiveKind k) const { return by_kind[static_cast<int>(k)]; }
  KindCounters& of(CollectiveKind k) { return by_kind[static_cast<int>(k)]; }
  std::int64_t total_sent() const;
  std::int64_t total_received() const;
  // Counters accumulated since `earlier` (a snapshot taken before).
  CommCounters since(const CommCounters& earlier) const;
  // One line per kind that has calls: "all_reduce calls=3 sent=... received=...".
  std::string to_string() const;
};

}  // namespace shardkit::comm
