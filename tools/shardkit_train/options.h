// shardkit-train's command line: what a run trains, how, and where it writes (issue 7).
//
// parse_options() turns argv into Options or an InvalidArgument whose message is the one line the tool
// prints ("expected --strategy ddp, oss or sddp, found 'foo'"). It checks only what can be checked without
// touching files; data files and checkpoint directories are checked by the trainer before any rank starts.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/nn/gpt.h"

namespace shardkit::train {

enum class Strategy { ddp, oss, sddp, fsdp };
enum class Precision { fp32, bf16 };
// How process ranks talk (ignored for threads). automatic: init_from_env's group, shared memory between ranks on
// one host and TCP between hosts (shm_rendezvous.h); tcp / shm: that transport for every pair; mpi: the MPI
// backend (under mpirun).
enum class Backend { automatic, tcp, shm, mpi };

std::string strategy_name(Strategy s);
// The run header's words for how the ranks talk: "threads" unless `processes`; else "processes, TCP",
// "processes, shared memory", "processes, MPI", or for automatic "processes, shared memory on a host, TCP
// between hosts".
std::string backend_label(Backend b, bool processes);
// The strategies this build has (sddp / fsdp only when those layers are built).
std::vector<Strategy> available_strategies();

struct ModelSize {
  std::string name;  // the --model name, followed by the shape flags that changed it ("small --layers 4")
  nn::GPTConfig config;
};

// The shape flags: each replaces one field of the named --model's config; unset keeps the named value.
struct ModelShape {
  std::optional<std::int64_t> layers, width, heads, context;
};

// The --model names: tiny / small / base (vocab 256, made for bytes) and nn::GPTConfig's named configs whose
// vocabulary holds every byte (gpt-1m, gpt-10m, gpt-100m, gpt2-small: GPT-2 small's shape, 124,439,808
// parameters); their unused token rows are trained like the others. gpt-10k / gpt-100k (vocab 64 / 128) are
// refused: bytes need 256 tokens.
std::vector<std::string> model_names();

// The named config with `shape` applied, checked: heads divide width, each flag within its limit below.
// InvalidArgument naming the flag otherwise.
absl::StatusOr<ModelSize> model_size(const std::string& name, const ModelShape& shape);

// Limits of the shape flags. They keep every count in int64 (batch x context x world <= 2^16 x 2^14 x 2^31),
// not a promise that such a model fits in memory: a model's bytes are printed before it is built.
inline constexpr std::int64_t kMaxLayers = 1024;
inline constexpr std::int64_t kMaxWidth = 65536;
inline constexpr std::int64_t kMaxContext = 16384;

// The largest --batch (sequences per rank per step). With the largest context (kMaxContext) and --ranks (64,
// or WORLD_SIZE, an int), batch x context x world stays far below INT64_MAX, so token counts never overflow;
// the activations of a batch this size are already far more than a machine of this project's kind holds.
inline constexpr std::int64_t kMaxBatch = 65536;
// The largest --data file (it is read whole into memory) and --sample (generation runs one forward per byte).
inline constexpr std::int64_t kMaxDataBytes = std::int64_t{1} << 30;  // 1 GiB
inline constexpr std::int64_t kMaxSampleBytes = 65536;

struct Options {
  Strategy strategy = Strategy::oss;
  int ranks = 4;              // simulated ranks (threads); WORLD_SIZE when started by shardrun
  std::string model = "small";
  ModelShape shape;           // --layers --width --heads --context
  std::string log;            // --log FILE.jsonl: one JSON object per step (Note [metrics log]); empty: none
  // Note [--export and --init-from] (model_files.h); empty: none.
  std::string export_path;    // --export FILE.safetensors | DIR: GPT-2 weights after the last step
  std::string init_from;      // --init-from FILE.safetensors | INDEX.json | DIR: GPT-2 weights to start from
  std::int64_t steps = 300;
  std::int64_t batch = 4;     // sequences per rank per step, in [1, kMaxBatch]
  double lr = 3e-3;
  Precision precision = Precision::fp32;
  Backend backend = Backend::automatic;  // --backend tcp|shm|mpi
  std::uint64_t seed = 1;
  std::string data;           // empty: the embedded corpus
  std::string checkpoint_dir; // empty: no checkpoints
  std::int64_t checkpoint_every = 50;
  bool resume = false;
  // --overwrite: a checkpoint already in --checkpoint-dir (of another run) may be replaced; without it (or
  // --resume) such a directory is refused.
  bool overwrite = false;
  bool compare = false;
  // --checkpoint-activations: every transformer block checkpointed (nn::checkpoint_blocks): its activations are
  // recomputed in backward; the report shows the activation peak with it and without it (Note [activation peak
  // without checkpointing] in trainer.cc).
  bool checkpoint_activations = false;
  // --compile: the step is captured on the first call and replayed (Note [--compile] in trainer.cc).
  bool compile = false;
  std::string svg = "shardkit-compare.svg";
  std::int64_t sample_bytes = 160;  // --sample, in [0, kMaxSampleBytes]
  // --timeout S: every collective's deadline (threads and processes; over SHARDKIT_TIMEOUT); empty: the default.
  std::optional<absl::Duration> timeout;
  // Test-only: the process SIGKILLs itself right after this step (a kill between steps). 0: never.
  std::int64_t stop_after_step = 0;
  // Test-only (--test-kill-checkpoint-write shard|manifest:BYTES): each checkpoint write SIGKILLs the process
  // after BYTES bytes of its rank file ("shard") or of the manifest; empty: never.
  std::string kill_checkpoint_file;
  std::int64_t kill_checkpoint_bytes = -1;
  // Test-only (--test-checkpoint-consolidated): rank 0 gathers the full state and writes every piece (the
  // reference the sharded layout is compared with).
  bool checkpoint_consolidated = false;
  bool help = false;
};

absl::StatusOr<Options> parse_options(const std::vector<std::string>& args);
std::string usage();

}  // namespace shardkit::train
