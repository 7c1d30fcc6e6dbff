// MixedPrecisionPolicy for fsdp::fully_shard (FSDP2's), and the rounding it applies to forward values.
//
// Note [mixed precision on f32 ops]
// The sharded parameters stay f32 (the master the optimizer steps). With param_dtype = bf16 (or f16) a unit's
// all-gather moves its shard cast to param_dtype (half the bytes), and the unsharded parameters the forward and
// backward compute with hold those values. The CPU ops of this library compute in f32, so "computing in
// param_dtype" means f32 arithmetic on parameters (and, with cast_forward_inputs, unit inputs) whose values are
// param_dtype's: the values a bf16 model has, with f32 accumulation (the GPU path, issue 14, computes natively).
// With reduce_dtype = bf16 the gradients are cast to it for the reduce-scatter (half the bytes; the backends
// accumulate in f32 and round once, process_group.h) and land f32 in the shards' gradients. output_dtype rounds
// the root's floating outputs the same way. A single-rank model that rounds the same values at the same points is
// the reference the tests compare with.
#pragma once

#include <optional>

#include "common/nn/module.h"
#include "common/tensor/dtype.h"

namespace shardkit::fsdp {

struct MixedPrecisionPolicy {
  // The dtype parameters are gathered in and hold during forward and backward; empty: f32 (no cast).
  std::optional<DType> param_dtype = std::nullopt;
  // The dtype gradients are reduced in; empty: param_dtype's (or f32).
  std::optional<DType> reduce_dtype = std::nullopt;
  // The root's floating outputs are rounded to it; empty: unchanged.
  std::optional<DType> output_dtype = std::nullopt;
  // Each unit's floating inputs are rounded to param_dtype before its forward.
  bool cast_forward_inputs = true;

  DType gather_dtype() const { return param_dtype.value_or(DType::f32); }
  DType reduce_in() const { return reduce_dtype.value_or(gather_dtype()); }
};

// The floating tensors of `values` rounded to `dtype` (an f32 tensor of dtype's values, MemoryCategory unchanged),
// differentiable with an identity gradient; other tensors as they are. dtype f32: `values` unchanged.
nn::TensorList round_floating(const nn::TensorList& values, DType dtype);

}  // namespace shardkit::fsdp
