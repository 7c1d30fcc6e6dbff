// StreamRunner: runs one call's chunk plan (ring_plan.h) over transport pairs (transport.h): the byte stream
// this rank sends to one peer and the one it receives from one peer, chunk by chunk, reducing or copying each
// received chunk into place (Note [chunk pipeline] in stream_runner.cc). Any plan runs over any Pair.
//
// Errors name the call (`what`) and the peer rank: a lost connection is Unavailable ("connection to rank P lost
// while sending / receiving (why; sent x of y bytes, received ...)", plus every peer whose connection had closed
// by then), the deadline is DeadlineExceeded naming the ranks waited for and the bytes moved, a header that
// differs from the expected one is InvalidArgument naming both calls.
//
// Thread-compatible: one runner per call, on the thread that runs the call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/comm/call_header.h"
#include "common/comm/process_group.h"
#include "common/comm/ring_plan.h"
#include "common/comm/transport.h"
#include "common/tensor/dtype.h"

namespace shardkit::comm {

struct StreamSend {
  const char* data;
  std::size_t bytes;
  std::int64_t after_recv;  // ready once recv chunk index after_recv is done (-1: at once)
};

enum class StreamRecvMode : std::uint8_t { kCopy, kReduce, kHeader };

struct StreamRecv {
  char* dst;
  std::size_t bytes;
  StreamRecvMode mode;
  bool finalize;        // kReduce: divide by divide_by after reducing (avg, owned segment)
  char* out = nullptr;  // kReduce: where dst (op) received goes; null = dst (reduce_scatter's last step writes
                        // straight into the output, saving a copy)
};

struct Streams {
  std::vector<StreamSend> sends;
  std::vector<StreamRecv> recvs;
};

// The streams of `plan` over a buffer at `base` of `elem`-byte elements, each led by the call header when it has
// a peer: `out` is sent first, `in` receives the peer's (checked against StreamRunner::expected).
Streams streams_for_plan(const ChunkPlan& plan, char* base, std::size_t elem, const CallHeader* out, CallHeader* in);

class StreamRunner {
 public:
  Pair* send_pair = nullptr;  // null: nothing to send
  Pair* recv_pair = nullptr;  // null: nothing to receive
  int send_peer = -1;         // ranks, for messages
  int recv_peer = -1;
  DType dtype = DType::f32;
  ReduceKind kind = ReduceKind::sum;  // sum, min or max (avg / premul_sum reduce as sums)
  int divide_by = 0;                  // > 0: finalize chunks divide by it (avg)
  char* scratch = nullptr;            // at least the largest kReduce chunk
  const CallHeader* expected = nullptr;  // what a received header must say
  absl::Time deadline;
  absl::Duration spin;
  std::string what;              // "all_reduce #3 (...) on group 'world' rank 1"
  std::vector<Pair*> all_pairs;  // by group rank (null: self), for naming every closed peer

  // A local copy (all_gather's own slice), finished before run() returns (Note [local copy] in stream_runner.cc):
  // done along with the sends that read the same bytes, and while the pairs are busy.
  char* copy_dst = nullptr;
  const char* copy_src = nullptr;
  std::size_t copy_left = 0;

  // Write the bytes copied into place (the local copy; chunks received from a peekable pair) with non-temporal
  // stores, past the caches (Note [streaming copies] in stream_runner.cc): for calls larger than the caches
  // (TcpProcessGroupOptions::streaming_copy_min_bytes); smaller results are better left in cache for their reader.
  bool streaming_copies = false;

  absl::Status run(const Streams& streams);

  // Longest wait on a wake-up counter before the runner asks the pairs whether their peers still live.
  static constexpr absl::Duration kLivenessPoll = absl::Milliseconds(50);

 private:
  // kReduce chunk c from a peekable recv_pair: reduces what can be read in place, advancing roff; returns the
  // bytes taken from the pair.
  absl::StatusOr<std::size_t> reduce_from_peek(const StreamRecv& c, std::size_t& roff);
  bool copy_some(std::size_t max_bytes);
  void copy_into_place(char* dst, const char* src, std::size_t bytes) const;
  // How many bytes at `data` to hand the send pair at once, and the local copy of what it took.
  std::size_t send_piece(const char* data, std::size_t bytes) const;
  void copy_sent(const char* data, std::size_t bytes);
  absl::Status check_header(const CallHeader& got) const;
  absl::Status lost(int peer, const char* doing, const absl::Status& why) const;
  std::string closed_peers() const;
  absl::Status timed_out(bool sending, bool receiving) const;

  alignas(8) char part_[8] = {};    // an element split across a ring's end (reduce_from_peek)
  alignas(8) char pad_in_[8] = {};  // the padding a peekable pair's stream ends with (stream_runner.cc)
  std::size_t part_len_ = 0;
  std::size_t sent_bytes_ = 0, recv_bytes_ = 0, send_total_ = 0, recv_total_ = 0;
};

}  // namespace shardkit::comm
