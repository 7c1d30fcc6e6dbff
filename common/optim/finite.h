// Checks for inf / NaN in tensors: the found_inf of a gradient scaler (sddp/grad_scaler.h), a training
// loop's divergence check, and a checkpoint writer's refusal to save non-finite values (issue 11).
//
// Note [finite checks]
//   A float is inf or NaN exactly when its exponent bits are all ones, in f32 (0x7f800000), bf16 (0x7f80)
//   and f16 (0x7c00) alike. The checks test those bits on the stored integers: no conversion to fp32, no
//   call to std::isfinite (which -ffinite-math-only would fold away), and loops gcc vectorises (an OR
//   of comparisons per chunk of 1024 elements; only a chunk that has a hit is scanned again for its index).
//   i64 tensors hold no non-finite values.
//
//   The checks are per rank. Ranks that must act together on the result (skip a step, stop a run) agree
//   on it with one collective over a flag (Note [agreed found_inf] in sddp/grad_scaler.h; shardkit-train's
//   Note [non-finite loss]); optim does not depend on comm.
//
// find_non_finite: CPU tensors only (SK_CHECK). The others take CUDA tensors too: two passes on the device (the
// largest magnitude, whose bits tell inf / NaN, then the scale), and the answer comes back to the host (a
// synchronisation). Pure functions of the tensors' values, thread-compatible.
#pragma once

#include <cstdint>

#include "absl/types/span.h"
#include "common/tensor/tensor.h"

namespace shardkit::optim {

// Index (in elements) of the first inf or NaN in `t`, or -1 when every element is finite.
std::int64_t find_non_finite(const Tensor& t);

// True when no element of any defined tensor in `tensors` is inf or NaN (undefined tensors are skipped).
bool all_finite(absl::Span<const Tensor> tensors);

// True when some parameter's gradient (p.grad(), where defined) holds an inf or NaN: a loop's found_inf.
bool found_non_finite_grads(absl::Span<const Tensor> params);

// Multiplies `t` by `factor` in place and returns whether any element was inf or NaN before the scaling,
// in one pass over the bytes (f32; bf16 / f16 through fp32 in chunks). A gradient scaler's unscale.
bool scale_and_find_non_finite(const Tensor& t, float factor);

}  // namespace shardkit::optim
