// A model's state to and from safetensors files: what a training loop calls to export its model for PyTorch /
// Hugging Face, or to start from weights made there.
//
//   io::ModelExportOptions gpt2{.names = io::TensorNames::gpt2(config)};
//   io::export_safetensors(model, "model.safetensors", gpt2);                   // one file, GPT-2's names
//   io::load_safetensors(model, "model.safetensors", io::TensorNames::gpt2(config));   // and back
//
// Note [tensor names in model files]
// A file names a model's tensors one of three ways (TensorNames):
//   shardkit  the names of Module::state_dict() as they are; every name is written, so a tied parameter (GPT's
//             wte.weight / lm_head.weight) is written under each of its names (shardkit reads either back);
//   gpt2      Hugging Face GPT-2's names and layout for nn::GPT (Note [GPT-2 names] in gpt2_names.h): the tied
//             lm_head is not written, the Conv1D weights are transposed; reading accepts either prefix;
//   custom    a user's NameMap (name_map.h: by hand or parse_name_map_json) for any other model.
// Writing needs every tensor of the state to have a name in the map; reading needs every tensor of the file to
// have one (or be ignored) and every untied entry of the map to be in the file (to_internal), and the model
// then checks shapes (nn::Module::load_state_dict: InvalidArgument naming the tensor, module unchanged).
//
// Where the model's state is: these functions take a module holding its full parameters (a single-rank model,
// DDP, OSS or ShardedDDP after step(), an FSDP model inside summon_full_params) or a full state dict
// (fsdp::full_state_dict). A fully sharded model is exported without gathering it by
// fsdp/safetensors_export.h, which writes the same files; load_safetensors loads into a model before it is
// sharded, fsdp::load_safetensors_rows after.
//
// Sharded files (Note [sharded safetensors] in safetensors_sharded.h): export_sharded_safetensors is the
// version for ranks that each hold the whole model (every rank writes the tensors plan_model_export assigns to
// it, from its own copy: no communication); readers must wait for every rank (a barrier).
//
// No global state; the functions are called from one rank's thread.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/io/gpt2_names.h"
#include "common/io/name_map.h"
#include "common/io/safetensors.h"
#include "common/io/safetensors_sharded.h"
#include "common/nn/module.h"

namespace shardkit::io {

// How a model's tensors are named in a file (Note [tensor names in model files]). A value: cheap to copy.
class TensorNames {
 public:
  static TensorNames shardkit();
  static TensorNames gpt2(const nn::GPTConfig& config, Gpt2NameOptions options = {});
  static TensorNames custom(NameMap map);

  // The map that writes a state whose tensors are named `internal` (shardkit: each name to itself).
  NameMap for_writing(const std::vector<std::string>& internal) const;
  // The map that reads a file whose tensors are named `external` (gpt2: for the prefix the file uses; NotFound
  // when it has no GPT-2 embedding at all).
  absl::StatusOr<NameMap> for_reading(const std::vector<std::string>& external) const;
  // "shardkit names", "GPT-2 names", "a custom name map": for messages.
  std::string describe() const;

 private:
  enum class Kind { shardkit, gpt2, custom };
  TensorNames() = default;
  Kind kind_ = Kind::shardkit;
  nn::GPTConfig config_;
  Gpt2NameOptions gpt2_options_;
  NameMap map_;
};

struct ModelExportOptions {
  TensorNames names = TensorNames::shardkit();
  // The header's "__metadata__". transformers' from_pretrained refuses a safetensors file whose "format" is not
  // "pt" (or "tf", "flax", "mlx"), so it is set by default.
  SafetensorsMetadata metadata = {{"format", "pt"}};
  // Sharded exports: the files are <stem>-0000r-of-0000N.safetensors and <stem>.safetensors.index.json.
  std::string stem = "model";
};

// The tensors written for `state` (internal names, full shapes): external names, transposed where the map says,
// tied names left out; handles of the state's tensors where nothing is transposed. InvalidArgument as
// to_external.
absl::StatusOr<NamedTensors> external_tensors(const NamedTensors& state, const ModelExportOptions& options = {});

// One file at `path` (atomically: write_safetensors). `state`: full tensors under state_dict() names.
absl::Status export_safetensors(const NamedTensors& state, const std::string& path,
                                const ModelExportOptions& options = {});
// The same for model.state_dict() (the module holds its full parameters).
absl::Status export_safetensors(const nn::Module& model, const std::string& path,
                                const ModelExportOptions& options = {});

// The plan of a sharded export in `num_parts` parts of a state whose tensors are `internal` (state_dict() names,
// full shapes, every rank the same list): the file's names and shapes, whole tensors balanced by bytes
// (plan_sharded_safetensors). Every rank computes the same plan, without communication.
absl::StatusOr<ShardedSafetensorsPlan> plan_model_export(const std::vector<SafetensorsTensorInfo>& internal,
                                                         int num_parts, const ModelExportOptions& options = {});
// Rank `rank` of `world`, holding the whole `state`, writes dir/<its part> (the tensors the plan assigns to
// it) and rank 0 also the index (write_sharded_safetensors). The directory must exist. The caller puts a barrier
// before anyone reads the files.
absl::Status export_sharded_safetensors(const NamedTensors& state, const std::string& dir, int rank, int world,
                                        const ModelExportOptions& options = {});

// A model stored as one safetensors file or as an index with its parts, mapped and validated; what the importers
// read from (tensors are copied out of it only when asked).
class SafetensorsModel {
 public:
  // `path`: an index (a name ending in ".json") with its parts; a directory: its model.safetensors.index.json,
  // else its model.safetensors; anything else: one safetensors file. Errors of SafetensorsFile::open /
  // ShardedSafetensors::open (NotFound, DataLoss naming the file and the tensor, ...).
  static absl::StatusOr<SafetensorsModel> open(const std::string& path, const SafetensorsReadOptions& options = {});

  // The file or index opened.
  const std::string& path() const { return path_; }
  // Every tensor: data order (one file) or name order (an index).
  const std::vector<const SafetensorsEntry*>& entries() const { return entries_; }
  // nullptr when absent.
  const SafetensorsEntry* find(std::string_view name) const;
  std::vector<std::string> names() const;
  std::vector<SafetensorsTensorInfo> infos() const;

 private:
  SafetensorsModel() = default;
  std::string path_;
  std::optional<SafetensorsFile> file_;
  std::optional<ShardedSafetensors> sharded_;
  std::vector<const SafetensorsEntry*> entries_;
};

// The state dict (internal names) a model file holds, read with `names`: copies (MemoryCategory::other by
// default), ready for nn::Module::load_state_dict or fsdp::load_full_state_dict. Errors of
// SafetensorsModel::open and to_internal, prefixed with the path.
absl::StatusOr<NamedTensors> import_safetensors(const std::string& path, const TensorNames& names = TensorNames::shardkit(),
                                                MemoryCategory category = MemoryCategory::other);
// import_safetensors, then model.load_state_dict(state, strict): the model must hold its full parameters (not
// sharded yet; for a fully sharded model, fsdp::load_safetensors_rows). On error the model is unchanged.
absl::Status load_safetensors(nn::Module& model, const std::string& path, const TensorNames& names = TensorNames::shardkit(),
                              bool strict = true);

}  // namespace shardkit::io
