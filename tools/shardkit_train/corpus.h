// The training text (byte-level tokens) and the batches drawn from it.
//
// Batches are a pure function of (seed, step): step s draws `world * rows` windows of context + 1 bytes at
// positions from Generator(seed, 1'000'000 + s), and rank r takes windows [r * rows, (r + 1) * rows). So
// the data position of a run is its step count (what a checkpoint records), and every world size, backend
// and strategy sees the same global batch.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/statusor.h"
#include "common/tensor/tensor.h"

namespace shardkit::train {

// The default corpus compiled into the binary (generated from the project's documentation).
std::string_view embedded_corpus();

struct Corpus {
  std::string bytes;
  std::string source;            // "embedded" or the file name
  std::uint64_t fingerprint = 0; // FNV-1a 64 of the bytes (checkpoints refuse another corpus)
};

std::uint64_t fnv1a64(const void* data, std::size_t n, std::uint64_t h = 1469598103934665603ull);

// `path` empty: the embedded corpus. Errors: NotFound / InvalidArgument ("expected a non-empty data file,
// found 0 bytes in x"), or too short for one window of `context + 1` bytes.
absl::StatusOr<Corpus> load_corpus(const std::string& path, std::int64_t context);

// Tokens [rows, context] and next-byte targets [rows, context] (i64) for `rank` of `world` at `step`.
std::pair<Tensor, Tensor> batch(const Corpus& corpus, std::uint64_t seed, std::int64_t step, int rank, int world,
                                std::int64_t rows, std::int64_t context);

}  // namespace shardkit::train
