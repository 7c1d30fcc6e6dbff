// Sharded safetensors exports: one part file per rank plus Hugging Face's index file.
//
// Note [sharded safetensors] Hugging Face stores a large model as parts "model-00001-of-00004.safetensors"
// (1-based, five digits) and an index "model.safetensors.index.json":
//   {"metadata": {"total_size": <bytes of every tensor>}, "weight_map": {"<tensor name>": "<part file>", ...}}
// which from_pretrained (and ShardedSafetensors::open below) follows to find each tensor. shardkit writes the
// same layout with one part per rank: rank r writes part r + 1 with the whole tensors assigned to it, and
// rank 0 also writes the index. Every rank builds the same plan from the same list of tensor names, dtypes
// and shapes (the full shapes, which every rank knows even when the values are sharded), so the index needs
// no communication. Which tensors a rank writes is the caller's choice (plan_sharded_safetensors balances
// bytes); a rank whose part is empty still writes a valid empty part, which the index does not mention.
// Readers must wait until every rank has written (a barrier), as for any collective write.
//
// Reading an index checks that every part file named in it is a plain file name in the index's directory
// (no path separators, no "." or "..": an index cannot point outside its directory), that each named tensor
// is in the part the index names, and that each part holds no tensor the index does not map to it. The
// parts are validated like any safetensors file (Note [safetensors format]). "total_size" is informative
// (Hugging Face's own files do not always agree with their tensors) and is not checked.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/io/safetensors.h"

namespace shardkit::io {

// Greedy balance: tensors in decreasing size (ties: lower index first), each to the part with the fewest bytes
// so far (ties: the lowest part). Returns the part of each tensor, in the input's order. Pure; num_parts >= 1.
std::vector<int> assign_parts_by_bytes(absl::Span<const std::uint64_t> nbytes, int num_parts);

struct ShardedSafetensorsPlan {
  std::string stem = "model";
  int num_parts = 1;
  std::vector<SafetensorsTensorInfo> tensors;  // every tensor of the model
  std::vector<int> part;                       // part (0-based: rank) of each tensor

  // "model-00002-of-00004.safetensors" for part 1 of 4.
  std::string part_file(int p) const;
  // "model.safetensors.index.json".
  std::string index_file() const;
  std::uint64_t total_bytes() const;
  // The tensors of part p, in plan order.
  std::vector<SafetensorsTensorInfo> tensors_of(int p) const;
};

// A plan over `tensors` (unique names) in `num_parts` parts balanced by bytes. InvalidArgument for
// num_parts < 1, an empty stem or a stem with a '/', an empty or repeated name.
absl::StatusOr<ShardedSafetensorsPlan> plan_sharded_safetensors(std::vector<SafetensorsTensorInfo> tensors,
                                                                int num_parts, std::string stem = "model");
// Name, dtype and shape of each tensor.
std::vector<SafetensorsTensorInfo> tensor_infos(const NamedTensors& tensors);

// Writes part `p` of the plan to dir/plan.part_file(p). `tensors` must be exactly the plan's tensors of that
// part (any order), with the plan's dtypes and shapes: InvalidArgument naming the first difference.
absl::Status write_safetensors_part(const std::string& dir, const ShardedSafetensorsPlan& plan, int p,
                                    const NamedTensors& tensors, const SafetensorsMetadata& metadata = {});
// Writes dir/plan.index_file() (atomically; keys sorted, as Hugging Face writes it).
absl::Status write_safetensors_index(const std::string& dir, const ShardedSafetensorsPlan& plan);
// What each rank of a sharded export calls: writes part `rank`, and on rank 0 the index as well.
absl::Status write_sharded_safetensors(const std::string& dir, const ShardedSafetensorsPlan& plan, int rank,
                                       const NamedTensors& tensors, const SafetensorsMetadata& metadata = {});

// The content of an index file.
struct SafetensorsIndex {
  std::optional<std::uint64_t> total_size;
  // Other "metadata" entries: strings as they are, other values as JSON text.
  SafetensorsMetadata metadata;
  // Tensor name -> part file name, sorted by tensor name.
  std::vector<std::pair<std::string, std::string>> weight_map;
};

// Parses an index's text (`source` names it in messages). DataLoss for malformed JSON, duplicate keys, a
// missing or non-object "weight_map", a non-string file name or one that is not a plain file name.
absl::StatusOr<SafetensorsIndex> parse_safetensors_index(std::string_view text, const std::string& source);

// A model stored as an index and its parts, every part mapped and validated.
class ShardedSafetensors {
 public:
  static absl::StatusOr<ShardedSafetensors> open(const std::string& index_path,
                                                 const SafetensorsReadOptions& options = {});

  ShardedSafetensors(ShardedSafetensors&&) = default;
  ShardedSafetensors& operator=(ShardedSafetensors&&) = default;

  const SafetensorsIndex& index() const { return index_; }
  // The part files, in the order of their names.
  const std::vector<SafetensorsFile>& parts() const { return parts_; }
  // Every tensor, sorted by name.
  const std::vector<const SafetensorsEntry*>& entries() const { return entries_; }
  const SafetensorsEntry* find(std::string_view name) const;
  absl::StatusOr<Tensor> tensor(std::string_view name, std::optional<MemoryCategory> category = std::nullopt) const;
  // Copies of every tensor, sorted by name.
  NamedTensors tensors(std::optional<MemoryCategory> category = std::nullopt) const;

 private:
  ShardedSafetensors() = default;

  std::string index_path_;
  SafetensorsIndex index_;
  std::vector<SafetensorsFile> parts_;
  std::vector<const SafetensorsEntry*> entries_;
  absl::flat_hash_map<std::string, const SafetensorsEntry*> by_name_;
};

// Every tensor of a model file: a ".json" path is read as an index with its parts, any other path as one
// safetensors file. Copies, in name order (index) or data order (one file).
absl::StatusOr<NamedTensors> read_safetensors_tensors(const std::string& path, const SafetensorsReadOptions& options = {});

}  // namespace shardkit::io
