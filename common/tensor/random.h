// Counter-based random numbers (Philox4x32-10), so results depend only on (seed, stream, counter) and
// never on thread scheduling. A Generator is a value: copy it to replay a sequence; fork(stream) gives an
// independent stream (e.g. one per rank, one per dropout layer).
//
// Thread-safety: a Generator is not shared between threads; each rank holds its own (RankContext).
#pragma once

#include <array>
#include <cstdint>

namespace shardkit {

// One Philox4x32-10 block: 4 random 32-bit words for a 128-bit counter and a 64-bit key.
std::array<std::uint32_t, 4> philox4x32(std::array<std::uint32_t, 4> counter, std::uint64_t key);

class Generator {
 public:
  explicit Generator(std::uint64_t seed = 0, std::uint64_t stream = 0) : seed_(seed), stream_(stream) {}

  std::uint64_t seed() const { return seed_; }
  std::uint64_t stream() const { return stream_; }
  // Number of 4-word blocks consumed so far.
  std::uint64_t offset() const { return offset_; }
  void set_offset(std::uint64_t offset) { offset_ = offset; }
  Generator fork(std::uint64_t stream) const { return Generator(seed_, stream); }

  // Fills out[0..n) with U[lo, hi). Uses ceil(n / 4) blocks.
  void fill_uniform(float* out, std::int64_t n, float lo = 0.f, float hi = 1.f);
  // Fills out[0..n) with N(mean, stddev) by Box-Muller. Uses ceil(n / 2) blocks.
  void fill_normal(float* out, std::int64_t n, float mean = 0.f, float stddev = 1.f);
  // A uniform integer in [0, bound), bound > 0. Uses one block.
  std::uint64_t next_below(std::uint64_t bound);

 private:
  std::array<std::uint32_t, 4> block(std::uint64_t index) const;

  std::uint64_t seed_;
  std::uint64_t stream_;
  std::uint64_t offset_ = 0;
};

}  // namespace shardkit
