// Parameter creation for modules: values from a caller's Generator (deterministic: ranks that use the
// same seed build bit-identical models), charged to MemoryCategory::parameter.
#pragma once

#include "common/tensor/random.h"
#include "common/tensor/tensor.h"

namespace shardkit::nn::init {

inline TensorOptions param_options() { return TensorOptions().with_category(MemoryCategory::parameter); }

inline Tensor uniform(const Shape& shape, Generator& gen, float lo, float hi) {
  return Tensor::uniform(shape, gen, lo, hi, param_options());
}
inline Tensor normal(const Shape& shape, Generator& gen, float mean, float stddev) {
  return Tensor::normal(shape, gen, mean, stddev, param_options());
}
inline Tensor zeros(const Shape& shape) { return Tensor::zeros(shape, param_options()); }
inline Tensor ones(const Shape& shape) { return Tensor::full(shape, 1.0, param_options()); }

}  // namespace shardkit::nn::init
