// A model and data set written by the user, not by the library (examples/mlp_train.cc trains it with every
// strategy): an MLP classifier, Linear -> GELU -> Linear -> GELU -> Linear, and a deterministic synthetic
// classification task. Nothing here knows about ranks or sharding except batch(), which cuts one step's
// global batch into the calling rank's rows.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "common/autograd/ops.h"
#include "common/nn/layers.h"
#include "common/tensor/random.h"
#include "common/tensor/tensor.h"

namespace mlp_example {

using shardkit::Generator;
using shardkit::Tensor;

inline constexpr std::int64_t kFeatures = 16, kHidden = 48, kClasses = 5;
inline constexpr int kGlobalRows = 32;  // rows per step over all ranks: divisible by 1, 2 and 4

// A plain nn::Module subclass: register the children in the constructor, call them (not their forward())
// in forward, so hooks of the data-parallel and fully sharded wrappers run.
class MlpClassifier : public shardkit::nn::Module {
 public:
  // Every rank builds the model from the same seed, so all start from bit-identical parameters.
  explicit MlpClassifier(std::uint64_t seed) : Module("MlpClassifier") {
    Generator gen(seed);
    fc1 = register_module("fc1", std::make_shared<shardkit::nn::Linear>(kFeatures, kHidden, gen));
    act1 = register_module("act1", std::make_shared<shardkit::nn::GELU>());  // exact GELU (erf), the default
    fc2 = register_module("fc2", std::make_shared<shardkit::nn::Linear>(kHidden, kHidden, gen));
    act2 = register_module("act2", std::make_shared<shardkit::nn::GELU>());
    head = register_module("head", std::make_shared<shardkit::nn::Linear>(kHidden, kClasses, gen));
  }

  // Mean cross-entropy over the rows of x [rows, kFeatures] with labels y [rows] (i64).
  Tensor loss(const Tensor& x, const Tensor& y) { return shardkit::autograd::cross_entropy((*this)(x), y); }

  std::shared_ptr<shardkit::nn::Linear> fc1, fc2, head;
  std::shared_ptr<shardkit::nn::GELU> act1, act2;

 protected:
  Tensor forward(const Tensor& x) override { return (*head)((*act2)((*fc2)((*act1)((*fc1)(x))))); }
};

// Step `step`'s batch, rows [rank * R, (rank + 1) * R) of its kGlobalRows rows (R = kGlobalRows / world):
// features ~ N(0, 1), label = which of the first kClasses features is the largest. Ranks get different
// rows; their concatenation is the global batch a single rank trains on.
inline std::pair<Tensor, Tensor> batch(int step, int rank, int world) {
  Generator gen(/*seed=*/2024, /*stream=*/static_cast<std::uint64_t>(step));
  std::vector<float> features(static_cast<std::size_t>(kGlobalRows * kFeatures));
  gen.fill_normal(features.data(), static_cast<std::int64_t>(features.size()));
  const int rows = kGlobalRows / world;
  std::vector<float> x;
  std::vector<std::int64_t> y;
  for (int r = rank * rows; r < (rank + 1) * rows; ++r) {
    const float* row = features.data() + static_cast<std::ptrdiff_t>(r) * kFeatures;
    std::int64_t label = 0;
    for (std::int64_t c = 1; c < kClasses; ++c) {
      if (row[c] > row[label]) label = c;
    }
    x.insert(x.end(), row, row + kFeatures);
    y.push_back(label);
  }
  return {Tensor::from_vector(x, {rows, kFeatures}), Tensor::from_int64(y, {rows})};
}

}  // namespace mlp_example
