#include "common/comm/tcp_rendezvous.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/comm/tcp_auth.h"

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

// Note [rank authentication]
// Every rank-to-rank connection opens with a challenge-response in both directions, keyed by the token (the
// Store's, tcp_auth.h says what this protects against). C connects to A (C > A):
//   C -> A  Hello      magic, version, C's rank, nonce_c (16 random bytes)
//   A -> C  Challenge  magic, A's rank, nonce_a, tag_a = MAC("accept", keys, A, C, nonce_c, nonce_a)
//   C -> A  Proof      magic, tag_c = MAC("connect", keys, A, C, nonce_c, nonce_a)
//   A -> C  Verdict    magic, accepted (0 or 1)
// "keys" is the group's store prefix and generation, so a proof is good for one connection of one group. The
// token itself is never sent. C checks tag_a before it proves anything (it is talking to rank A of this group);
// A checks tag_c before the connection becomes rank C's. A connection that fails at A (wrong token, not a
// handshake, a rank that is not expected, silence past handshake_timeout) is closed and A keeps accepting
// until every expected rank has connected or the deadline passes, whose error then counts the refusals: a
// process that only knows the port cannot take a rank's place, nor make the rendezvous fail early. At C a
// failed check is PermissionDenied at once (the two ranks' tokens differ). All values in host byte order, as
// the call headers.

namespace {

using tcp_auth::Nonce;
using tcp_auth::Tag;

constexpr std::uint32_t kHelloMagic = 0x4f4c4548;      // "HELO"
constexpr std::uint32_t kChallengeMagic = 0x4c414843;  // "CHAL"
constexpr std::uint32_t kProofMagic = 0x464f5250;      // "PROF"
constexpr std::uint32_t kVerdictMagic = 0x44524556;    // "VERD"
constexpr std::uint32_t kVersion = 2;

struct Hello {
  std::uint32_t magic = kHelloMagic;
  std::uint32_t version = kVersion;
  std::int32_t rank = 0;
  std::uint32_t pad = 0;
  Nonce nonce{};
};
struct Challenge {
  std::uint32_t magic = kChallengeMagic;
  std::int32_t rank = 0;
  Nonce nonce{};
  Tag tag{};
};
struct Proof {
  std::uint32_t magic = kProofMagic;
  std::uint32_t pad = 0;
  Tag tag{};
};
struct Verdict {
  std::uint32_t magic = kVerdictMagic;
  std::uint32_t accepted = 0;
};
static_assert(sizeof(Hello) == 32 && sizeof(Challenge) == 40 && sizeof(Proof) == 24 && sizeof(Verdict) == 8);

Tag handshake_tag(const tcp_auth::Key& key, const char* role, const std::string& keys, int acceptor, int connector,
                  const Nonce& nonce_c, const Nonce& nonce_a) {
  std::string m = absl::StrCat(role, "\n", keys, "\n", acceptor, "\n", connector, "\n");
  m.append(reinterpret_cast<const char*>(nonce_c.data()), nonce_c.size());
  m.append(reinterpret_cast<const char*>(nonce_a.data()), nonce_a.size());
  return tcp_auth::mac(key, m);
}

// C's side on a new connection to rank a. PermissionDenied when the ranks' tokens differ.
absl::Status introduce(const tcp::Socket& s, const tcp_auth::Key& key, const std::string& keys, int r, int a,
                       absl::Time deadline) {
  const std::string peer = absl::StrCat("rank ", a);
  Hello hello;
  hello.rank = r;
  auto nonce_c = tcp_auth::random_nonce();
  if (!nonce_c.ok()) return nonce_c.status();
  hello.nonce = *nonce_c;
  if (auto st = tcp::send_all(s, &hello, sizeof(hello), deadline, peer); !st.ok()) return st;
  Challenge ch;
  if (auto st = tcp::recv_all(s, &ch, sizeof(ch), deadline, peer); !st.ok()) return st;
  if (ch.magic != kChallengeMagic || ch.rank != a) {
    return absl::InvalidArgumentError(absl::StrCat("expected a challenge from rank ", a, ", found magic ", ch.magic,
                                                   " rank ", ch.rank));
  }
  if (!tcp_auth::tags_equal(ch.tag, handshake_tag(key, "accept", keys, a, r, hello.nonce, ch.nonce))) {
    return absl::PermissionDeniedError(absl::StrCat(
        "rank ", a, " did not prove this rank's token: the ranks' tokens differ (TcpProcessGroupOptions::token, "
        "else SHARDKIT_STORE_TOKEN)"));
  }
  Proof proof;
  proof.tag = handshake_tag(key, "connect", keys, a, r, hello.nonce, ch.nonce);
  if (auto st = tcp::send_all(s, &proof, sizeof(proof), deadline, peer); !st.ok()) return st;
  Verdict v;
  if (auto st = tcp::recv_all(s, &v, sizeof(v), deadline, peer); !st.ok()) return st;
  if (v.magic != kVerdictMagic || v.accepted != 1) {
    return absl::PermissionDeniedError(absl::StrCat("rank ", a, " refused this rank's proof of the token"));
  }
  return absl::OkStatus();
}

// A's side on an accepted connection: the connecting rank, or why the connection is refused.
absl::StatusOr<int> admit(const tcp::Socket& s, const tcp_auth::Key& key, const std::string& keys, int r, int n,
                          const std::vector<tcp::Socket>& peers, absl::Time until) {
  Hello hello;
  if (auto st = tcp::recv_all(s, &hello, sizeof(hello), until, "a connecting rank"); !st.ok()) return st;
  const int c = hello.rank;
  if (hello.magic != kHelloMagic || hello.version != kVersion || c <= r || c >= n ||
      peers[static_cast<std::size_t>(c)].valid()) {
    return absl::InvalidArgumentError(absl::StrCat("expected a hello (version ", kVersion, ") from a rank in (", r,
                                                   ", ", n, ") not yet connected, found magic ", hello.magic,
                                                   " version ", hello.version, " rank ", c));
  }
  Challenge ch;
  ch.rank = r;
  auto nonce_a = tcp_auth::random_nonce();
  if (!nonce_a.ok()) return nonce_a.status();
  ch.nonce = *nonce_a;
  ch.tag = handshake_tag(key, "accept", keys, r, c, hello.nonce, ch.nonce);
  const std::string peer = absl::StrCat("connecting rank ", c);
  if (auto st = tcp::send_all(s, &ch, sizeof(ch), until, peer); !st.ok()) return st;
  Proof proof;
  if (auto st = tcp::recv_all(s, &proof, sizeof(proof), until, peer); !st.ok()) return st;
  Verdict v;
  v.accepted = proof.magic == kProofMagic &&
               tcp_auth::tags_equal(proof.tag, handshake_tag(key, "connect", keys, r, c, hello.nonce, ch.nonce));
  tcp::send_all(s, &v, sizeof(v), until, peer).IgnoreError();  // best effort: the refused end learns why
  if (!v.accepted) {
    return absl::PermissionDeniedError(absl::StrCat("a connection claiming to be rank ", c,
                                                    " did not prove the token"));
  }
  return c;
}

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
  const tcp_auth::Key key = tcp_auth::derive_key(options.token);
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
    if (auto st = introduce(*s, key, prefix, r, p, deadline); !st.ok()) {
      return absl::Status(st.code(), where(absl::StrCat("connecting to rank ", p, " at ", *addr, ": ", st.message())));
    }
    tcp::tune_socket(s->fd(), options.socket_buffer_bytes);
    peers[static_cast<std::size_t>(p)] = std::move(*s);
  }
  int refused = 0;
  std::string last_refusal;
  for (int k = r + 1; k < n;) {
    auto s = tcp::accept_one(*listener, deadline);
    if (!s.ok()) {
      std::vector<int> missing;
      for (int p = r + 1; p < n; ++p)
        if (!peers[static_cast<std::size_t>(p)].valid()) missing.push_back(p);
      return absl::DeadlineExceededError(
          where(absl::StrCat("ranks [", absl::StrJoin(missing, ", "), "] did not connect before the deadline",
                             refused == 0 ? ""
                                          : absl::StrCat(" (refused ", refused, " connection", refused == 1 ? "" : "s",
                                                         "; the last: ", last_refusal, ")"))));
    }
    auto p = admit(*s, key, prefix, r, n, peers, std::min(deadline, absl::Now() + options.handshake_timeout));
    if (!p.ok()) {
      ++refused;  // closed when s goes; keep waiting for the real rank
      last_refusal = std::string(p.status().message());
      continue;
    }
    tcp::tune_socket(s->fd(), options.socket_buffer_bytes);
    peers[static_cast<std::size_t>(*p)] = std::move(*s);
    ++k;
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
