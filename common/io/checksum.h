// The checksum of common/io's checkpoints: XXH3-64 (xxHash 0.8, Debian's libxxhash-dev, used header-only so
// the library adds no link dependency). A standard, seedless, well-specified 64-bit hash that any language's
// xxhash binding reproduces (Python: xxhash.xxh3_64_intdigest(bytes)), fast enough (tens of GB/s) that every
// read can verify every byte. It detects accidental damage (truncation, bit flips, mixed files); it is not a
// signature against someone who can write the directory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace shardkit::io {

// XXH3-64 (seed 0) of `n` bytes.
std::uint64_t checksum64(const void* data, std::size_t n);
inline std::uint64_t checksum64(std::string_view bytes) { return checksum64(bytes.data(), bytes.size()); }

// 16 lowercase hex digits, as checkpoint files spell a checksum.
std::string checksum_hex(std::uint64_t sum);

}  // namespace shardkit::io
