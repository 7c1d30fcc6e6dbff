// TcpPair: the Pair (transport.h) over one connected TCP socket. The socket is non-blocking (as
// tcp::connect_with_retry / tcp::accept_one make it); try_send / try_recv are one send(2) / recv(2) each with
// MSG_DONTWAIT (and MSG_NOSIGNAL: a closed peer is an error, not SIGPIPE). poll_fd() is the socket.
// Thread-safety: as Pair.
#pragma once

#include <cstddef>

#include "absl/status/statusor.h"
#include "common/comm/tcp_socket.h"
#include "common/comm/transport.h"

namespace shardkit::comm {

class TcpPair final : public Pair {
 public:
  explicit TcpPair(tcp::Socket socket) : socket_(std::move(socket)) {}

  absl::StatusOr<std::size_t> try_send(const void* data, std::size_t n) override;
  absl::StatusOr<std::size_t> try_recv(void* data, std::size_t n) override;
  int poll_fd() const override { return socket_.fd(); }
  void shutdown() override;

 private:
  tcp::Socket socket_;
};

}  // namespace shardkit::comm
