#include "common/comm/tcp_socket.h"

#include <arpa/inet.h>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"

namespace shardkit::comm::tcp {
namespace {

std::string errno_text(int e) { return std::strerror(e); }

void set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

int poll_ms_until(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  if (left > absl::Seconds(1)) return 1000;
  const std::int64_t ms = absl::ToInt64Milliseconds(left) + 1;
  return static_cast<int>(std::min<std::int64_t>(ms, 1000));
}

absl::StatusOr<addrinfo*> resolve(const std::string& host, std::uint16_t port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected a resolvable host, found '", host, "': ", ::gai_strerror(rc)));
  }
  return res;
}

}  // namespace

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

void Socket::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void tune_socket(int fd, int buffer_bytes) {
  set_nodelay(fd);
  if (buffer_bytes > 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer_bytes, sizeof(buffer_bytes));
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer_bytes, sizeof(buffer_bytes));
  }
}

absl::Status wait_ready(int fd, short events, absl::Time deadline, const std::string& what, absl::Duration spin) {
  pollfd p{fd, events, 0};
  // Busy-poll briefly: cheap wake-ups for short round trips (DESIGN.md section 9).
  const absl::Time spin_end = std::min(absl::Now() + spin, deadline);
  do {
    const int rc = ::poll(&p, 1, 0);
    if (rc > 0) return absl::OkStatus();
  } while (absl::Now() < spin_end);
  for (;;) {
    const int ms = poll_ms_until(deadline);
    if (ms == 0 && absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("deadline exceeded waiting for ", what));
    }
    const int rc = ::poll(&p, 1, ms);
    if (rc > 0) return absl::OkStatus();
    if (rc < 0 && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("poll failed while waiting for ", what, ": ", errno_text(errno)));
    }
  }
}

absl::StatusOr<Socket> connect_with_retry(const std::string& host, std::uint16_t port, absl::Time deadline,
                                          const std::string& what) {
  absl::Duration backoff = absl::Milliseconds(5);
  std::string last_error = "no attempt made";
  for (;;) {
    auto res = resolve(host, port, false);
    if (!res.ok()) return res.status();
    for (addrinfo* ai = *res; ai != nullptr; ai = ai->ai_next) {
      Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
      if (!s.valid()) {
        last_error = errno_text(errno);
        continue;
      }
      set_nonblocking(s.fd());
      set_nodelay(s.fd());
      int rc = ::connect(s.fd(), ai->ai_addr, ai->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        auto st = wait_ready(s.fd(), POLLOUT, deadline, what, absl::ZeroDuration());
        if (!st.ok()) {
          last_error = "connect timed out";
          continue;
        }
        int err = 0;
        socklen_t len = sizeof(err);
        ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
        rc = err == 0 ? 0 : -1;
        errno = err;
      }
      if (rc == 0) {
        ::freeaddrinfo(*res);
        return s;
      }
      last_error = errno_text(errno);
    }
    ::freeaddrinfo(*res);
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("could not connect to ", what, " at ", host, ":", port,
                                                      " before the deadline; last error: ", last_error));
    }
    std::this_thread::sleep_for(absl::ToChronoNanoseconds(std::min(backoff, deadline - now)));
    backoff = std::min(backoff * 2, absl::Milliseconds(200));
  }
}

absl::StatusOr<Socket> listen_on(const std::string& host, std::uint16_t port, int backlog) {
  auto res = resolve(host, port, true);
  if (!res.ok()) return res.status();
  std::string last_error = "no address";
  for (addrinfo* ai = *res; ai != nullptr; ai = ai->ai_next) {
    Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!s.valid()) {
      last_error = errno_text(errno);
      continue;
    }
    int one = 1;
    ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(s.fd(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(s.fd(), backlog) != 0) {
      last_error = errno_text(errno);
      continue;
    }
    set_nonblocking(s.fd());
    ::freeaddrinfo(*res);
    return s;
  }
  ::freeaddrinfo(*res);
  return absl::UnavailableError(absl::StrCat("expected to listen on ", host, ":", port, ", found: ", last_error));
}

absl::StatusOr<std::uint16_t> local_port(const Socket& s) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getsockname(s.fd(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return absl::InternalError(absl::StrCat("getsockname failed: ", errno_text(errno)));
  }
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
}

absl::StatusOr<Socket> accept_one(const Socket& listener, absl::Time deadline) {
  for (;;) {
    const int fd = ::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) {
      set_nodelay(fd);
      return Socket(fd);
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("accept failed: ", errno_text(errno)));
    }
    auto st = wait_ready(listener.fd(), POLLIN, deadline, "an incoming connection", absl::ZeroDuration());
    if (!st.ok()) return st;
  }
}

absl::Status send_all(const Socket& s, const void* data, std::size_t n, absl::Time deadline, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::send(s.fd(), p, n, MSG_NOSIGNAL);
    if (k > 0) {
      p += k;
      n -= static_cast<std::size_t>(k);
      continue;
    }
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      auto st = wait_ready(s.fd(), POLLOUT, deadline, what);
      if (!st.ok()) return st;
      continue;
    }
    return absl::UnavailableError(absl::StrCat("connection to ", what, " lost while sending: ", errno_text(errno)));
  }
  return absl::OkStatus();
}

absl::Status recv_all(const Socket& s, void* data, std::size_t n, absl::Time deadline, const std::string& what) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t k = ::recv(s.fd(), p, n, 0);
    if (k > 0) {
      p += k;
      n -= static_cast<std::size_t>(k);
      continue;
    }
    if (k == 0) {
      return absl::UnavailableError(absl::StrCat("connection to ", what, " closed by the peer (", n,
                                                 " bytes still expected)"));
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      auto st = wait_ready(s.fd(), POLLIN, deadline, what);
      if (!st.ok()) return st;
      continue;
    }
    return absl::UnavailableError(absl::StrCat("connection to ", what, " lost while receiving: ", errno_text(errno)));
  }
  return absl::OkStatus();
}

}  // namespace shardkit::comm::tcp
