// The training run behind shardkit-train: every rank builds the same GPT, trains it with one strategy on
// its slice of each global batch, and rank 0 collects what the report shows (issue 7).
//
// Ranks are threads of this process (run_threads: an InProcessWorld, one RankContext and MemoryTracker per
// thread) or this process is one rank of a TCP group started by tools/shardrun (run_process:
// comm::init_from_env). The per-rank loop (train_rank) is the same code in both cases, so the same seed
// gives the same losses up to the backends' fp32 summation order.
//
// Strategies (Note [strategies in shardkit-train]):
//   ddp:  full AdamW on every rank; sddp::DistributedDataParallel all-reduces gradient buckets during
//         backward (ZeRO-0: 16 bytes of model state per parameter on every rank).
//   oss:  ZeRO-1: full gradients on every rank, copied into flat buffers (one per chunk of the flat
//         partition) and reduce-scattered so each rank receives the average of the ranges it owns;
//         oss::Oss steps that 1/N share of the optimizer state and all-gathers the updated parameters
//         (2Psi elements sent per step, as DDP; the flat buffers cost 4Psi bytes of communication_buffer).
//   sddp: sddp::ShardedDataParallel over the same Oss: gradient buckets are reduce-scattered into the owned
//         slices during backward and full-size gradients are released (ZeRO-2).
//   fsdp: fsdp::fully_shard on every transformer block, then the model (the root): parameters sharded too,
//         gathered per unit around its forward and backward (ZeRO-3); each rank checkpoints its rows
//         (fsdp::sharded_state_dict / sharded_optimizer_state, Note [checkpoint format] in checkpoint.h), which
//         load into any strategy at any world size (also under --precision bf16: the masters are f32).
// Without the sddp layer (an older tree) ddp / oss fall back to one all_reduce per gradient after
// backward, and sddp is not offered.
// --precision bf16: mixed precision for every strategy (Note [mixed precision on f32 ops] in
// common/nn/mixed_precision.h): forward and backward compute with the parameters' values rounded to bf16, gradients
// are reduced in bf16 and land f32, the parameters stay the f32 masters AdamW steps. ddp / sddp:
// DataParallelOptions::mixed_precision {bf16, bf16}; oss: nn::MixedPrecisionHooks for the forward and a bf16 flat
// buffer for its reduce-scatter; fsdp: FullyShardOptions::mp_policy {bf16, bf16} on every unit (the all-gathers
// move bf16 too). OSS's all-gather of updated parameters stays f32 (OssOptions::broadcast_dtype would round the
// owners' masters). The memory table prints this implementation's formulas next to DESIGN.md's mixed-precision
// column (Note [mixed-precision memory in shardkit-train] in report.cc).
//
// --checkpoint-activations: nn::checkpoint_blocks on every rank's model before the runner wraps or shards it.
//
// Measurements, per rank: per-category peak bytes of the ledger over the training steps (peaks restart
// at each step; checkpoint work between steps is not counted, and only steps up to the first checkpoint
// count, a rule from the consolidated checkpoints of earlier versions, after which Oss kept the full state on
// rank 0; sharded checkpoints free their copies before the next step), bytes
// sent per step from the
// ProcessGroup's counters (only the step's own collectives: the loss average for display is excluded).
//
// Weights in and out: --init-from loads GPT-2 weights into every rank's model before the runner shards it;
// --export writes them after the last step, outside the measured steps (Note [--export and --init-from] in
// model_files.h).
//
// Divergence: a non-finite loss stops the run on every rank at the same step, before that step updates
// the parameters, with an error naming the step and the loss; a checkpoint holding inf or NaN is never
// written (Note [non-finite loss] in trainer.cc).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/nn/module.h"
#include "common/tensor/memory_tracker.h"
#include "tools/shardkit_train/checkpoint.h"
#include "tools/shardkit_train/corpus.h"
#include "tools/shardkit_train/metrics_log.h"
#include "tools/shardkit_train/options.h"

namespace shardkit::train {

struct RankStats {
  std::array<std::int64_t, kNumMemoryCategories> peak{};  // bytes, max over step windows
  std::int64_t bytes_sent_per_step = 0;                    // mean over the steps run
  std::int64_t owned_numel = 0;                            // elements of optimizer state this rank owns
  // --checkpoint-activations: the activation peak of one more forward + backward without checkpointing
  // (Note [activation peak without checkpointing] in trainer.cc); -1 when not measured.
  std::int64_t activation_peak_without_checkpointing = -1;
  // --compile: the activation peak of the replayed steps (every step after the run's first, whose capture holds
  // every value of the step while it records); -1 when no step was replayed.
  std::int64_t activation_peak_replayed = -1;
};

struct RunResult {
  Strategy strategy = Strategy::oss;
  int world = 1;
  std::int64_t num_params = 0;
  std::int64_t start_step = 0;          // > 0 after --resume
  std::vector<double> losses;           // mean loss over all ranks, one per step run
  std::vector<RankStats> ranks;
  double seconds_per_step = 0;          // mean wall time of a step on rank 0 (first step excluded)
  double total_seconds = 0;
  std::int64_t tokens_per_step = 0;     // global
  std::string sample;                   // generated text (rank 0)
  std::uint64_t param_digest = 0;       // FNV-1a 64 of every parameter's bytes at the end
  std::string backend;                  // "in-process threads" / "tcp"
  std::string compiled_graph;           // --compile: rank 0's graph summary (Note [--compile] in trainer.cc)
};

// Called on rank 0 after each step (the progress line, the --log file). An error stops the run on every rank.
using StepObserver = std::function<absl::Status(const StepRecord&)>;

// Checks that a checkpoint fits this run (model config, data, seed); the one-line error otherwise.
absl::Status check_resumable(const Checkpoint& ckpt, const Options& options, const ModelSize& model, const Corpus& corpus);

// `init`: weights every rank loads into its model before sharding it (--init-from: read_init_weights in
// model_files.h); nullptr: the seed's. With options.export_path the run writes the weights after the last step
// (Note [--export and --init-from]).
absl::StatusOr<RunResult> run_threads(const Options& options, Strategy strategy, const Corpus& corpus,
                                      const Checkpoint* resume, const StepObserver& observe,
                                      const nn::StateDict* init = nullptr);
// This process is one rank (RANK / WORLD_SIZE set by shardrun). Rank 0 gets the full result; others an
// empty one (nullopt).
absl::StatusOr<std::optional<RunResult>> run_process(const Options& options, Strategy strategy, const Corpus& corpus,
                                                     const Checkpoint* resume, const StepObserver& observe,
                                                     const nn::StateDict* init = nullptr);

}  // namespace shardkit::train
