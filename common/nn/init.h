// Parameter creation for modules: values from a caller's Generator (deterministic: ranks that use the
// same seed build bit-identical models), charged to MemoryCategory::parameter. Under a
// DeferredInitScope the values are recorded, not filled (deferred_init.h).
#pragma once

#include "common/nn/deferred_init.h"
#include "common/tensor/random.h"
#include "common/tensor/tensor.h"

namespace shardkit::nn::init {

inline TensorOptions param_options() { return TensorOptions().with_category(MemoryCategory::parameter); }

inline Tensor uniform(const Shape& shape, Generator& gen, float lo, float hi) {
  if (DeferredInit* d = current_deferred_init()) return d->defer(shape, param_options(), DeferredInit::Kind::uniform, &gen, lo, hi);
  return Tensor::uniform(shape, gen, lo, hi, param_options());
}
inline Tensor normal(const Shape& shape, Generator& gen, float mean, float stddev) {
  if (DeferredInit* d = current_deferred_init()) return d->defer(shape, param_options(), DeferredInit::Kind::normal, &gen, mean, stddev);
  return Tensor::normal(shape, gen, mean, stddev, param_options());
}
inline Tensor constant(const Shape& shape, float value) {
  if (DeferredInit* d = current_deferred_init()) return d->defer(shape, param_options(), DeferredInit::Kind::constant, nullptr, value, 0.f);
  return Tensor::full(shape, value, param_options());
}
inline Tensor zeros(const Shape& shape) { return constant(shape, 0.f); }
inline Tensor ones(const Shape& shape) { return constant(shape, 1.f); }

}  // namespace shardkit::nn::init
