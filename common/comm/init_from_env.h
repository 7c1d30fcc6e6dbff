// init_from_env(): the torchrun convention (DESIGN.md section 2). Reads RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT (as set by tools/shardrun; under mpirun or srun their variables, parse_rank_env), connects a TcpStore (rank 0 hosts its server on
// MASTER_ADDR:MASTER_PORT, or with host_store = false every rank connects to a standalone server such as
// tools/shardkit-store; clients retry connecting until store_connect_timeout) and returns this rank's TCP
// process group over all WORLD_SIZE ranks (whose ranks on one host talk through shared memory unless
// SHARDKIT_TRANSPORT=tcp: shm_rendezvous.h).
//
// The rank context: on success init_from_env also makes the calling thread's current_rank_context() this
// rank's, the way run_ranks (run_ranks.h) sets up each rank thread: rank = RANK, world_size = WORLD_SIZE and
// generator = Generator(seed).fork(RANK), so dropout and other randomness differ across ranks (options
// .rank_context: same_on_every_rank gives every rank Generator(seed); install = false leaves the context
// alone). The context is modified in place, not replaced: it keeps its memory tracker. Lifetime: nothing is
// returned to keep alive. Without a RankContextScope on the calling thread the context is that thread's own
// default context, which lives as long as the thread (for the main thread: the process); under a scope it is
// the scope's context, and the change ends with it. Other threads of the process keep their own default
// context (rank 0 of 1); to run one as this rank, install a RankContextScope on it for a context of its own
// set up with init_rank_context (a Generator is not thread-safe: do not share one between threads).
//
// SHARDKIT_TIMEOUT=<seconds> (as shardrun --timeout sets it) replaces options.group.default_timeout, the deadline
// of every collective; SHARDKIT_HEARTBEAT_WINDOW=<seconds> the watchdog's window (0 turns it off).
//
// Errors: InvalidArgument naming the variable, e.g. "expected environment variable RANK to be an integer in
// [0, WORLD_SIZE=4), found '7'" or "... found it unset"; the store's and group's own errors otherwise.
// Thread-safety: reads the environment; call it once per process, before starting threads that setenv.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/comm/process_group.h"
#include "common/comm/tcp_process_group.h"
#include "common/comm/watchdog.h"
#include "common/tensor/rank_context.h"

namespace shardkit::comm {

// What the environment says about this process's rank (named apart from the test harness's RankEnv,
// comm/testing/run_ranks.h, which is a different struct in the same namespace).
struct ProcessRankEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;
  std::uint16_t master_port = 0;
  std::string launcher = "shardrun";  // whose variables gave the rank: "shardrun" (torchrun's), "mpirun", "slurm"
};

// Parses the variables through `lookup` (returns null for an unset variable). LOCAL_RANK defaults to RANK
// when unset. Also understands mpirun's (OMPI_COMM_WORLD_*) and Slurm's (SLURM_PROCID, ...) variables, with
// defaults for MASTER_ADDR / MASTER_PORT there (Note [launchers] in init_from_env.cc). Pure: testable without
// touching the process environment.
absl::StatusOr<ProcessRankEnv> parse_rank_env(const std::function<const char*(const char*)>& lookup);
// The first host of a Slurm host list: "node[01-04,07],gpu3" -> "node01"; "gpu3,gpu4" -> "gpu3".
absl::StatusOr<std::string> first_slurm_host(std::string_view nodelist);
// parse_rank_env(getenv).
absl::StatusOr<ProcessRankEnv> read_rank_env();

// How init_from_env sets up the calling thread's rank context.
struct RankContextOptions {
  bool install = true;                          // false: leave current_rank_context() as it is
  std::uint64_t seed = 0;                       // every rank's Generator seed
  RankStreams streams = RankStreams::per_rank;  // Generator(seed).fork(RANK), or Generator(seed) on every rank
};

// Makes `ctx` the context of rank env.rank of env.world_size: set_rank(ctx, env.rank, env.world_size,
// options.seed, options.streams) (rank_context.h): what init_from_env does to current_rank_context(), without
// reading the environment or connecting.
void init_rank_context(const ProcessRankEnv& env, const RankContextOptions& options, RankContext& ctx);

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
  // empty: SHARDKIT_STORE_TOKEN if set. Also the token of the ranks' connections (group.token) unless that is set.
  std::string store_token;
  // Every collective's deadline; wins over SHARDKIT_TIMEOUT and group.default_timeout. Empty: those.
  std::optional<absl::Duration> timeout;
  RankContextOptions rank_context;
  // The group's heartbeat watchdog (watchdog.h), kept alive with the returned group; empty: none. The
  // environment overrides: SHARDKIT_HEARTBEAT_WINDOW=<seconds> sets the window (0: no watchdog).
  std::optional<WatchdogOptions> watchdog = WatchdogOptions{.interval = absl::Seconds(1), .window = absl::Seconds(10)};
};

absl::StatusOr<std::shared_ptr<ProcessGroup>> init_from_env(InitFromEnvOptions options = {});

}  // namespace shardkit::comm
