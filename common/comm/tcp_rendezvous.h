// TCP rendezvous: ranks meet through a Store and connect a full mesh of TCP sockets, one per pair of ranks
// (DESIGN.md section 2: the "rendezvous" of gloo's rendezvous / transport / algorithm split).
//
// Every rank listens on an ephemeral port of `listen_host`, publishes "host:port" under
// "<keys>/addr/<rank>", connects to every lower rank and accepts every higher rank, each connection opened by a
// handshake in which both ends prove they know the token (Note [rank authentication] in tcp_rendezvous.cc; a
// connection that fails it is closed and the rank keeps waiting for the real peer); then a store barrier ("<keys>/connected", "<keys>/all_connected") so that no rank
// needs the store for bootstrapping afterwards. `keys` is "<store_prefix>/<generation>" (Note [group
// generations] in tcp_rendezvous.cc): every creation of a group on a prefix meets under keys of its own.
//
// Errors name the group and rank ("TcpProcessGroup '<name>' rank r of n: ..."): DeadlineExceeded naming the
// ranks that did not publish or connect in time (and the connections refused meanwhile), PermissionDenied when
// the rank connected to does not prove the token or refuses this rank's proof, InvalidArgument for a
// malformed address or handshake, the store's error when it fails.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/comm/store.h"
#include "common/comm/tcp_socket.h"

namespace shardkit::comm {

struct TcpRendezvousOptions {
  std::string listen_host = "127.0.0.1";  // bound, and published for the other ranks
  std::string store_prefix = "tcp_pg";
  std::string group_name = "world";       // for messages
  int socket_buffer_bytes = 0;             // tcp::tune_socket (0: kernel default)
  std::string token;                       // the secret both ends of every connection prove (tcp_auth.h)
  // Bound on one incoming handshake (a connection that stays silent cannot hold the rendezvous up longer).
  absl::Duration handshake_timeout = absl::Seconds(10);
};

struct TcpMesh {
  std::string keys;                  // "<store_prefix>/<generation>": where this group's store keys live
  std::vector<tcp::Socket> sockets;  // by rank; sockets[rank] invalid
};

// Connects rank `rank` of `size` to every other rank before `deadline` (every rank calls it with the same
// prefix, equally often). A group of one rank touches neither network nor store (keys = store_prefix).
absl::StatusOr<TcpMesh> tcp_rendezvous(Store& store, int rank, int size, const TcpRendezvousOptions& options,
                                       absl::Time deadline);

}  // namespace shardkit::comm
