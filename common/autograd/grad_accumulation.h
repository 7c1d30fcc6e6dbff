// Summing gradients: the engine's input buffers and a leaf's .grad (DESIGN.md section 2).
//
// Note [gradient buffer reuse]: a gradient tensor that nobody else references (one handle, one
// storage user, covering its whole storage) can be added into in place, and can become a leaf's .grad
// without a copy (its storage is moved from the activation to the gradient category of the ledger).
// Anything shared (the same gradient sent to two inputs, a gradient a hook kept) is copied instead.
#pragma once

#include "common/autograd/node.h"
#include "common/tensor/tensor.h"

namespace shardkit::autograd::detail {

// True when `t` is the only reference to its bytes (see the note).
bool is_exclusive(const Tensor& t);

// dst += src elementwise (same numel, same device); any float dtypes, fp32 arithmetic.
void add_into(const Tensor& dst, const Tensor& src);

// Returns a + b, reusing a's or b's buffer when exclusive (the inputs are consumed).
Tensor sum_gradients(Tensor a, Tensor b);

// Runs `hooks` in order on `grad`; a hook's returned tensor (same shape as `expected`) replaces it.
Tensor run_tensor_hooks(const TensorHookList& hooks, Tensor grad, const Shape& expected);

// Note [activation category]: tensors that ops create (forward results, saved intermediates, backward
// temporaries) are activations in the ledger. A caller that wants them elsewhere installs a
// MemoryCategoryScope; only the thread's default category ("other") is mapped to activation. A leaf's
// .grad is always charged to MemoryCategory::gradient.
MemoryCategory activation_category();

// A new tensor for an op's result or a backward temporary, on `device`, charged to activation_category().
Tensor new_activation(const Shape& shape, DType dtype = DType::f32, Device device = Device::cpu());
Tensor zeros_activation(const Shape& shape, DType dtype = DType::f32, Device device = Device::cpu());

// dst = src converted to dst's dtype, for tensors on any devices: Tensor::copy_, except that a copy within a CUDA
// device is only queued on the calling thread's stream (kernels::cast), not waited for.
void copy_into(const Tensor& dst, const Tensor& src);

}  // namespace shardkit::autograd::detail
