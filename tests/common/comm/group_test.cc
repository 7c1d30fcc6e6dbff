// In-process groups: p2p, counters, sub-groups, HashStore, harness basics.
#include <string>
#include <thread>
#include <vector>

#include "common/comm/hash_store.h"
#include "common/comm/process_group.h"
#include "common/comm/testing/run_ranks.h"
#include "common/tensor/rank_context.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::comm {
namespace {

using ::testing::HasSubstr;

#define RETURN_IF_ERROR_(expr)             \
  do {                                     \
    absl::Status s_ = (expr);              \
    if (!s_.ok()) return s_;               \
  } while (0)

TEST(HarnessTest, EachRankHasItsOwnContextLedgerAndGenerator) {
  std::vector<std::int64_t> charged(3);
  std::vector<std::uint64_t> streams(3);
  absl::Status st = RunRanks(3, [&](RankEnv& env) {
    EXPECT_EQ(&current_rank_context(), &env.context);
    EXPECT_EQ(env.context.rank, env.rank);
    EXPECT_EQ(env.context.world_size, 3);
    EXPECT_EQ(env.group.rank(), env.rank);
    EXPECT_EQ(env.group.size(), 3);
    Tensor t = Tensor::zeros({10 * (env.rank + 1)});
    charged[env.rank] = env.context.memory->total_current();
    streams[env.rank] = env.context.generator.stream();
  }, {.seed = 7});
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(charged, (std::vector<std::int64_t>{40, 80, 120}));
  EXPECT_EQ(streams, (std::vector<std::uint64_t>{0, 1, 2}));
}

TEST(P2PTest, RingExchangeWithRecvsPostedFirst) {
  for (int n : {2, 3, 5}) {
    absl::Status st = RunRanks(n, [&](RankEnv& env) -> absl::Status {
      const int r = env.rank;
      Tensor out = Tensor::full({5}, 100 + r);
      Tensor in = Tensor::zeros({5});
      auto rw = env.group.recv(in, (r + n - 1) % n);
      auto sw = env.group.send(out, (r + 1) % n);
      RETURN_IF_ERROR_(rw->wait());
      RETURN_IF_ERROR_(sw->wait());
      EXPECT_TRUE(rw->is_completed());
      EXPECT_EQ(in.to_vector(), std::vector<float>(5, static_cast<float>(100 + (r + n - 1) % n)));
      return absl::OkStatus();
    });
    EXPECT_TRUE(st.ok()) << st;
  }
}

TEST(P2PTest, MessagesOnAPairAreMatchedInOrder) {
  absl::Status st = RunRanks(2, [&](RankEnv& env) -> absl::Status {
    if (env.rank == 0) {
      auto a = env.group.send(Tensor::full({3}, 1.0), 1);
      auto b = env.group.send(Tensor::full({3}, 2.0), 1);
      RETURN_IF_ERROR_(a->wait());
      return b->wait();
    }
    Tensor x = Tensor::zeros({3}), y = Tensor::zeros({3});
    RETURN_IF_ERROR_(env.group.recv(x, 0)->wait());
    RETURN_IF_ERROR_(env.group.recv(y, 0)->wait());
    EXPECT_EQ(x.to_vector(), std::vector<float>(3, 1.f));
    EXPECT_EQ(y.to_vector(), std::vector<float>(3, 2.f));
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

TEST(P2PTest, SendThatIsNeverReceivedNamesTheReceiver) {
  absl::Status st = RunRanks(2, [&](RankEnv& env) -> absl::Status {
    if (env.rank == 1) return absl::OkStatus();
    return env.group.send(Tensor::zeros({2}), 1)->wait();
  });
  EXPECT_FALSE(st.ok());
  EXPECT_THAT(std::string(st.message()), HasSubstr("rank 1 returned from its function without"));
}

TEST(P2PTest, SizeMismatchFailsBothSides) {
  absl::Status st = RunRanks(2, [&](RankEnv& env) -> absl::Status {
    if (env.rank == 0) return env.group.send(Tensor::zeros({3}), 1)->wait();
    Tensor x = Tensor::zeros({4});
    return env.group.recv(x, 0)->wait();
  });
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("expected the recv to match f32[3] cpu, found f32[4] cpu"));
}

TEST(CountersTest, RingEquivalentVolumes) {
  const int n = 4;
  std::vector<CommCounters> c(n);
  absl::Status st = RunRanks(n, [&](RankEnv& env) -> absl::Status {
    ProcessGroup& pg = env.group;
    Tensor t = Tensor::zeros({1000});  // 4000 bytes
    RETURN_IF_ERROR_(pg.all_reduce(t)->wait());
    RETURN_IF_ERROR_(pg.all_reduce(t)->wait());
    Tensor shard = Tensor::zeros({250}), full = Tensor::zeros({1000});
    RETURN_IF_ERROR_(pg.all_gather(full, shard)->wait());
    RETURN_IF_ERROR_(pg.reduce_scatter(shard, full)->wait());
    RETURN_IF_ERROR_(pg.broadcast(t, {.root = 1})->wait());
    RETURN_IF_ERROR_(pg.reduce(t, {.root = 1})->wait());
    RETURN_IF_ERROR_(pg.barrier()->wait());
    c[env.rank] = pg.counters();
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  for (int r = 0; r < n; ++r) {
    const auto& ar = c[r].of(CollectiveKind::all_reduce);
    EXPECT_EQ(ar.calls, 2);
    EXPECT_EQ(ar.bytes_sent, 2 * 6000);  // 2 (n-1)/n * 4000 per call
    EXPECT_EQ(ar.bytes_received, 2 * 6000);
    EXPECT_EQ(c[r].of(CollectiveKind::all_gather).bytes_sent, 3000);  // (n-1) * 1000
    EXPECT_EQ(c[r].of(CollectiveKind::reduce_scatter).bytes_received, 3000);
    EXPECT_EQ(c[r].of(CollectiveKind::barrier).calls, 1);
    EXPECT_EQ(c[r].of(CollectiveKind::barrier).bytes_sent, 0);
  }
  // Broadcast from 1 along 1 -> 2 -> 3 -> 0: rank 0 is last (sends nothing), root receives nothing.
  EXPECT_EQ(c[1].of(CollectiveKind::broadcast).bytes_sent, 4000);
  EXPECT_EQ(c[1].of(CollectiveKind::broadcast).bytes_received, 0);
  EXPECT_EQ(c[0].of(CollectiveKind::broadcast).bytes_sent, 0);
  EXPECT_EQ(c[0].of(CollectiveKind::broadcast).bytes_received, 4000);
  // Reduce to 1 along 2 -> 3 -> 0 -> 1: rank 2 receives nothing, the root sends nothing.
  EXPECT_EQ(c[2].of(CollectiveKind::reduce).bytes_received, 0);
  EXPECT_EQ(c[1].of(CollectiveKind::reduce).bytes_sent, 0);
  EXPECT_EQ(c[1].of(CollectiveKind::reduce).bytes_received, 4000);
  std::int64_t sent = 0, received = 0;
  for (int r = 0; r < n; ++r) {
    sent += c[r].total_sent();
    received += c[r].total_received();
  }
  EXPECT_EQ(sent, received);
  CommCounters d = c[0].since(CommCounters{});
  EXPECT_EQ(d.total_sent(), c[0].total_sent());
  EXPECT_THAT(c[0].to_string(), HasSubstr("all_reduce calls=2 sent=12000 received=12000"));
}

TEST(CountersTest, SingleRankAndP2P) {
  EXPECT_EQ(collective_volume(CollectiveKind::all_reduce, 4000, 1, 0).sent, 0);
  EXPECT_EQ(collective_volume(CollectiveKind::send, 12, 2, 0).sent, 12);
  EXPECT_EQ(collective_volume(CollectiveKind::recv, 12, 2, 1).received, 12);
  EXPECT_EQ(collective_volume(CollectiveKind::all_reduce, 10, 3, 0).sent, 13);  // 2*2*10/3 rounded down
}

TEST(SubGroupTest, NewGroupAndSplit) {
  const int n = 4;
  absl::Status st = RunRanks(n, [&](RankEnv& env) -> absl::Status {
    const int r = env.rank;
    auto odd = env.group.new_group(std::vector<int>{3, 1});
    if (!odd.ok()) return odd.status();
    if (r == 1 || r == 3) {
      ProcessGroup& g = **odd;
      EXPECT_EQ(g.size(), 2);
      EXPECT_EQ(g.rank(), r == 3 ? 0 : 1);
      EXPECT_EQ(g.global_ranks(), (std::vector<int>{3, 1}));
      Tensor t = Tensor::full({3}, r);
      RETURN_IF_ERROR_(g.all_reduce(t)->wait());
      EXPECT_EQ(t.to_vector(), std::vector<float>(3, 4.f));
    } else {
      EXPECT_EQ(*odd, nullptr);
    }
    // split by parity, reversed order within each group.
    auto half = env.group.split(r % 2, -r, {.name = r % 2 ? "odd" : "even"});
    if (!half.ok()) return half.status();
    ProcessGroup& h = **half;
    EXPECT_EQ(h.size(), 2);
    EXPECT_EQ(h.rank(), r < 2 ? 1 : 0);
    Tensor t = Tensor::full({2}, r);
    RETURN_IF_ERROR_(h.broadcast(t, {.root = 0})->wait());  // root = the higher world rank
    EXPECT_EQ(t.to_vector(), std::vector<float>(2, static_cast<float>(r < 2 ? r + 2 : r)));
    // The world group still works after sub-groups were made.
    return env.group.barrier()->wait();
  });
  EXPECT_TRUE(st.ok()) << st;
}

TEST(SubGroupTest, FailureInASubGroupNamesTheGlobalRank) {
  absl::Status st = RunRanks(4, [&](RankEnv& env) -> absl::Status {
    auto sub = env.group.new_group(std::vector<int>{2, 3});
    if (!sub.ok()) return sub.status();
    if (env.rank == 3) return absl::OkStatus();  // leaves without joining the sub-group barrier
    if (env.rank == 2) return (*sub)->barrier({.tag = "sub"})->wait();
    return absl::OkStatus();  // ranks 0, 1 are not members
  });
  EXPECT_FALSE(st.ok());
  EXPECT_THAT(std::string(st.message()), HasSubstr("rank 1 (global rank 3) returned from its function"));
}

TEST(HashStoreTest, SetGetAddWaitDelete) {
  HashStore store;
  ASSERT_TRUE(store.set("a", "x").ok());
  EXPECT_EQ(*store.get("a", absl::Seconds(1)), "x");
  EXPECT_EQ(*store.add("n", 2), 2);
  EXPECT_EQ(*store.add("n", 3), 5);
  EXPECT_EQ(*store.get("n", absl::Seconds(1)), "5");
  EXPECT_EQ(store.add("a", 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(*store.check({"a", "n"}));
  EXPECT_FALSE(*store.check({"a", "missing"}));
  absl::Status w = store.wait({"a", "missing"}, absl::Milliseconds(20));
  EXPECT_EQ(w.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(w.message()), HasSubstr("[missing]"));
  EXPECT_TRUE(*store.delete_key("a"));
  EXPECT_FALSE(*store.delete_key("a"));
  // A waiter is woken by a set from another thread.
  std::thread setter([&] { ASSERT_TRUE(store.set("late", "v").ok()); });
  EXPECT_EQ(*store.get("late", absl::Seconds(10)), "v");
  setter.join();
}

}  // namespace
}  // namespace shardkit::comm
