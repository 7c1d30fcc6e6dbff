// Small POSIX TCP helpers with deadlines, shared by the TcpStore client and the TCP process group.
//
// Every blocking call takes an absolute deadline and returns DeadlineExceeded instead of waiting past it;
// connection loss is Unavailable. The sockets are non-blocking; waits use poll(2) after a short busy-poll
// (DESIGN.md section 9: a blocking wake-up costs ~50 us in this VM).
// Thread-compatible: one thread uses a Socket at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shardkit::comm::tcp {

// Owns a file descriptor; closes it on destruction.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket() { close(); }

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void close();
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

// Connects to host:port, retrying (refused / unreachable) until the deadline. The socket is non-blocking
// with TCP_NODELAY. `what` names the peer in error messages.
absl::StatusOr<Socket> connect_with_retry(const std::string& host, std::uint16_t port, absl::Time deadline,
                                          const std::string& what);

// Listens on host:port (port 0 = an ephemeral port chosen by the kernel). Non-blocking.
absl::StatusOr<Socket> listen_on(const std::string& host, std::uint16_t port, int backlog = 128);
// The local port a socket is bound to.
absl::StatusOr<std::uint16_t> local_port(const Socket& s);
// Accepts one connection before the deadline (non-blocking, TCP_NODELAY).
absl::StatusOr<Socket> accept_one(const Socket& listener, absl::Time deadline);

// Sends / receives exactly n bytes before the deadline.
absl::Status send_all(const Socket& s, const void* data, std::size_t n, absl::Time deadline, const std::string& what);
absl::Status recv_all(const Socket& s, void* data, std::size_t n, absl::Time deadline, const std::string& what);

// Waits until fd is ready for `events` (POLLIN / POLLOUT) or the deadline passes; busy-polls first for
// `spin` then blocks. Returns DeadlineExceeded on timeout.
absl::Status wait_ready(int fd, short events, absl::Time deadline, const std::string& what,
                        absl::Duration spin = absl::Microseconds(50));

// Sets socket buffer sizes (best effort) and TCP_NODELAY.
void tune_socket(int fd, int buffer_bytes);

}  // namespace shardkit::comm::tcp
