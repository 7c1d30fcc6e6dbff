// shardkit-train's command line: what a run trains, how, and where it writes (issue 7).
//
// parse_options() turns argv into Options or an InvalidArgument whose message is the one line the tool
// prints ("expected --strategy ddp, oss or sddp, found 'foo'"). It checks only what can be checked without
// touching files; data files and checkpoint directories are checked by the trainer before any rank starts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/nn/gpt.h"

namespace shardkit::train {

enum class Strategy { ddp, oss, sddp, fsdp };
enum class Precision { fp32, bf16 };

std::string strategy_name(Strategy s);
// The strategies this build has (sddp / fsdp only when those layers are built).
std::vector<Strategy> available_strategies();

struct ModelSize {
  std::string name;  // tiny, small, base
  nn::GPTConfig config;
};
// tiny / small / base: byte-level GPTs (vocab 256). NotFound-style InvalidArgument for another name.
absl::StatusOr<ModelSize> model_size(const std::string& name);

// The largest --batch (sequences per rank per step). With the largest context (128) and --ranks (64, or
// WORLD_SIZE, an int), batch x context x world stays far below INT64_MAX, so token counts never overflow;
// the activations of a batch this size (8M tokens per rank for model base) are already more than a
// machine of this project's kind holds.
inline constexpr std::int64_t kMaxBatch = 65536;

struct Options {
  Strategy strategy = Strategy::oss;
  int ranks = 4;              // simulated ranks (threads); WORLD_SIZE when started by shardrun
  std::string model = "small";
  std::int64_t steps = 300;
  std::int64_t batch = 4;     // sequences per rank per step, in [1, kMaxBatch]
  double lr = 3e-3;
  Precision precision = Precision::fp32;
  std::uint64_t seed = 1;
  std::string data;           // empty: the embedded corpus
  std::string checkpoint_dir; // empty: no checkpoints
  std::int64_t checkpoint_every = 50;
  bool resume = false;
  bool compare = false;
  std::string svg = "shardkit-compare.svg";
  std::int64_t sample_bytes = 160;
  // Test-only: the process SIGKILLs itself right after this step (a kill between steps). 0: never.
  std::int64_t stop_after_step = 0;
  bool help = false;
};

absl::StatusOr<Options> parse_options(const std::vector<std::string>& args);
std::string usage();

}  // namespace shardkit::train
