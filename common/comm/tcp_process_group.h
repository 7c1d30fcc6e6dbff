// TcpProcessGroup: the ProcessGroup (process_group.h) over TCP sockets, for ranks that are processes on
// one or many hosts (DESIGN.md section 2, issue 4 item 4). Bootstrapped through a Store (normally a
// TcpStore, see init_from_env.h).
//
// Parts (gloo's split, DESIGN.md section 2):
//   rendezvous  tcp_rendezvous.h: addresses through the store, then a full mesh, one TCP connection per pair
//               of ranks (a pair's connection carries both directions; point-to-point and collectives share it,
//               ordered by the contract in process_group.h)
//   transport   transport.h: each pair of ranks has a Pair that moves byte chunks: shared memory
//               (shm_transport.h) when both ranks are on one host, TCP (tcp_transport.h) otherwise, chosen by
//               shm_rendezvous.h from a host identity exchanged through the store (options.transport /
//               SHARDKIT_TRANSPORT=tcp|shm override); over shared memory, reductions read straight out of the
//               shared ring (no copy into a scratch buffer)
//   algorithms  ring_plan.h: which chunks each rank sends to whom and receives from whom, run over the pairs by
//               stream_runner.h (Note [chunk pipeline]: chunks are forwarded as soon as they have arrived)
//
// Algorithms (Note [ring plans] in ring_plan.cc):
//   all_reduce      ring reduce-scatter then ring all-gather, each step split into chunks of chunk_bytes
//                   and pipelined: a chunk is forwarded as soon as it has arrived (and been reduced)
//   reduce_scatter  ring reduce-scatter on the input (the input is used as scratch, as the contract allows)
//   all_gather      ring all-gather in the output
//   broadcast       chunked chain root -> root+1 -> ... -> root-1
//   reduce          chunked chain root+1 -> ... -> root-1 -> root (non-root tensors are used as scratch)
//   barrier         a 1-byte-per-rank ring all-gather
//   send / recv     the pair's connection. Calls run one at a time on the comm thread, so a send larger than
//                   the socket buffers completes only once the peer's matching recv runs: when two ranks
//                   exchange large tensors, one of them must issue its recv first (or use a collective);
//                   otherwise both sends wait for each other until the deadline (an error, never a hang).
// bf16 / f16 partial sums are computed in f32 and rounded to the tensor dtype at every hop (the
// contract allows it); every rank ends with bit-identical results (the all-gather copies bytes).
// Every call starts with a 32-byte header to the peers it sends to (call_header.h: kind, dtype, op, root, seq,
// numel): ranks that disagree fail with InvalidArgument naming both calls instead of exchanging garbage.
//
// Asynchrony: calls are queued to one communication thread per group and return at once; Work completes
// from that thread, so compute overlaps communication.
// Failure: a peer that closes its connection (process died, SIGKILL, abort) or misses the call's deadline
// fails the call on every rank within the deadline, naming the peer rank and the operation; the group is
// then aborted (Note [group failure]): its connections are shut down so the other ranks notice at once, and the
// reason is posted to the store under "<store_prefix>/<generation>/abort" so ranks further away quote the origin.
// Authentication: both ends of every rank-to-rank connection prove they know the token (options.token,
// normally the Store's) by a challenge-response when the mesh connects; a process that only knows a rank's
// port is refused (tcp_auth.h: what this protects against and what it does not).
// Recovery: create a new group (every rank calls create() again, with the same store and prefix if wanted;
// each creation uses keys of its own, Note [group generations] in tcp_rendezvous.cc).
//
// Thread-safety: as ProcessGroup. Destruction fails pending calls (Aborted) and joins the thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/comm/completion_work.h"
#include "common/comm/process_group.h"
#include "common/comm/shm_transport.h"
#include "common/comm/store.h"
#include "common/comm/transport.h"

namespace shardkit::comm {

struct TcpProcessGroupOptions {
  // Address the other ranks use to reach this rank (published through the store); also bound.
  std::string listen_host = "127.0.0.1";
  // Store keys of this group live under this prefix; two groups on one store need different prefixes.
  std::string store_prefix = "tcp_pg";
  std::string name = "world";
  // Default deadline of each call (CollectiveCall::timeout when the options leave it empty).
  absl::Duration default_timeout = absl::Seconds(300);
  // Deadline for connecting the mesh in create().
  absl::Duration connect_timeout = absl::Seconds(120);
  // Pipelining granularity (also the receive-then-reduce scratch, which stays in L2). 256 KiB measured best
  // for 64 MiB all_reduce on loopback among 128 KiB .. 4 MiB; tests use tiny values so multi-chunk paths
  // run on small tensors. Rounded down to a whole number of elements (at least one).
  std::size_t chunk_bytes = 256u << 10;
  // Socket send / receive buffer sizes (0: kernel default, which autotunes).
  int socket_buffer_bytes = 0;
  // Busy-poll this long before blocking in poll(2) (DESIGN.md section 9).
  absl::Duration spin = absl::Microseconds(30);
  // The secret every rank-to-rank connection proves at the rendezvous (Note [rank authentication] in
  // tcp_rendezvous.cc; tcp_auth.h says what it protects against): normally the Store's token. Empty:
  // SHARDKIT_STORE_TOKEN if set (resolve_tcp_group_options), else none. Every rank of a group needs the same token.
  std::string token = {};
  // Transport of each pair of ranks (shm_rendezvous.h): "auto" (shared memory between ranks on one host, TCP
  // between hosts), "tcp" or "shm" (every rank on this host, else InvalidArgument). Empty: SHARDKIT_TRANSPORT
  // if set (resolve_tcp_group_options), else auto.
  std::string transport = {};
  // Bytes of each shared-memory ring (one per direction and pair on a host; at least 16). 1 MiB: four 256 KiB
  // chunks in flight (bench/comm_bench_shm.cc). Tests use tiny rings so that bytes and elements wrap around
  // the ring's end.
  std::size_t shm_ring_bytes = 1u << 20;
  // Single copy over shared memory (Note [shm single copy] in shm_transport.cc): sends of at least
  // shm_single_copy_min_bytes are read by the peer straight out of this rank's memory (process_vm_readv) instead
  // of through the ring, where the rendezvous' probe shows the kernel allows it. Unset: SHARDKIT_SHM_SINGLE_COPY
  // (1/on/true or 0/off/false) if set (resolve_tcp_group_options), else off: on the VMs measured it is slower
  // than the ring (process_vm_readv pins the sender's pages one by one; README, comm_bench).
  std::optional<bool> shm_single_copy = std::nullopt;
  std::size_t shm_single_copy_min_bytes = ShmPairOptions{}.single_copy_min_bytes;
  // Calls whose tensor has at least this many bytes write what they copy into place past the caches
  // (non-temporal stores: Note [streaming copies] in stream_runner.cc); smaller results stay in cache for their
  // reader. Tests lower it so that small tensors take that path.
  std::size_t streaming_copy_min_bytes = std::size_t{16} << 20;
  // Testing seam: this rank's host identity (empty: the real one, shm_rendezvous.h); tests pretend hosts.
  std::string host_id = {};
};

// The options create() uses: `token`, `transport` and `shm_single_copy` filled in from SHARDKIT_STORE_TOKEN /
// SHARDKIT_TRANSPORT / SHARDKIT_SHM_SINGLE_COPY where empty, then checked (chunk_bytes > 0, shm_ring_bytes >= 16, a transport parse_transport_choice knows);
// InvalidArgument naming the setting otherwise. init_from_env calls it before it touches the store, so a bad
// setting is reported by every rank as itself, never as a store connection that rank 0 dropped.
absl::StatusOr<TcpProcessGroupOptions> resolve_tcp_group_options(TcpProcessGroupOptions options);

class TcpProcessGroup final : public ProcessGroup {
 public:
  // Connects rank `rank` of `size` to its peers through `store` (every rank calls it with the same
  // prefix, equally often: the k-th calls of the ranks form one group). Fails with DeadlineExceeded naming
  // the ranks that did not show up.
  static absl::StatusOr<std::shared_ptr<TcpProcessGroup>> create(std::shared_ptr<Store> store, int rank, int size,
                                                                 TcpProcessGroupOptions options = {});
  ~TcpProcessGroup() override;

  // The transports of this rank's pairs: "shm" (every pair over shared memory), "tcp" (every pair over TCP, or
  // no pair: a group of one) or "tcp+shm" (both). Ranks of one group can differ: with two ranks on host A and one
  // on host B, A's ranks report "tcp+shm" and B's "tcp".
  std::string backend_name() const override;
  void abort(const absl::Status& reason) override;
  const TcpProcessGroupOptions& options() const { return options_; }
  // The transport to group rank `peer`: "shm" or "tcp" (empty for this rank).
  const std::string& transport_to(int peer) const { return kinds_.at(static_cast<std::size_t>(peer)); }
  // The Store key a failing rank posts its reason under before it shuts its connections; the others quote it
  // (and a Watchdog hands it over before the Store's host exits: WatchdogOptions::failure_key).
  std::string failure_key() const;

  // Testing seam (none by default): `hook` runs on the communication thread after it has taken a call off the
  // queue and before it runs it, with a function that blocks until this group's destruction has begun. Tests
  // hold a call in that window with it. Set it before issuing calls.
  using AfterDequeueHook = std::function<void(const std::function<void()>& wait_for_destruction)>;
  void set_testing_after_dequeue(AfterDequeueHook hook);

 protected:
  std::shared_ptr<Work> run(CollectiveCall call) override;
  absl::StatusOr<std::shared_ptr<ProcessGroup>> make_subgroup(std::vector<int> members, const std::string& key,
                                                              const std::string& name, absl::Duration default_timeout,
                                                              absl::Time deadline) override;

 private:
  TcpProcessGroup(std::shared_ptr<Store> store, int rank, int size, std::vector<int> global_ranks,
                  TcpProcessGroupOptions options);
  absl::Status connect_mesh(absl::Time deadline);
  void comm_loop();
  absl::Status execute(const CollectiveCall& call);
  // Shuts every connection down (wakes the comm thread and tells the peers).
  void shutdown_pairs();
  // Records `reason` as the group's failure (first wins) and posts it to the store.
  absl::Status fail_group(const absl::Status& reason, bool post);
  std::string progress_note() const;

  std::shared_ptr<Store> store_;
  TcpProcessGroupOptions options_;
  std::vector<std::unique_ptr<Pair>> peers_;  // by group rank; peers_[rank()] null
  std::vector<std::string> kinds_;            // by group rank: "shm", "tcp", empty for this rank
  std::vector<std::int64_t> sends_to_;      // p2p sequence numbers per peer (comm thread only)
  std::vector<std::int64_t> recvs_from_;
  struct Impl;
  std::unique_ptr<Impl> impl_;              // scratch buffers (comm thread only)

  mutable std::mutex mu_;
  std::condition_variable cv_;
  struct Item {
    CollectiveCall call;
    std::shared_ptr<CompletionWork> work;
  };
  std::deque<Item> queue_;                  // guarded by mu_
  std::atomic<bool> store_unreachable_{false};  // set when a failure-path store call failed
  std::atomic<int> queued_{0};              // queue_.size(), readable without mu_ (comm thread's spin)
  bool stopping_ = false;                   // guarded by mu_
  absl::Status failure_;                    // guarded by mu_; first failure of the group
  std::string current_;                     // guarded by mu_; what the comm thread is waiting for
  std::string keys_;                        // this group's store keys: "<store_prefix>/<generation>"
  bool running_ = false;                    // guarded by mu_; the comm thread holds a call taken off queue_
  AfterDequeueHook after_dequeue_;          // guarded by mu_
  std::thread thread_;
};

}  // namespace shardkit::comm
