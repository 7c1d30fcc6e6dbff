#include "common/comm/completion_work.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace shardkit::comm {

bool CompletionWork::complete(absl::Status status) {
  absl::MutexLock lock(&mu_);
  if (done_) return false;
  done_ = true;
  status_ = std::move(status);
  return true;
}

absl::Status CompletionWork::wait(absl::Duration timeout) {
  const absl::Time wait_until = timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
  const absl::Time until = std::min(wait_until, deadline_);
  {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithDeadline(absl::Condition(&done_), until);
    if (done_) return status_;
  }
  if (until == deadline_ && on_deadline_ && absl::Now() >= deadline_) {
    complete(on_deadline_());
    absl::MutexLock lock(&mu_);
    return status_;
  }
  return absl::DeadlineExceededError(
      absl::StrCat("Work::wait timed out after ", absl::FormatDuration(timeout), "; the call is still pending"));
}

bool CompletionWork::is_completed() const {
  absl::MutexLock lock(&mu_);
  return done_;
}

std::optional<absl::Status> CompletionWork::status() const {
  absl::MutexLock lock(&mu_);
  if (!done_) return std::nullopt;
  return status_;
}

}  // namespace shardkit::comm
