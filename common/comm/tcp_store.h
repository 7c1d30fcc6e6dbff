// TcpStore: the Store (store.h) over TCP. A client of a TcpStoreServer (tcp_store_server.h), which rank 0
// hosts in-process (options.is_server) or a standalone program runs.
//
// Connecting: create() retries connecting until options.connect_timeout has passed (the server may start
// later than its clients), then performs the handshake; a wrong or missing token is refused by the server
// and create() returns PermissionDenied quoting its reason; a server over one of its connection limits
// (tcp_store_server.h) gives ResourceExhausted quoting the limit.
// Token: options.token, or when that is empty the environment variable SHARDKIT_STORE_TOKEN (read once, in
// create()). The server compares in constant time.
// Integers written by add() are stored as decimal text (get() returns e.g. "3"); the server's refusal of an
// add (non-integer value, int64 overflow) is InvalidArgument, as in HashStore. get() / wait() send their
// timeout in milliseconds clamped to tcp_store_protocol::kMaxTimeoutMs (infinite included).
//
// Thread-safety: every method may be called concurrently. Each call borrows a connection from a small pool
// (opening a new one when all are busy), so a thread blocked in get()/wait() never delays another thread's
// set(). A connection that saw an error is discarded.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/comm/store.h"
#include "common/comm/tcp_socket.h"
#include "common/comm/tcp_store_protocol.h"
#include "common/comm/tcp_store_server.h"

namespace shardkit::comm {

struct TcpStoreOptions {
  std::string host = "127.0.0.1";
  std::uint16_t port = 0;  // with is_server, 0 picks an ephemeral port; read it with TcpStore::port()
  bool is_server = false;  // host the server in this process (rank 0)
  std::string token;       // empty: SHARDKIT_STORE_TOKEN if set, else no token
  absl::Duration connect_timeout = absl::Seconds(60);
  // Deadline for one request's network round trip (get / wait add their own timeout on top).
  absl::Duration io_timeout = absl::Seconds(60);
  std::size_t max_frame_bytes = tcp_store_protocol::kDefaultMaxFrameBytes;
  // After create(), opening another pooled connection retries only this long: a server that went away
  // (e.g. its host rank died) is reported quickly instead of after connect_timeout.
  absl::Duration reconnect_timeout = absl::Seconds(1);
};

class TcpStore final : public Store {
 public:
  static absl::StatusOr<std::unique_ptr<TcpStore>> create(TcpStoreOptions options);
  ~TcpStore() override;

  absl::Status set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> get(const std::string& key, absl::Duration timeout) override;
  absl::StatusOr<std::int64_t> add(const std::string& key, std::int64_t delta) override;
  absl::StatusOr<bool> check(const std::vector<std::string>& keys) override;
  absl::StatusOr<bool> delete_key(const std::string& key) override;
  absl::Status wait(const std::vector<std::string>& keys, absl::Duration timeout) override;

  // The server's port (useful with is_server and port 0).
  std::uint16_t port() const { return options_.port; }
  const std::string& host() const { return options_.host; }
  // The hosted server, or null when this client does not host one.
  TcpStoreServer* server() const { return server_.get(); }

 private:
  explicit TcpStore(TcpStoreOptions options) : options_(std::move(options)) {}
  absl::StatusOr<tcp::Socket> open_connection(absl::Time deadline);
  // Sends one request and reads one reply on a pooled connection.
  absl::StatusOr<tcp_store_protocol::Message> round_trip(const tcp_store_protocol::Message& request,
                                                         absl::Duration extra_wait);

  TcpStoreOptions options_;
  std::unique_ptr<TcpStoreServer> server_;
  std::mutex mu_;
  std::vector<tcp::Socket> idle_;  // guarded by mu_
};

}  // namespace shardkit::comm
