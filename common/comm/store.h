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
  // Waits until key exists (up to timeout), then returns its value.
  virtual absl::StatusOr<std::string> get(const std::string& key, absl::Duration timeout) = 0;
  // Atomically adds delta to the integer stored at key (missing = 0) and returns the new value.
  virtual absl::StatusOr<std::int64_t> add(const std::string& key, std::int64_t delta) = 0;
  // True when every key exists, without waiting.
  virtual absl::StatusOr<bool> check(const std::vector<std::string>& keys) = 0;
  // Removes key; returns whether it existed.
  virtual absl::StatusOr<bool> delete_key(const std::string& key) = 0;
  // Waits until every key exists, up to timeout.
  virtual absl::Status wait(const std::vector<std::string>& keys, absl::Duration timeout) = 0;
};

}  // namespace shardkit::comm
