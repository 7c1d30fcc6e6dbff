// CompletionWork: a Work completed by whoever runs the call (a backend's comm thread, a peer rank's
// thread), for backends to reuse.
//
// complete(status) may be called once (later calls are ignored). wait() blocks on an absl::Mutex
// condition until completion, the wait timeout, or the call's own deadline (if given at construction):
// when that deadline passes first, `on_deadline` is asked for the status to fail the call with (e.g. a
// DeadlineExceeded naming the missing peer; the backend also aborts the group there), and the Work
// completes with it.
//
// Thread-safety: all methods may be called concurrently.
#pragma once

#include <functional>
#include <optional>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/comm/process_group.h"

namespace shardkit::comm {

class CompletionWork : public Work {
 public:
  CompletionWork() = default;
  // on_deadline runs (in a waiting thread, without this Work's lock) when `deadline` passes before
  // completion; its status completes the Work (unless completion raced it).
  CompletionWork(absl::Time deadline, std::function<absl::Status()> on_deadline)
      : deadline_(deadline), on_deadline_(std::move(on_deadline)) {}

  // Completes the Work with `status`. Returns false if it was already complete.
  bool complete(absl::Status status);

  absl::Status wait(absl::Duration timeout = absl::InfiniteDuration()) override;
  bool is_completed() const override;

  // The status once completed, nullopt before.
  std::optional<absl::Status> status() const;

 private:
  mutable absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  absl::Time deadline_ = absl::InfiniteFuture();
  std::function<absl::Status()> on_deadline_;
};

}  // namespace shardkit::comm
