// Pair: this rank's end of a connection to one other rank, over which a process backend moves the byte chunks
// of its calls (DESIGN.md section 2: the "transport" of gloo's rendezvous / transport / algorithm split).
// Implementations: TcpPair (tcp_transport.h), ShmPair (shm_transport.h). The chunk plans (ring_plan.h) run over any Pair through
// StreamRunner (stream_runner.h); a backend builds its pairs in its rendezvous (e.g. tcp_rendezvous.h).
//
// Contract of an implementation:
//   * A pair carries two ordered byte streams, one each way; the bytes this end sends arrive at the peer's end
//     in order, and no message boundaries are kept (chunks may be split and joined freely).
//   * try_send / try_recv never block: they move what they can now (possibly fewer bytes than asked, possibly
//     none) and return the count. They are called with n > 0 from one thread at a time.
//   * A lost connection (the peer closed, died or shut down; this end shut down) is Unavailable whose message
//     says why in a few words ("closed by the peer", "Connection reset by peer"); a receive reports it only
//     once the bytes that arrived before are drained. The runner names the rank and the call around it.
//   * poll_fd(): a descriptor that poll(2) reports readable when try_recv can move bytes or the connection is
//     lost, writable when try_send can, and POLLRDHUP / POLLHUP when the peer has gone; -1 when the transport
//     has none, and the runner then keeps trying (yielding the CPU between tries) until its deadline.
//   * shutdown() may be called from any thread, also while another thread is inside try_send / try_recv: it
//     ends both streams, wakes pollers, and the peer's end sees the connection lost. Idempotent.
//   * Optional, for transports without a poll_fd (ShmPair; defaults: not offered):
//     - wake_key() / wake_seq() / wait_wake(): a wake-up counter that changes whenever a try_send / try_recv on
//       this pair may move more bytes or the connection state changes. Pairs that share a counter return the
//       same non-null wake_key(), so a runner waits for both its pairs at once: it reads wake_seq() before
//       trying them, and wait_wake(seen, until) blocks until the counter differs from `seen` or `until` passes
//       (true: it changed). Called from the thread that calls try_send / try_recv.
//     - check_peer(): looks whether the peer has gone (its process died) without saying so; if it has, the next
//       try_send reports the connection lost, and the next try_recv once the bytes that arrived are drained.
//       Runners call it when a wait ends without a wake-up.
//     - hangup_fd(): a descriptor that poll(2) reports POLLRDHUP / POLLHUP on once the peer has gone (to name
//       every closed peer in an error); default poll_fd().
//     - peekable() / peek() / consume(): zero-copy receive. peek(n) returns up to n received bytes readable in
//       place (fewer when they wrap around a ring, none when nothing arrived; errors as try_recv); they stay
//       valid and unchanged until consume(k) hands the first k of them back to the sender. A runner reduces
//       straight out of them instead of copying them into a scratch buffer first (DESIGN.md section 9).
// Destroying a pair closes it (the peer sees the connection lost).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/time.h"

#include "absl/status/statusor.h"

namespace shardkit::comm {

class Pair {
 public:
  virtual ~Pair() = default;

  // Hands up to n bytes to the connection; returns how many it took (0: none now).
  virtual absl::StatusOr<std::size_t> try_send(const void* data, std::size_t n) = 0;
  // Takes up to n received bytes; returns how many (0: none now).
  virtual absl::StatusOr<std::size_t> try_recv(void* data, std::size_t n) = 0;
  // See the contract above; -1: not pollable.
  virtual int poll_fd() const = 0;
  // Ends the connection both ways (any thread).
  virtual void shutdown() = 0;

  // Optional parts (see the contract above).
  virtual const void* wake_key() const { return nullptr; }
  virtual std::uint32_t wake_seq() const { return 0; }
  virtual bool wait_wake(std::uint32_t /*seen*/, absl::Time /*until*/) { return false; }
  virtual void check_peer() {}
  virtual int hangup_fd() const { return poll_fd(); }
  virtual bool peekable() const { return false; }
  virtual absl::StatusOr<std::pair<const char*, std::size_t>> peek(std::size_t /*n*/) {
    return absl::UnimplementedError("peek: not offered by this transport");
  }
  virtual void consume(std::size_t /*n*/) {}
};

}  // namespace shardkit::comm
