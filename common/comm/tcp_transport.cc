#include "common/comm/tcp_transport.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"

namespace shardkit::comm {
namespace {

bool would_block(int e) { return e == EAGAIN || e == EWOULDBLOCK || e == EINTR; }

}  // namespace

absl::StatusOr<std::size_t> TcpPair::try_send(const void* data, std::size_t n) {
  const ssize_t k = ::send(socket_.fd(), data, n, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (k >= 0) return static_cast<std::size_t>(k);
  if (would_block(errno)) return 0;
  return absl::UnavailableError(std::strerror(errno));
}

absl::StatusOr<std::size_t> TcpPair::try_recv(void* data, std::size_t n) {
  const ssize_t k = ::recv(socket_.fd(), data, n, MSG_DONTWAIT);
  if (k > 0) return static_cast<std::size_t>(k);
  if (k == 0) return absl::UnavailableError("closed by the peer");
  if (would_block(errno)) return 0;
  return absl::UnavailableError(std::strerror(errno));
}

void TcpPair::shutdown() {
  if (socket_.valid()) ::shutdown(socket_.fd(), SHUT_RDWR);
}

}  // namespace shardkit::comm
