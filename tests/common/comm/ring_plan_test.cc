// Chunk plans (ring_plan.h) without sockets: every rank's plan is run by a small simulator (element streams
// between ranks, sends that wait for receives as the plan says) and the results are checked against what the
// collective means: each element holds every rank's contribution exactly once (all_reduce, the owned segment
// of reduce_scatter, reduce at the root), the root's / owner's values (broadcast, all_gather), and avg's
// division happens exactly once per element. Also: the shapes of the plans (segments, chunking, the peers,
// the pipelining dependencies).
#include "common/comm/ring_plan.h"

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::comm {
namespace {

using ::testing::ElementsAre;

// What an element holds in the simulation: the sum of contribution(r) over the ranks reduced into it (one
// byte per rank: a contribution counted twice shows as a 2) and how many times it was finalized.
struct Elem {
  std::uint64_t contributions = 0;
  int finalized = 0;
  bool operator==(const Elem&) const = default;
};

std::uint64_t contribution(int rank) { return std::uint64_t{1} << (8 * rank); }

std::uint64_t all_contributions(int world) {
  std::uint64_t s = 0;
  for (int r = 0; r < world; ++r) s += contribution(r);
  return s;
}

// Runs every rank's plan on its buffer. Streams between ranks carry elements (no chunk boundaries, like a
// byte stream); a send copies its elements when it leaves, a receive takes them when enough have arrived. Fails
// the test when the plans deadlock or leave elements in flight.
void simulate(std::vector<ChunkPlan>& plans, std::vector<std::vector<Elem>>& buffers) {
  const int n = static_cast<int>(plans.size());
  std::map<std::pair<int, int>, std::deque<Elem>> wire;  // (from, to)
  std::vector<std::size_t> si(static_cast<std::size_t>(n), 0), ri(static_cast<std::size_t>(n), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < n; ++r) {
      ChunkPlan& p = plans[static_cast<std::size_t>(r)];
      std::vector<Elem>& buf = buffers[static_cast<std::size_t>(r)];
      std::size_t& s = si[static_cast<std::size_t>(r)];
      std::size_t& q = ri[static_cast<std::size_t>(r)];
      while (s < p.sends.size() && p.sends[s].after_recv < static_cast<std::int64_t>(q)) {
        const PlannedSend& c = p.sends[s];
        auto& w = wire[{r, p.send_peer}];
        for (std::int64_t i = 0; i < c.count; ++i) w.push_back(buf[static_cast<std::size_t>(c.offset + i)]);
        ++s;
        progress = true;
      }
      while (q < p.recvs.size()) {
        const PlannedRecv& c = p.recvs[q];
        auto& w = wire[{p.recv_peer, r}];
        if (static_cast<std::int64_t>(w.size()) < c.count) break;
        for (std::int64_t i = 0; i < c.count; ++i) {
          Elem& e = buf[static_cast<std::size_t>(c.offset + i)];
          const Elem got = w.front();
          w.pop_front();
          if (c.mode == PlanRecvMode::kCopy) {
            e = got;
          } else {
            e.contributions += got.contributions;
            e.finalized += got.finalized + (c.finalize ? 1 : 0);
          }
        }
        ++q;
        progress = true;
      }
    }
  }
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(si[static_cast<std::size_t>(r)], plans[static_cast<std::size_t>(r)].sends.size())
        << "rank " << r << " could not send everything (deadlock)";
    EXPECT_EQ(ri[static_cast<std::size_t>(r)], plans[static_cast<std::size_t>(r)].recvs.size())
        << "rank " << r << " could not receive everything (deadlock)";
  }
  for (const auto& [ends, w] : wire) EXPECT_TRUE(w.empty()) << w.size() << " elements left from rank " << ends.first;
}

std::vector<std::vector<Elem>> own_contributions(int world, std::int64_t numel) {
  std::vector<std::vector<Elem>> b(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) b[static_cast<std::size_t>(r)].assign(static_cast<std::size_t>(numel), {contribution(r), 0});
  return b;
}

struct Shape {
  int world;
  std::int64_t numel;
  std::int64_t chunk;
};

std::vector<Shape> shapes() {
  std::vector<Shape> v;
  for (int world : {1, 2, 3, 4, 5})
    for (std::int64_t numel : {0, 1, 4, 7, 61})
      for (std::int64_t chunk : {1, 3, 1000}) v.push_back({world, numel, chunk});
  return v;
}

std::string where(const Shape& s) { return absl::StrCat("world ", s.world, " numel ", s.numel, " chunk ", s.chunk); }

TEST(SplitSegments, NearEqualConsecutiveTheFirstGetTheRemainder) {
  const auto segs = split_segments(10, 4);
  ASSERT_EQ(segs.size(), 4u);
  EXPECT_EQ(segs[0].offset, 0);
  EXPECT_EQ(segs[0].count, 3);
  EXPECT_EQ(segs[1].offset, 3);
  EXPECT_EQ(segs[1].count, 3);
  EXPECT_EQ(segs[2].offset, 6);
  EXPECT_EQ(segs[2].count, 2);
  EXPECT_EQ(segs[3].offset, 8);
  EXPECT_EQ(segs[3].count, 2);
  const auto few = split_segments(2, 3);
  EXPECT_EQ(few[2].count, 0);
  EXPECT_EQ(few[2].offset, 2);
}

TEST(RingPlans, AllReduceGivesEveryRankEveryContributionOnceFinalizedOnce) {
  for (const Shape& s : shapes()) {
    std::vector<ChunkPlan> plans;
    for (int r = 0; r < s.world; ++r) plans.push_back(plan_ring_all_reduce(r, s.world, s.numel, s.chunk));
    auto bufs = own_contributions(s.world, s.numel);
    simulate(plans, bufs);
    const Elem want{all_contributions(s.world), s.world > 1 ? 1 : 0};
    for (int r = 0; r < s.world; ++r)
      for (std::int64_t i = 0; i < s.numel; ++i)
        ASSERT_EQ(bufs[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)], want)
            << where(s) << " rank " << r << " element " << i;
  }
}

TEST(RingPlans, ReduceScatterLeavesEachRankItsSegmentReduced) {
  for (const Shape& s : shapes()) {
    const std::int64_t total = s.numel * s.world;  // as reduce_scatter's input
    std::vector<ChunkPlan> plans;
    for (int r = 0; r < s.world; ++r) plans.push_back(plan_ring_reduce_scatter(r, s.world, total, s.chunk));
    auto bufs = own_contributions(s.world, total);
    simulate(plans, bufs);
    const auto segs = split_segments(total, s.world);
    for (int r = 0; r < s.world; ++r) {
      const Segment own = segs[static_cast<std::size_t>(r)];
      ASSERT_EQ(own.offset, r * s.numel);
      for (std::int64_t i = own.offset; i < own.offset + own.count; ++i)
        ASSERT_EQ(bufs[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)],
                  (Elem{all_contributions(s.world), s.world > 1 ? 1 : 0}))
            << where(s) << " rank " << r << " element " << i;
    }
  }
}

TEST(RingPlans, AllGatherGivesEveryRankEverySegmentFromItsOwner) {
  for (const Shape& s : shapes()) {
    const auto segs = split_segments(s.numel, s.world);
    std::vector<ChunkPlan> plans;
    std::vector<std::vector<Elem>> bufs(static_cast<std::size_t>(s.world));
    for (int r = 0; r < s.world; ++r) {
      plans.push_back(plan_ring_all_gather(r, s.world, s.numel, s.chunk));
      auto& b = bufs[static_cast<std::size_t>(r)];
      b.assign(static_cast<std::size_t>(s.numel), Elem{});
      const Segment own = segs[static_cast<std::size_t>(r)];
      for (std::int64_t i = own.offset; i < own.offset + own.count; ++i) b[static_cast<std::size_t>(i)] = {contribution(r), 0};
    }
    simulate(plans, bufs);
    for (int r = 0; r < s.world; ++r)
      for (int owner = 0; owner < s.world; ++owner) {
        const Segment seg = segs[static_cast<std::size_t>(owner)];
        for (std::int64_t i = seg.offset; i < seg.offset + seg.count; ++i)
          ASSERT_EQ(bufs[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)], (Elem{contribution(owner), 0}))
              << where(s) << " rank " << r << " element " << i;
      }
  }
}

TEST(ChainPlans, BroadcastGivesEveryRankTheRootsValues) {
  for (const Shape& s : shapes()) {
    for (int root = 0; root < s.world; ++root) {
      std::vector<ChunkPlan> plans;
      for (int r = 0; r < s.world; ++r) plans.push_back(plan_chain_broadcast(r, s.world, root, s.numel, s.chunk));
      auto bufs = own_contributions(s.world, s.numel);
      simulate(plans, bufs);
      for (int r = 0; r < s.world; ++r)
        for (std::int64_t i = 0; i < s.numel; ++i)
          ASSERT_EQ(bufs[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)], (Elem{contribution(root), 0}))
              << where(s) << " root " << root << " rank " << r;
    }
  }
}

TEST(ChainPlans, ReduceGivesTheRootEveryContributionOnceFinalizedOnce) {
  for (const Shape& s : shapes()) {
    for (int root = 0; root < s.world; ++root) {
      std::vector<ChunkPlan> plans;
      for (int r = 0; r < s.world; ++r) plans.push_back(plan_chain_reduce(r, s.world, root, s.numel, s.chunk));
      auto bufs = own_contributions(s.world, s.numel);
      simulate(plans, bufs);
      for (std::int64_t i = 0; i < s.numel; ++i)
        ASSERT_EQ(bufs[static_cast<std::size_t>(root)][static_cast<std::size_t>(i)],
                  (Elem{all_contributions(s.world), s.world > 1 ? 1 : 0}))
            << where(s) << " root " << root;
    }
  }
}

TEST(PointToPointPlans, TheReceiverGetsTheSendersBuffer) {
  for (std::int64_t chunk : {1, 4, 100}) {
    std::vector<ChunkPlan> plans = {plan_send(1, 10, chunk), plan_recv(0, 10, chunk)};
    auto bufs = own_contributions(2, 10);
    simulate(plans, bufs);
    for (const Elem& e : bufs[1]) ASSERT_EQ(e, (Elem{contribution(0), 0}));
  }
}

TEST(RingPlans, NeighboursChunksAndPipelining) {
  // Rank 1 of 3, 12 elements (segments of 4), chunks of 3: sends to 2, receives from 0.
  const ChunkPlan p = plan_ring_all_reduce(1, 3, 12, 3);
  EXPECT_EQ(p.send_peer, 2);
  EXPECT_EQ(p.recv_peer, 0);
  auto offsets = [](const auto& chunks) {
    std::vector<std::pair<std::int64_t, std::int64_t>> v;
    for (const auto& c : chunks) v.emplace_back(c.offset, c.count);
    return v;
  };
  using P = std::pair<std::int64_t, std::int64_t>;
  // Reduce-scatter sends seg 0 then seg 2; all-gather sends seg 1 (owned) then seg 0.
  EXPECT_THAT(offsets(p.sends), ElementsAre(P{0, 3}, P{3, 1}, P{8, 3}, P{11, 1}, P{4, 3}, P{7, 1}, P{0, 3}, P{3, 1}));
  // Reduce-scatter receives seg 2 then seg 1 (owned, finalized); all-gather receives seg 0 then seg 2.
  EXPECT_THAT(offsets(p.recvs), ElementsAre(P{8, 3}, P{11, 1}, P{4, 3}, P{7, 1}, P{0, 3}, P{3, 1}, P{8, 3}, P{11, 1}));
  std::vector<std::int64_t> after;
  for (const auto& c : p.sends) after.push_back(c.after_recv);
  // The first step leaves at once; every later chunk waits for the chunk it forwards.
  EXPECT_THAT(after, ElementsAre(-1, -1, 0, 1, 2, 3, 4, 5));
  std::vector<bool> finalize;
  for (const auto& c : p.recvs) finalize.push_back(c.mode == PlanRecvMode::kReduce && c.finalize);
  EXPECT_THAT(finalize, ElementsAre(false, false, true, true, false, false, false, false));
  EXPECT_EQ(p.recvs[4].mode, PlanRecvMode::kCopy);
}

TEST(ChainPlans, TheEndsOfTheChainOnlySendOrOnlyReceive) {
  const ChunkPlan root = plan_chain_broadcast(2, 4, 2, 5, 2);
  EXPECT_EQ(root.send_peer, 3);
  EXPECT_EQ(root.recv_peer, -1);
  EXPECT_EQ(root.sends.size(), 3u);
  const ChunkPlan last = plan_chain_broadcast(1, 4, 2, 5, 2);
  EXPECT_EQ(last.send_peer, -1);
  EXPECT_EQ(last.recv_peer, 0);
  const ChunkPlan middle = plan_chain_broadcast(0, 4, 2, 5, 2);
  EXPECT_EQ(middle.recv_peer, 3);
  EXPECT_EQ(middle.send_peer, 1);
  EXPECT_EQ(middle.sends[2].after_recv, 2);  // a middle rank forwards chunk k once it has arrived
  const ChunkPlan one = plan_ring_all_reduce(0, 1, 10, 3);
  EXPECT_EQ(one.send_peer, -1);
  EXPECT_EQ(one.recv_peer, -1);
  EXPECT_TRUE(one.sends.empty() && one.recvs.empty());
}

}  // namespace
}  // namespace shardkit::comm
