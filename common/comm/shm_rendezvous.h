// Transport choice and shared-memory rendezvous of the process group (DESIGN.md section 2; issue 15 item 2):
// after the TCP mesh has connected (tcp_rendezvous.h), make_pairs() gives each pair of ranks its transport:
// shared memory (shm_transport.h) when both ranks are on one host, TCP otherwise.
//
// Ranks are told apart by a host identity, "<hostname>/<boot id>" (/proc/sys/kernel/random/boot_id), published
// under "<keys>/host/<rank>". The choice (TransportChoice, from TcpProcessGroupOptions::transport, else
// SHARDKIT_TRANSPORT):
//   auto  shared memory between ranks with the same host identity, TCP between the others
//   tcp   TCP everywhere (no host identity is exchanged)
//   shm   shared memory everywhere; InvalidArgument naming the first rank on another host when they are not all
//         on this one
// Every rank must make the same choice (the environment of a job is normally the same on every rank); ranks
// that disagree fail within the connect deadline.
//
// Segments (Note [shm segment lifetime] in shm_rendezvous.cc): each rank with a local peer creates one, named
// "/shardkit.<hash of the group's keys>.<rank>.<pid>.<random>" (the keys hold the store prefix and the group's
// generation; pid and random part tell jobs apart), publishes its name and nonce under "<keys>/shm/<rank>",
// maps its local peers' segments, meets them at "<keys>/shm_mapped/<lowest local rank>", then unlinks its own
// name: from then on nothing is left behind in /dev/shm whatever happens to the processes.
//
// Single copy: before the meeting each rank probes each local peer's memory (probe_single_copy) and, when it
// can read it and options.pair.single_copy is on, lets that peer send to it by single copy (per direction; a probe
// that fails only keeps that direction on the ring).
//
// Errors name the group and rank ("TcpProcessGroup '<name>' rank r of n: ..."): DeadlineExceeded naming the
// rank that did not publish in time, the segment's own errors (no room in /dev/shm, a segment that cannot be
// opened: e.g. ranks in containers that share a host identity but not /dev/shm; use SHARDKIT_TRANSPORT=tcp).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/comm/shm_transport.h"
#include "common/comm/store.h"
#include "common/comm/tcp_rendezvous.h"
#include "common/comm/transport.h"

namespace shardkit::comm {

enum class TransportChoice { kAuto, kTcp, kShm };

// "" or "auto", "tcp", "shm"; InvalidArgument naming `what` (e.g. "SHARDKIT_TRANSPORT") otherwise.
absl::StatusOr<TransportChoice> parse_transport_choice(std::string_view value, std::string_view what);

// "<hostname>/<boot id>" of this machine (the boot id tells apart hosts that share a name, e.g. containers
// started from one image on several machines, and one machine before and after a reboot).
std::string local_host_id();

struct ShmRendezvousOptions {
  std::string group_name = "world";  // for messages
  TransportChoice choice = TransportChoice::kAuto;
  std::size_t ring_bytes = 1u << 20;  // each inbound ring
  std::string host_id;                // empty: local_host_id() (tests pretend several hosts)
  // Single copy of large sends (Note [shm single copy] in shm_transport.cc): with pair.single_copy (off by
  // default) each rank probes each local peer (probe_single_copy) and allows it on its inbound ring from that
  // peer when the probe succeeds; the peer's sends then use it if its own option is on. Off: neither allowed nor
  // used.
  ShmPairOptions pair;
};

struct TransportMesh {
  std::vector<std::unique_ptr<Pair>> pairs;  // by rank; pairs[rank] null
  std::vector<std::string> kinds;            // by rank: "shm", "tcp" ("" for this rank)
};

// The pairs of rank `rank` over `mesh` (its sockets are moved into TcpPairs, or kept as ShmPairs' liveness
// connections). Every rank of the group calls it after tcp_rendezvous with the same options.
absl::StatusOr<TransportMesh> make_pairs(Store& store, int rank, int size, TcpMesh mesh,
                                         const ShmRendezvousOptions& options, absl::Time deadline);

}  // namespace shardkit::comm
