#include "common/autograd/accumulate_grad.h"

#include "common/autograd/autograd_meta.h"
#include "common/autograd/grad_accumulation.h"

namespace shardkit::autograd {

AccumulateGrad::AccumulateGrad(Tensor variable) : variable_(std::move(variable)) {
  add_output(variable_.shape(), variable_.dtype(), variable_.device());
}

TensorList AccumulateGrad::apply(TensorList&& grads) {
  SK_CHECK_EQ(grads.size(), 1u);
  Tensor g = std::move(grads[0]);
  AutogradMeta* meta = meta_of(variable_);
  // A leaf's tensor hooks see (and may replace) the gradient before it is accumulated.
  if (meta && meta->hooks && g.defined()) g = detail::run_tensor_hooks(*meta->hooks, std::move(g), variable_.shape());
  if (!g.defined()) return {};
  SK_CHECK_EQ(g.numel(), variable_.numel()) << "gradient " << g.describe() << " for leaf " << variable_.describe();
  Tensor current = variable_.grad();
  if (!current.defined()) {
    // Note [gradient buffer reuse] in grad_accumulation.h.
    if (detail::is_exclusive(g) && g.dtype() == variable_.dtype() && g.device() == variable_.device()) {
      g.storage()->recategorize(MemoryCategory::gradient);
      variable_.set_grad(Tensor::over(g.storage(), 0, variable_.shape(), g.dtype()));
    } else {
      TensorOptions o;
      o.dtype = variable_.dtype();
      o.device = variable_.device();
      o.category = MemoryCategory::gradient;
      Tensor fresh = Tensor::empty(variable_.shape(), o);
      detail::copy_into(fresh, g);
      variable_.set_grad(fresh);
    }
  } else {
    detail::add_into(current, g);
  }
  g = Tensor();
  if (meta && meta->post_accumulate_hooks) {
    meta->post_accumulate_hooks->for_each([&](const PostAccumulateGradHook& hook) { hook(variable_); });
  }
  return {};
}

}  // namespace shardkit::autograd
