#include "common/comm/tcp_rendezvous.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardkit::comm {

// Note [group generations]
// A failed group is not usable again: the way back is a new group, every rank calling create() again, usually
// with the same store and prefix. The failed group's keys are still in the store (addresses of listeners that
// are closed now, the arrival count, the abort reason), so each creation works under keys of its own:
// "<store_prefix>/<k>/...", where k counts this rank's earlier creations on that prefix (the store counter
// "<store_prefix>/generation/<rank>"). Creating a group is collective, so every rank creates it equally often on
// a prefix and the k-th creations of all ranks meet under the same keys, never reading what an earlier
// generation left. Sub-groups live under their parent's keys. A rank that creates the group more often than
// the others (a create() only some ranks called) waits under keys nobody writes and fails at the deadline,
// naming the generation. A group of one rank uses no keys of its own.

namespace {

constexpr std::uint32_t kHelloMagic = 0x4f4c4548;  // "HELO"

}  // namespace

absl::StatusOr<TcpMesh> tcp_rendezvous(Store& store, int rank, int size, const TcpRendezvousOptions& options,
                                       absl::Time deadline) {
  const int n = size, r = rank;
  auto where = [&](const std::string& what) {
    return absl::StrCat("TcpProcessGroup '", options.group_name, "' rank ", r, " of ", n, ": ", what);
  };
  TcpMesh mesh;
  mesh.sockets.resize(static_cast<std::size_t>(n));
  if (n == 1) {
    mesh.keys = options.store_prefix;  // no other rank reads this group's keys
    return mesh;
  }
  // Note [group generations].
  auto created = store.add(absl::StrCat(options.store_prefix, "/generation/", r), 1);
  if (!created.ok()) {
    return absl::Status(created.status().code(),
                        where(absl::StrCat("counting this rank's groups on the store failed: ", created.status().message())));
  }
  const std::int64_t generation = *created - 1;
  mesh.keys = absl::StrCat(options.store_prefix, "/", generation);
  const std::string& prefix = mesh.keys;
  std::vector<tcp::Socket>& peers = mesh.sockets;

  auto listener = tcp::listen_on(options.listen_host, 0);
  if (!listener.ok()) return absl::Status(listener.status().code(), where(std::string(listener.status().message())));
  auto port = tcp::local_port(*listener);
  if (!port.ok()) return port.status();
  if (auto st = store.set(absl::StrCat(prefix, "/addr/", r), absl::StrCat(options.listen_host, ":", *port)); !st.ok()) {
    return absl::Status(st.code(), where(absl::StrCat("publishing the address failed: ", st.message())));
  }
  // Connect to every lower rank, then accept every higher rank (the backlog holds early connections).
  for (int p = 0; p < r; ++p) {
    auto addr = store.get(absl::StrCat(prefix, "/addr/", p), std::max(deadline - absl::Now(), absl::ZeroDuration()));
    if (!addr.ok()) {
      return absl::DeadlineExceededError(where(absl::StrCat("rank ", p, " did not publish its address in time (group #",
                                                            generation, " on store prefix '", options.store_prefix,
                                                            "'): ", addr.status().message())));
    }
    const auto colon = addr->rfind(':');
    int peer_port = 0;
    if (colon == std::string::npos || !absl::SimpleAtoi(addr->substr(colon + 1), &peer_port)) {
      return absl::InvalidArgumentError(where(absl::StrCat("expected 'host:port' for rank ", p, ", found '", *addr, "'")));
    }
    auto s = tcp::connect_with_retry(addr->substr(0, colon), static_cast<std::uint16_t>(peer_port), deadline,
                                     absl::StrCat("rank ", p));
    if (!s.ok()) return absl::Status(s.status().code(), where(std::string(s.status().message())));
    const std::uint32_t hello[2] = {kHelloMagic, static_cast<std::uint32_t>(r)};
    if (auto st = tcp::send_all(*s, hello, sizeof(hello), deadline, absl::StrCat("rank ", p)); !st.ok()) {
      return absl::Status(st.code(), where(std::string(st.message())));
    }
    tcp::tune_socket(s->fd(), options.socket_buffer_bytes);
    peers[static_cast<std::size_t>(p)] = std::move(*s);
  }
  for (int k = r + 1; k < n; ++k) {
    auto s = tcp::accept_one(*listener, deadline);
    if (!s.ok()) {
      std::vector<int> missing;
      for (int p = r + 1; p < n; ++p)
        if (!peers[static_cast<std::size_t>(p)].valid()) missing.push_back(p);
      return absl::DeadlineExceededError(
          where(absl::StrCat("ranks [", absl::StrJoin(missing, ", "), "] did not connect before the deadline")));
    }
    std::uint32_t hello[2] = {0, 0};
    if (auto st = tcp::recv_all(*s, hello, sizeof(hello), deadline, "a connecting rank"); !st.ok()) {
      return absl::Status(st.code(), where(std::string(st.message())));
    }
    const int p = static_cast<int>(hello[1]);
    if (hello[0] != kHelloMagic || p <= r || p >= n || peers[static_cast<std::size_t>(p)].valid()) {
      return absl::InvalidArgumentError(where(absl::StrCat("expected a hello from a rank in (", r, ", ", n,
                                                           "), found magic ", hello[0], " rank ", p)));
    }
    tcp::tune_socket(s->fd(), options.socket_buffer_bytes);
    peers[static_cast<std::size_t>(p)] = std::move(*s);
  }
  // Store barrier: after it no rank needs the store for bootstrapping (rank 0 may host it and leave).
  auto arrived = store.add(absl::StrCat(prefix, "/connected"), 1);
  if (!arrived.ok()) return arrived.status();
  if (*arrived == n) {
    if (auto st = store.set(absl::StrCat(prefix, "/all_connected"), "1"); !st.ok()) return st;
  }
  if (auto st = store.wait({absl::StrCat(prefix, "/all_connected")}, std::max(deadline - absl::Now(), absl::ZeroDuration()));
      !st.ok()) {
    return absl::DeadlineExceededError(where(absl::StrCat("not every rank connected in time: ", st.message())));
  }
  return mesh;
}

}  // namespace shardkit::comm
