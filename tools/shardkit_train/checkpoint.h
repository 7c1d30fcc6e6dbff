// shardkit-train's checkpoints, on common/io's sharded checkpoint library (issue 17 item 4).
//
// Note [checkpoint format]
// --checkpoint-dir holds a common/io sharded checkpoint (Note [sharded checkpoint] in common/io/checkpoint.h):
// every rank writes the pieces of the state it holds to a file of its own, rank 0 commits DIR/manifest.json.
// Nothing is gathered to write it. Tensors:
//   "model/<state_dict name>"     the model's state (every name: GPT's tied "wte.weight" and "lm_head.weight")
//   "optim/<param name>/<key>"    the optimizer's state of a parameter ("exp_avg", "exp_avg_sq", "master" ...),
//                                 of the parameter's global shape
//   "optim/<param name>/step"     its step count (i64 scalar)
// A parameter's name is its first name in model.named_parameters(). Who writes what:
//   ddp        rank 0 everything (every rank holds the same state: the replicas are written once)
//   oss, sddp  rank 0 the model; every rank its Oss pieces of the optimizer state (ranges of the flattened
//              parameters, Note [flat chunks]); a parameter's step from the rank holding its first element
//   fsdp       every rank its rows of each sharded parameter and of its state (fsdp::sharded_state_dict,
//              fsdp::sharded_optimizer_state); rank 0 what is whole everywhere (buffers, unsharded parameters)
// Meta (strings): the run ("model", "model.*", "step", "seed", "data.*", "strategy", "world") and the optimizer
// ("optim.name", "optim.groups", per group g "optim.group.<g>.hyper" and "optim.group.<g>.params": the
// parameter names in the optimizer's order, which give the indices of Note [parameter indices]).
//
// Writing (save_checkpoint, a collective): every rank checks that the values it writes are finite (Note
// [non-finite loss] in trainer.cc), the ranks agree on that and on a checkpoint id "step<N>-<6 hex>" (rank 0's
// random value, so a run never writes over the rank files the directory's manifest points at), each writes its
// file, they agree that every write succeeded, rank 0 commits, and they agree on the commit. A failure
// anywhere is an error on every rank and leaves the previous checkpoint.
// Reading (--resume): read_checkpoint reads every tensor whole through the library (each piece checked) and
// gives the full state, which every strategy loads at any world size (OSS re-shards it, FSDP keeps its rows).
// The directory: open_dir (rank 0 only, for the whole run) refuses a directory holding a checkpoint unless
// --resume or --overwrite, and holds the directory's lock (Note [directory lock] in common/io/dir_lock.h).
//
// The single-file format of earlier versions ("SKCKPT01", DIR/checkpoint.skck) is refused with a message that
// says so (README, "Checkpoints"): resume it with the shardkit-train that wrote it.
// No global state; thread-compatible.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/comm/process_group.h"
#include "common/io/checkpoint.h"
#include "common/io/dir_lock.h"
#include "common/nn/module.h"
#include "common/optim/optimizer.h"
#include "common/optim/state_dict.h"
#include "oss/oss.h"
#include "tools/shardkit_train/options.h"

namespace shardkit::train {

// The full state a run resumes from.
struct Checkpoint {
  std::map<std::string, std::string> meta;
  nn::StateDict model;
  optim::OptimizerStateDict optimizer;
};

// DIR/manifest.json: the file that names the checkpoint in messages.
std::string checkpoint_path(const std::string& dir);
// The old single-file format's name inside DIR.
inline constexpr char kOldCheckpointFile[] = "checkpoint.skck";

// Rank 0, before training: creates DIR, takes its lock for the life of the result, and refuses a DIR that
// already holds a checkpoint unless --resume or --overwrite: "checkpoint directory 'd' already holds a
// checkpoint ('d/manifest.json'); pass --resume to continue it or --overwrite to replace it". Errors of
// io::open_checkpoint_dir otherwise ("cannot write checkpoint directory 'd': Not a directory", "... is in use by
// another run (pid N holds 'd/.lock')").
absl::StatusOr<io::DirectoryLock> open_dir(const Options& options);

// What a rank holds of the training state (Note [checkpoint format]).
struct CheckpointSource {
  nn::Module* model = nullptr;
  optim::Optimizer* optimizer = nullptr;  // ddp, fsdp: over model->parameters()
  oss::Oss* oss = nullptr;                // oss, sddp: over model->parameters(), one group per optimizer group
  bool fsdp = false;                      // model and optimizer sharded by fsdp::fully_shard
};

// The pieces a rank writes, and the optimizer's meta (the same on every rank).
struct CheckpointContents {
  std::vector<io::TensorPiece> pieces;
  std::map<std::string, std::string> meta;
};

// This rank's pieces as Note [checkpoint format] says (local: no communication; copies where the state is
// produced by a state-dict call, views of the model's tensors otherwise).
absl::StatusOr<CheckpointContents> sharded_contents(const CheckpointSource& source, int rank);
// Test-only reference layout (--test-checkpoint-consolidated): the full state, gathered by the caller (the
// model unsharded, `full` = the full optimizer state on rank 0), all written by rank 0.
absl::StatusOr<CheckpointContents> consolidated_contents(const nn::Module& model,
                                                         const optim::OptimizerStateDict* full, int rank);

// Collective (Note [checkpoint format]): writes the checkpoint of `step` with `meta` (rank 0's is used) plus
// the contents' meta. FailedPrecondition "refusing to write the checkpoint of step N: expected finite values,
// found inf in model/x (element 3)" (on the rank that found it; "rank R found a non-finite value" on the others),
// or the library's error of the rank that failed ("rank R could not write its checkpoint file" elsewhere).
absl::Status save_checkpoint(const Options& options, std::int64_t step, std::map<std::string, std::string> meta,
                             const CheckpointContents& contents, comm::ProcessGroup& pg);

// The full state of DIR's checkpoint. NotFound "cannot read checkpoint: no checkpoint in 'd' ..."; DataLoss
// "checkpoint 'd/manifest.json' is corrupt: ..." for a damaged checkpoint (naming the file, tensor and what was
// expected) or one holding inf / NaN; FailedPrecondition for the old single-file format.
absl::StatusOr<Checkpoint> read_checkpoint(const std::string& dir);

// OK when every model and optimizer-state value is finite; otherwise InvalidArgument naming the first tensor
// and element, e.g. "expected finite values, found nan in model/ln_f.bias (element 0)".
absl::Status check_finite(const Checkpoint& ckpt);

// "nan", "inf", "-inf", or the value.
std::string value_str(double v);

}  // namespace shardkit::train
