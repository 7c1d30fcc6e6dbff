// Watchdog: finds a rank that stopped (SIGSTOP, a hung host, a process frozen in the kernel) within seconds and
// names it on every other rank, instead of each survivor blaming its neighbours when a collective deadline
// passes minutes later (issue 17 item 3; NCCL's watchdog and c10d's monitored barrier are the anchors).
//
// Note [heartbeats]
// Each rank's watchdog thread bumps its counter "<prefix>/hb/<rank>" in the Store every `interval` and reads every
// other rank's counter. A counter that has not moved for `window` (timed on this rank's own clock: no clock
// agreement between hosts is needed) belongs to a stalled rank. The first rank to notice posts the verdict to
// "<prefix>/stalled" (the stalled rank, the window) unless a verdict is there already, and every watchdog, on
// seeing a verdict or its own finding, aborts its group with
//   Aborted: "watchdog: rank 2 stopped: no heartbeat for 3s (pid 4711 on host-a)"
// so every survivor names the same rank, and its pending and later calls fail at once (process_group.h, Note
// [group failure]). The watchdog thread makes no collective calls, so it keeps beating while its rank is blocked
// in one; it stops only when the process stops. A rank that is alive but never reaches the next collective (an
// endless loop in user code) keeps beating: that is the collective deadline's job.
//
// start() beats once before it returns; a rank is judged only once its first beat has been seen, so one that
// never starts is the rendezvous's (or the collective deadline's) to report.
//
// Note [verdict hand-over]
// A survivor whose collective fails because a peer aborted (the peer closed its connections) finds the origin in
// the Store ("<group keys>/abort", posted before the peer shut its sockets; tcp_process_group.cc). The Store
// usually lives in rank 0's process, and rank 0 is a survivor too: once its own call fails with the verdict its
// program reports it and exits, taking the Store along, perhaps before a slower survivor has read why its
// connection to rank 0 closed (it then named "connection to rank 0 lost" instead of the stopped rank). So the
// verdict is handed over before the Store goes: the finder also posts the stalled rank under "<prefix>/stalled/
// rank"; every watchdog, when destroyed (its program is done with the group) after a verdict was posted, says so
// under "<prefix>/done/<rank>"; and the destructor on the rank hosting the Store (verdict_linger > 0) waits up to
// verdict_linger for "done" from every rank but itself and the stalled one. A failure the group posted itself
// (WatchdogOptions::failure_key: a rank's own error, posted before it shut its connections) is handed over the same
// way, with every other rank waited for: the survivors quote it instead of "connection to rank 0 lost". A rank whose
// heartbeat has not moved for a quarter of the window (at least 3 intervals: killed by the failure, or stopped) is no
// longer waited for. Nothing
// waits when neither was posted, and a survivor that never finishes (still busy) costs the host at most
// verdict_linger.
//
// Cost: per interval, one `add` and size-1 `get`s on the Store per rank (N² small requests per interval over the
// job: fine for the tens of ranks this library runs; a tree of watchers would be next).
//
// Thread-safety: the destructor stops the thread (then hands a verdict over, Note [verdict hand-over]); status()
// may be called from any thread.
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/comm/process_group.h"
#include "common/comm/store.h"

namespace shardkit::comm {

struct WatchdogOptions {
  absl::Duration interval = absl::Milliseconds(500);  // heartbeat period
  absl::Duration window = absl::Seconds(5);           // a counter still for this long: the rank has stalled
  std::string prefix = "watchdog";                     // Store keys; one prefix per group watched
  // On the rank whose process hosts the Store: how long the destructor waits, after a verdict, for the other
  // survivors to be done with it (Note [verdict hand-over]); zero elsewhere. init_from_env sets it to `window`.
  absl::Duration verdict_linger = absl::ZeroDuration();
  // The Store key the watched group posts its failure under (TcpProcessGroup::failure_key()); when present at
  // destruction it is handed over as a verdict is (Note [verdict hand-over]). Empty: none.
  std::string failure_key = {};
};

class Watchdog {
 public:
  // Starts watching `group` (rank `group->rank()` of `group->size()`, its peers reachable through `store`).
  // InvalidArgument when window <= 2 * interval (a single late beat would look like a stall).
  static absl::StatusOr<std::unique_ptr<Watchdog>> start(std::shared_ptr<Store> store,
                                                          std::weak_ptr<ProcessGroup> group, int rank, int size,
                                                          WatchdogOptions options = {});
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // OK while every rank beats; the Aborted status the group was aborted with once one stalled.
  absl::Status status() const;

  // Tests: stop beating (as a stopped process would) while still watching the others.
  void pause_heartbeat_for_testing();

 private:
  Watchdog(std::shared_ptr<Store> store, std::weak_ptr<ProcessGroup> group, int rank, int size,
           WatchdogOptions options);
  void loop();
  // Aborts the group with `verdict` (once).
  void blame(const std::string& verdict);
  // Note [verdict hand-over]: after a verdict, says this rank is done with it and, on the Store's host, waits
  // (up to verdict_linger) for the other survivors to say so too.
  void hand_over_verdict();

  std::shared_ptr<Store> store_;
  std::weak_ptr<ProcessGroup> group_;
  int rank_;
  int size_;
  WatchdogOptions options_;
  std::string identity_;  // "pid 4711 on host-a", published next to the counter

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  bool store_lost_ ABSL_GUARDED_BY(mu_) = false;  // this rank's last beat did not reach the Store
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// c10d's monitored_barrier over a Store: every rank of `size` arrives under `key` (unique per barrier, the same on
// every rank); rank 0 waits up to `timeout` for the others and then every rank returns the same result: OK, or
// DeadlineExceeded "monitored_barrier 'key': ranks 2, 5 of 8 did not arrive within 10s" (all the missing ranks,
// not only the first). Non-zero ranks wait for rank 0's verdict up to twice `timeout`.
absl::Status monitored_barrier(Store& store, int rank, int size, const std::string& key, absl::Duration timeout);

}  // namespace shardkit::comm
