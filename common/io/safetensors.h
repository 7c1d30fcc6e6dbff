// safetensors files: read (memory-mapped, every offset validated) and write (atomically).
//
// Note [safetensors format] (https://github.com/huggingface/safetensors, the format PyTorch and Hugging Face
// load):
//   u64 N (little-endian)   the header's length in bytes
//   N bytes                 a JSON object, UTF-8, padded with spaces to a multiple of 8 by writers:
//                             {"__metadata__": {"key": "value", ...},               (optional, strings only)
//                              "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
//   the data region         every tensor's bytes, row-major, little-endian, at [begin, end) relative to the
//                           start of the region; the tensors cover the region exactly, without gaps or overlaps
//
// Types: F32, BF16, F16 and I64 map one to one to shardkit's DType (f32, bf16, f16, i64); bytes are kept as
// they are (a round trip is bitwise, NaN payloads included). Other safetensors types (F64, I32, U8, BOOL,
// F8_*, ...) are refused with Unimplemented naming the tensor: shardkit has no such tensors to put them in.
//
// Reading (SafetensorsFile::open) maps the file read-only (mapped_file.h) and checks, before any tensor byte
// is touched, everything the reference implementation checks and a little more:
//   - the file has the 8-byte length, N <= max_header_bytes (100 MB by default, the reference's limit) and
//     N <= file size - 8;
//   - the header is well-formed JSON (check_json_strict: no duplicate keys, at most 2 levels of nesting), an
//     object whose "__metadata__", if present, maps strings to strings;
//   - each tensor has "dtype" (a supported type), "shape" (integers >= 0, element and byte counts within
//     int64: checked_numel) and "data_offsets" (two integers, begin <= end <= data region size,
//     end - begin == bytes of the shape);
//   - the tensors, in offset order, cover the data region exactly: no overlap, no gap, no trailing bytes.
// Anything else is DataLoss, "<path>: tensor 'h.0.attn.c_attn.weight': expected ..., found ...", never a
// crash or a read outside the file. Extra keys in a tensor's entry are ignored (as the reference does).
// The file must not be truncated while it is open (Note [mapped file truncation]).
//
// Writing (write_safetensors) produces what the reference writer produces for the same tensors: tensors
// ordered by element size, largest first (so every tensor starts at a multiple of its element size), then
// by name; the header lists "__metadata__" first (when there is any) and then the tensors in data order, and
// is padded with spaces to a multiple of 8. The file is written through AtomicFileWriter (Note [atomic
// replace]): a temporary file in the same directory, fsync, rename, fsync of the directory.
//
// The library assumes a little-endian host (checked at compile time).
//
// Thread-safety: a SafetensorsFile is immutable after open(); its const methods may be called from several
// threads. Functions here keep no global state.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/io/mapped_file.h"
#include "common/tensor/tensor.h"

namespace shardkit::io {

// Name -> tensor, in a caller's order (the same type as nn::StateDict and nn::NamedTensors).
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;
// The header's "__metadata__": free-form text, e.g. {"format": "pt"}.
using SafetensorsMetadata = std::map<std::string, std::string>;

inline constexpr std::uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

// "F32", "BF16", "F16", "I64".
std::string_view safetensors_dtype_name(DType dtype);
// The DType of a safetensors type name; Unimplemented for a type shardkit has no tensors for, InvalidArgument
// for a name that is no safetensors type.
absl::StatusOr<DType> dtype_from_safetensors(std::string_view name);

// What a header says about one tensor, without its bytes.
struct SafetensorsTensorInfo {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  // Bytes of the tensor's data (numel * element size).
  std::uint64_t nbytes() const;
};

struct SafetensorsReadOptions {
  std::uint64_t max_header_bytes = kSafetensorsMaxHeaderBytes;
};

// One tensor of an open file.
struct SafetensorsEntry {
  SafetensorsTensorInfo info;
  std::uint64_t begin = 0;  // data_offsets, relative to the data region
  std::uint64_t end = 0;
  // The tensor's bytes inside the mapping (little-endian, row-major; no alignment is guaranteed, so read
  // them with memcpy). Valid while the SafetensorsFile that owns this entry lives.
  absl::Span<const std::byte> bytes;
};

class SafetensorsFile {
 public:
  // Maps and validates `path` (see the Note above). NotFound / FailedPrecondition when the file cannot be
  // opened, DataLoss when it is malformed, Unimplemented for a tensor type shardkit does not have.
  static absl::StatusOr<SafetensorsFile> open(const std::string& path, const SafetensorsReadOptions& options = {});
  // The same checks on bytes the caller holds (`source` names them in messages). The bytes must outlive the
  // returned object.
  static absl::StatusOr<SafetensorsFile> parse(absl::Span<const std::byte> bytes, std::string source,
                                               const SafetensorsReadOptions& options = {});

  SafetensorsFile(SafetensorsFile&&) = default;
  SafetensorsFile& operator=(SafetensorsFile&&) = default;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  // The path given to open(), or parse()'s source.
  const std::string& source() const { return source_; }
  const SafetensorsMetadata& metadata() const { return metadata_; }
  // Every tensor, in data order.
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  // nullptr when the file has no tensor of that name.
  const SafetensorsEntry* find(std::string_view name) const;

  // A copy of one tensor: a new contiguous CPU tensor of the file's dtype and shape, charged to `category`
  // (default: the calling thread's current category). NotFound naming the tensor and the file.
  absl::StatusOr<Tensor> tensor(std::string_view name, std::optional<MemoryCategory> category = std::nullopt) const;
  // Copies of every tensor, in data order.
  NamedTensors tensors(std::optional<MemoryCategory> category = std::nullopt) const;

 private:
  SafetensorsFile() = default;

  std::unique_ptr<MappedFile> map_;  // null for parse()
  std::string source_;
  SafetensorsMetadata metadata_;
  std::vector<SafetensorsEntry> entries_;
  absl::flat_hash_map<std::string, std::size_t> by_name_;
};

// A copy of an entry's bytes as a tensor (see SafetensorsFile::tensor).
Tensor tensor_from_entry(const SafetensorsEntry& entry, std::optional<MemoryCategory> category = std::nullopt);

// Writes `tensors` and `metadata` to `path` atomically (see the Note above). InvalidArgument, naming the
// tensor, for an empty or repeated name, the reserved name "__metadata__", a name or metadata text that is
// not valid UTF-8, an undefined tensor, a CUDA tensor (copy it to the CPU first) or released storage;
// FailedPrecondition / ResourceExhausted for I/O errors (the previous file at `path` is then untouched).
absl::Status write_safetensors(const std::string& path, const NamedTensors& tensors,
                               const SafetensorsMetadata& metadata = {});
// The same file as bytes in memory.
absl::StatusOr<std::string> serialize_safetensors(const NamedTensors& tensors, const SafetensorsMetadata& metadata = {});

}  // namespace shardkit::io
