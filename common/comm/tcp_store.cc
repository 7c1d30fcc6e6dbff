#include "common/comm/tcp_store.h"

#include <cstdlib>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"

namespace shardkit::comm {

namespace proto = tcp_store_protocol;

namespace {

std::string what_server(const TcpStoreOptions& o) { return absl::StrCat("store server ", o.host, ":", o.port); }

absl::StatusOr<proto::Message> read_frame(const tcp::Socket& s, std::size_t max_bytes, absl::Time deadline,
                                          const std::string& what) {
  unsigned char header[proto::kHeaderBytes];
  if (auto st = tcp::recv_all(s, header, sizeof(header), deadline, what); !st.ok()) return st;
  const std::uint32_t len = proto::decode_header(header);
  if (len > max_bytes) {
    return absl::InternalError(
        absl::StrCat("reply from ", what, ": expected at most ", max_bytes, " bytes, found ", len));
  }
  std::string body(len, '\0');
  if (auto st = tcp::recv_all(s, body.data(), len, deadline, what); !st.ok()) return st;
  return proto::decode_payload(body);
}

// The wire's timeout_ms: ToInt64Milliseconds saturates (infinite and huge durations give INT64_MAX), and the
// result is clamped to what the server accepts (proto::kMaxTimeoutMs).
std::int64_t to_ms(absl::Duration d) { return proto::clamp_timeout_ms(absl::ToInt64Milliseconds(d)); }

}  // namespace

absl::StatusOr<std::unique_ptr<TcpStore>> TcpStore::create(TcpStoreOptions options) {
  if (options.token.empty()) {
    if (const char* env = std::getenv("SHARDKIT_STORE_TOKEN"); env != nullptr) options.token = env;
  }
  std::unique_ptr<TcpStore> store(new TcpStore(options));
  if (options.is_server) {
    TcpStoreServerOptions so;
    so.host = options.host;
    so.port = options.port;
    so.token = options.token;
    so.max_frame_bytes = options.max_frame_bytes;
    auto server = TcpStoreServer::start(so);
    if (!server.ok()) return server.status();
    store->server_ = std::move(*server);
    store->options_.port = store->server_->port();
  }
  if (store->options_.port == 0) {
    return absl::InvalidArgumentError("TcpStore: expected a server port for a client, found 0");
  }
  // The first connection proves the server is up and the token is accepted.
  auto conn = store->open_connection(absl::Now() + options.connect_timeout);
  if (!conn.ok()) return conn.status();
  store->idle_.push_back(std::move(*conn));
  return store;
}

TcpStore::~TcpStore() {
  idle_.clear();
  server_.reset();
}

absl::StatusOr<tcp::Socket> TcpStore::open_connection(absl::Time deadline) {
  const std::string what = what_server(options_);
  auto s = tcp::connect_with_retry(options_.host, options_.port, deadline, what);
  if (!s.ok()) return s.status();
  proto::Message hello;
  hello.type = proto::MessageType::kHello;
  hello.magic = proto::kMagic;
  hello.version = proto::kVersion;
  hello.value = options_.token;
  const std::string frame = proto::encode_frame(hello);
  const absl::Time io_deadline = absl::Now() + options_.io_timeout;
  if (auto st = tcp::send_all(*s, frame.data(), frame.size(), io_deadline, what); !st.ok()) return st;
  auto reply = read_frame(*s, options_.max_frame_bytes, io_deadline, what);
  if (!reply.ok()) {
    return absl::UnavailableError(absl::StrCat("TcpStore handshake with ", what, " failed: ", reply.status().message()));
  }
  if (reply->type == proto::MessageType::kError) {
    const std::string message = absl::StrCat("TcpStore: ", what, " refused the connection: ", reply->value);
    if (absl::StartsWith(reply->value, proto::kConnectionLimitPrefix)) return absl::ResourceExhaustedError(message);
    return absl::PermissionDeniedError(message);
  }
  if (reply->type != proto::MessageType::kOk) {
    return absl::InternalError(absl::StrCat("TcpStore handshake with ", what, ": expected an ok reply, found type ",
                                            static_cast<int>(reply->type)));
  }
  return std::move(*s);
}

absl::StatusOr<proto::Message> TcpStore::round_trip(const proto::Message& request, absl::Duration extra_wait) {
  tcp::Socket conn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!idle_.empty()) {
      conn = std::move(idle_.back());
      idle_.pop_back();
    }
  }
  if (!conn.valid()) {
    auto c = open_connection(absl::Now() + std::min(options_.io_timeout, options_.reconnect_timeout));
    if (!c.ok()) return c.status();
    conn = std::move(*c);
  }
  const std::string what = what_server(options_);
  const absl::Time deadline = absl::Now() + options_.io_timeout + extra_wait;
  std::string frame = proto::encode_frame(request);
  if (frame.size() - proto::kHeaderBytes > options_.max_frame_bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    idle_.push_back(std::move(conn));
    return absl::InvalidArgumentError(absl::StrCat("TcpStore: expected a request of at most ", options_.max_frame_bytes,
                                                   " bytes, found ", frame.size() - proto::kHeaderBytes));
  }
  if (auto st = tcp::send_all(conn, frame.data(), frame.size(), deadline, what); !st.ok()) return st;
  auto reply = read_frame(conn, options_.max_frame_bytes, deadline, what);
  if (!reply.ok()) return reply.status();  // the connection is dropped
  if (reply->type == proto::MessageType::kError) {
    return absl::FailedPreconditionError(absl::StrCat("TcpStore: ", what, " answered: ", reply->value));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    idle_.push_back(std::move(conn));
  }
  return reply;
}

absl::Status TcpStore::set(const std::string& key, const std::string& value) {
  proto::Message m;
  m.type = proto::MessageType::kSet;
  m.keys = {key};
  m.value = value;
  auto r = round_trip(m, absl::ZeroDuration());
  if (!r.ok()) return r.status();
  return absl::OkStatus();
}

absl::StatusOr<std::string> TcpStore::get(const std::string& key, absl::Duration timeout) {
  proto::Message m;
  m.type = proto::MessageType::kGet;
  m.keys = {key};
  m.number = to_ms(timeout);
  auto r = round_trip(m, timeout);
  if (!r.ok()) return r.status();
  if (r->type == proto::MessageType::kTimeout) {
    return absl::DeadlineExceededError(absl::StrCat("TcpStore get: expected key '", key, "' within ",
                                                    absl::FormatDuration(timeout), ", found it missing"));
  }
  if (r->type != proto::MessageType::kValue) {
    return absl::InternalError(absl::StrCat("TcpStore get: expected a value reply, found type ", static_cast<int>(r->type)));
  }
  return std::move(r->value);
}

absl::StatusOr<std::int64_t> TcpStore::add(const std::string& key, std::int64_t delta) {
  proto::Message m;
  m.type = proto::MessageType::kAdd;
  m.keys = {key};
  m.number = delta;
  auto r = round_trip(m, absl::ZeroDuration());
  if (!r.ok() && r.status().code() == absl::StatusCode::kFailedPrecondition) {
    // The server refused the add (a non-integer value or an int64 overflow; its message names the key):
    // the same code as HashStore (store.h).
    return absl::InvalidArgumentError(r.status().message());
  }
  if (!r.ok()) return r.status();
  if (r->type != proto::MessageType::kInt) {
    return absl::InternalError(absl::StrCat("TcpStore add: expected an integer reply, found type ", static_cast<int>(r->type)));
  }
  return r->number;
}

absl::StatusOr<bool> TcpStore::check(const std::vector<std::string>& keys) {
  proto::Message m;
  m.type = proto::MessageType::kCheck;
  m.keys = keys;
  auto r = round_trip(m, absl::ZeroDuration());
  if (!r.ok()) return r.status();
  if (r->type != proto::MessageType::kBool) {
    return absl::InternalError(absl::StrCat("TcpStore check: expected a bool reply, found type ", static_cast<int>(r->type)));
  }
  return r->number != 0;
}

absl::StatusOr<bool> TcpStore::delete_key(const std::string& key) {
  proto::Message m;
  m.type = proto::MessageType::kDelete;
  m.keys = {key};
  auto r = round_trip(m, absl::ZeroDuration());
  if (!r.ok()) return r.status();
  if (r->type != proto::MessageType::kBool) {
    return absl::InternalError(absl::StrCat("TcpStore delete: expected a bool reply, found type ", static_cast<int>(r->type)));
  }
  return r->number != 0;
}

absl::Status TcpStore::wait(const std::vector<std::string>& keys, absl::Duration timeout) {
  proto::Message m;
  m.type = proto::MessageType::kWait;
  m.keys = keys;
  m.number = to_ms(timeout);
  auto r = round_trip(m, timeout);
  if (!r.ok()) return r.status();
  if (r->type == proto::MessageType::kTimeout) {
    return absl::DeadlineExceededError(absl::StrCat("TcpStore wait: expected keys [", absl::StrJoin(keys, ", "),
                                                    "] within ", absl::FormatDuration(timeout), ", found missing: ",
                                                    r->value));
  }
  if (r->type != proto::MessageType::kOk) {
    return absl::InternalError(absl::StrCat("TcpStore wait: expected an ok reply, found type ", static_cast<int>(r->type)));
  }
  return absl::OkStatus();
}

}  // namespace shardkit::comm
