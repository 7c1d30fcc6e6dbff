// Test helper: reading shardkit-train's report out of its captured stdout.
#pragma once

#include <string>

namespace shardkit::testing {

// The rest of the line after the last occurrence of `key`, e.g. Field(out, "parameter digest: "); "" when absent.
inline std::string Field(const std::string& out, const std::string& key) {
  const std::size_t pos = out.rfind(key);
  if (pos == std::string::npos) return "";
  const std::size_t start = pos + key.size();
  return out.substr(start, out.find('\n', start) - start);
}

}  // namespace shardkit::testing
