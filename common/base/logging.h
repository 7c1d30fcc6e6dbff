// A small levelled logger. Library code never prints directly (DESIGN.md section 7); it logs here.
//
// The threshold comes from the Logger options a program installs (default: warnings and errors to
// stderr). The sink is per Logger instance; `default_logger()` is the one the library uses and is
// configured once by the program at start-up (before ranks start), never from inside the library.
// Thread-safe: each record is written with a single write under a mutex.
#pragma once

#include <functional>
#include <string_view>

#include "absl/strings/str_cat.h"

namespace shardkit {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kOff = 4 };

struct LoggerOptions {
  LogLevel threshold = LogLevel::kWarning;
  // Receives each formatted line (without trailing newline). Empty: write to stderr.
  std::function<void(LogLevel, std::string_view)> sink;
};

class Logger {
 public:
  explicit Logger(LoggerOptions options = {});
  void set_options(LoggerOptions options);
  bool enabled(LogLevel level) const;
  void log(LogLevel level, std::string_view message);

 private:
  LoggerOptions options_;
};

// The logger the library writes to.
Logger& default_logger();

}  // namespace shardkit

#define SK_LOG(level, ...)                                                   \
  do {                                                                       \
    auto& sk_logger_ = ::shardkit::default_logger();                        \
    if (sk_logger_.enabled(::shardkit::LogLevel::level))                     \
      sk_logger_.log(::shardkit::LogLevel::level, absl::StrCat(__VA_ARGS__)); \
  } while (0)
