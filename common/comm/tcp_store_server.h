// TcpStoreServer: the Boost.Asio server behind TcpStore. Rank 0 hosts one (TcpStoreOptions::is_server), or a
// program runs one standalone. Speaks tcp_store_protocol.h.
//
// Robustness contract (issue 4): every connection is independent. A malformed, oversized or truncated frame,
// a frame that stalls mid-way for longer than frame_timeout, or a failed handshake (wrong magic / version /
// token) gets a kError reply where possible and closes *that* connection only; the server keeps serving the
// others and never crashes or blocks on one client. Waiting requests (get / wait) are parked server-side and
// answered when their keys appear or their timeout passes; any timeout_ms a client sends is clamped to
// [0, kMaxTimeoutMs] (tcp_store_protocol.h). An add whose sum would leave int64 gets a kError naming the key
// and leaves the value unchanged.
//
// Resource limits (issue 17), so that a local user without the token, or a flood of connections, cannot take
// the server's memory or file descriptors from the job it serves:
//  - Before a connection's hello is accepted the server buffers at most kMaxHelloPayloadBytes for it: a larger
//    length prefix is refused (kError, close) before anything is allocated, and the whole handshake must
//    complete within frame_timeout. Buffers larger than kRetainedBufferBytes are released once their frame
//    or reply is done, so idle authenticated connections hold little.
//  - At most max_connections connections are open at once, and at most max_connections_per_address from one
//    peer address; a connection over either limit is answered a kError starting with
//    tcp_store_protocol::kConnectionLimitPrefix (best effort) and closed at once, with a warning naming the
//    address and the limit. If accept() itself fails (e.g. EMFILE) the server retries after accept_backoff
//    instead of spinning.
//  - A client that disconnects while its get / wait is parked is noticed at once (Note [parked watch]): its
//    request is dropped and its socket closed, so no connection lingers in CLOSE_WAIT until its timeout.
//  - Warnings (refused, malformed or lost connections; they name the peer address) are rate-limited: at most
//    max_warnings_per_window per warning_window; the rest are counted (TcpStoreServerStats::suppressed_warnings) and
//    summarised in one line when the next window opens.
//
// Threading: one I/O thread owned by the server runs every handler, so the key-value map needs no lock.
// The destructor stops the thread and closes every connection. The public methods are thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/base/logging.h"
#include "common/comm/tcp_store_protocol.h"

namespace shardkit::comm {

struct TcpStoreServerOptions {
  std::string host = "127.0.0.1";  // address to bind ("0.0.0.0" for every interface)
  std::uint16_t port = 0;          // 0: an ephemeral port; read it back with port()
  std::string token;               // required from clients at the handshake when non-empty
  std::size_t max_frame_bytes = tcp_store_protocol::kDefaultMaxFrameBytes;
  // A frame (or the handshake) that has started must complete within this time.
  absl::Duration frame_timeout = absl::Seconds(10);
  // Open connections at once, in total and from one peer address (IP, any port). Each rank's TcpStore
  // holds one connection plus one per call it has blocked concurrently, all from its host's address.
  int max_connections = 8192;
  int max_connections_per_address = 2048;
  // Wait before accepting again after accept() failed (out of file descriptors, ...).
  absl::Duration accept_backoff = absl::Milliseconds(100);
  // Warning rate limit (see above).
  int max_warnings_per_window = 20;
  absl::Duration warning_window = absl::Seconds(10);
  // Where warnings go; null: default_logger(). Must outlive the server.
  Logger* logger = nullptr;
};

// A snapshot of the server's counters (for tests and monitoring).
struct TcpStoreServerStats {
  std::int64_t open_connections = 0;         // accepted and not yet closed
  std::int64_t parked_requests = 0;          // get / wait requests waiting for keys
  std::int64_t buffered_bytes = 0;           // frame and reply buffers held by connections now
  std::int64_t peak_buffered_bytes = 0;      // the most buffered_bytes has ever been
  std::int64_t rejected_connections = 0;     // closed for a protocol error, a refused handshake or a stall
  std::int64_t refused_connections = 0;      // closed at accept for a connection limit
  std::int64_t suppressed_warnings = 0;      // warnings not logged because of the rate limit
};

class TcpStoreServer {
 public:
  // A connection's frame or reply buffer larger than this is released once its frame or reply is done.
  static constexpr std::size_t kRetainedBufferBytes = 64u << 10;

  // Binds and starts serving. Fails (Unavailable) when the address cannot be bound, InvalidArgument when a
  // connection limit is below 1.
  static absl::StatusOr<std::unique_ptr<TcpStoreServer>> start(TcpStoreServerOptions options);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  std::uint16_t port() const;
  // Connections closed because of a protocol error or refused handshake so far (for tests).
  std::int64_t rejected_connections() const;
  TcpStoreServerStats stats() const;

  struct Impl;

 private:
  explicit TcpStoreServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardkit::comm
