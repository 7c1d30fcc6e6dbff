#include "common/base/check.h"

namespace shardkit::detail {

CheckFailure::CheckFailure(const char* file, int line, const std::string& what)
    : head_(std::string(file) + ":" + std::to_string(line) + ": " + what) {}

CheckFailure::~CheckFailure() noexcept(false) {
  std::string msg = head_;
  const std::string extra = extra_.str();
  if (!extra.empty()) msg += ": " + extra;
  throw InternalError(msg);
}

}  // namespace shardkit::detail
