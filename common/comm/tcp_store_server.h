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
// Threading: one I/O thread owned by the server runs every handler, so the key-value map needs no lock.
// The destructor stops the thread and closes every connection. The public methods are thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/comm/tcp_store_protocol.h"

namespace shardkit::comm {

struct TcpStoreServerOptions {
  std::string host = "127.0.0.1";  // address to bind ("0.0.0.0" for every interface)
  std::uint16_t port = 0;          // 0: an ephemeral port; read it back with port()
  std::string token;               // required from clients at the handshake when non-empty
  std::size_t max_frame_bytes = tcp_store_protocol::kDefaultMaxFrameBytes;
  // A frame (or the handshake) that has started must complete within this time.
  absl::Duration frame_timeout = absl::Seconds(10);
};

class TcpStoreServer {
 public:
  // Binds and starts serving. Fails (Unavailable) when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<TcpStoreServer>> start(TcpStoreServerOptions options);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  std::uint16_t port() const;
  // Connections closed because of a protocol error or refused handshake so far (for tests).
  std::int64_t rejected_connections() const;

  struct Impl;

 private:
  explicit TcpStoreServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardkit::comm
