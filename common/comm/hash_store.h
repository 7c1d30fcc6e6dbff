// HashStore: the in-process Store (store.h), for simulated ranks (threads) and tests.
//
// A hash map under one mutex; get() and wait() block on a condition until the keys exist or the
// timeout passes (DeadlineExceeded naming the missing keys). add() stores the decimal string of the
// counter, like TcpStore, so get() of an add()ed key returns e.g. "3"; add() on a key holding a
// non-integer value, or whose sum would leave int64, is InvalidArgument and leaves the value unchanged.
//
// Thread-safety: every method may be called concurrently.
#pragma once

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "common/comm/store.h"

namespace shardkit::comm {

class HashStore final : public Store {
 public:
  absl::Status set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> get(const std::string& key, absl::Duration timeout) override;
  absl::StatusOr<std::int64_t> add(const std::string& key, std::int64_t delta) override;
  absl::StatusOr<bool> check(const std::vector<std::string>& keys) override;
  absl::StatusOr<bool> delete_key(const std::string& key) override;
  absl::Status wait(const std::vector<std::string>& keys, absl::Duration timeout) override;

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::string> map_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardkit::comm
