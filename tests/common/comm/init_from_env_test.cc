// init_from_env's rank context: rank r of a multi-process world draws from Generator(seed).fork(r), as a
// run_ranks thread does (init_rank_context, tested without connecting), and init_from_env installs it on
// the calling thread (a world of one against a standalone store, with the variables set).
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "common/comm/init_from_env.h"
#include "common/comm/tcp_store_server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::comm {
namespace {

std::vector<float> draw(Generator g) {
  std::vector<float> v(8);
  g.fill_uniform(v.data(), static_cast<std::int64_t>(v.size()));
  return v;
}

absl::StatusOr<ProcessRankEnv> env_of(const char* rank, const char* world_size) {
  return parse_rank_env([=](const char* n) -> const char* {
    const std::string name = n;
    if (name == "RANK") return rank;
    if (name == "WORLD_SIZE") return world_size;
    if (name == "MASTER_ADDR") return "127.0.0.1";
    if (name == "MASTER_PORT") return "29500";
    return nullptr;
  });
}

TEST(InitRankContextTest, RankOneOfTwoDrawsFromStreamOne) {
  auto env = env_of("1", "2");
  ASSERT_TRUE(env.ok()) << env.status();
  RankContext ctx;
  auto tracker = ctx.memory;
  init_rank_context(*env, {.seed = 7}, ctx);
  EXPECT_EQ(ctx.rank, 1);
  EXPECT_EQ(ctx.world_size, 2);
  EXPECT_EQ(ctx.generator.seed(), 7u);
  EXPECT_EQ(ctx.generator.stream(), 1u);
  EXPECT_EQ(draw(ctx.generator), draw(Generator(7).fork(1)));
  EXPECT_NE(draw(ctx.generator), draw(Generator(7).fork(0)));  // rank 0's stream
  EXPECT_EQ(ctx.memory, tracker);                                // the ledger is kept
}

TEST(InitRankContextTest, SameStreamOnEveryRankWhenAsked) {
  auto env = env_of("1", "2");
  ASSERT_TRUE(env.ok()) << env.status();
  RankContext ctx;
  init_rank_context(*env, {.seed = 7, .streams = RankStreams::same_on_every_rank}, ctx);
  EXPECT_EQ(ctx.rank, 1);
  EXPECT_EQ(draw(ctx.generator), draw(Generator(7)));
}

// Sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and SHARDKIT_TRANSPORT, unset at the end) for the test's duration (the tests of this binary do not
// run concurrently, and nothing else here reads them).
class ScopedRankVariables {
 public:
  explicit ScopedRankVariables(std::uint16_t port, const char* rank = "0", const char* world_size = "1") {
    ::setenv("RANK", rank, 1);
    ::setenv("WORLD_SIZE", world_size, 1);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  }
  ~ScopedRankVariables() {
    for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SHARDKIT_TRANSPORT"}) ::unsetenv(name);
  }
};

// On a thread of its own, so the context it changes is that thread's default context, not the test's.
TEST(InitFromEnvTest, InstallsTheRankContextOnTheCallingThread) {
  auto server = TcpStoreServer::start({});
  ASSERT_TRUE(server.ok()) << server.status();
  ScopedRankVariables vars((*server)->port());
  for (bool install : {true, false}) {
    std::thread([&] {
      RankContext& ctx = current_rank_context();
      ctx.world_size = 5;  // something init_from_env must overwrite
      ctx.generator = Generator(99, 4);
      InitFromEnvOptions o;
      o.host_store = false;
      o.store_connect_timeout = absl::Seconds(30);
      o.group.store_prefix = install ? "installs" : "leaves";
      o.rank_context.install = install;
      o.rank_context.seed = 5;
      auto pg = init_from_env(o);
      ASSERT_TRUE(pg.ok()) << pg.status();
      EXPECT_EQ((*pg)->size(), 1);
      if (install) {
        EXPECT_EQ(ctx.rank, 0);
        EXPECT_EQ(ctx.world_size, 1);
        EXPECT_EQ(draw(ctx.generator), draw(Generator(5).fork(0)));
      } else {
        EXPECT_EQ(ctx.world_size, 5);
        EXPECT_EQ(draw(ctx.generator), draw(Generator(99, 4)));
      }
    }).join();
  }
}

// A bad group setting is this rank's own error, found before the store is touched: with no store to reach
// (rank 1 of 2, nothing listening at MASTER_PORT), it is InvalidArgument naming the setting, not a store
// connection failure after the connect timeout. (Under shardrun, rank 1 used to report rank 0's store dropping
// out as rank 0 exited on the bad value, and rank 0 could be stopped before it printed why.)
TEST(InitFromEnvTest, ABadTransportIsRefusedBeforeTheStoreIsTouched) {
  std::uint16_t port = 0;
  {
    auto server = TcpStoreServer::start({});
    ASSERT_TRUE(server.ok()) << server.status();
    port = (*server)->port();
  }  // closed: nothing listens there now
  ScopedRankVariables vars(port, "1", "2");
  ::setenv("SHARDKIT_TRANSPORT", "infiniband", 1);
  InitFromEnvOptions o;
  o.store_connect_timeout = absl::Seconds(3);
  auto pg = init_from_env(o);
  ASSERT_FALSE(pg.ok());
  EXPECT_EQ(pg.status().code(), absl::StatusCode::kInvalidArgument) << pg.status();
  EXPECT_THAT(std::string(pg.status().message()),
              ::testing::AllOf(::testing::HasSubstr("init_from_env (rank 1 of 2)"),
                               ::testing::HasSubstr("to be tcp, shm or auto, found 'infiniband'")));
}

}  // namespace
}  // namespace shardkit::comm
