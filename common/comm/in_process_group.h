// The in-process backend: ranks are threads of one process sharing memory (DESIGN.md section 2). Used by
// the simulated-rank test harness (testing/run_ranks.h) and by single-machine runs.
//
// Usage: create one InProcessWorld for n ranks, then have thread r take world->group(r) (once) and use it
// as its ProcessGroup.
//
// Asynchrony (Note [in-process progress engine] in in_process_group.cc): a collective on a group of more
// than one rank is queued to the handle's worker thread and returns at once; the worker runs the calls in
// issue order and completes each Work, so compute overlaps communication as with TCP and NCCL. The queued
// call holds its tensors until every peer has finished with them; the caller may drop its handles at once.
// A group of one rank runs its calls in the calling thread.
//
// Algorithms (Note [in-process collectives]). Every call is two rendezvous points with the group's other
// ranks:
//   enter: each rank publishes its call (kind, dtype, sizes, buffer addresses); the last to arrive checks
//          that all ranks agree and fails the group if not;
//   data:  each rank moves its share straight from/to its peers' buffers (no staging copy):
//            all_reduce:     rank r reduces slice r of every rank's buffer (in rank order, chunked through
//                            a cache-sized f32 accumulator) and writes the result into slice r of EVERY
//                            rank's buffer: each rank reads and writes 1/n of the total, n·(N/n) = N
//                            elements, so the cost is one memcpy of the tensor per rank, run in parallel.
//            reduce:         the same, writing only into the root's buffer.
//            reduce_scatter: rank r reduces slice r of every rank's input into its output.
//            all_gather:     rank r copies its input into slice r of every rank's output.
//            broadcast:      rank r copies slice r of the root's buffer into every other rank's buffer.
//   leave: nobody returns until every rank has finished its data phase, so no peer touches a rank's
//          buffers after its call returned. Once the enter point has completed, the leave point waits
//          with no deadline and ignores failures that happen meanwhile (an abort, another sub-group's
//          failure): the data phase is a bounded copy, and returning early would hand buffers back to the
//          caller while peers still write them (Note [in-process leave] in in_process_group.cc). A deadline
//          bounds the wait for peers to join; a call whose peers all joined completes.
// Slices of a tensor of N elements: slice r = [N·r/n, N·(r+1)/n).
// Send/recv: a send and its matching recv meet in a per-pair queue; whichever is issued second copies
// the bytes and completes both Works (so both are asynchronous and never deadlock each other).
//
// Failure (process_group.h, Note [group failure]): the whole world shares one failure state. The first
// failure (a deadline passing, ranks disagreeing, a rank's abort(), InProcessWorld::abort(), or a rank
// leaving while others wait for it) aborts every group of the world: every pending and later call of
// every rank fails with a Status naming the origin rank and operation.
//
// Thread-safety: InProcessWorld's methods may be called from any thread. Each group handle follows the
// ProcessGroup contract (one thread issues its calls). Destroying a handle fails the calls it queued and
// had not started (aborting the world: the peers would wait for them) and joins its worker.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/comm/process_group.h"

namespace shardkit::comm {

struct InProcessOptions {
  // Each group handle's default call timeout (process_group.h options).
  absl::Duration default_timeout = absl::Minutes(5);
  // Bytes of the f32 accumulator a reduction goes through per step. Tests set it tiny (e.g. 16) so the
  // multi-chunk paths run on small tensors.
  std::int64_t chunk_bytes = 128 * 1024;
  // Name of the world group in error messages.
  std::string name = "world";
};

class InProcessWorldState;

class InProcessWorld {
 public:
  static std::shared_ptr<InProcessWorld> create(int size, const InProcessOptions& options = {});
  ~InProcessWorld();

  int size() const;
  // Rank r's handle on the world group. Call once per rank (a second call for r is an SK_CHECK failure).
  std::shared_ptr<ProcessGroup> group(int rank);

  // Fails every pending and later call of every rank on every group of this world with `reason` (the
  // first reason wins). Idempotent.
  void abort(const absl::Status& reason);
  // Declares that world rank `rank` will issue no more calls (its thread is done): calls of other ranks
  // that wait for it fail at once, naming it, instead of waiting for their deadline (calls it issued before
  // departing still run: a group waits for them first). The harness calls this when a rank's function returns.
  void mark_departed(int rank);
  // OK, or the first failure.
  absl::Status status() const;

 private:
  explicit InProcessWorld(std::shared_ptr<InProcessWorldState> state);
  std::shared_ptr<InProcessWorldState> state_;
};

}  // namespace shardkit::comm
