// The Store contract at the edges of its value ranges, for every implementation (HashStore, TcpStore as
// server and as client): add() past INT64_MAX / below INT64_MIN is refused naming the key and leaves the
// value unchanged; get() / wait() accept an infinite or huge timeout and still return when the key appears.
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/comm/hash_store.h"
#include "common/comm/tcp_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::comm {
namespace {

using ::testing::HasSubstr;

constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min();

// One store of each kind; the TCP client talks to the server held next to it.
struct Stores {
  HashStore hash;
  std::unique_ptr<TcpStore> tcp_server;
  std::unique_ptr<TcpStore> tcp_client;

  Stores() {
    TcpStoreOptions so;
    so.is_server = true;
    auto s = TcpStore::create(so);
    EXPECT_TRUE(s.ok()) << s.status();
    tcp_server = std::move(*s);
    TcpStoreOptions co;
    co.port = tcp_server->port();
    auto c = TcpStore::create(co);
    EXPECT_TRUE(c.ok()) << c.status();
    tcp_client = std::move(*c);
  }
  std::vector<std::pair<std::string, Store*>> all() {
    return {{"HashStore", &hash}, {"TcpStore server", tcp_server.get()}, {"TcpStore client", tcp_client.get()}};
  }
};

TEST(StoreLimits, AddPastInt64IsRefusedNamingTheKeyAndKeepsTheValue) {
  Stores stores;
  for (auto [name, store] : stores.all()) {
    SCOPED_TRACE(name);
    const std::string up = absl::StrCat(name, "/up"), down = absl::StrCat(name, "/down");
    ASSERT_EQ(*store->add(up, kMax), kMax);
    auto over = store->add(up, 1);
    ASSERT_FALSE(over.ok()) << "returned " << *over;
    EXPECT_EQ(over.status().code(), absl::StatusCode::kInvalidArgument) << over.status();
    EXPECT_THAT(over.status().message(), HasSubstr(absl::StrCat("'", up, "'")));
    EXPECT_THAT(over.status().message(), HasSubstr("9223372036854775807 + 1 overflows"));
    EXPECT_EQ(*store->get(up, absl::Seconds(10)), "9223372036854775807");
    EXPECT_EQ(*store->add(up, -kMax), 0);  // the store still adds

    ASSERT_EQ(*store->add(down, kMin), kMin);
    auto under = store->add(down, -1);
    ASSERT_FALSE(under.ok()) << "returned " << *under;
    EXPECT_EQ(under.status().code(), absl::StatusCode::kInvalidArgument) << under.status();
    EXPECT_THAT(under.status().message(), HasSubstr("-9223372036854775808 + -1 overflows"));
    EXPECT_EQ(*store->get(down, absl::Seconds(10)), "-9223372036854775808");
    EXPECT_FALSE(store->add(down, kMin).ok());
    EXPECT_EQ(*store->add(down, kMax), -1);
  }
}

// An infinite or huge timeout is a deadline in the far future: the call waits and returns the value once
// another thread sets the key (the set may come before or after the call starts waiting; either way the
// answer is the value, never a timeout). Before the fix the TCP server converted the milliseconds to
// nanoseconds with a signed overflow.
TEST(StoreLimits, InfiniteAndHugeTimeoutsWaitForTheKey) {
  Stores stores;
  int round = 0;
  for (auto [name, store] : stores.all()) {
    for (const absl::Duration timeout : {absl::InfiniteDuration(), absl::Hours(1e12), absl::Seconds(kMax)}) {
      SCOPED_TRACE(absl::StrCat(name, " timeout ", absl::FormatDuration(timeout)));
      const std::string key = absl::StrCat("late", ++round), other = absl::StrCat("later", round);
      std::thread setter([&] {
        ASSERT_TRUE(stores.hash.set(key, "v").ok());
        ASSERT_TRUE(stores.tcp_server->set(key, "v").ok());
        ASSERT_TRUE(stores.hash.set(other, "w").ok());
        ASSERT_TRUE(stores.tcp_server->set(other, "w").ok());
      });
      auto v = store->get(key, timeout);
      EXPECT_TRUE(v.ok()) << v.status();
      EXPECT_TRUE(store->wait({key, other}, timeout).ok());
      setter.join();
    }
  }
}

TEST(StoreLimits, NegativeTimeoutDoesNotWait) {
  Stores stores;
  for (auto [name, store] : stores.all()) {
    SCOPED_TRACE(name);
    for (const absl::Duration timeout : {-absl::InfiniteDuration(), absl::Seconds(-1), absl::Seconds(kMin)}) {
      EXPECT_EQ(store->get("never", timeout).status().code(), absl::StatusCode::kDeadlineExceeded);
      EXPECT_EQ(store->wait({"never"}, timeout).code(), absl::StatusCode::kDeadlineExceeded);
    }
  }
}

}  // namespace
}  // namespace shardkit::comm
