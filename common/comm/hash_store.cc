#include "common/comm/hash_store.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardkit::comm {

absl::Status HashStore::set(const std::string& key, const std::string& value) {
  absl::MutexLock lock(&mu_);
  map_[key] = value;
  return absl::OkStatus();
}

absl::StatusOr<std::string> HashStore::get(const std::string& key, absl::Duration timeout) {
  if (absl::Status st = wait({key}, timeout); !st.ok()) return st;
  absl::MutexLock lock(&mu_);
  auto it = map_.find(key);
  if (it == map_.end()) return absl::NotFoundError(absl::StrCat("store key '", key, "' was deleted while waiting"));
  return it->second;
}

absl::StatusOr<std::int64_t> HashStore::add(const std::string& key, std::int64_t delta) {
  absl::MutexLock lock(&mu_);
  std::int64_t value = 0;
  auto it = map_.find(key);
  if (it != map_.end() && !absl::SimpleAtoi(it->second, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("store add on key '", key, "': expected an integer value, found '", it->second, "'"));
  }
  std::int64_t sum = 0;
  if (__builtin_add_overflow(value, delta, &sum)) {
    return absl::InvalidArgumentError(absl::StrCat("store add on key '", key, "': expected a sum within int64, found ",
                                                   value, " + ", delta, " overflows (the value is unchanged)"));
  }
  map_[key] = absl::StrCat(sum);
  return sum;
}

absl::StatusOr<bool> HashStore::check(const std::vector<std::string>& keys) {
  absl::MutexLock lock(&mu_);
  for (const auto& k : keys) {
    if (!map_.contains(k)) return false;
  }
  return true;
}

absl::StatusOr<bool> HashStore::delete_key(const std::string& key) {
  absl::MutexLock lock(&mu_);
  return map_.erase(key) > 0;
}

absl::Status HashStore::wait(const std::vector<std::string>& keys, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto all_present = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& k : keys) {
      if (!map_.contains(k)) return false;
    }
    return true;
  };
  if (mu_.AwaitWithTimeout(absl::Condition(&all_present), timeout)) return absl::OkStatus();
  std::vector<std::string> missing;
  for (const auto& k : keys) {
    if (!map_.contains(k)) missing.push_back(k);
  }
  return absl::DeadlineExceededError(absl::StrCat("store wait: expected keys [", absl::StrJoin(missing, ", "),
                                                  "] within ", absl::FormatDuration(timeout), ", found none"));
}

}  // namespace shardkit::comm
