// TcpStore / TcpStoreServer: the Store contract over real loopback sockets, and the server's robustness
// against malformed, oversized, truncated and stalled frames and refused handshakes (issue 4 acceptance),
// and its resource limits: unauthenticated length prefixes, parked-then-disconnected clients, connection
// limits and rate-limited warnings (issue 17 acceptance).
#include "common/comm/tcp_store.h"

#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>

#include <atomic>
#include <filesystem>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/comm/tcp_socket.h"
#include "common/comm/tcp_store_protocol.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::comm {
namespace {

namespace proto = tcp_store_protocol;
using ::testing::HasSubstr;

std::unique_ptr<TcpStore> make_server(std::string token = "") {
  TcpStoreOptions o;
  o.is_server = true;
  o.token = std::move(token);
  auto s = TcpStore::create(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return std::move(*s);
}

absl::StatusOr<std::unique_ptr<TcpStore>> make_client(std::uint16_t port, std::string token = "",
                                                      absl::Duration connect_timeout = absl::Seconds(10)) {
  TcpStoreOptions o;
  o.port = port;
  o.token = std::move(token);
  o.connect_timeout = connect_timeout;
  return TcpStore::create(o);
}

TEST(TcpStoreProtocol, RoundTripsEveryRequest) {
  proto::Message m;
  m.type = proto::MessageType::kWait;
  m.keys = {"a", "bb", ""};
  m.number = 1234;
  const std::string frame = proto::encode_frame(m);
  ASSERT_EQ(proto::decode_header(reinterpret_cast<const unsigned char*>(frame.data())),
            frame.size() - proto::kHeaderBytes);
  auto d = proto::decode_payload(std::string_view(frame).substr(proto::kHeaderBytes));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->type, proto::MessageType::kWait);
  EXPECT_EQ(d->keys, m.keys);
  EXPECT_EQ(d->number, 1234);
}

TEST(TcpStoreProtocol, RejectsMalformedPayloads) {
  EXPECT_THAT(proto::decode_payload("").status().message(), HasSubstr("expected a 1-byte field"));
  EXPECT_THAT(proto::decode_payload("\x63").status().message(), HasSubstr("expected a known message type, found 99"));
  // kDelete with a key length of 100 but only 2 bytes present.
  std::string p = "\x06";
  p += std::string("\x64\x00\x00\x00", 4) + "ab";
  EXPECT_THAT(proto::decode_payload(p).status().message(), HasSubstr("bytes left"));
  // Trailing bytes after a complete kOk.
  EXPECT_THAT(proto::decode_payload(std::string("\x64xyz", 4)).status().message(), HasSubstr("expected 1 payload bytes, found 4"));
}

TEST(TcpStoreProtocol, ConstantTimeEqual) {
  EXPECT_TRUE(proto::constant_time_equal("secret", "secret"));
  EXPECT_TRUE(proto::constant_time_equal("", ""));
  EXPECT_FALSE(proto::constant_time_equal("secret", "secreT"));
  EXPECT_FALSE(proto::constant_time_equal("secret", "secret2"));
  EXPECT_FALSE(proto::constant_time_equal("", "x"));
}

TEST(TcpStore, SetGetAddCheckDeleteWait) {
  auto server = make_server();
  auto client = make_client(server->port());
  ASSERT_TRUE(client.ok()) << client.status();
  TcpStore& c = **client;

  ASSERT_TRUE(server->set("k", std::string("v\0w", 3)).ok());
  auto v = c.get("k", absl::Seconds(5));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, std::string("v\0w", 3));

  EXPECT_EQ(*c.add("n", 5), 5);
  EXPECT_EQ(*server->add("n", -2), 3);
  EXPECT_EQ(*c.get("n", absl::Seconds(1)), "3");

  EXPECT_TRUE(*c.check({"k", "n"}));
  EXPECT_FALSE(*c.check({"k", "missing"}));
  EXPECT_TRUE(*c.delete_key("k"));
  EXPECT_FALSE(*c.delete_key("k"));
  EXPECT_FALSE(*c.check({"k"}));

  ASSERT_TRUE(c.wait({"n"}, absl::Seconds(1)).ok());
  ASSERT_TRUE(c.set("big", std::string(1 << 20, 'x')).ok());
  EXPECT_EQ(server->get("big", absl::Seconds(1))->size(), 1u << 20);
}

TEST(TcpStore, AddOnNonIntegerValueIsAnError) {
  auto server = make_server();
  ASSERT_TRUE(server->set("k", "abc").ok());
  auto r = server->add("k", 1);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("expected a decimal integer value, found 'abc'"));
  EXPECT_EQ(*server->add("other", 1), 1);  // the store still works
}

TEST(TcpStore, GetAndWaitBlockUntilAnotherClientSets) {
  auto server = make_server();
  auto client = make_client(server->port());
  ASSERT_TRUE(client.ok());
  std::thread waiter([&] {
    auto v = (*client)->get("late", absl::Seconds(20));
    EXPECT_TRUE(v.ok()) << v.status();
    if (v.ok()) {
      EXPECT_EQ(*v, "here");
    }
    EXPECT_TRUE((*client)->wait({"late", "later"}, absl::Seconds(20)).ok());
  });
  ASSERT_TRUE(server->set("late", "here").ok());
  ASSERT_TRUE(server->set("later", "x").ok());
  waiter.join();
}

TEST(TcpStore, OneClientObjectServesConcurrentBlockingAndNonBlockingCalls) {
  auto server = make_server();
  auto client = make_client(server->port());
  ASSERT_TRUE(client.ok());
  TcpStore& c = **client;
  // The same object blocks in get() on one thread while another thread's set() must get through.
  std::thread waiter([&] { EXPECT_TRUE(c.get("x", absl::Seconds(20)).ok()); });
  ASSERT_TRUE(c.set("x", "1").ok());
  waiter.join();
}

TEST(TcpStore, TimeoutsNameTheMissingKeys) {
  auto server = make_server();
  const absl::Time start = absl::Now();
  auto v = server->get("nope", absl::Milliseconds(100));
  ASSERT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(v.status().message(), HasSubstr("'nope'"));
  ASSERT_TRUE(server->set("a", "1").ok());
  auto w = server->wait({"a", "b"}, absl::Milliseconds(100));
  ASSERT_EQ(w.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(w.message(), HasSubstr("found missing: b"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(TcpStore, ConcurrentAddsAreAtomic) {
  auto server = make_server();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      auto c = make_client(server->port());
      ASSERT_TRUE(c.ok());
      for (int i = 0; i < 100; ++i) ASSERT_TRUE((*c)->add("count", 1).ok());
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(*server->add("count", 0), 400);
}

TEST(TcpStore, ClientRetriesUntilTheServerComesUp) {
  // Reserve a free port, release it, and start the server on it only after the client began connecting.
  std::uint16_t port = 0;
  {
    auto l = tcp::listen_on("127.0.0.1", 0);
    ASSERT_TRUE(l.ok());
    port = *tcp::local_port(*l);
  }
  std::atomic<bool> connected{false};
  std::thread client([&] {
    auto c = make_client(port, "", absl::Seconds(20));
    EXPECT_TRUE(c.ok()) << c.status();
    connected = c.ok();
    if (c.ok()) {
      EXPECT_EQ(*(*c)->get("ready", absl::Seconds(10)), "yes");
    }
  });
  TcpStoreOptions o;
  o.is_server = true;
  o.port = port;
  auto server = TcpStore::create(o);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE((*server)->set("ready", "yes").ok());
  client.join();
  EXPECT_TRUE(connected);
}

TEST(TcpStore, ConnectGivesUpAtItsDeadline) {
  std::uint16_t port = 0;
  {
    auto l = tcp::listen_on("127.0.0.1", 0);
    port = *tcp::local_port(*l);
  }
  const absl::Time start = absl::Now();
  auto c = make_client(port, "", absl::Milliseconds(300));
  ASSERT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(c.status().message(), HasSubstr(absl::StrCat("127.0.0.1:", port)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(TcpStore, WrongOrMissingTokenIsRefusedAtTheHandshake) {
  auto server = make_server("s3cret");
  auto wrong = make_client(server->port(), "s3creT");
  ASSERT_EQ(wrong.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(wrong.status().message(), HasSubstr("wrong or missing token"));
  auto missing = make_client(server->port(), "");
  ASSERT_EQ(missing.status().code(), absl::StatusCode::kPermissionDenied);
  auto right = make_client(server->port(), "s3cret");
  ASSERT_TRUE(right.ok()) << right.status();
  EXPECT_TRUE((*right)->set("k", "v").ok());
  EXPECT_EQ(server->server()->rejected_connections(), 2);
}

TEST(TcpStore, TokenFromEnvironment) {
  ::setenv("SHARDKIT_STORE_TOKEN", "from-env", 1);
  auto server = make_server();  // picks up the env token
  auto client = make_client(server->port());
  ::unsetenv("SHARDKIT_STORE_TOKEN");
  ASSERT_TRUE(client.ok()) << client.status();
  auto without = make_client(server->port());
  EXPECT_EQ(without.status().code(), absl::StatusCode::kPermissionDenied);
}

// ---- raw-socket fault tests ------------------------------------------------------------------------

class RawConnection {
 public:
  explicit RawConnection(std::uint16_t port) {
    auto s = tcp::connect_with_retry("127.0.0.1", port, absl::Now() + absl::Seconds(5), "test server");
    EXPECT_TRUE(s.ok());
    sock_ = std::move(*s);
  }
  void send(const std::string& bytes) {
    ASSERT_TRUE(tcp::send_all(sock_, bytes.data(), bytes.size(), absl::Now() + absl::Seconds(5), "server").ok());
  }
  void hello(const std::string& token = "") {
    proto::Message h;
    h.type = proto::MessageType::kHello;
    h.magic = proto::kMagic;
    h.version = proto::kVersion;
    h.value = token;
    send(proto::encode_frame(h));
    auto r = read_reply();
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->type, proto::MessageType::kOk);
  }
  absl::StatusOr<proto::Message> read_reply() {
    unsigned char h[4];
    if (auto st = tcp::recv_all(sock_, h, 4, absl::Now() + absl::Seconds(10), "server"); !st.ok()) return st;
    std::string body(proto::decode_header(h), '\0');
    if (auto st = tcp::recv_all(sock_, body.data(), body.size(), absl::Now() + absl::Seconds(10), "server"); !st.ok())
      return st;
    return proto::decode_payload(body);
  }
  // True when the server closed the connection within the deadline.
  bool closed_by_server(absl::Duration within) {
    char c;
    auto st = tcp::recv_all(sock_, &c, 1, absl::Now() + within, "server");
    return st.code() == absl::StatusCode::kUnavailable;
  }
  void close() { sock_.close(); }

 private:
  tcp::Socket sock_;
};

std::string header(std::uint32_t len) {
  std::string h(4, '\0');
  for (int i = 0; i < 4; ++i) h[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  return h;
}

void expect_server_still_serves(TcpStore& server) {
  auto c = make_client(server.port());
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE((*c)->set("after", "ok").ok());
  EXPECT_EQ(*server.get("after", absl::Seconds(1)), "ok");
}

TEST(TcpStoreServerFaults, OversizedFrameGetsAnErrorAndIsClosed) {
  auto server = make_server();
  RawConnection raw(server->port());
  raw.hello();
  raw.send(header(0xfffffff0u));
  auto r = raw.read_reply();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->type, proto::MessageType::kError);
  EXPECT_THAT(r->value, HasSubstr("oversized store frame: expected at most 16777216 payload bytes"));
  EXPECT_TRUE(raw.closed_by_server(absl::Seconds(5)));
  expect_server_still_serves(*server);
}

TEST(TcpStoreServerFaults, MalformedFrameGetsAnErrorAndIsClosed) {
  auto server = make_server();
  RawConnection raw(server->port());
  raw.hello();
  std::string payload = "\x02";                      // kSet
  payload += header(1000) + "short";                 // key length runs past the end
  raw.send(header(static_cast<std::uint32_t>(payload.size())) + payload);
  auto r = raw.read_reply();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->type, proto::MessageType::kError);
  EXPECT_THAT(r->value, HasSubstr("malformed store frame"));
  EXPECT_TRUE(raw.closed_by_server(absl::Seconds(5)));
  expect_server_still_serves(*server);
}

TEST(TcpStoreServerFaults, UnknownTypeAndRequestBeforeHelloAreRefused) {
  auto server = make_server();
  {
    RawConnection raw(server->port());
    raw.hello();
    raw.send(header(1) + "\x50");
    auto r = raw.read_reply();
    ASSERT_TRUE(r.ok());
    EXPECT_THAT(r->value, HasSubstr("expected a known message type, found 80"));
  }
  {
    RawConnection raw(server->port());
    proto::Message set;
    set.type = proto::MessageType::kSet;
    set.keys = {"k"};
    raw.send(proto::encode_frame(set));
    auto r = raw.read_reply();
    ASSERT_TRUE(r.ok());
    EXPECT_THAT(r->value, HasSubstr("expected a hello frame first"));
    EXPECT_TRUE(raw.closed_by_server(absl::Seconds(5)));
  }
  EXPECT_FALSE(*server->check({"k"}));
  expect_server_still_serves(*server);
}

TEST(TcpStoreServerFaults, TruncatedFrameThenCloseDoesNotDisturbTheServer) {
  auto server = make_server();
  {
    RawConnection raw(server->port());
    raw.hello();
    raw.send(header(100) + "only ten b");
    raw.close();
  }
  expect_server_still_serves(*server);
}

// A hostile client's timeout_ms of INT64_MAX is clamped (the request waits for its key; before the fix the
// server's milliseconds -> nanoseconds conversion overflowed, to -1 ms in a plain build, and answered
// kTimeout at once); INT64_MIN does not wait. The server keeps serving either way.
TEST(TcpStoreServerFaults, HostileTimeoutsAreClampedNotOverflowed) {
  auto server = make_server();
  for (const proto::MessageType type : {proto::MessageType::kGet, proto::MessageType::kWait}) {
    SCOPED_TRACE(static_cast<int>(type));
    const std::string key = absl::StrCat("hostile", static_cast<int>(type));
    RawConnection raw(server->port());
    raw.hello();
    proto::Message m;
    m.type = type;
    m.keys = {key};
    m.number = std::numeric_limits<std::int64_t>::max();
    raw.send(proto::encode_frame(m));
    ASSERT_TRUE(server->set(key, "v").ok());
    auto r = raw.read_reply();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->type, type == proto::MessageType::kGet ? proto::MessageType::kValue : proto::MessageType::kOk)
        << r->value;

    m.keys = {"never"};
    m.number = std::numeric_limits<std::int64_t>::min();
    raw.send(proto::encode_frame(m));
    r = raw.read_reply();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->type, proto::MessageType::kTimeout);
  }
  EXPECT_EQ(server->server()->rejected_connections(), 0);
  expect_server_still_serves(*server);
}

TEST(TcpStoreServerFaults, StalledFrameIsClosedAfterTheFrameTimeout) {
  TcpStoreServerOptions so;
  so.frame_timeout = absl::Milliseconds(200);
  auto server = TcpStoreServer::start(so);
  ASSERT_TRUE(server.ok());
  RawConnection stalled((*server)->port());
  stalled.hello();
  stalled.send(header(100) + "partial");
  // Meanwhile another client is served normally.
  auto c = make_client((*server)->port());
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE((*c)->set("k", "v").ok());
  const absl::Time start = absl::Now();
  EXPECT_TRUE(stalled.closed_by_server(absl::Seconds(10)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // A connection that never says hello is closed the same way.
  RawConnection silent((*server)->port());
  EXPECT_TRUE(silent.closed_by_server(absl::Seconds(10)));
  EXPECT_GE((*server)->rejected_connections(), 2);
}


// ---- resource limits (issue 17) --------------------------------------------------------------------

// Polls `condition` until it holds or `within` passes (no sleeping to synchronise: a deadline on a condition).
bool eventually(const std::function<bool()>& condition, absl::Duration within = absl::Seconds(20)) {
  const absl::Time deadline = absl::Now() + within;
  for (;;) {
    if (condition()) return true;
    if (absl::Now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

int open_fds() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// Captures what a server logs.
struct CapturedLog {
  std::mutex mu;
  std::vector<std::string> lines;
  Logger logger{LoggerOptions{LogLevel::kWarning, [this](LogLevel, std::string_view line) {
                                std::lock_guard<std::mutex> lock(mu);
                                lines.emplace_back(line);
                              }}};
  std::vector<std::string> snapshot() {
    std::lock_guard<std::mutex> lock(mu);
    return lines;
  }
};

// 200 connections that never authenticate each announce a 16 MiB frame. Before the fix the server allocated
// (and zero-filled) 16 MiB for each, 3.2 GB in all, and answered none of them until the frame timeout; now
// a header larger than a hello is refused before anything is allocated, and a client with the token is
// served meanwhile. Bound: the server never buffers more than 1 MiB at once.
TEST(TcpStoreServerLimits, UnauthenticatedLargePrefixesAllocateNothingAndACorrectClientIsServed) {
  TcpStoreServerOptions so;
  so.token = "s3cret";
  so.frame_timeout = absl::Seconds(3);
  auto server = TcpStoreServer::start(so);
  ASSERT_TRUE(server.ok()) << server.status();
  constexpr int kFlood = 200;
  constexpr std::uint32_t kAnnounced = 16u << 20;
  std::vector<std::unique_ptr<RawConnection>> flood;
  for (int i = 0; i < kFlood; ++i) {
    flood.push_back(std::make_unique<RawConnection>((*server)->port()));
    flood.back()->send(header(kAnnounced));
  }
  auto good = make_client((*server)->port(), "s3cret");
  ASSERT_TRUE(good.ok()) << good.status();
  ASSERT_TRUE((*good)->set("k", "v").ok());
  EXPECT_EQ(*(*good)->get("k", absl::Seconds(1)), "v");
  for (auto& raw : flood) {
    auto r = raw->read_reply();
    if (!r.ok()) {
      ADD_FAILURE() << r.status();
      continue;
    }
    EXPECT_EQ(r->type, proto::MessageType::kError);
    EXPECT_THAT(r->value, HasSubstr(absl::StrCat("store handshake refused: expected a hello frame of at most ",
                                                 proto::kMaxHelloPayloadBytes,
                                                 " payload bytes, found a header announcing ", kAnnounced)));
    EXPECT_TRUE(raw->closed_by_server(absl::Seconds(5)));
  }
  const TcpStoreServerStats stats = (*server)->stats();
  EXPECT_LT(stats.peak_buffered_bytes, 1 << 20);  // 200 x kMaxHelloPayloadBytes would be 0.8 MiB
  EXPECT_EQ(stats.rejected_connections, kFlood);
}

// Clients that disconnect while their get / wait is parked. Before the fix the server noticed nothing until
// the request's timeout (here two minutes): each connection stayed open in CLOSE_WAIT, one file descriptor
// per dead client. Now every one is closed and its request dropped as soon as its client goes.
TEST(TcpStoreServerLimits, ParkedThenDisconnectedClientsReleaseTheirConnections) {
  auto server = TcpStoreServer::start({});
  ASSERT_TRUE(server.ok()) << server.status();
  TcpStoreServer& s = **server;
  const int fds_before = open_fds();
  constexpr int kClients = 50;
  std::vector<std::unique_ptr<RawConnection>> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.push_back(std::make_unique<RawConnection>(s.port()));
    clients.back()->hello();
    proto::Message m;
    m.type = i % 2 == 0 ? proto::MessageType::kGet : proto::MessageType::kWait;
    m.keys = {"never", absl::StrCat("never", i)};
    if (m.type == proto::MessageType::kGet) m.keys.resize(1);
    m.number = 120'000;
    clients.back()->send(proto::encode_frame(m));
  }
  ASSERT_TRUE(eventually([&] { return s.stats().parked_requests == kClients; }));
  EXPECT_EQ(s.stats().open_connections, kClients);
  for (auto& c : clients) c->close();
  EXPECT_TRUE(eventually([&] { return s.stats().open_connections == 0; }))
      << s.stats().open_connections << " connections still open";
  EXPECT_EQ(s.stats().parked_requests, 0);
  EXPECT_TRUE(eventually([&] { return open_fds() == fds_before; }))
      << open_fds() << " fds open, " << fds_before << " before";
  EXPECT_EQ(s.stats().rejected_connections, 0);  // a client going away is not a protocol error
  // The server still serves, and setting the keys the dead clients waited for answers no one.
  auto c = make_client(s.port());
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE((*c)->set("never", "now").ok());
  EXPECT_EQ(*(*c)->get("never", absl::Seconds(1)), "now");
}


TEST(TcpStoreServerLimits, ConnectionsOverAPerAddressLimitAreRefusedWithAClearMessage) {
  CapturedLog log;
  TcpStoreServerOptions so;
  so.max_connections_per_address = 3;
  so.logger = &log.logger;
  auto server = TcpStoreServer::start(so);
  ASSERT_TRUE(server.ok()) << server.status();
  TcpStoreServer& s = **server;
  std::vector<std::unique_ptr<RawConnection>> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(std::make_unique<RawConnection>(s.port()));
    held.back()->hello();
  }
  auto refused = make_client(s.port());
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(refused.status().message(),
              HasSubstr("store connection limit reached: 3 connections from 127.0.0.1 open "
                        "(max_connections_per_address = 3)"));
  EXPECT_EQ(s.stats().refused_connections, 1);
  const auto lines = log.snapshot();
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_THAT(lines[0], HasSubstr("TcpStoreServer: refusing a connection from 127.0.0.1:"));
  EXPECT_THAT(lines[0], HasSubstr("(max_connections_per_address = 3)"));
  // A slot freed is a slot usable again.
  held.back()->close();
  ASSERT_TRUE(eventually([&] { return s.stats().open_connections == 2; }));
  auto admitted = make_client(s.port());
  ASSERT_TRUE(admitted.ok()) << admitted.status();
  EXPECT_TRUE((*admitted)->set("k", "v").ok());
}

TEST(TcpStoreServerLimits, ConnectionsOverTheTotalLimitAreRefused) {
  CapturedLog log;
  TcpStoreServerOptions so;
  so.max_connections = 2;
  so.logger = &log.logger;
  auto server = TcpStoreServer::start(so);
  ASSERT_TRUE(server.ok()) << server.status();
  RawConnection a((*server)->port()), b((*server)->port());
  a.hello();
  b.hello();
  auto refused = make_client((*server)->port());
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("2 connections open (max_connections = 2)"));
  EXPECT_EQ((*server)->stats().open_connections, 2);
}

TEST(TcpStoreServerLimits, BadLimitsAreRejectedAtStart) {
  TcpStoreServerOptions so;
  so.max_connections_per_address = 0;
  auto server = TcpStoreServer::start(so);
  ASSERT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(server.status().message(), HasSubstr("found 8192 and 0"));
}

// 20 refused handshakes with room for 5 warnings per window: 5 lines, each naming the peer, 15 counted.
TEST(TcpStoreServerLimits, WarningsAreRateLimitedAndNameThePeer) {
  CapturedLog log;
  TcpStoreServerOptions so;
  so.token = "right";
  so.max_warnings_per_window = 5;
  so.warning_window = absl::Hours(1);
  so.logger = &log.logger;
  auto server = TcpStoreServer::start(so);
  ASSERT_TRUE(server.ok()) << server.status();
  for (int i = 0; i < 20; ++i) {
    auto c = make_client((*server)->port(), "wrong");
    ASSERT_EQ(c.status().code(), absl::StatusCode::kPermissionDenied) << c.status();
  }
  const auto lines = log.snapshot();
  ASSERT_EQ(lines.size(), 5u);
  for (const auto& line : lines) {
    EXPECT_THAT(line, HasSubstr("TcpStoreServer: closing the connection from 127.0.0.1:"));
    EXPECT_THAT(line, HasSubstr("wrong or missing token"));
  }
  EXPECT_EQ((*server)->stats().suppressed_warnings, 15);
  EXPECT_EQ((*server)->stats().rejected_connections, 20);
}

// Large frames from an authenticated client are served, and their buffers are not kept afterwards.
TEST(TcpStoreServerLimits, LargeFrameBuffersAreReleasedAfterUse) {
  auto server = make_server();
  auto c = make_client(server->port());
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE((*c)->set("big", std::string(4 << 20, 'x')).ok());
  EXPECT_EQ((*c)->get("big", absl::Seconds(5))->size(), 4u << 20);
  const TcpStoreServerStats st = server->server()->stats();
  EXPECT_GE(st.peak_buffered_bytes, 4 << 20);
  EXPECT_TRUE(eventually([&] {
    return server->server()->stats().buffered_bytes <= 4 * static_cast<std::int64_t>(TcpStoreServer::kRetainedBufferBytes);
  })) << server->server()->stats().buffered_bytes;
}

}  // namespace
}  // namespace shardkit::comm
