// init_from_env(): the torchrun convention (DESIGN.md section 2). Reads RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT (as set by tools/shardrun), connects a TcpStore (rank 0 hosts its server on
// MASTER_ADDR:MASTER_PORT, or with host_store = false every rank connects to a standalone server such as
// tools/shardkit-store; clients retry connecting until store_connect_timeout) and returns this rank's TCP
// process group over all WORLD_SIZE ranks.
//
// Errors: InvalidArgument naming the variable, e.g. "expected environment variable RANK to be an integer in
// [0, WORLD_SIZE=4), found '7'" or "... found it unset"; the store's and group's own errors otherwise.
// Thread-safety: reads the environment; call it once per process, before starting threads that setenv.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/comm/process_group.h"
#include "common/comm/tcp_process_group.h"

namespace shardkit::comm {

struct RankEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;
  std::uint16_t master_port = 0;
};

// Parses the variables through `lookup` (returns null for an unset variable). LOCAL_RANK defaults to RANK
// when unset. Pure: testable without touching the process environment.
absl::StatusOr<RankEnv> parse_rank_env(const std::function<const char*(const char*)>& lookup);
// parse_rank_env(getenv).
absl::StatusOr<RankEnv> read_rank_env();

struct InitFromEnvOptions {
  // The group's options. listen_host empty: 127.0.0.1 when MASTER_ADDR is a loopback address, else the
  // local address of the route to MASTER_ADDR (so other hosts can reach this rank).
  TcpProcessGroupOptions group = [] {
    TcpProcessGroupOptions o;
    o.listen_host = "";
    o.store_prefix = "world";
    return o;
  }();
  absl::Duration store_connect_timeout = absl::Seconds(120);
  // Rank 0 hosts the store server; false: a standalone server already listens at MASTER_ADDR:MASTER_PORT.
  bool host_store = true;
  std::string store_token;  // empty: SHARDKIT_STORE_TOKEN if set
};

absl::StatusOr<std::shared_ptr<ProcessGroup>> init_from_env(InitFromEnvOptions options = {});

}  // namespace shardkit::comm
