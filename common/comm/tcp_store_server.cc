#include "common/comm/tcp_store_server.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <thread>
#include <unordered_map>
#include <vector>

#include <boost/asio.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardkit::comm {

namespace asio = boost::asio;
using asio::ip::tcp;
namespace proto = tcp_store_protocol;

namespace {
class Session;

// A parked get / wait request.
struct Waiter {
  std::shared_ptr<Session> session;  // keeps a parked session alive; reset when answered or dropped
  std::vector<std::string> keys;
  bool is_get = false;
  bool done = false;
  std::unique_ptr<asio::steady_timer> timer;
};

// An option's duration as a timer interval, clamped to [0, kMaxTimeoutMs] so that adding it to the clock's
// now cannot overflow (an infinite option means "about 35 years").
std::chrono::steady_clock::duration to_chrono(absl::Duration d) {
  const std::int64_t ms = proto::clamp_timeout_ms(absl::ToInt64Milliseconds(d));
  const std::int64_t ns = ms == proto::kMaxTimeoutMs ? ms * 1'000'000 : absl::ToInt64Nanoseconds(d);
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::nanoseconds(ns < 0 ? 0 : ns));
}

// Heap bytes a string holds (its inline buffer is part of the session object).
std::int64_t heap_bytes(const std::string& s) {
  static const std::size_t kInline = std::string().capacity();
  return s.capacity() > kInline ? static_cast<std::int64_t>(s.capacity()) : 0;
}

// Counters shared with stats(); written on the I/O thread (or by the destructor after it stopped).
struct Counters {
  std::atomic<std::int64_t> open{0};
  std::atomic<std::int64_t> parked{0};
  std::atomic<std::int64_t> buffered{0};
  std::atomic<std::int64_t> peak_buffered{0};
  std::atomic<std::int64_t> rejected{0};
  std::atomic<std::int64_t> refused{0};
  std::atomic<std::int64_t> suppressed{0};

  void add_buffered(std::int64_t delta) {
    const std::int64_t now = buffered.fetch_add(delta) + delta;
    std::int64_t peak = peak_buffered.load();
    while (now > peak && !peak_buffered.compare_exchange_weak(peak, now)) {
    }
  }
};

}  // namespace

struct TcpStoreServer::Impl {
  // Note [server member order]: members are destroyed in reverse order. The io_context is destroyed after
  // everything declared below it; its destructor destroys the handlers still queued, which release the
  // sessions (and their sockets) while it exists. A session's destructor updates `counters` and
  // `per_address`, so those are declared above the io_context and outlive it.
  Counters counters;
  std::unordered_map<std::string, int> per_address;  // open connections per peer IP (I/O thread)
  asio::io_context io;
  TcpStoreServerOptions options;
  Logger* logger = nullptr;
  std::unique_ptr<tcp::acceptor> acceptor;
  std::unique_ptr<asio::steady_timer> accept_retry;
  std::uint16_t port = 0;
  std::unordered_map<std::string, std::string> data;
  std::unordered_map<std::string, std::vector<std::shared_ptr<Waiter>>> waiters;
  // Warning rate limit (I/O thread).
  std::chrono::steady_clock::time_point window_start{};
  int logged_in_window = 0;
  std::int64_t suppressed_in_window = 0;
  std::thread thread;

  void accept();
  void admit(tcp::socket socket);
  void notify(const std::string& key);
  // Removes a waiter from the lists of every key it waits for.
  void unlist(const Waiter& w);
  void warn(const std::string& message);
  bool all_present(const std::vector<std::string>& keys) const {
    for (const auto& k : keys)
      if (!data.contains(k)) return false;
    return true;
  }
};

namespace {

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(TcpStoreServer::Impl& server, tcp::socket socket, std::string address, std::string peer)
      : server_(server), socket_(std::move(socket)), timer_(server.io), address_(std::move(address)),
        peer_(std::move(peer)) {
    server_.counters.open.fetch_add(1);
    ++server_.per_address[address_];
  }
  // Runs on the I/O thread, or while the server is destroyed (Note [server member order]).
  ~Session() {
    server_.counters.open.fetch_sub(1);
    server_.counters.add_buffered(-accounted_);
    if (auto it = server_.per_address.find(address_); it != server_.per_address.end() && --it->second <= 0) {
      server_.per_address.erase(it);
    }
  }

  void start() {
    boost::system::error_code ignored;
    socket_.non_blocking(true, ignored);  // the parked watch peeks without blocking the I/O thread
    arm_timer();  // the handshake must arrive within frame_timeout
    read_header();
  }

  // Answers the parked request `w` (called by the server on notify / timeout, or at once when its keys are
  // already present).
  void complete_waiter(Waiter& w, bool timed_out) {
    auto keep_alive = shared_from_this();
    if (w.done) return;
    w.done = true;
    w.session.reset();
    if (w.timer) w.timer->cancel();
    end_parking(w);
    proto::Message reply;
    if (timed_out) {
      reply.type = proto::MessageType::kTimeout;
      std::vector<std::string> missing;
      for (const auto& k : w.keys)
        if (!server_.data.contains(k)) missing.push_back(k);
      reply.value = absl::StrJoin(missing, ", ");
    } else if (w.is_get) {
      reply.type = proto::MessageType::kValue;
      reply.value = server_.data.at(w.keys.front());
    } else {
      reply.type = proto::MessageType::kOk;
    }
    write(reply, false);
  }

 private:
  void arm_timer() {
    timer_.expires_after(to_chrono(server_.options.frame_timeout));
    timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (ec == asio::error::operation_aborted) return;
      self->fail("frame or handshake not completed within the frame timeout", false);
    });
  }

  // Reads the first header byte without a deadline (idle connections are fine once authenticated; before the
  // hello the timer armed in start() runs), then the rest under one.
  void read_header() {
    asio::async_read(socket_, asio::buffer(header_, 1),
                     [self = shared_from_this()](const boost::system::error_code& ec, std::size_t) {
                       if (ec) return self->closed(ec, "idle");
                       if (self->handshaken_) self->arm_timer();
                       asio::async_read(self->socket_, asio::buffer(self->header_ + 1, proto::kHeaderBytes - 1),
                                        [self](const boost::system::error_code& ec2, std::size_t) {
                                          if (ec2) return self->closed(ec2, "frame header");
                                          self->on_header();
                                        });
                     });
  }

  void on_header() {
    const std::uint32_t len = proto::decode_header(header_);
    // Nothing is allocated for a frame longer than a hello before the client has authenticated.
    if (!handshaken_ && len > proto::kMaxHelloPayloadBytes) {
      fail(absl::StrCat("store handshake refused: expected a hello frame of at most ", proto::kMaxHelloPayloadBytes,
                        " payload bytes, found a header announcing ", len),
           true);
      return;
    }
    if (len > server_.options.max_frame_bytes) {
      fail(absl::StrCat("oversized store frame: expected at most ", server_.options.max_frame_bytes,
                        " payload bytes, found a header announcing ", len),
           true);
      return;
    }
    body_.resize(len);
    account();
    asio::async_read(socket_, asio::buffer(body_), [self = shared_from_this()](const boost::system::error_code& ec,
                                                                               std::size_t) {
      if (ec) return self->closed(ec, "truncated frame body");
      self->timer_.cancel();
      self->on_frame();
    });
  }

  void on_frame() {
    auto decoded = proto::decode_payload(body_);
    release_if_large(body_);
    if (!decoded.ok()) return fail(std::string(decoded.status().message()), true);
    proto::Message& m = *decoded;
    if (!handshaken_) {
      if (m.type != proto::MessageType::kHello) {
        return fail(absl::StrCat("store handshake refused: expected a hello frame first, found message type ",
                                 static_cast<int>(m.type)),
                    true);
      }
      if (m.magic != proto::kMagic || m.version != proto::kVersion) {
        return fail(absl::StrCat("store handshake refused: expected protocol magic ", proto::kMagic, " version ",
                                 proto::kVersion, ", found magic ", m.magic, " version ", m.version),
                    true);
      }
      if (!proto::constant_time_equal(m.value, server_.options.token)) {
        return fail("store handshake refused: wrong or missing token", true);
      }
      handshaken_ = true;
      proto::Message ok;
      ok.type = proto::MessageType::kOk;
      return write(ok, false);
    }
    proto::Message reply;
    switch (m.type) {
      case proto::MessageType::kSet:
        server_.data[m.keys[0]] = std::move(m.value);
        reply.type = proto::MessageType::kOk;
        write(reply, false);
        server_.notify(m.keys[0]);
        return;
      case proto::MessageType::kAdd: {
        std::int64_t current = 0;
        if (auto it = server_.data.find(m.keys[0]); it != server_.data.end()) {
          const std::string& s = it->second;
          auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), current);
          if (ec != std::errc() || ptr != s.data() + s.size()) {
            reply.type = proto::MessageType::kError;
            reply.value = absl::StrCat("add on key '", m.keys[0], "': expected a decimal integer value, found '",
                                       s.substr(0, 64), "'");
            return write(reply, false);
          }
        }
        std::int64_t sum = 0;
        if (__builtin_add_overflow(current, m.number, &sum)) {
          reply.type = proto::MessageType::kError;
          reply.value = absl::StrCat("add on key '", m.keys[0], "': expected a sum within int64, found ", current,
                                     " + ", m.number, " overflows (the value is unchanged)");
          return write(reply, false);
        }
        server_.data[m.keys[0]] = std::to_string(sum);
        reply.type = proto::MessageType::kInt;
        reply.number = sum;
        write(reply, false);
        server_.notify(m.keys[0]);
        return;
      }
      case proto::MessageType::kCheck:
        reply.type = proto::MessageType::kBool;
        reply.number = server_.all_present(m.keys) ? 1 : 0;
        return write(reply, false);
      case proto::MessageType::kDelete:
        reply.type = proto::MessageType::kBool;
        reply.number = server_.data.erase(m.keys[0]) > 0 ? 1 : 0;
        return write(reply, false);
      case proto::MessageType::kGet:
      case proto::MessageType::kWait:
        return park(std::move(m));
      default:
        return fail(absl::StrCat("malformed store frame: expected a request message type, found ",
                                 static_cast<int>(m.type)),
                    true);
    }
  }

  void park(proto::Message m) {
    auto w = std::make_shared<Waiter>();
    w->session = shared_from_this();
    w->keys = std::move(m.keys);
    w->is_get = m.type == proto::MessageType::kGet;
    if (server_.all_present(w->keys)) return complete_waiter(*w, false);
    // A client's timeout is any int64: clamped before the chrono conversion to nanoseconds can overflow.
    const std::int64_t timeout_ms = proto::clamp_timeout_ms(m.number);
    w->timer = std::make_unique<asio::steady_timer>(server_.io);
    w->timer->expires_after(std::chrono::milliseconds(timeout_ms));
    w->timer->async_wait([w](const boost::system::error_code& ec) {
      if (ec == asio::error::operation_aborted || w->done) return;
      if (auto s = w->session) s->complete_waiter(*w, true);
    });
    for (const auto& k : w->keys) server_.waiters[k].push_back(w);
    parked_ = w;
    server_.counters.parked.fetch_add(1);
    watch_peer();
  }

  // Note [parked watch]: while a request is parked the connection has no read outstanding, so a client that
  // goes away would not be noticed until the request's timeout (possibly hours), its socket left in
  // CLOSE_WAIT. Instead the session waits for readability without consuming anything, then peeks: end of
  // stream or an error means the client is gone (the request is dropped, the socket closed); bytes mean the
  // client sent another request before its answer, which the protocol does not allow. A request answered
  // meanwhile bumps watch_generation_ and cancels the wait, so a stale completion does nothing.
  void watch_peer() {
    socket_.async_wait(tcp::socket::wait_read, [self = shared_from_this(), generation = watch_generation_](
                                                    const boost::system::error_code& ec) {
      if (generation != self->watch_generation_ || self->closing_ || self->parked_.expired()) return;
      if (ec == asio::error::operation_aborted) return;
      if (ec) return self->peer_gone(ec.message());
      char c = 0;
      boost::system::error_code peek_ec;
      const std::size_t n = self->socket_.receive(asio::buffer(&c, 1), tcp::socket::message_peek, peek_ec);
      if (peek_ec == asio::error::would_block || peek_ec == asio::error::try_again || peek_ec == asio::error::interrupted) {
        return self->watch_peer();
      }
      if (peek_ec || n == 0) return self->peer_gone(peek_ec ? peek_ec.message() : "end of stream");
      self->fail("expected no request while a get / wait is parked, found more bytes", true);
    });
  }

  // Stops treating `w` as this session's parked request (answered, or dropped).
  void end_parking(const Waiter& w) {
    server_.unlist(w);
    if (auto p = parked_.lock(); p.get() == &w) {
      parked_.reset();
      server_.counters.parked.fetch_sub(1);
      ++watch_generation_;
      boost::system::error_code ignored;
      socket_.cancel(ignored);  // only the parked watch is outstanding on the socket
    }
  }

  // Drops the parked request without an answer (the connection is closing).
  void drop_parked() {
    auto w = parked_.lock();
    if (!w) return;
    w->done = true;
    w->session.reset();
    if (w->timer) w->timer->cancel();
    end_parking(*w);
  }

  void peer_gone(const std::string& why) {
    if (closing_) return;
    closing_ = true;
    if (server_.logger->enabled(LogLevel::kDebug)) {
      server_.logger->log(LogLevel::kDebug, absl::StrCat("TcpStoreServer: the client at ", peer_,
                                                         " went away while its request was parked: ", why));
    }
    shutdown();
  }

  void write(const proto::Message& reply, bool close_after) {
    out_.clear();
    proto::encode_frame(reply, out_);
    account();
    asio::async_write(socket_, asio::buffer(out_),
                      [self = shared_from_this(), close_after](const boost::system::error_code& ec, std::size_t) {
                        self->release_if_large(self->out_);
                        if (ec || close_after) return self->shutdown();
                        self->read_header();
                      });
  }

  // Protocol error: count it, log it, reply with kError when `reply` and close this connection only.
  void fail(const std::string& why, bool reply) {
    if (closing_) return;
    closing_ = true;
    drop_parked();
    server_.counters.rejected.fetch_add(1);
    server_.warn(absl::StrCat("TcpStoreServer: closing the connection from ", peer_, ": ", why));
    timer_.cancel();
    if (reply) {
      proto::Message m;
      m.type = proto::MessageType::kError;
      m.value = why;
      write(m, true);
    } else {
      shutdown();
    }
  }

  void closed(const boost::system::error_code& ec, const char* during) {
    timer_.cancel();
    if (ec == asio::error::eof && std::string_view(during) == "idle") return shutdown();
    if (ec == asio::error::operation_aborted && closing_) return;
    if (!closing_) {
      closing_ = true;
      if (std::string_view(during) != "idle") {
        server_.counters.rejected.fetch_add(1);
        server_.warn(absl::StrCat("TcpStoreServer: the connection from ", peer_, " was lost during ", during, ": ",
                                  ec.message()));
      }
    }
    shutdown();
  }

  void shutdown() {
    closing_ = true;
    drop_parked();
    boost::system::error_code ignored;
    timer_.cancel();
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }

  // Keeps the server's buffered-bytes count equal to what this session's buffers hold.
  void account() {
    const std::int64_t now = heap_bytes(body_) + heap_bytes(out_);
    server_.counters.add_buffered(now - accounted_);
    accounted_ = now;
  }
  void release_if_large(std::string& buffer) {
    if (buffer.capacity() <= TcpStoreServer::kRetainedBufferBytes) return;
    std::string().swap(buffer);
    account();
  }

  TcpStoreServer::Impl& server_;
  tcp::socket socket_;
  asio::steady_timer timer_;
  const std::string address_;  // peer IP: the per-address limit's key
  const std::string peer_;     // "IP:port", for messages
  unsigned char header_[proto::kHeaderBytes] = {};
  std::string body_;
  std::string out_;
  std::int64_t accounted_ = 0;  // heap bytes of body_ and out_ last counted in the server's total
  std::weak_ptr<Waiter> parked_;  // the parked request (the waiter owns the session, not the reverse)
  std::uint64_t watch_generation_ = 0;
  bool handshaken_ = false;
  bool closing_ = false;
};

// Closes a connection refused at accept, after a best-effort kError naming the limit. The socket is
// non-blocking and fresh, so the short reply fits its send buffer; a hello that already arrived is read
// first so that the close sends FIN, not RST (which could discard the reply at the client).
void refuse(tcp::socket& socket, const std::string& why) {
  boost::system::error_code ec;
  socket.non_blocking(true, ec);
  proto::Message m;
  m.type = proto::MessageType::kError;
  m.value = why;
  const std::string frame = proto::encode_frame(m);
  socket.write_some(asio::buffer(frame), ec);
  char drain[4096];
  for (int i = 0; i < 4 && !ec; ++i) socket.read_some(asio::buffer(drain), ec);
  socket.shutdown(tcp::socket::shutdown_both, ec);
  socket.close(ec);
}

}  // namespace

void TcpStoreServer::Impl::warn(const std::string& message) {
  const auto now = std::chrono::steady_clock::now();
  if (now - window_start >= to_chrono(options.warning_window)) {
    if (suppressed_in_window > 0 && logger->enabled(LogLevel::kWarning)) {
      logger->log(LogLevel::kWarning,
                  absl::StrCat("TcpStoreServer: ", suppressed_in_window, " more warnings were suppressed in the last ",
                               absl::FormatDuration(options.warning_window), " (at most ",
                               options.max_warnings_per_window, " per window)"));
    }
    window_start = now;
    logged_in_window = 0;
    suppressed_in_window = 0;
  }
  if (logged_in_window < options.max_warnings_per_window) {
    ++logged_in_window;
    if (logger->enabled(LogLevel::kWarning)) logger->log(LogLevel::kWarning, message);
  } else {
    ++suppressed_in_window;
    counters.suppressed.fetch_add(1);
  }
}

void TcpStoreServer::Impl::accept() {
  acceptor->async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted) return;
    if (ec) {
      // E.g. EMFILE: the pending connection stays in the backlog, so accepting again at once would spin.
      warn(absl::StrCat("TcpStoreServer: accept failed (", ec.message(), "); retrying in ",
                        absl::FormatDuration(options.accept_backoff)));
      accept_retry->expires_after(to_chrono(options.accept_backoff));
      accept_retry->async_wait([this](const boost::system::error_code& timer_ec) {
        if (timer_ec != asio::error::operation_aborted) accept();
      });
      return;
    }
    admit(std::move(socket));
    accept();
  });
}

void TcpStoreServer::Impl::admit(tcp::socket socket) {
  boost::system::error_code ec;
  const tcp::endpoint remote = socket.remote_endpoint(ec);
  const std::string address = ec ? std::string("unknown") : remote.address().to_string();
  const std::string peer = ec ? std::string("an unknown peer") : absl::StrCat(address, ":", remote.port());
  const std::int64_t open = counters.open.load();
  const auto it = per_address.find(address);
  const int from_address = it == per_address.end() ? 0 : it->second;
  std::string refusal;
  if (open >= options.max_connections) {
    refusal = absl::StrCat(open, " connections open (max_connections = ", options.max_connections, ")");
  } else if (from_address >= options.max_connections_per_address) {
    refusal = absl::StrCat(from_address, " connections from ", address, " open (max_connections_per_address = ",
                           options.max_connections_per_address, ")");
  }
  if (!refusal.empty()) {
    counters.refused.fetch_add(1);
    warn(absl::StrCat("TcpStoreServer: refusing a connection from ", peer, ": ", refusal));
    refuse(socket, absl::StrCat(proto::kConnectionLimitPrefix, refusal));
    return;
  }
  socket.set_option(tcp::no_delay(true), ec);
  std::make_shared<Session>(*this, std::move(socket), address, peer)->start();
}

void TcpStoreServer::Impl::notify(const std::string& key) {
  auto it = waiters.find(key);
  if (it == waiters.end()) return;
  std::vector<std::shared_ptr<Waiter>> list = std::move(it->second);
  waiters.erase(it);
  std::vector<std::shared_ptr<Waiter>> keep;
  for (auto& w : list) {
    if (w->done) continue;
    auto s = w->session;
    if (!s) continue;
    if (all_present(w->keys)) {
      s->complete_waiter(*w, false);
    } else {
      keep.push_back(w);
    }
  }
  if (!keep.empty()) {
    auto& slot = waiters[key];
    slot.insert(slot.end(), keep.begin(), keep.end());
  }
}

void TcpStoreServer::Impl::unlist(const Waiter& w) {
  for (const auto& k : w.keys) {
    auto it = waiters.find(k);
    if (it == waiters.end()) continue;
    std::erase_if(it->second, [&](const std::shared_ptr<Waiter>& p) { return p.get() == &w; });
    if (it->second.empty()) waiters.erase(it);
  }
}

absl::StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::start(TcpStoreServerOptions options) {
  if (options.max_connections < 1 || options.max_connections_per_address < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TcpStoreServer: expected max_connections and max_connections_per_address of at least 1, found ",
        options.max_connections, " and ", options.max_connections_per_address));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  impl->logger = impl->options.logger != nullptr ? impl->options.logger : &default_logger();
  impl->accept_retry = std::make_unique<asio::steady_timer>(impl->io);
  impl->window_start = std::chrono::steady_clock::now();
  try {
    boost::system::error_code ec;
    auto address = asio::ip::make_address(impl->options.host == "localhost" ? "127.0.0.1" : impl->options.host, ec);
    if (ec) {
      tcp::resolver resolver(impl->io);
      auto results = resolver.resolve(impl->options.host, std::to_string(impl->options.port), ec);
      if (ec || results.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("TcpStoreServer: expected a resolvable host, found '",
                                                       impl->options.host, "': ", ec.message()));
      }
      address = results.begin()->endpoint().address();
    }
    impl->acceptor = std::make_unique<tcp::acceptor>(impl->io);
    tcp::endpoint endpoint(address, impl->options.port);
    impl->acceptor->open(endpoint.protocol());
    impl->acceptor->set_option(tcp::acceptor::reuse_address(true));
    impl->acceptor->bind(endpoint, ec);
    if (ec) {
      return absl::UnavailableError(absl::StrCat("TcpStoreServer: expected to bind ", impl->options.host, ":",
                                                 impl->options.port, ", found: ", ec.message()));
    }
    impl->acceptor->listen(asio::socket_base::max_listen_connections);
    impl->port = impl->acceptor->local_endpoint().port();
  } catch (const boost::system::system_error& e) {
    return absl::UnavailableError(absl::StrCat("TcpStoreServer: could not listen on ", impl->options.host, ":",
                                               impl->options.port, ": ", e.what()));
  }
  impl->accept();
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] {
    for (;;) {
      try {
        raw->io.run();
        return;
      } catch (const std::exception& e) {
        // A handler must never take the server down; log and keep serving.
        raw->logger->log(LogLevel::kError, absl::StrCat("TcpStoreServer: handler threw: ", e.what()));
      }
    }
  });
  return std::unique_ptr<TcpStoreServer>(new TcpStoreServer(std::move(impl)));
}

TcpStoreServer::TcpStoreServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TcpStoreServer::~TcpStoreServer() {
  impl_->io.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
  impl_->waiters.clear();
  boost::system::error_code ignored;
  impl_->acceptor->close(ignored);
}

std::uint16_t TcpStoreServer::port() const { return impl_->port; }
std::int64_t TcpStoreServer::rejected_connections() const { return impl_->counters.rejected.load(); }

TcpStoreServerStats TcpStoreServer::stats() const {
  const Counters& c = impl_->counters;
  TcpStoreServerStats s;
  s.open_connections = c.open.load();
  s.parked_requests = c.parked.load();
  s.buffered_bytes = c.buffered.load();
  s.peak_buffered_bytes = c.peak_buffered.load();
  s.rejected_connections = c.rejected.load();
  s.refused_connections = c.refused.load();
  s.suppressed_warnings = c.suppressed.load();
  return s;
}

}  // namespace shardkit::comm
