#include "common/comm/ring_plan.h"

#include <algorithm>
#include <cstddef>
#include <utility>

#include "common/base/check.h"

namespace shardkit::comm {

// Note [ring plans]
// Ring reduce-scatter over segments seg[0..n), rank r ends owning seg[r]:
//   step s = 0..n-2: send seg[r-s-1], receive seg[r-s-2] and reduce (mod n); step n-2 receives seg[r].
// Ring all-gather, rank r starting with seg[r]:
//   step s = 0..n-2: send seg[r-s], receive seg[r-s-1] into place.
// all_reduce is the two back to back (the first all-gather send, seg[r], depends on the last
// reduce-scatter receive). avg divides the owned segment once, before the all-gather (finalize).
// In a ring, what a rank forwards at step s+1 is exactly what it received (and reduced) at step s, so chunk j
// of step s+1 can leave as soon as chunk j of step s has arrived: the plan says so with after_recv, and a
// runner pipelines the steps. Causality makes the in-place buffers safe: a region is only overwritten by data
// whose production required this rank's earlier sends of that region to have been handed to the transport.
// The chains (broadcast, reduce) are the same idea along a line instead of a circle.

namespace {

int mod(int a, int n) { return ((a % n) + n) % n; }

// Appends the steps of one plan. A step sends one segment and / or receives one; when chained, the step's
// send chunks wait chunk for chunk for the previous step's receive chunks (the same segment by construction).
class PlanBuilder {
 public:
  explicit PlanBuilder(std::int64_t chunk_elems) : chunk_elems_(chunk_elems) {
    SK_CHECK_GT(chunk_elems, 0) << "chunk plans need at least one element per chunk";
  }

  void step(const Segment* send_seg, const Segment* recv_seg, PlanRecvMode mode, bool finalize, bool chained) {
    std::vector<std::int64_t> this_recv;
    if (send_seg) {
      std::size_t k = 0;
      for (std::int64_t off = 0; off < send_seg->count; off += chunk_elems_, ++k) {
        std::int64_t after = -1;
        if (chained) {
          SK_CHECK_LT(k, prev_recv_.size()) << "ring steps must forward the segment received before";
          after = prev_recv_[k];
        }
        plan.sends.push_back({send_seg->offset + off, std::min(chunk_elems_, send_seg->count - off), after});
      }
    }
    if (recv_seg) {
      for (std::int64_t off = 0; off < recv_seg->count; off += chunk_elems_) {
        this_recv.push_back(static_cast<std::int64_t>(plan.recvs.size()));
        plan.recvs.push_back({recv_seg->offset + off, std::min(chunk_elems_, recv_seg->count - off), mode, finalize});
      }
    }
    prev_recv_ = std::move(this_recv);
  }

  ChunkPlan plan;

 private:
  std::int64_t chunk_elems_;
  std::vector<std::int64_t> prev_recv_;
};

void check_rank(int rank, int world) {
  SK_CHECK(world >= 1 && rank >= 0 && rank < world) << "rank " << rank << " of world " << world;
}

ChunkPlan ring(int rank, int world, std::int64_t numel, std::int64_t chunk_elems, bool reduce_scatter,
               bool all_gather) {
  check_rank(rank, world);
  PlanBuilder b(chunk_elems);
  if (world == 1) return b.plan;
  const int n = world, r = rank;
  const std::vector<Segment> segs = split_segments(numel, n);
  auto seg = [&](int i) { return &segs[static_cast<std::size_t>(mod(i, n))]; };
  b.plan.send_peer = mod(r + 1, n);
  b.plan.recv_peer = mod(r - 1, n);
  bool chained = false;
  if (reduce_scatter) {
    for (int s = 0; s <= n - 2; ++s) {
      b.step(seg(r - s - 1), seg(r - s - 2), PlanRecvMode::kReduce, s == n - 2, chained);
      chained = true;
    }
  }
  if (all_gather) {
    for (int s = 0; s <= n - 2; ++s) {
      b.step(seg(r - s), seg(r - s - 1), PlanRecvMode::kCopy, false, chained);
      chained = true;
    }
  }
  return std::move(b.plan);
}

// A chain: position 0 starts, position world-1 ends; each position receives from the one before and
// forwards to the one after.
ChunkPlan chain(int rank, int world, int pos, std::int64_t numel, std::int64_t chunk_elems, PlanRecvMode mode) {
  PlanBuilder b(chunk_elems);
  const int n = world;
  b.plan.send_peer = pos < n - 1 ? mod(rank + 1, n) : -1;
  b.plan.recv_peer = pos > 0 ? mod(rank - 1, n) : -1;
  const Segment all{0, numel};
  b.step(nullptr, pos > 0 ? &all : nullptr, mode, mode == PlanRecvMode::kReduce && pos == n - 1, false);
  if (pos < n - 1) b.step(&all, nullptr, PlanRecvMode::kCopy, false, pos > 0);
  return std::move(b.plan);
}

}  // namespace

std::vector<Segment> split_segments(std::int64_t numel, int world) {
  SK_CHECK_GE(world, 1);
  std::vector<Segment> segs(static_cast<std::size_t>(world));
  const std::int64_t base = numel / world, extra = numel % world;
  std::int64_t off = 0;
  for (int i = 0; i < world; ++i) {
    const std::int64_t c = base + (i < extra ? 1 : 0);
    segs[static_cast<std::size_t>(i)] = {off, c};
    off += c;
  }
  return segs;
}

ChunkPlan plan_ring_reduce_scatter(int rank, int world, std::int64_t numel, std::int64_t chunk_elems) {
  return ring(rank, world, numel, chunk_elems, /*reduce_scatter=*/true, /*all_gather=*/false);
}

ChunkPlan plan_ring_all_gather(int rank, int world, std::int64_t numel, std::int64_t chunk_elems) {
  return ring(rank, world, numel, chunk_elems, /*reduce_scatter=*/false, /*all_gather=*/true);
}

ChunkPlan plan_ring_all_reduce(int rank, int world, std::int64_t numel, std::int64_t chunk_elems) {
  return ring(rank, world, numel, chunk_elems, /*reduce_scatter=*/true, /*all_gather=*/true);
}

ChunkPlan plan_chain_broadcast(int rank, int world, int root, std::int64_t numel, std::int64_t chunk_elems) {
  check_rank(rank, world);
  check_rank(root, world);
  return chain(rank, world, mod(rank - root, world), numel, chunk_elems, PlanRecvMode::kCopy);
}

ChunkPlan plan_chain_reduce(int rank, int world, int root, std::int64_t numel, std::int64_t chunk_elems) {
  check_rank(rank, world);
  check_rank(root, world);
  return chain(rank, world, mod(rank - root - 1, world), numel, chunk_elems, PlanRecvMode::kReduce);
}

ChunkPlan plan_send(int peer, std::int64_t numel, std::int64_t chunk_elems) {
  PlanBuilder b(chunk_elems);
  b.plan.send_peer = peer;
  const Segment all{0, numel};
  b.step(&all, nullptr, PlanRecvMode::kCopy, false, false);
  return std::move(b.plan);
}

ChunkPlan plan_recv(int peer, std::int64_t numel, std::int64_t chunk_elems) {
  PlanBuilder b(chunk_elems);
  b.plan.recv_peer = peer;
  const Segment all{0, numel};
  b.step(nullptr, &all, PlanRecvMode::kCopy, false, false);
  return std::move(b.plan);
}

}  // namespace shardkit::comm
