// shardkit-train's checkpoint: one self-describing, checksummed file per run directory (issue 7).
//
// Note [checkpoint format]
//   "SKCKPT01"                       8-byte magic (the digits are the format version)
//   u64 meta_bytes, meta             text, one "key=value\n" per entry (model config, step, seed, data
//                                    fingerprint, optimizer name, hyper-parameters, per-parameter step counts)
//   u64 num_tensors, then per tensor u32 name_bytes, name, u8 dtype, u32 ndim, i64 dims[ndim],
//                                    u64 nbytes, the bytes (little-endian, as in memory)
//   u64 checksum                     FNV-1a 64 of every byte before it
// Model tensors are named "model/<state_dict name>", optimizer state "optim/<param index>/<key>" (the full,
// consolidated state with global indices, common/optim/state_dict.h), so a checkpoint written at one world
// size or strategy loads at another. Integers are little-endian (this format is for one machine kind).
//
// Writing is atomic: the file is written to "<dir>/checkpoint.skck.tmp", flushed to disk, then renamed over
// "<dir>/checkpoint.skck", so a process killed at any point leaves the last complete checkpoint.
// Reading checks magic, size and checksum before parsing: a truncated or corrupted file is an error
// (DataLoss), never a crash. Shapes are checked with checked_numel (Note [checked shapes], tensor.h) before
// any count is computed from them. A checkpoint never holds inf or NaN (Note [non-finite loss], trainer.cc:
// the trainer refuses to write one), so reading refuses one too, naming the tensor.
// No global state; thread-compatible.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "common/nn/module.h"
#include "common/optim/state_dict.h"

namespace shardkit::train {

struct Checkpoint {
  std::map<std::string, std::string> meta;
  nn::StateDict model;
  optim::OptimizerStateDict optimizer;
};

std::string checkpoint_path(const std::string& dir);

// Creates `dir` (and parents) if needed and proves a file can be created in it. FailedPrecondition
// ("cannot write checkpoint directory 'x': Not a directory") otherwise.
absl::Status ensure_writable_dir(const std::string& dir);

// Writes atomically (see above). The caller checks check_finite() first: this function writes what it gets.
absl::Status write_checkpoint(const std::string& dir, const Checkpoint& ckpt);
absl::StatusOr<Checkpoint> read_checkpoint(const std::string& path);

// OK when every model and optimizer-state value is finite; otherwise InvalidArgument naming the first tensor
// (file order: "model/<name>", then "optim/<index>/<key>") and element, e.g. "expected finite values,
// found nan in model/ln_f.bias (element 0)".
absl::Status check_finite(const Checkpoint& ckpt);

// "nan", "inf", "-inf", or the value.
std::string value_str(double v);

}  // namespace shardkit::train
