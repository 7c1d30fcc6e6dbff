#include "common/comm/init_from_env.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/comm/tcp_store.h"

namespace shardkit::comm {
namespace {

absl::Status bad(const char* name, const std::string& expected, const char* value) {
  return absl::InvalidArgumentError(absl::StrCat("init_from_env: expected environment variable ", name, " to be ",
                                                 expected, ", found ",
                                                 value ? absl::StrCat("'", value, "'") : std::string("it unset")));
}

absl::StatusOr<long> parse_in(const char* name, const char* value, long lo, long hi, const std::string& expected) {
  long v = 0;
  if (value == nullptr || !absl::SimpleAtoi(value, &v) || v < lo || v > hi) return bad(name, expected, value);
  return v;
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

// The local address of the route to `host` (a connected UDP socket sends nothing).
std::string route_source_address(const std::string& host, std::uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || res == nullptr) return "127.0.0.1";
  std::string out = "127.0.0.1";
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    char buf[INET_ADDRSTRLEN];
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        ::inet_ntop(AF_INET, &local.sin_addr, buf, sizeof(buf)) != nullptr) {
      out = buf;
    }
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(res);
  return out;
}

}  // namespace

absl::StatusOr<ProcessRankEnv> parse_rank_env(const std::function<const char*(const char*)>& lookup) {
  ProcessRankEnv env;
  auto world = parse_in("WORLD_SIZE", lookup("WORLD_SIZE"), 1, 1 << 20, "an integer >= 1");
  if (!world.ok()) return world.status();
  env.world_size = static_cast<int>(*world);
  const std::string rank_range = absl::StrCat("an integer in [0, WORLD_SIZE=", env.world_size, ")");
  auto rank = parse_in("RANK", lookup("RANK"), 0, env.world_size - 1, rank_range);
  if (!rank.ok()) return rank.status();
  env.rank = static_cast<int>(*rank);
  if (const char* lr = lookup("LOCAL_RANK"); lr != nullptr) {
    auto local = parse_in("LOCAL_RANK", lr, 0, env.world_size - 1, rank_range);
    if (!local.ok()) return local.status();
    env.local_rank = static_cast<int>(*local);
  } else {
    env.local_rank = env.rank;
  }
  const char* addr = lookup("MASTER_ADDR");
  if (addr == nullptr || *addr == '\0') return bad("MASTER_ADDR", "a host name or address", addr);
  env.master_addr = addr;
  auto port = parse_in("MASTER_PORT", lookup("MASTER_PORT"), 1, 65535, "a port number in [1, 65535]");
  if (!port.ok()) return port.status();
  env.master_port = static_cast<std::uint16_t>(*port);
  return env;
}

absl::StatusOr<ProcessRankEnv> read_rank_env() {
  return parse_rank_env([](const char* name) -> const char* { return std::getenv(name); });
}

void init_rank_context(const ProcessRankEnv& env, const RankContextOptions& options, RankContext& ctx) {
  set_rank(ctx, env.rank, env.world_size, options.seed, options.streams);
}

absl::StatusOr<std::shared_ptr<ProcessGroup>> init_from_env(InitFromEnvOptions options) {
  auto env = read_rank_env();
  if (!env.ok()) return env.status();
  TcpStoreOptions so;
  so.host = env->master_addr;
  so.port = env->master_port;
  so.is_server = options.host_store && env->rank == 0;
  so.token = options.store_token;
  so.connect_timeout = options.store_connect_timeout;
  auto store = TcpStore::create(so);
  if (!store.ok()) {
    return absl::Status(store.status().code(),
                        absl::StrCat("init_from_env (rank ", env->rank, " of ", env->world_size,
                                     "): store at ", env->master_addr, ":", env->master_port, ": ",
                                     store.status().message()));
  }
  TcpProcessGroupOptions go = options.group;
  if (go.listen_host.empty()) {
    go.listen_host = is_loopback(env->master_addr) ? "127.0.0.1" : route_source_address(env->master_addr, env->master_port);
  }
  auto pg = TcpProcessGroup::create(std::shared_ptr<Store>(std::move(*store)), env->rank, env->world_size, go);
  if (!pg.ok()) return pg.status();
  if (options.rank_context.install) init_rank_context(*env, options.rank_context, current_rank_context());
  return std::shared_ptr<ProcessGroup>(std::move(*pg));
}

}  // namespace shardkit::comm
