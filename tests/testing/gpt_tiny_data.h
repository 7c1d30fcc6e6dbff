// GPT-tiny ("gpt-10k") training data shared by the equivalence tests of every sharding layer: N ranks, each
// on its rows of a step's batch, must end equal to one rank on the whole batch.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "common/nn/gpt.h"
#include "common/tensor/random.h"
#include "common/tensor/tensor.h"

namespace shardkit::gpt_tiny {

inline constexpr int kBatch = 24;  // divisible by 1, 2, 3, 4 and 8

inline nn::GPTConfig TinyConfig() { return *nn::GPTConfig::named("gpt-10k"); }

// Batch `step`: tokens and next-token targets, rows [row0, row0 + rows) of the step's kBatch rows.
inline std::pair<Tensor, Tensor> Batch(int step, int row0, int rows) {
  const nn::GPTConfig c = TinyConfig();
  Generator gen(99, static_cast<std::uint64_t>(step));
  std::vector<std::int64_t> all(static_cast<std::size_t>(kBatch * (c.context + 1)));
  for (auto& t : all) t = static_cast<std::int64_t>(gen.next_below(static_cast<std::uint64_t>(c.vocab_size)));
  std::vector<std::int64_t> x, y;
  for (int r = row0; r < row0 + rows; ++r) {
    for (std::int64_t t = 0; t < c.context; ++t) {
      x.push_back(all[static_cast<std::size_t>(r * (c.context + 1) + t)]);
      y.push_back(all[static_cast<std::size_t>(r * (c.context + 1) + t + 1)]);
    }
  }
  return {Tensor::from_int64(x, {rows, c.context}), Tensor::from_int64(y, {rows, c.context})};
}

// Every parameter's values, in parameters() order.
inline std::vector<std::vector<float>> Values(const nn::Module& m) {
  std::vector<std::vector<float>> out;
  for (const Tensor& p : m.parameters()) out.push_back(p.to_vector());
  return out;
}

}  // namespace shardkit::gpt_tiny
