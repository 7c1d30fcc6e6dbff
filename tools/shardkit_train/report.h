// What shardkit-train prints: the progress line, the end-of-run report (memory per rank by ledger category
// next to the ZeRO formula of the strategy, bytes communicated per step, a text sample), and --compare's
// table and SVG chart. Pure formatting: every function returns a string (or writes the named file).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tools/shardkit_train/options.h"
#include "tools/shardkit_train/trainer.h"

namespace shardkit::train {

// "step  40/150 [#####.....]  loss 2.8123  31.2k tok/s  ETA 12s". `bar` false: no bar (plain lines).
std::string progress_line(std::int64_t step, std::int64_t total, double loss, double tokens_per_s, double eta_s, bool bar);

// The header printed before training (model size, strategy, data, batch).
std::string run_header(const Options& options, Strategy strategy, const ModelSize& model, const Corpus& corpus,
                       int world, const std::string& backend);

// The report after a run (loss first/last, time, memory table with formulas, communication, sample).
std::string run_report(const Options& options, const RunResult& result);

// Expected bytes of a ledger category per rank for a strategy (DESIGN.md section 6), and the formula text; under
// bf16 this implementation's formula (Note [mixed-precision memory in shardkit-train] in report.cc). Categories
// without a formula (activation, communication_buffer, other) give -1.
struct Expected {
  std::int64_t bytes = -1;
  std::string formula;
};
Expected expected_bytes(Strategy s, MemoryCategory c, std::int64_t num_params, int world, std::int64_t owned_numel,
                        Precision precision = Precision::fp32);

std::string compare_table(const std::vector<RunResult>& results);
absl::Status write_compare_svg(const std::string& path, const std::vector<RunResult>& results);

// 1234567 -> "1,234,567".
std::string with_commas(std::int64_t v);

}  // namespace shardkit::train
