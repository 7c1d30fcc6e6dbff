#include "common/comm/tcp_store_server.h"

#include <atomic>
#include <charconv>
#include <deque>
#include <thread>
#include <unordered_map>
#include <vector>

#include <boost/asio.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/logging.h"

namespace shardkit::comm {

namespace asio = boost::asio;
using asio::ip::tcp;
namespace proto = tcp_store_protocol;

namespace {
class Session;

// A parked get / wait request.
struct Waiter {
  std::shared_ptr<Session> session;  // keeps a parked session alive; reset when answered
  std::vector<std::string> keys;
  bool is_get = false;
  bool done = false;
  std::unique_ptr<asio::steady_timer> timer;
};
}  // namespace

struct TcpStoreServer::Impl {
  // Note [server member order]: the io_context is declared first so it is destroyed last; its destructor
  // destroys the handlers still queued, which release the sessions (and their sockets) while it exists.
  asio::io_context io;
  TcpStoreServerOptions options;
  std::unique_ptr<tcp::acceptor> acceptor;
  std::uint16_t port = 0;
  std::atomic<std::int64_t> rejected{0};
  std::unordered_map<std::string, std::string> data;
  std::unordered_map<std::string, std::vector<std::shared_ptr<Waiter>>> waiters;
  std::thread thread;

  void accept();
  void notify(const std::string& key);
  bool all_present(const std::vector<std::string>& keys) const {
    for (const auto& k : keys)
      if (!data.contains(k)) return false;
    return true;
  }
};

namespace {

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(TcpStoreServer::Impl& server, tcp::socket socket)
      : server_(server), socket_(std::move(socket)), timer_(server.io) {}

  void start() {
    arm_timer();  // the handshake must arrive within frame_timeout
    read_header();
  }

  // Sends a reply for a parked waiter (called by the server on notify / timeout).
  void complete_waiter(Waiter& w, bool timed_out) {
    auto keep_alive = shared_from_this();
    w.done = true;
    w.session.reset();
    if (w.timer) w.timer->cancel();
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
    timer_.expires_after(std::chrono::nanoseconds(absl::ToInt64Nanoseconds(server_.options.frame_timeout)));
    timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (ec == asio::error::operation_aborted) return;
      self->fail("frame or handshake not completed within the frame timeout", false);
    });
  }

  // Reads the first header byte without a deadline (idle connections are fine), then the rest under one.
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
    if (len > server_.options.max_frame_bytes) {
      fail(absl::StrCat("oversized store frame: expected at most ", server_.options.max_frame_bytes,
                        " payload bytes, found a header announcing ", len),
           true);
      return;
    }
    body_.resize(len);
    asio::async_read(socket_, asio::buffer(body_), [self = shared_from_this()](const boost::system::error_code& ec,
                                                                               std::size_t) {
      if (ec) return self->closed(ec, "truncated frame body");
      self->timer_.cancel();
      self->on_frame();
    });
  }

  void on_frame() {
    auto decoded = proto::decode_payload(body_);
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
  }

  void write(const proto::Message& reply, bool close_after) {
    out_.clear();
    proto::encode_frame(reply, out_);
    asio::async_write(socket_, asio::buffer(out_),
                      [self = shared_from_this(), close_after](const boost::system::error_code& ec, std::size_t) {
                        if (ec || close_after) return self->shutdown();
                        self->read_header();
                      });
  }

  // Protocol error: count it, log it, reply with kError when `reply` and close this connection only.
  void fail(const std::string& why, bool reply) {
    if (closing_) return;
    closing_ = true;
    server_.rejected.fetch_add(1);
    SK_LOG(kWarning, "TcpStoreServer: closing a connection: ", why);
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
        server_.rejected.fetch_add(1);
        SK_LOG(kWarning, "TcpStoreServer: connection lost during ", during, ": ", ec.message());
      }
    }
    shutdown();
  }

  void shutdown() {
    boost::system::error_code ignored;
    timer_.cancel();
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }

  TcpStoreServer::Impl& server_;
  tcp::socket socket_;
  asio::steady_timer timer_;
  unsigned char header_[proto::kHeaderBytes] = {};
  std::string body_;
  std::string out_;
  bool handshaken_ = false;
  bool closing_ = false;
};

}  // namespace

void TcpStoreServer::Impl::accept() {
  acceptor->async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted) return;
    if (!ec) {
      boost::system::error_code ignored;
      socket.set_option(tcp::no_delay(true), ignored);
      std::make_shared<Session>(*this, std::move(socket))->start();
    }
    accept();
  });
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

absl::StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::start(TcpStoreServerOptions options) {
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
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
        SK_LOG(kError, "TcpStoreServer: handler threw: ", e.what());
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
std::int64_t TcpStoreServer::rejected_connections() const { return impl_->rejected.load(); }

}  // namespace shardkit::comm
