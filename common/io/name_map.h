// NameMap: translate a model's tensors between shardkit's names and another framework's (a file's).
//
// Each entry pairs a shardkit name ("internal", as Module::state_dict() names it) with the name the file uses
// ("external"), and says whether the file stores a 2-D tensor transposed (GPT-2's Conv1D keeps [in, out]
// where a Linear keeps [out, in]) and whether the internal name is tied to another one (the same tensor
// registered twice, GPT's lm_head.weight and wte.weight). gpt2_names.h builds the map for shardkit's GPT;
// users build one for other models, by hand or from JSON (parse_name_map_json).
//
// Exporting (to_external): every tensor given must have an entry; tied names are left out of the file (the
// target's tensor carries the values, as Hugging Face's save_pretrained drops tied weights); transposed
// tensors are copied transposed. A subset of a model may be exported (a rank's part of a sharded export).
// Importing (to_internal): every entry that is not tied must be in the file, and every tensor of the file
// must have an entry or be listed in `ignored_external` (GPT-2 checkpoints carry attention-mask buffers);
// a tied name receives its target's tensor, and when the file carries the tied name too its values must equal
// the target's (shardkit could not keep two different tensors there). The result is a state dict for
// Module::load_state_dict, which checks shapes against the model. Errors are InvalidArgument naming the
// tensor, the map entry and what was expected.
//
// Pure functions: no global state; the tensors returned are new (transposed copies) or the inputs' handles.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/io/safetensors.h"

namespace shardkit::io {

struct NameMapEntry {
  std::string internal;    // shardkit's name
  std::string external;    // the file's name
  bool transpose = false;  // 2-D tensors only: the file holds internal^T
  std::string tied_to;     // non-empty: `internal` is the same tensor as this internal name (not exported)
};

struct NameMap {
  std::vector<NameMapEntry> entries;
  // File tensors that have no shardkit counterpart and are skipped on import.
  std::vector<std::string> ignored_external;

  // nullptr when absent.
  const NameMapEntry* find_internal(std::string_view internal) const;
  const NameMapEntry* find_external(std::string_view external) const;
};

// OK when names are non-empty and unique on each side, every tied_to names an untied entry, and tied entries do
// not transpose. InvalidArgument naming the entry otherwise.
absl::Status validate_name_map(const NameMap& map);

// A row-major 2-D tensor's transpose as a new tensor (any dtype; charged to the current category).
Tensor transpose_2d(const Tensor& t);

// Internal (state dict) -> external (file) tensors, in the input's order; see above.
absl::StatusOr<NamedTensors> to_external(const NamedTensors& internal, const NameMap& map);
// The same for names, dtypes and shapes only (what a sharded export plans with).
absl::StatusOr<std::vector<SafetensorsTensorInfo>> to_external_infos(const std::vector<SafetensorsTensorInfo>& internal,
                                                                     const NameMap& map);
// External (file) -> internal (state dict) tensors, in the map's order; see above.
absl::StatusOr<NamedTensors> to_internal(const NamedTensors& external, const NameMap& map);

// A map from JSON text:
//   {"entries": [{"internal": "fc.weight", "external": "dense.kernel", "transpose": true},
//                {"internal": "head.weight", "external": "head.weight", "tied_to": "embed.weight"}, ...],
//    "ignored_external": ["mask"]}                                                   (optional)
// DataLoss for malformed JSON or fields of the wrong type, InvalidArgument when validate_name_map fails.
absl::StatusOr<NameMap> parse_name_map_json(std::string_view text, const std::string& source);

}  // namespace shardkit::io
