// shardkit-train --log FILE.jsonl: the per-step metrics a plotting tool reads (issue 19).
//
// Note [metrics log]
// One JSON object per line (JSON Lines), one line per optimizer step, written by rank 0 as the step ends and
// flushed, so `tail -f` and a notebook polling the file see each step as it lands:
//   {"strategy":"oss","ranks":4,"step":3,"steps":300,"loss":4.83,"lr":0.0003,"tokens":1024,
//    "step_seconds":0.0102,"tokens_per_s":100392.2,"elapsed_s":0.031,
//    "memory":{"parameter":482304,"gradient":482304,"optimizer_state":241152,"activation":...,
//              "communication_buffer":...,"other":...}}
// - loss: the mean over every rank of this step's loss (the value the progress line shows); lr: the learning
//   rate this step used (warmup + cosine).
// - tokens: global tokens of the step; step_seconds: rank 0's wall time of the step without the display
//   all_reduce; tokens_per_s = tokens / step_seconds (this step alone, not a running mean).
// - memory: rank 0's ledger, the peak bytes of each category during this step (the report's table shows the
//   largest over the steps, and every rank).
// With --compare every strategy's steps go to the one file, told apart by "strategy". The file is created
// (truncated) before any rank starts, so a path that cannot be written is an error up front, not after
// training. Values are written with a JSON library, never by hand; a non-finite loss never reaches the log
// (the run stops first, Note [non-finite loss] in trainer.cc).
#pragma once

#include <array>
#include <cstdint>
#include <fstream>
#include <string>

#include "absl/status/statusor.h"
#include "common/tensor/memory_tracker.h"
#include "tools/shardkit_train/options.h"

namespace shardkit::train {

// What rank 0 knows when a step ends: the progress line and the metrics log are both made from it.
struct StepRecord {
  Strategy strategy = Strategy::oss;
  int ranks = 1;
  std::int64_t step = 0;   // 1-based
  std::int64_t steps = 0;  // --steps
  double loss = 0;
  double lr = 0;
  std::int64_t tokens = 0;       // global, this step
  double step_seconds = 0;       // rank 0, this step, without the display all_reduce
  double elapsed_seconds = 0;    // since the first step of this run started
  double mean_tokens_per_s = 0;  // over the steps of this run so far
  double eta_seconds = 0;
  std::array<std::int64_t, kNumMemoryCategories> memory_peak{};  // rank 0's ledger, this step
};

class MetricsLog {
 public:
  // Creates or truncates `path`. FailedPrecondition naming the path when it cannot be opened for writing.
  static absl::StatusOr<MetricsLog> open(const std::string& path);

  // Appends one line and flushes. FailedPrecondition when the write fails (disk full, file gone read-only).
  absl::Status write(const StepRecord& r);

 private:
  MetricsLog(std::string path, std::ofstream out) : path_(std::move(path)), out_(std::move(out)) {}
  std::string path_;
  std::ofstream out_;
};

// The line `write` appends (without its newline), for tests.
std::string metrics_json(const StepRecord& r);

}  // namespace shardkit::train
