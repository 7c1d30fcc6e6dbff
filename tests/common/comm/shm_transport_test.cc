// The shared-memory transport of the process group (shm_transport.h, shm_rendezvous.h) with ranks as threads
// of this process (shared memory works between threads too): which transport each pair gets (auto, tcp, shm,
// pretend hosts through the host_id seam), the errors of a bad choice, segment names gone from /dev/shm once
// the group exists, and the faults that threads can show (a peer that aborts, a peer that never calls: both
// bounded, naming the peer). The collective matrix over shm is in collectives_test.cc (Shm/...); killed and
// stopped rank processes are in shm_process_test.cc.
#include <dirent.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/comm/hash_store.h"
#include "common/comm/shm_rendezvous.h"
#include "common/comm/tcp_process_group.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/comm/tcp_test_util.h"

namespace shardkit::comm {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;

// Creates the n ranks' groups on threads over one HashStore (options_for(rank) per rank) and runs fn on each.
void run_ranks(int n, const std::function<TcpProcessGroupOptions(int)>& options_for,
               const std::function<void(int, absl::StatusOr<std::shared_ptr<TcpProcessGroup>>&)>& fn,
               std::shared_ptr<Store> store = std::make_shared<HashStore>()) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      auto pg = TcpProcessGroup::create(store, r, n, options_for(r));
      fn(r, pg);
    });
  }
  for (auto& t : threads) t.join();
}

TcpProcessGroupOptions base_options() {
  TcpProcessGroupOptions o;
  o.default_timeout = absl::Seconds(60);
  o.connect_timeout = absl::Seconds(60);
  o.chunk_bytes = 24;
  o.shm_ring_bytes = 37;  // odd: elements straddle the ring's end
  return o;
}

// /dev/shm names this process created (segment names carry the creator's pid).
std::vector<std::string> our_segments() {
  std::vector<std::string> out;
  const std::string mine = absl::StrCat(".", ::getpid(), ".");
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (absl::StartsWith(name, "shardkit.") && absl::StrContains(name, mine)) out.push_back(name);
    }
    ::closedir(d);
  }
  return out;
}

TEST(ShmTransport, AutoUsesSharedMemoryOnOneHostAndTcpBetweenHosts) {
  // Ranks 0, 1 pretend to be on host A, ranks 2, 3 on host B: the ring 0 -> 1 -> 2 -> 3 -> 0 mixes both
  // transports on ranks 1 and 3 (one neighbour each way), and the matrix still matches the reference.
  const std::vector<std::string> hosts = {"A/boot", "A/boot", "B/boot", "B/boot"};
  run_ranks(
      4,
      [&](int r) {
        TcpProcessGroupOptions o = base_options();
        o.transport = "auto";
        o.host_id = hosts[static_cast<std::size_t>(r)];
        return o;
      },
      [&](int r, absl::StatusOr<std::shared_ptr<TcpProcessGroup>>& pg) {
        ASSERT_TRUE(pg.ok()) << pg.status();
        for (int p = 0; p < 4; ++p) {
          const std::string want = p == r ? "" : hosts[static_cast<std::size_t>(p)] == hosts[static_cast<std::size_t>(r)] ? "shm" : "tcp";
          EXPECT_EQ((*pg)->transport_to(p), want) << "rank " << r << " to rank " << p;
        }
        EXPECT_THAT(tcp_testing::run_collective_matrix(**pg, {0, 1, 7, 61}, {DType::f32, DType::bf16, DType::i64}),
                    IsEmpty());
      });
}

// Note [streaming copies] in stream_runner.cc: with streaming_copy_min_bytes = 0 every call copies into place with
// non-temporal stores (received chunks out of the ring, all_gather's own slice). The results stay those of the
// matrix's reference, and all_gather's bitwise, in place or not, through rings of 37 bytes (elements straddle the
// ring's end; pieces shorter than a 64-byte block) and 4099 bytes (whole blocks at unaligned addresses), and over
// TCP (the local copy only: TCP chunks are received by the kernel).
TEST(ShmTransport, StreamingCopiesGiveTheSameResults) {
  for (const std::size_t ring : {std::size_t{37}, std::size_t{4099}, std::size_t{0}}) {  // 0: over TCP
    for (const int n : {2, 3}) {
      run_ranks(
          n,
          [&](int) {
            TcpProcessGroupOptions o = base_options();
            if (ring == 0) {
              o.transport = "tcp";
            } else {
              o.shm_ring_bytes = ring;
            }
            o.chunk_bytes = ring == 37 ? 24 : 1000;
            o.streaming_copy_min_bytes = 0;
            return o;
          },
          [&](int r, absl::StatusOr<std::shared_ptr<TcpProcessGroup>>& pg) {
            ASSERT_TRUE(pg.ok()) << pg.status();
            EXPECT_THAT(tcp_testing::run_collective_matrix(**pg, {0, 1, 7, 61}, {DType::f32, DType::bf16, DType::i64}),
                        IsEmpty())
                << "ring " << ring << ", n = " << n;
            EXPECT_THAT(tcp_testing::run_collective_matrix(**pg, {100003}, {DType::f32}, /*all_ops=*/false), IsEmpty())
                << "ring " << ring << ", n = " << n;
            const std::int64_t m = 33331;  // per rank, odd
            for (const bool in_place : {false, true}) {
              Tensor out = Tensor::zeros({n * m});
              Tensor in = tcp_testing::make_input(r, m, DType::f32);
              if (in_place) {
                out.view(r * m, {m}).copy_(in);
                in = out.view(r * m, {m});
              }
              ASSERT_TRUE((*pg)->all_gather(out, in)->wait().ok());
              std::int64_t bad = 0;
              for (std::int64_t j = 0; j < n * m; ++j) {
                const double want = tcp_testing::input_value(static_cast<int>(j / m), j % m);
                if (out.data<float>()[j] != static_cast<float>(want)) ++bad;
              }
              EXPECT_EQ(bad, 0) << "all_gather" << (in_place ? " in place" : "") << ", ring " << ring << ", n = " << n
                                << ", rank " << r;
            }
          });
    }
  }
}

TEST(ShmTransport, AutoOnOneHostIsSharedMemoryEverywhere) {
  run_ranks(
      3, [](int) { return base_options(); },
      [](int r, absl::StatusOr<std::shared_ptr<TcpProcessGroup>>& pg) {
        ASSERT_TRUE(pg.ok()) << pg.status();
        for (int p = 0; p < 3; ++p) EXPECT_EQ((*pg)->transport_to(p), p == r ? "" : "shm");
      });
}

TEST(ShmTransport, TcpOverrideUsesTcpOnOneHost) {
  run_ranks(
      3,
      [](int) {
        TcpProcessGroupOptions o = base_options();
        o.transport = "TCP";  // case-insensitive
        return o;
      },
      [](int r, absl::StatusOr<std::shared_ptr<TcpProcessGroup>>& pg) {
        ASSERT_TRUE(pg.ok()) << pg.status();
        for (int p = 0; p < 3; ++p) EXPECT_EQ((*pg)->transport_to(p), p == r ? "" : "tcp");
        Tensor t = Tensor::full({5}, r + 1, {});
        ASSERT_TRUE((*pg)->all_reduce(t)->wait().ok());
        EXPECT_EQ(t.item_at(4), 6);
      });
}

TEST(ShmTransport, BackendNameNamesTheTransportsOfTheRanksPairs) {
  // One host, auto: every pair is shared memory.
  run_ranks(
      2, [](int) { return base_options(); },
      [](int, absl::StatusOr<std::shared_ptr<TcpProcessGroup>>& pg) {
        ASSERT_TRUE(pg.ok()) << pg.status();
        EXPECT_EQ((*pg)->backend_name(), "shm");
      });
  // One host, tcp forced: every pair is TCP.
  run_ranks(
      2,
      [](int) {
        TcpProcessGroupOptions o = base_options();
        o.transport = "tcp";
        return o;
      },
      [](int, absl::StatusOr<std::shared_ptr<TcpProcessGroup>>& pg) {
        ASSERT_TRUE(pg.ok()) << pg.status();
        EXPECT_EQ((*pg)->backend_name(), "tcp");
      });
  // Ranks 0, 1 on host A, rank 2 on host B: ranks 0 and 1 have one pair of each kind, rank 2 only TCP pairs.
  const std::vector<std::string> hosts = {"A/boot", "A/boot", "B/boot"};
  run_ranks(
      3,
      [&](int r) {
        TcpProcessGroupOptions o = base_options();
        o.transport = "auto";
        o.host_id = hosts[static_cast<std::size_t>(r)];
        return o;
      },
      [](int r, absl::StatusOr<std::shared_ptr<TcpProcessGroup>>& pg) {
        ASSERT_TRUE(pg.ok()) << pg.status();
        EXPECT_EQ((*pg)->backend_name(), r == 2 ? "tcp" : "tcp+shm") << "rank " << r;
      });
  // A group of one has no pairs: "tcp" (the backend, no transport in use).
  auto alone = TcpProcessGroup::create(std::make_shared<HashStore>(), 0, 1, base_options());
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_EQ((*alone)->backend_name(), "tcp");
}

TEST(ShmTransport, ForcedSharedMemoryAcrossHostsNamesTheRankOnTheOtherHost) {
  run_ranks(
      3,
      [](int r) {
        TcpProcessGroupOptions o = base_options();
        o.transport = "shm";
        o.host_id = r == 2 ? "other-host/b" : "this-host/a";
        o.connect_timeout = absl::Seconds(30);
        return o;
      },
      [](int r, absl::StatusOr<std::shared_ptr<TcpProcessGroup>>& pg) {
        ASSERT_FALSE(pg.ok());
        EXPECT_EQ(pg.status().code(), absl::StatusCode::kInvalidArgument) << pg.status();
        const std::string msg(pg.status().message());
        EXPECT_THAT(msg, HasSubstr(absl::StrCat("TcpProcessGroup 'world' rank ", r, " of 3")));
        EXPECT_THAT(msg, HasSubstr("the shared-memory transport (SHARDKIT_TRANSPORT=shm) needs every rank on this host"));
        if (r == 2) {
          EXPECT_THAT(msg, HasSubstr("found rank 0 on host 'this-host/a' (this rank: 'other-host/b')"));
        } else {
          EXPECT_THAT(msg, HasSubstr("found rank 2 on host 'other-host/b' (this rank: 'this-host/a')"));
        }
      });
  EXPECT_THAT(our_segments(), IsEmpty());
}

TEST(ShmTransport, UnknownTransportIsRefusedNamingIt) {
  TcpProcessGroupOptions o = base_options();
  o.transport = "udp";
  auto pg = TcpProcessGroup::create(std::make_shared<HashStore>(), 0, 1, o);
  ASSERT_FALSE(pg.ok());
  EXPECT_EQ(pg.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(pg.status().message()),
              HasSubstr("expected the transport (TcpProcessGroupOptions::transport, else SHARDKIT_TRANSPORT) to be "
                        "tcp, shm or auto, found 'udp'"));
  o.transport = "shm";
  o.shm_ring_bytes = 8;
  pg = TcpProcessGroup::create(std::make_shared<HashStore>(), 0, 1, o);
  ASSERT_FALSE(pg.ok());
  EXPECT_THAT(std::string(pg.status().message()), HasSubstr("expected shm_ring_bytes >= 16, found 8"));
}

TEST(ShmTransport, SegmentNamesAreGoneOnceTheGroupExistsAndTwoJobsDoNotCollide) {
  // Two "jobs" (separate stores, the same prefix and generation) at once, plus a second generation of one.
  std::atomic<int> ok{0};
  auto job = [&](std::shared_ptr<Store> store, int generations) {
    for (int g = 0; g < generations; ++g) {
      run_ranks(
          3, [](int) { return base_options(); },
          [&](int r, absl::StatusOr<std::shared_ptr<TcpProcessGroup>>& pg) {
            ASSERT_TRUE(pg.ok()) << pg.status();
            Tensor t = Tensor::full({100}, r + 1, {});
            ASSERT_TRUE((*pg)->all_reduce(t)->wait().ok());
            EXPECT_EQ(t.item_at(99), 6);
            // Every rank of this job has created its group: no name of ours is left.
            ASSERT_TRUE((*pg)->barrier()->wait().ok());
            ++ok;
          },
          store);
    }
  };
  std::thread a(job, std::make_shared<HashStore>(), 2);
  std::thread b(job, std::make_shared<HashStore>(), 1);
  a.join();
  b.join();
  EXPECT_EQ(ok.load(), 9);
  EXPECT_THAT(our_segments(), IsEmpty());
}

TEST(ShmTransport, SegmentsAreUnlinkedWhileTheGroupLives) {
  run_ranks(
      2, [](int) { return base_options(); },
      [](int, absl::StatusOr<std::shared_ptr<TcpProcessGroup>>& pg) {
        ASSERT_TRUE(pg.ok()) << pg.status();
        ASSERT_TRUE((*pg)->barrier()->wait().ok());  // both groups exist
        EXPECT_THAT(our_segments(), IsEmpty());
        ASSERT_TRUE((*pg)->barrier()->wait().ok());
      });
}

TEST(ShmTransport, APeerThatAbortsIsNamedAtOnce) {
  // Rank 1 aborts instead of joining a 4 MiB all_reduce that rank 0 waits in (it has sent what fits in the
  // ring): rank 0 fails within a fraction of its 60 s deadline, naming rank 1 and quoting its reason.
  run_ranks(
      2,
      [](int) {
        TcpProcessGroupOptions o = base_options();
        o.chunk_bytes = 256 << 10;
        o.shm_ring_bytes = 64 << 10;
        return o;
      },
      [](int r, absl::StatusOr<std::shared_ptr<TcpProcessGroup>>& pg) {
        ASSERT_TRUE(pg.ok()) << pg.status();
        ASSERT_TRUE((*pg)->barrier()->wait().ok());
        if (r == 1) {
          (*pg)->abort(absl::CancelledError("rank 1 gives up"));
          return;
        }
        Tensor t = Tensor::full({1 << 20}, 1.0, {});
        const absl::Time start = absl::Now();
        const absl::Status st = (*pg)->all_reduce(t)->wait();
        const absl::Duration took = absl::Now() - start;
        ASSERT_FALSE(st.ok());
        EXPECT_THAT(std::string(st.message()), HasSubstr("rank 1"));
        EXPECT_THAT(std::string(st.message()), HasSubstr("all_reduce"));
        EXPECT_LT(took, absl::Seconds(20)) << st;
      });
}

TEST(ShmTransport, APeerThatNeverCallsIsADeadlineErrorNamingIt) {
  // Rank 0's all_reduce (deadline 1 s) waits on the futex for rank 1, which never issues it: DeadlineExceeded
  // naming rank 1 after about the deadline, not a hang and not a spin until some other timeout.
  std::atomic<bool> done{false};
  run_ranks(
      2, [](int) { return base_options(); },
      [&](int r, absl::StatusOr<std::shared_ptr<TcpProcessGroup>>& pg) {
        ASSERT_TRUE(pg.ok()) << pg.status();
        if (r == 1) {
          while (!done.load()) std::this_thread::yield();  // keeps its group alive, issues nothing
          return;
        }
        Tensor t = Tensor::full({1000}, 1.0, {});
        AllReduceOptions o;
        o.timeout = absl::Seconds(1);
        const absl::Time start = absl::Now();
        const absl::Status st = (*pg)->all_reduce(t, o)->wait();
        const absl::Duration took = absl::Now() - start;
        done = true;
        EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
        EXPECT_THAT(std::string(st.message()), HasSubstr("rank 1"));
        EXPECT_GE(took, absl::Milliseconds(900));
        EXPECT_LT(took, absl::Seconds(15));
      });
}

TEST(ShmTransport, ParseTransportChoice) {
  EXPECT_EQ(*parse_transport_choice("", "X"), TransportChoice::kAuto);
  EXPECT_EQ(*parse_transport_choice("auto", "X"), TransportChoice::kAuto);
  EXPECT_EQ(*parse_transport_choice("Shm", "X"), TransportChoice::kShm);
  EXPECT_EQ(*parse_transport_choice("tcp", "X"), TransportChoice::kTcp);
  EXPECT_THAT(std::string(parse_transport_choice("nccl", "SHARDKIT_TRANSPORT").status().message()),
              HasSubstr("expected SHARDKIT_TRANSPORT to be tcp, shm or auto, found 'nccl'"));
  const std::string id = local_host_id();
  EXPECT_THAT(id, ::testing::MatchesRegex(".+/[0-9a-f-]{36}"));
}

}  // namespace
}  // namespace shardkit::comm
