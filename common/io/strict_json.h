// Strict JSON checks shared by the readers of common/io (the safetensors header and index files).
//
// nlohmann::json (the parser every reader here uses) accepts duplicate object keys, keeping the last
// one, and builds values of any depth. A file whose meaning depends on which duplicate wins, or that nests
// deep enough to exhaust memory, is refused before it is parsed into a value: check_json_strict runs a
// SAX pass (no value is built) that reports a syntax error, a duplicate key or nesting deeper than
// `max_depth` with the place it happened. The readers then parse the text knowing it is well formed.
// This header does not include nlohmann, so the library's public headers never need it.
#pragma once

#include <string_view>

#include "absl/status/status.h"

namespace shardkit::io {

// OK when `text` is one well-formed JSON value (surrounding whitespace allowed) with no duplicate key in
// any object and no array or object nested deeper than `max_depth` (the outermost value is depth 0).
// Otherwise DataLoss: "<what>: ..." naming the key path, e.g.
//   "header of 'm.safetensors': duplicate key \"dtype\" in \"a\""
absl::Status check_json_strict(std::string_view text, std::string_view what, int max_depth);

}  // namespace shardkit::io
