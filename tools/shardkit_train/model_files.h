// shardkit-train's --export and --init-from: the model's weights as GPT-2 safetensors, out of a run and into
// one (issue 18).
//
// Note [--export and --init-from]
// Both use Hugging Face GPT-2's names and layout (common/io/gpt2_names.h), so an export loads into a PyTorch /
// transformers GPT-2 of the same shape (n_embd = --width, n_layer, n_head, n_positions = context, vocab 256 for
// the byte models) and a GPT-2 file of that shape starts a run.
//   --export PATH     written once, after the last step. PATH ending in ".safetensors": one file, written by
//                     rank 0 (under fsdp every tensor is gathered to rank 0 alone, one at a time). Any other
//                     PATH is a directory (created if needed) in Hugging Face's sharded layout: one part per rank,
//                     model-0000r-of-0000N.safetensors, and model.safetensors.index.json from rank 0. Under fsdp
//                     each rank writes its part shard by shard, so no rank ever holds the whole model
//                     (fsdp/safetensors_export.h); under ddp / oss / sddp every rank writes its part from its own
//                     replica. A barrier follows: the files are complete when the run reports.
//   --init-from PATH  read before any rank starts (a .safetensors file, an index .json, or a directory holding
//                     either) and loaded into every rank's model before it is sharded, in place of the seed's
//                     initial values (the seed still orders the data). A file whose vocabulary, context, width
//                     or number of layers differs from --model and the shape flags is refused with one line
//                     naming both; the number of heads is not in the file (GPT-2 keeps it in config.json) and
//                     is taken from the flags.
// Thread-safety: plain functions, no state.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/io/model_safetensors.h"
#include "common/nn/module.h"
#include "tools/shardkit_train/options.h"

namespace shardkit::train {

// Whether --export PATH names one file (".safetensors") rather than a directory of parts.
bool export_is_one_file(const std::string& path);

// GPT-2 names for `config`'s GPT ("transformer." prefix, metadata format "pt").
io::ModelExportOptions export_options(const nn::GPTConfig& config);

// Before training: a one-file PATH's directory exists and a file can be created in it; a directory PATH is
// created if needed and writable. FailedPrecondition ("cannot write --export 'x': ...") otherwise.
absl::Status check_export_target(const std::string& path);

// The state dict for nn::GPT(model.config) that the GPT-2 file(s) at `path` hold, or the one-line error
// ("cannot initialise from 'x': expected GPT-2 weights of model 'tiny' (vocab 256, context 32, width 32, 2 layers),
// found ...").
absl::StatusOr<nn::StateDict> read_init_weights(const std::string& path, const ModelSize& model);

}  // namespace shardkit::train
