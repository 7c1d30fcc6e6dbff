#include "tools/shardkit_train/metrics_log.h"

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace shardkit::train {

std::string metrics_json(const StepRecord& r) {
  nlohmann::ordered_json memory = nlohmann::ordered_json::object();
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    memory[std::string(memory_category_name(static_cast<MemoryCategory>(c)))] = r.memory_peak[static_cast<std::size_t>(c)];
  }
  const nlohmann::ordered_json j = {
      {"strategy", strategy_name(r.strategy)},
      {"ranks", r.ranks},
      {"step", r.step},
      {"steps", r.steps},
      {"loss", r.loss},
      {"lr", r.lr},
      {"tokens", r.tokens},
      {"step_seconds", r.step_seconds},
      {"tokens_per_s", r.step_seconds > 0 ? static_cast<double>(r.tokens) / r.step_seconds : 0.0},
      {"elapsed_s", r.elapsed_seconds},
      {"memory", memory},
  };
  return j.dump();
}

absl::StatusOr<MetricsLog> MetricsLog::open(const std::string& path) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::FailedPreconditionError(absl::StrCat("cannot write the metrics log '", path, "'"));
  return MetricsLog(path, std::move(out));
}

absl::Status MetricsLog::write(const StepRecord& r) {
  out_ << metrics_json(r) << '\n';
  out_.flush();
  if (!out_) return absl::FailedPreconditionError(absl::StrCat("cannot write the metrics log '", path_, "'"));
  return absl::OkStatus();
}

}  // namespace shardkit::train
