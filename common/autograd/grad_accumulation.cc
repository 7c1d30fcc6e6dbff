#include "common/autograd/grad_accumulation.h"

#include <cstring>

#include "common/kernels/elementwise.h"
#include "common/tensor/rank_context.h"

namespace shardkit::autograd::detail {

bool is_exclusive(const Tensor& t) {
  const auto& impl = t.impl_ptr();
  if (!impl || impl.use_count() != 1) return false;
  const auto& storage = impl->storage;
  return storage && storage.use_count() == 1 && !storage->borrowed() && impl->offset_bytes == 0 &&
         storage->nbytes() == t.nbytes();
}

void add_into(const Tensor& dst, const Tensor& src) {
  SK_CHECK_EQ(dst.numel(), src.numel()) << "adding gradient " << src.describe() << " into " << dst.describe();
  SK_CHECK(dst.device() == src.device()) << "adding gradient " << src.describe() << " into " << dst.describe();
  const std::int64_t n = dst.numel();
  if (dst.device().is_cuda()) {
    // fp32 arithmetic on the device: other dtypes go through fp32 temporaries.
    if (dst.dtype() == DType::f32 && src.dtype() == DType::f32) return kernels::add(dst, src, dst);
    Tensor a = new_activation(dst.shape(), DType::f32, dst.device());
    Tensor b = new_activation(dst.shape(), DType::f32, dst.device());
    kernels::cast(dst, a);
    kernels::cast(src, b);
    kernels::add(a, b, a);
    kernels::cast(a, dst);
    return;
  }
  if (dst.dtype() == DType::f32 && src.dtype() == DType::f32) {
    float* __restrict d = dst.data<float>();
    const float* __restrict s = src.data<float>();
    for (std::int64_t i = 0; i < n; ++i) d[i] += s[i];
    return;
  }
  std::vector<float> a = dst.to_vector();
  const std::vector<float> b = src.to_vector();
  for (std::size_t i = 0; i < a.size(); ++i) a[i] += b[i];
  convert_elements(a.data(), DType::f32, dst.raw_data(), dst.dtype(), n);
}

Tensor sum_gradients(Tensor a, Tensor b) {
  if (!a.defined()) return b;
  if (!b.defined()) return a;
  if (is_exclusive(a)) {
    add_into(a, b);
    return a;
  }
  if (is_exclusive(b) && b.dtype() == a.dtype()) {
    add_into(b, a);
    return Tensor::over(b.storage(), 0, a.shape(), b.dtype());
  }
  Tensor out = new_activation(a.shape(), a.dtype(), a.device());
  copy_into(out, a);
  add_into(out, b);
  return out;
}

Tensor run_tensor_hooks(const TensorHookList& hooks, Tensor grad, const Shape& expected) {
  hooks.for_each([&](const TensorHook& hook) {
    std::optional<Tensor> replaced = hook(grad);
    if (replaced.has_value()) {
      SK_CHECK(replaced->defined() && replaced->shape() == expected)
          << "a tensor hook returned " << replaced->describe() << " for a gradient of shape " << shape_str(expected);
      SK_CHECK(replaced->device() == grad.device())
          << "a tensor hook returned " << replaced->describe() << " for a gradient on " << grad.device().str();
      grad = std::move(*replaced);
    }
  });
  return grad;
}

MemoryCategory activation_category() {
  const MemoryCategory c = current_memory_category();
  return c == MemoryCategory::other ? MemoryCategory::activation : c;
}

Tensor new_activation(const Shape& shape, DType dtype, Device device) {
  TensorOptions o;
  o.dtype = dtype;
  o.device = device;
  o.category = activation_category();
  return Tensor::empty(shape, o);
}

Tensor zeros_activation(const Shape& shape, DType dtype, Device device) {
  TensorOptions o;
  o.dtype = dtype;
  o.device = device;
  o.category = activation_category();
  return Tensor::zeros(shape, o);
}

void copy_into(const Tensor& dst, const Tensor& src) {
  if (dst.device().is_cpu() && src.device().is_cpu()) {
    dst.copy_(src);  // keeps Tensor::copy_'s trace check
    return;
  }
  kernels::cast(src, dst);
}

}  // namespace shardkit::autograd::detail
