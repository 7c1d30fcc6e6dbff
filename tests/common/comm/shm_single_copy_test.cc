// Single copy over shared memory (Note [shm single copy] in shm_transport.cc): ShmPair ends in this process
// (process_vm_readv of the own pid works, so one process exercises the whole path): a large send arrives intact
// through try_recv and through peek / consume, is reported sent only once the reader has read it, keeps FIFO order
// with the ring's bytes around it, falls back to the ring when switched off or not allowed, and a read that fails
// or a sender that closes is an error, not a hang. Then the rendezvous' per-direction probe, the
// SHARDKIT_SHM_SINGLE_COPY setting, and the collective matrix with single copy on small chunks.
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/comm/hash_store.h"
#include "common/comm/shm_rendezvous.h"
#include "common/comm/shm_transport.h"
#include "common/comm/stream_runner.h"
#include "common/comm/tcp_process_group.h"
#include "common/comm/tcp_rendezvous.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/comm/tcp_test_util.h"

namespace shardkit::comm {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;

std::vector<char> pattern(std::size_t n, unsigned seed) {
  std::vector<char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 131 + seed * 7 + i / 251) & 0xff);
  return v;
}

// Rank A (local index 0) and rank B (index 1) of one process: `ab` is A's end towards B, `ba` B's towards A.
struct Ends {
  std::shared_ptr<ShmSegment> a, b;
  std::unique_ptr<ShmPair> ab, ba;
};

ShmPairOptions on() {
  ShmPairOptions o;
  o.single_copy = true;  // off by default
  return o;
}

Ends make_ends(std::size_t ring_bytes, bool allow, ShmPairOptions options = on(), tcp::Socket ab_liveness = {}) {
  static std::atomic<int> next{0};
  Ends e;
  const int id = next.fetch_add(1);
  auto a = ShmSegment::create(absl::StrCat("/sktest-sc.", ::getpid(), ".", id, ".a"), 2, ring_bytes, 11);
  auto b = ShmSegment::create(absl::StrCat("/sktest-sc.", ::getpid(), ".", id, ".b"), 2, ring_bytes, 22);
  SK_CHECK(a.ok() && b.ok()) << (a.ok() ? b.status() : a.status());
  e.a = *a;
  e.b = *b;
  SK_CHECK(e.a->unlink().ok() && e.b->unlink().ok());
  if (allow) {
    // What the rendezvous does: each reader probes its writer's memory, then allows its inbound ring.
    SK_CHECK(probe_single_copy(*e.b).ok());
    e.a->allow_single_copy(1);
    SK_CHECK(probe_single_copy(*e.a).ok());
    e.b->allow_single_copy(0);
  }
  e.ab = std::make_unique<ShmPair>(e.a, 1, e.b, 0, std::move(ab_liveness), options);
  e.ba = std::make_unique<ShmPair>(e.b, 0, e.a, 1, tcp::Socket{}, options);
  return e;
}

std::size_t send_ok(ShmPair& p, const char* data, std::size_t n) {
  auto k = p.try_send(data, n);
  SK_CHECK(k.ok()) << k.status();
  return *k;
}

std::size_t recv_ok(ShmPair& p, char* data, std::size_t n) {
  auto k = p.try_recv(data, n);
  SK_CHECK(k.ok()) << k.status();
  return *k;
}

constexpr std::size_t kBig = (std::size_t{1} << 20) + 7;

TEST(ShmSingleCopy, LargeSendArrivesThroughTryRecvAndIsReportedOnlyOnceRead) {
  Ends e = make_ends(4096, true);
  ASSERT_TRUE(e.ab->sends_single_copy());
  const std::vector<char> src = pattern(kBig, 1);
  std::vector<char> dst(kBig, 0);
  EXPECT_EQ(send_ok(*e.ab, src.data(), kBig), 0u);  // posted, nothing read yet
  EXPECT_EQ(e.ab->stats().descriptors_posted, 1u);
  EXPECT_EQ(send_ok(*e.ab, src.data(), kBig), 0u);  // still nothing read: nothing reported
  EXPECT_EQ(recv_ok(*e.ba, dst.data(), 100000), 100000u);
  EXPECT_EQ(e.ba->stats().bytes_read, 100000u);
  EXPECT_EQ(send_ok(*e.ab, src.data(), kBig), 100000u);  // exactly what was read
  EXPECT_EQ(send_ok(*e.ab, src.data() + 100000, kBig - 100000), 0u);
  std::size_t got = 100000;
  while (got < kBig) {
    const std::size_t k = recv_ok(*e.ba, dst.data() + got, kBig - got);
    ASSERT_GT(k, 0u);
    got += k;
  }
  EXPECT_EQ(send_ok(*e.ab, src.data() + 100000, kBig - 100000), kBig - 100000);
  EXPECT_EQ(e.ab->stats().bytes_sent, kBig);
  EXPECT_EQ(e.ab->stats().descriptors_posted, 1u);
  EXPECT_TRUE(dst == src);
  // Retired: nothing more to receive, and the next large send posts a new descriptor.
  EXPECT_EQ(recv_ok(*e.ba, dst.data(), 10), 0u);
  EXPECT_EQ(send_ok(*e.ab, src.data(), 1 << 17), 0u);
  EXPECT_EQ(e.ab->stats().descriptors_posted, 2u);
}

TEST(ShmSingleCopy, PeekAndConsumeReadTheDescriptorInPieces) {
  Ends e = make_ends(4096, true);
  const std::vector<char> src = pattern(kBig, 2);
  std::vector<char> dst;
  ASSERT_EQ(send_ok(*e.ab, src.data(), kBig), 0u);
  std::size_t reported = 0;
  while (dst.size() < kBig) {
    auto p = e.ba->peek(kBig - dst.size());
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_GT(p->second, 0u);
    EXPECT_LE(p->second, std::size_t{128} << 10);  // a bounce piece
    // Unchanged until consumed: a second peek returns the same bytes; consume them in two steps.
    auto again = e.ba->peek(kBig);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->first, p->first);
    const std::size_t half = p->second / 2;
    dst.insert(dst.end(), p->first, p->first + half);
    e.ba->consume(half);
    auto rest = e.ba->peek(kBig);
    ASSERT_TRUE(rest.ok());
    ASSERT_EQ(rest->second, p->second - half);
    EXPECT_EQ(rest->first, p->first + half);
    dst.insert(dst.end(), rest->first, rest->first + rest->second);
    e.ba->consume(rest->second);
    // The sender learns of the piece once it is read (into the bounce buffer), not before.
    const std::size_t k = send_ok(*e.ab, src.data() + reported, kBig - reported);
    EXPECT_EQ(reported + k, dst.size());
    reported += k;
  }
  EXPECT_EQ(reported, kBig);
  EXPECT_EQ(e.ba->stats().bytes_read, kBig);
  EXPECT_TRUE(dst == src);
}

TEST(ShmSingleCopy, RingBytesBeforeAndAfterADescriptorKeepTheirOrder) {
  // 1000 bytes through the ring, a descriptor posted while they are still there, then 3000 more through the
  // ring once it is done: the reader gets them in that order, reading across both boundaries in one try_recv and
  // through peek.
  Ends e = make_ends(4096, true);
  const std::vector<char> small = pattern(1000, 3), big = pattern(kBig, 4), after = pattern(3000, 5);
  std::vector<char> want(small);
  want.insert(want.end(), big.begin(), big.end());
  want.insert(want.end(), after.begin(), after.end());
  std::vector<char> dst(want.size(), 0);
  ASSERT_EQ(send_ok(*e.ab, small.data(), small.size()), small.size());  // below the threshold: the ring
  ASSERT_EQ(send_ok(*e.ab, big.data(), kBig), 0u);
  EXPECT_EQ(e.ab->stats().descriptors_posted, 1u);
  std::size_t got = recv_ok(*e.ba, dst.data(), 2500);  // 1000 from the ring, 1500 from the descriptor
  EXPECT_EQ(got, 2500u);
  auto p = e.ba->peek(7000);
  ASSERT_TRUE(p.ok());
  ASSERT_EQ(p->second, 7000u);
  std::memcpy(dst.data() + got, p->first, p->second);
  e.ba->consume(p->second);
  got += 7000;
  std::size_t reported = 0;
  while (reported < kBig) {
    if (got < small.size() + kBig) got += recv_ok(*e.ba, dst.data() + got, small.size() + kBig - got);
    reported += send_ok(*e.ab, big.data() + reported, kBig - reported);
  }
  // Retired: the next small send goes through the ring again, after the descriptor's bytes.
  ASSERT_EQ(send_ok(*e.ab, after.data(), after.size()), after.size());
  while (got < want.size()) {
    const std::size_t k = recv_ok(*e.ba, dst.data() + got, want.size() - got);
    ASSERT_GT(k, 0u);
    got += k;
  }
  EXPECT_TRUE(dst == want);
}

// Moves `src` from ab to ba, alternating sends and receives (the ring is smaller than the data).
std::vector<char> transfer(Ends& e, const std::vector<char>& src) {
  std::vector<char> dst(src.size(), 0);
  std::size_t sent = 0, got = 0;
  while (sent < src.size() || got < src.size()) {
    if (sent < src.size()) sent += send_ok(*e.ab, src.data() + sent, src.size() - sent);
    if (got < src.size()) got += recv_ok(*e.ba, dst.data() + got, src.size() - got);
  }
  return dst;
}

TEST(ShmSingleCopy, OffSwitchAndUnprobedRingsUseTheRing) {
  const std::vector<char> src = pattern(kBig, 6);
  {
    ShmPairOptions off;
    off.single_copy = false;
    Ends e = make_ends(4096, /*allow=*/true, off);
    EXPECT_FALSE(e.ab->sends_single_copy());
    EXPECT_TRUE(transfer(e, src) == src);
    EXPECT_EQ(e.ab->stats().descriptors_posted, 0u);
    EXPECT_EQ(e.ba->stats().bytes_read, 0u);
  }
  {
    Ends e = make_ends(4096, /*allow=*/false);  // the reader did not allow it (its probe failed or was off)
    EXPECT_FALSE(e.ab->sends_single_copy());
    EXPECT_TRUE(transfer(e, src) == src);
    EXPECT_EQ(e.ab->stats().descriptors_posted, 0u);
  }
  {
    ShmPairOptions high = on();
    high.single_copy_min_bytes = kBig + 1;  // every send below the threshold
    Ends e = make_ends(4096, true, high);
    EXPECT_TRUE(e.ab->sends_single_copy());
    EXPECT_TRUE(transfer(e, src) == src);
    EXPECT_EQ(e.ab->stats().descriptors_posted, 0u);
  }
}

TEST(ShmSingleCopy, AFailedReadIsAnErrorNamingThePeerNotAHang) {
  // The sender's buffer becomes unreadable under a posted descriptor (PROT_NONE, not munmap: a later mapping
  // could take the address): the read fails (EFAULT) and the receive is an error; through the runner it names
  // the peer rank.
  Ends e = make_ends(4096, true);
  const std::size_t n = std::size_t{1} << 20;
  void* region = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(region, MAP_FAILED);
  std::memset(region, 1, n);
  ASSERT_EQ(send_ok(*e.ab, static_cast<const char*>(region), n), 0u);
  ASSERT_EQ(::mprotect(region, n, PROT_NONE), 0);
  std::vector<char> dst(n);
  auto k = e.ba->try_recv(dst.data(), n);
  ASSERT_FALSE(k.ok());
  EXPECT_EQ(k.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(k.status().message()), HasSubstr("process_vm_readv"));
  EXPECT_THAT(std::string(k.status().message()), HasSubstr(std::strerror(EFAULT)));
  auto p = e.ba->peek(n);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("process_vm_readv"));

  StreamRunner runner;
  runner.recv_pair = e.ba.get();
  runner.recv_peer = 1;
  runner.what = "test recv";
  runner.deadline = absl::Now() + absl::Seconds(60);
  runner.spin = absl::Microseconds(5);
  Streams streams;
  streams.recvs.push_back({dst.data(), n, StreamRecvMode::kCopy, false, nullptr});
  const absl::Status st = runner.run(streams);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("connection to rank 1 lost while receiving"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("process_vm_readv"));
  ::munmap(region, n);
}

TEST(ShmSingleCopy, ASenderThatClosesIsNotReadAndAWaitingSenderNoticesADeadPeer) {
  // The reader does not read a descriptor whose sender has shut down (its buffer may be gone): the stream is
  // closed. A sender waiting for its descriptor to be read notices that the peer's process has gone
  // (check_peer on its liveness connection) instead of waiting.
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  Ends e = make_ends(4096, true, on(), tcp::Socket(sv[0]));
  const std::vector<char> src = pattern(kBig, 7);
  ASSERT_EQ(send_ok(*e.ab, src.data(), kBig), 0u);
  ::close(sv[1]);  // the peer's process "dies"
  e.ab->check_peer();
  auto k = e.ab->try_send(src.data(), kBig);
  ASSERT_FALSE(k.ok());
  EXPECT_THAT(std::string(k.status().message()), HasSubstr("the peer's process has gone"));

  Ends f = make_ends(4096, true);
  ASSERT_EQ(send_ok(*f.ab, src.data(), kBig), 0u);
  f.ab->shutdown();
  std::vector<char> dst(kBig);
  auto r = f.ba->try_recv(dst.data(), kBig);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("closed by the peer"));
  EXPECT_EQ(f.ba->stats().bytes_read, 0u);
}

// Two ranks (threads) meet through a Store and build their shared-memory pair; `configure` sets each rank's options
// (after choosing shm). Returns, per rank, whether its pair sends by single copy.
std::vector<bool> SendsSingleCopyAfterRendezvous(const std::function<void(int, ShmRendezvousOptions&)>& configure) {
  auto store = std::make_shared<HashStore>();
  std::vector<bool> sends(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      const absl::Time deadline = absl::Now() + absl::Seconds(60);
      auto mesh = tcp_rendezvous(*store, r, 2, TcpRendezvousOptions{}, deadline);
      ASSERT_TRUE(mesh.ok()) << mesh.status();
      ShmRendezvousOptions so;
      so.choice = TransportChoice::kShm;
      configure(r, so);
      auto pairs = make_pairs(*store, r, 2, std::move(*mesh), so, deadline);
      ASSERT_TRUE(pairs.ok()) << pairs.status();
      auto* shm = dynamic_cast<ShmPair*>(pairs->pairs[static_cast<std::size_t>(1 - r)].get());
      ASSERT_NE(shm, nullptr);
      sends[static_cast<std::size_t>(r)] = shm->sends_single_copy();
    });
  }
  for (auto& t : threads) t.join();
  return sends;
}

TEST(ShmSingleCopy, RendezvousAllowsEachDirectionWhoseReaderHasItOn) {
  // Both on: both directions single copy. Rank 1 off: it neither allows rank 0's sends nor posts its own. Neither
  // asks (the default): off both ways.
  const std::vector<bool> by_default = SendsSingleCopyAfterRendezvous([](int, ShmRendezvousOptions&) {});
  EXPECT_FALSE(by_default[0]);
  EXPECT_FALSE(by_default[1]);
  for (const bool rank1_on : {true, false}) {
    const std::vector<bool> sends = SendsSingleCopyAfterRendezvous(
        [rank1_on](int r, ShmRendezvousOptions& so) { so.pair.single_copy = r == 0 || rank1_on; });
    EXPECT_EQ(sends[0], rank1_on);
    EXPECT_EQ(sends[1], rank1_on);
  }
}

TEST(ShmSingleCopy, EnvironmentSettingIsResolvedAndCheckedNamingIt) {
  ::unsetenv("SHARDKIT_SHM_SINGLE_COPY");
  EXPECT_EQ(resolve_tcp_group_options({})->shm_single_copy, false);  // off by default
  ::setenv("SHARDKIT_SHM_SINGLE_COPY", "on", 1);
  EXPECT_EQ(resolve_tcp_group_options({})->shm_single_copy, true);
  ::setenv("SHARDKIT_SHM_SINGLE_COPY", "0", 1);
  EXPECT_EQ(resolve_tcp_group_options({})->shm_single_copy, false);
  TcpProcessGroupOptions explicit_on;
  explicit_on.shm_single_copy = true;
  EXPECT_EQ(resolve_tcp_group_options(explicit_on)->shm_single_copy, true);  // the option wins
  ::setenv("SHARDKIT_SHM_SINGLE_COPY", "Off", 1);
  EXPECT_EQ(resolve_tcp_group_options({})->shm_single_copy, false);
  ::setenv("SHARDKIT_SHM_SINGLE_COPY", "1", 1);
  EXPECT_EQ(resolve_tcp_group_options({})->shm_single_copy, true);
  ::setenv("SHARDKIT_SHM_SINGLE_COPY", "maybe", 1);
  auto bad = resolve_tcp_group_options({});
  ::unsetenv("SHARDKIT_SHM_SINGLE_COPY");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("expected SHARDKIT_SHM_SINGLE_COPY to be 1, on, true, 0, off or false, found 'maybe'"));
}

TEST(ShmSingleCopy, CollectivesMatchTheReferenceWithSingleCopyOnSmallChunks) {
  // A threshold of 64 bytes puts nearly every chunk of the matrix through descriptors (in-band: headers, padding
  // and short tails), through rings of odd size so that ring bytes wrap around their end as well.
  for (const int n : {2, 3}) {
    auto store = std::make_shared<HashStore>();
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        TcpProcessGroupOptions o;
        o.default_timeout = absl::Seconds(60);
        o.connect_timeout = absl::Seconds(60);
        o.spin = absl::Microseconds(5);
        o.transport = "shm";
        o.chunk_bytes = 1000;
        o.shm_ring_bytes = 4099;
        o.shm_single_copy = true;
        o.shm_single_copy_min_bytes = 64;
        auto pg = TcpProcessGroup::create(store, r, n, o);
        ASSERT_TRUE(pg.ok()) << pg.status();
        EXPECT_THAT(tcp_testing::run_collective_matrix(**pg, {0, 1, 7, 61, 3001}, {DType::f32, DType::bf16, DType::i64}),
                    IsEmpty())
            << "n = " << n;
        EXPECT_THAT(tcp_testing::run_collective_matrix(**pg, {100003}, {DType::f32}, /*all_ops=*/false), IsEmpty())
            << "n = " << n;
      });
    }
    for (auto& t : threads) t.join();
  }
}

}  // namespace
}  // namespace shardkit::comm
