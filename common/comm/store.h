// Store: the small key-value service ranks use to meet (rendezvous), exchange bootstrap data (NCCL unique
// ids, TCP addresses), count arrivals and report failures (DESIGN.md section 2).
//
// Values are byte strings. Every call that can wait takes a deadline and returns DeadlineExceeded naming
// the keys it was waiting for; nothing blocks forever. Implementations: HashStore (in process, for
// simulated ranks) and TcpStore (Boost.Asio; one rank or a standalone process serves).
//
// Thread-safety: every method may be called concurrently from several threads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shardkit::comm {

class Store {
 public:
  virtual ~Store() = default;

  // Sets key to value (overwrites) and wakes waiters on key.
  virtual absl::Status set(const std::string& key, const std::string& value) = 0;
  // Waits until key exists (up to timeout), then returns its value. Every timeout is valid (get and wait):
  // zero or negative does not wait; an infinite or huge one is a deadline in the far future (TcpStore
  // clamps it to tcp_store_protocol::kMaxTimeoutMs, about 35 years; it never overflows).
  virtual absl::StatusOr<std::string> get(const std::string& key, absl::Duration timeout) = 0;
  // Atomically adds delta to the integer stored at key (missing = 0) and returns the new value.
  // InvalidArgument naming the key, with the value unchanged, when the stored value is not a decimal
  // integer or the sum would leave int64 (never wraps).
  virtual absl::StatusOr<std::int64_t> add(const std::string& key, std::int64_t delta) = 0;
  // True when every key exists, without waiting.
  virtual absl::StatusOr<bool> check(const std::vector<std::string>& keys) = 0;
  // Removes key; returns whether it existed.
  virtual absl::StatusOr<bool> delete_key(const std::string& key) = 0;
  // Waits until every key exists, up to timeout.
  virtual absl::Status wait(const std::vector<std::string>& keys, absl::Duration timeout) = 0;
};

}  // namespace shardkit::comm
