#include "common/comm/shm_rendezvous.h"

#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/comm/shm_transport.h"
#include "common/comm/tcp_transport.h"

namespace shardkit::comm {

// Note [shm segment lifetime]
// A POSIX shared-memory name outlives its processes until shm_unlink, so a name must not stay in /dev/shm
// longer than needed: each rank unlinks its own segment as soon as every local rank has mapped it (the store
// meeting "<keys>/shm_mapped/<lowest local rank>"), and the memory then lives exactly as long as the last
// mapping. A rank that fails before the meeting unlinks its own name (and, after a missed meeting, its
// peers' names it read, which no one will map any more). Only a process killed between creating its segment
// and the meeting (a few store round trips) leaves its name behind; the name says which job and pid. Names are
// created O_EXCL with mode 0600: another user cannot map them, and a name already taken is an error, not
// a shared segment. A group of one rank, or a rank alone on its host, creates nothing.

absl::StatusOr<TransportChoice> parse_transport_choice(std::string_view value, std::string_view what) {
  const std::string v = absl::AsciiStrToLower(std::string(value));
  if (v.empty() || v == "auto") return TransportChoice::kAuto;
  if (v == "tcp") return TransportChoice::kTcp;
  if (v == "shm") return TransportChoice::kShm;
  return absl::InvalidArgumentError(
      absl::StrCat("expected ", std::string(what), " to be tcp, shm or auto, found '", std::string(value), "'"));
}

std::string local_host_id() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "unknown-host");
  std::string boot;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot);
  return absl::StrCat(host, "/", absl::StripAsciiWhitespace(boot));
}

namespace {

std::uint64_t fnv1a(std::string_view s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

absl::StatusOr<std::uint64_t> random_u64() {
  std::uint64_t v = 0;
  std::size_t got = 0;
  while (got < sizeof(v)) {
    const ssize_t k = ::getrandom(reinterpret_cast<char*>(&v) + got, sizeof(v) - got, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return absl::InternalError(absl::StrCat("getrandom failed: ", std::strerror(errno)));
    got += static_cast<std::size_t>(k);
  }
  return v;
}

absl::Duration left(absl::Time deadline) { return std::max(deadline - absl::Now(), absl::ZeroDuration()); }

}  // namespace

absl::StatusOr<TransportMesh> make_pairs(Store& store, int rank, int size, TcpMesh mesh,
                                         const ShmRendezvousOptions& options, absl::Time deadline) {
  const int n = size, r = rank;
  auto where = [&](const std::string& what) {
    return absl::StrCat("TcpProcessGroup '", options.group_name, "' rank ", r, " of ", n, ": ", what);
  };
  auto wrap = [&](const absl::Status& st, const std::string& doing) {
    return absl::Status(st.code(), where(absl::StrCat(doing, ": ", st.message())));
  };
  TransportMesh out;
  out.pairs.resize(static_cast<std::size_t>(n));
  out.kinds.assign(static_cast<std::size_t>(n), "tcp");
  out.kinds[static_cast<std::size_t>(r)] = "";
  std::vector<int> local;  // ranks on this host, in order (this rank included)
  if (n > 1 && options.choice != TransportChoice::kTcp) {
    const std::string host = options.host_id.empty() ? local_host_id() : options.host_id;
    if (auto st = store.set(absl::StrCat(mesh.keys, "/host/", r), host); !st.ok()) {
      return wrap(st, "publishing the host identity failed");
    }
    for (int p = 0; p < n; ++p) {
      std::string other = host;
      if (p != r) {
        auto got = store.get(absl::StrCat(mesh.keys, "/host/", p), left(deadline));
        if (!got.ok()) {
          return absl::DeadlineExceededError(
              where(absl::StrCat("rank ", p, " did not publish its host identity in time: ", got.status().message())));
        }
        other = *got;
      }
      if (other == host) {
        local.push_back(p);
      } else if (options.choice == TransportChoice::kShm) {
        return absl::InvalidArgumentError(where(absl::StrCat(
            "the shared-memory transport (SHARDKIT_TRANSPORT=shm) needs every rank on this host, found rank ", p,
            " on host '", other, "' (this rank: '", host, "'); use SHARDKIT_TRANSPORT=tcp or auto")));
      }
    }
  }
  if (local.size() > 1) {
    const int nl = static_cast<int>(local.size());
    auto index_of = [&](int p) {
      return static_cast<int>(std::find(local.begin(), local.end(), p) - local.begin());
    };
    const int me = index_of(r);
    auto nonce = random_u64();
    if (!nonce.ok()) return wrap(nonce.status(), "creating the shared-memory segment");
    auto salt = random_u64();
    if (!salt.ok()) return wrap(salt.status(), "creating the shared-memory segment");
    const std::string name = absl::StrCat("/shardkit.", absl::Hex(fnv1a(mesh.keys), absl::kZeroPad16), ".", r, ".",
                                          ::getpid(), ".", absl::Hex(*salt, absl::kZeroPad16));
    // One inbound ring per local rank (this rank's own slot is unused: the index stays simple).
    auto self = ShmSegment::create(name, nl, options.ring_bytes, *nonce);
    if (!self.ok()) return wrap(self.status(), "shared-memory transport");
    std::vector<std::string> read_names;
    auto fail = [&](const absl::Status& st, bool unlink_peers) {
      (*self)->unlink().IgnoreError();
      if (unlink_peers) {
        for (const std::string& other : read_names) ::shm_unlink(other.c_str());
      }
      return st;
    };
    if (auto st = store.set(absl::StrCat(mesh.keys, "/shm/", r),
                            absl::StrCat(name, " ", *nonce, " ", options.ring_bytes));
        !st.ok()) {
      return fail(wrap(st, "publishing the shared-memory segment failed"), false);
    }
    std::vector<std::shared_ptr<ShmSegment>> segments(static_cast<std::size_t>(n));
    for (int p : local) {
      if (p == r) continue;
      auto got = store.get(absl::StrCat(mesh.keys, "/shm/", p), left(deadline));
      if (!got.ok()) {
        return fail(absl::DeadlineExceededError(where(absl::StrCat(
                        "rank ", p, " (on this host) did not publish its shared-memory segment in time: ",
                        got.status().message()))),
                    false);
      }
      std::vector<std::string> parts = absl::StrSplit(*got, ' ');
      std::uint64_t peer_nonce = 0;
      std::size_t peer_ring = 0;
      if (parts.size() != 3 || !absl::SimpleAtoi(parts[1], &peer_nonce) || !absl::SimpleAtoi(parts[2], &peer_ring)) {
        return fail(absl::InvalidArgumentError(where(absl::StrCat("expected 'name nonce ring_bytes' from rank ", p,
                                                                  ", found '", *got, "'"))),
                    false);
      }
      read_names.push_back(parts[0]);
      auto seg = ShmSegment::open(parts[0], nl, peer_ring, peer_nonce);
      if (!seg.ok()) {
        return fail(wrap(seg.status(), absl::StrCat("mapping rank ", p,
                                                    "'s segment (ranks with one host identity but separate /dev/shm, "
                                                    "e.g. containers? use SHARDKIT_TRANSPORT=tcp)")),
                    false);
      }
      // Note [shm single copy]: allowed on the ring from p once this rank has read p's memory (before the
      // meeting, so p sees the flag when it builds its pair).
      if (options.pair.single_copy && probe_single_copy(**seg).ok()) (*self)->allow_single_copy(index_of(p));
      segments[static_cast<std::size_t>(p)] = std::move(*seg);
    }
    // Note [shm segment lifetime]: meet the local ranks, then unlink this rank's name.
    const std::string met = absl::StrCat(mesh.keys, "/shm_mapped/", local.front());
    auto arrived = store.add(met, 1);
    if (!arrived.ok()) return fail(wrap(arrived.status(), "shared-memory meeting"), false);
    if (*arrived == nl) {
      if (auto st = store.set(absl::StrCat(met, "/all"), "1"); !st.ok()) {
        return fail(wrap(st, "shared-memory meeting"), false);
      }
    }
    if (auto st = store.wait({absl::StrCat(met, "/all")}, left(deadline)); !st.ok()) {
      return fail(absl::DeadlineExceededError(where(absl::StrCat(
                      "not every rank on this host mapped the shared-memory segments in time: ", st.message()))),
                  true);
    }
    if (auto st = (*self)->unlink(); !st.ok()) return wrap(st, "shared-memory transport");
    for (int p : local) {
      if (p == r) continue;
      const auto pi = static_cast<std::size_t>(p);
      out.pairs[pi] = std::make_unique<ShmPair>(*self, index_of(p), segments[pi], me, std::move(mesh.sockets[pi]),
                                                options.pair);
      out.kinds[pi] = "shm";
    }
  }
  for (int p = 0; p < n; ++p) {
    const auto pi = static_cast<std::size_t>(p);
    if (p != r && out.pairs[pi] == nullptr) out.pairs[pi] = std::make_unique<TcpPair>(std::move(mesh.sockets[pi]));
  }
  return out;
}

}  // namespace shardkit::comm
