// Chunk plans: what one rank sends to whom and receives from whom, chunk by chunk, in the ring and chain
// algorithms of the process backends (DESIGN.md section 2: the "algorithms" of gloo's rendezvous / transport /
// algorithm split). Pure functions of rank, world size, root and sizes: no buffers, no sockets. A transport
// runs a plan (stream_runner.h); any plan runs over any transport.
//
// A plan is two streams on this rank: `sends` to one peer (`send_peer`) and `recvs` from one peer
// (`recv_peer`), each in order, in elements of the call's buffer (offset, count). A received chunk is copied
// into place (kCopy) or reduced into it (kReduce; `finalize` marks the last reduction of an element on this
// rank, where avg divides). A send may wait for a receive: `after_recv` = k means "not before recvs[k] is done"
// (-1: at once). Chunks hold at most `chunk_elems` elements (the last of a segment may hold fewer); empty
// segments give no chunks; a world of one rank gets an empty plan (no peers). The byte streams of the two ends match: what rank a sends to b, in order, is what b
// plans to receive from a. Note [ring plans] says why the in-place buffers are safe.
//
// Thread-compatible (plain values).
#pragma once

#include <cstdint>
#include <vector>

namespace shardkit::comm {

// A range of elements of the call's buffer.
struct Segment {
  std::int64_t offset = 0;
  std::int64_t count = 0;
};

// `numel` elements split into `world` near-equal consecutive segments (the first numel % world get one more).
std::vector<Segment> split_segments(std::int64_t numel, int world);

enum class PlanRecvMode : std::uint8_t { kCopy, kReduce };

struct PlannedSend {
  std::int64_t offset = 0;      // elements
  std::int64_t count = 0;
  std::int64_t after_recv = -1;  // ready once recvs[after_recv] is done; -1: at once
};

struct PlannedRecv {
  std::int64_t offset = 0;  // elements
  std::int64_t count = 0;
  PlanRecvMode mode = PlanRecvMode::kCopy;
  bool finalize = false;    // kReduce: the last reduction of these elements on this rank
};

struct ChunkPlan {
  int send_peer = -1;  // -1: sends nothing
  int recv_peer = -1;  // -1: receives nothing
  std::vector<PlannedSend> sends;
  std::vector<PlannedRecv> recvs;
};

// Ring reduce-scatter over split_segments(numel, world): rank r ends owning seg[r] reduced over all ranks
// (its last reduction of seg[r] is marked finalize). Sends to r+1, receives from r-1.
ChunkPlan plan_ring_reduce_scatter(int rank, int world, std::int64_t numel, std::int64_t chunk_elems);
// Ring all-gather: rank r starts with seg[r] in place and ends with every segment.
ChunkPlan plan_ring_all_gather(int rank, int world, std::int64_t numel, std::int64_t chunk_elems);
// Ring all-reduce: the reduce-scatter then the all-gather, pipelined across the two (the first all-gather
// send, seg[r], waits chunk for chunk for the last reduce-scatter receive).
ChunkPlan plan_ring_all_reduce(int rank, int world, std::int64_t numel, std::int64_t chunk_elems);
// Chain broadcast root -> root+1 -> ... -> root-1; a middle rank forwards each chunk once it has arrived.
ChunkPlan plan_chain_broadcast(int rank, int world, int root, std::int64_t numel, std::int64_t chunk_elems);
// Chain reduce root+1 -> ... -> root-1 -> root: each rank reduces what arrives into its buffer and forwards it;
// the root's reductions are marked finalize.
ChunkPlan plan_chain_reduce(int rank, int world, int root, std::int64_t numel, std::int64_t chunk_elems);
// Point to point: the whole buffer to / from `peer`.
ChunkPlan plan_send(int peer, std::int64_t numel, std::int64_t chunk_elems);
ChunkPlan plan_recv(int peer, std::int64_t numel, std::int64_t chunk_elems);

}  // namespace shardkit::comm
