#include "common/io/checksum.h"

#include "absl/strings/str_format.h"

// Header-only use of xxHash (its documented XXH_INLINE_ALL mode): the functions are compiled into this file
// and stay internal to it, so neither shardkit nor its consumers link libxxhash.
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace shardkit::io {

std::uint64_t checksum64(const void* data, std::size_t n) { return XXH3_64bits(data, n); }

std::string checksum_hex(std::uint64_t sum) { return absl::StrFormat("%016x", sum); }

}  // namespace shardkit::io
