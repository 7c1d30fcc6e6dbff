// Rank-to-rank authentication of the TCP mesh (tcp_auth.h, Note [rank authentication] in tcp_rendezvous.cc):
// SipHash-2-4 against the reference vectors, and the handshake from the outside: a rank with another token is
// refused with a message saying so, and a client that knows a rank's port and speaks the handshake but not the
// token (it forges the proof) is refused while the real rank still joins.
#include "common/comm/tcp_auth.h"

#include <array>
#include <cstring>
#include <string>
#include <thread>

#include "common/comm/hash_store.h"
#include "common/comm/tcp_process_group.h"
#include "common/comm/tcp_socket.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::comm {
namespace {

using ::testing::HasSubstr;

TEST(SipHash24, MatchesTheReferenceVectors) {
  // Key 00 01 .. 0f, messages 00 01 .. (len-1): vectors.h of the SipHash reference implementation.
  const tcp_auth::Key key = {0x0706050403020100ULL, 0x0f0e0d0c0b0a0908ULL};
  auto message = [](int len) {
    std::string m;
    for (int i = 0; i < len; ++i) m.push_back(static_cast<char>(i));
    return m;
  };
  EXPECT_EQ(tcp_auth::siphash24(key, message(0)), 0x726fdb47dd0e0e31ULL);
  EXPECT_EQ(tcp_auth::siphash24(key, message(1)), 0x74f839c593dc67fdULL);
  EXPECT_EQ(tcp_auth::siphash24(key, message(7)), 0xab0200f58b01d137ULL);
  EXPECT_EQ(tcp_auth::siphash24(key, message(8)), 0x93f5f5799a932462ULL);
  EXPECT_EQ(tcp_auth::siphash24(key, message(15)), 0xa129ca6149be45e5ULL);
}

TEST(TcpAuth, TagsDependOnTokenAndMessage) {
  const tcp_auth::Key a = tcp_auth::derive_key("token a"), b = tcp_auth::derive_key("token b");
  EXPECT_NE(a, b);
  EXPECT_EQ(a, tcp_auth::derive_key("token a"));
  EXPECT_TRUE(tcp_auth::tags_equal(tcp_auth::mac(a, "hello"), tcp_auth::mac(a, "hello")));
  EXPECT_FALSE(tcp_auth::tags_equal(tcp_auth::mac(a, "hello"), tcp_auth::mac(b, "hello")));
  EXPECT_FALSE(tcp_auth::tags_equal(tcp_auth::mac(a, "hello"), tcp_auth::mac(a, "hellp")));
  auto n1 = tcp_auth::random_nonce(), n2 = tcp_auth::random_nonce();
  ASSERT_TRUE(n1.ok() && n2.ok());
  EXPECT_NE(*n1, *n2);
}

TcpProcessGroupOptions with_token(const std::string& token) {
  TcpProcessGroupOptions o;
  o.token = token;
  o.store_prefix = "auth";
  o.default_timeout = absl::Seconds(60);
  return o;
}

TEST(TcpAuth, ARankWithAnotherTokenIsRefused) {
  auto store = std::make_shared<HashStore>();
  absl::StatusOr<std::shared_ptr<TcpProcessGroup>> g0, g1;
  TcpProcessGroupOptions o0 = with_token("right token"), o1 = with_token("wrong token");
  o0.connect_timeout = absl::Seconds(3);
  o1.connect_timeout = absl::Seconds(3);
  std::thread t([&] { g0 = TcpProcessGroup::create(store, 0, 2, o0); });
  g1 = TcpProcessGroup::create(store, 1, 2, o1);
  t.join();
  ASSERT_FALSE(g1.ok());
  EXPECT_EQ(g1.status().code(), absl::StatusCode::kPermissionDenied) << g1.status();
  EXPECT_THAT(std::string(g1.status().message()), HasSubstr("rank 0 did not prove this rank's token: the ranks' tokens differ"));
  ASSERT_FALSE(g0.ok());
  EXPECT_EQ(g0.status().code(), absl::StatusCode::kDeadlineExceeded) << g0.status();
  EXPECT_THAT(std::string(g0.status().message()), HasSubstr("ranks [1] did not connect before the deadline (refused 1 connection"));
}

// The handshake's first three messages as they go on the wire (Note [rank authentication]).
struct Hello {
  std::uint32_t magic = 0x4f4c4548;
  std::uint32_t version = 2;
  std::int32_t rank = 0;
  std::uint32_t pad = 0;
  std::array<std::uint8_t, 16> nonce{};
};
struct Challenge {
  std::uint32_t magic;
  std::int32_t rank;
  std::array<std::uint8_t, 16> nonce;
  std::array<std::uint8_t, 16> tag;
};
struct Proof {
  std::uint32_t magic = 0x464f5250;
  std::uint32_t pad = 0;
  std::array<std::uint8_t, 16> tag{};
};

TEST(TcpAuth, AClientThatKnowsThePortButNotTheTokenIsRefusedAndTheRealRankStillJoins) {
  const std::string token = "0123456789abcdef-a-long-random-token";
  auto store = std::make_shared<HashStore>();
  absl::StatusOr<std::shared_ptr<TcpProcessGroup>> g0;
  std::thread t0([&] { g0 = TcpProcessGroup::create(store, 0, 2, with_token(token)); });

  // The intruder reads rank 0's address (generation 0 of prefix "auth") and claims to be rank 1.
  auto addr = store->get("auth/0/addr/0", absl::Seconds(60));
  ASSERT_TRUE(addr.ok()) << addr.status();
  const auto colon = addr->rfind(':');
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  auto s = tcp::connect_with_retry(addr->substr(0, colon), static_cast<std::uint16_t>(std::stoi(addr->substr(colon + 1))),
                                   deadline, "rank 0");
  ASSERT_TRUE(s.ok()) << s.status();
  Hello hello;
  hello.rank = 1;
  ASSERT_TRUE(tcp::send_all(*s, &hello, sizeof(hello), deadline, "rank 0").ok());
  Challenge ch{};
  ASSERT_TRUE(tcp::recv_all(*s, &ch, sizeof(ch), deadline, "rank 0").ok());
  EXPECT_EQ(ch.rank, 0);
  const std::string challenge_bytes(reinterpret_cast<const char*>(&ch), sizeof(ch));
  EXPECT_EQ(challenge_bytes.find(token.substr(0, 8)), std::string::npos);  // the token is not sent
  Proof forged;
  forged.tag = tcp_auth::mac(tcp_auth::derive_key("a guess"), "anything");
  ASSERT_TRUE(tcp::send_all(*s, &forged, sizeof(forged), deadline, "rank 0").ok());
  std::uint32_t verdict[2] = {0, 7};
  absl::Status st = tcp::recv_all(*s, verdict, sizeof(verdict), deadline, "rank 0");
  if (st.ok()) {
    EXPECT_EQ(verdict[1], 0u) << "rank 0 accepted a forged proof";
  }
  char more = 0;
  EXPECT_FALSE(tcp::recv_all(*s, &more, 1, deadline, "rank 0").ok()) << "rank 0 kept the connection open";

  // The real rank 1 still joins, and the group works.
  auto g1 = TcpProcessGroup::create(store, 1, 2, with_token(token));
  t0.join();
  ASSERT_TRUE(g0.ok()) << g0.status();
  ASSERT_TRUE(g1.ok()) << g1.status();
  Tensor a = Tensor::full({10}, 1, {}), b = Tensor::full({10}, 2, {});
  auto w0 = (*g0)->all_reduce(a);
  auto w1 = (*g1)->all_reduce(b);
  ASSERT_TRUE(w0->wait().ok());
  ASSERT_TRUE(w1->wait().ok());
  EXPECT_EQ(a.item_at(9), 3);
  EXPECT_EQ(b.item_at(9), 3);
}

}  // namespace
}  // namespace shardkit::comm
