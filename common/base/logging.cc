#include "common/base/logging.h"

#include <cstdio>
#include <mutex>
#include <string>

namespace shardkit {
namespace {
const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "D";
    case LogLevel::kInfo: return "I";
    case LogLevel::kWarning: return "W";
    case LogLevel::kError: return "E";
    case LogLevel::kOff: break;
  }
  return "?";
}
std::mutex& WriteMutex() {
  static std::mutex m;
  return m;
}
}  // namespace

Logger::Logger(LoggerOptions options) : options_(std::move(options)) {}

void Logger::set_options(LoggerOptions options) { options_ = std::move(options); }

bool Logger::enabled(LogLevel level) const { return level >= options_.threshold && level != LogLevel::kOff; }

void Logger::log(LogLevel level, std::string_view message) {
  std::lock_guard<std::mutex> lock(WriteMutex());
  if (options_.sink) {
    options_.sink(level, message);
    return;
  }
  std::string line = absl::StrCat("[shardkit ", LevelName(level), "] ", std::string(message), "\n");
  std::fwrite(line.data(), 1, line.size(), stderr);
}

Logger& default_logger() {
  // Configured by the program before ranks start; not mutated by the library.
  static Logger logger;
  return logger;
}

}  // namespace shardkit
