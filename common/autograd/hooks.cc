#include "common/autograd/hooks.h"

#include "common/autograd/engine.h"

namespace shardkit::autograd {

HookHandle register_hook(const Tensor& t, TensorHook fn) {
  if (!t.requires_grad()) {
    throw AutogradError("register_hook: expected a tensor that requires grad, found " + t.describe() +
                        " with requires_grad=false");
  }
  AutogradMeta& m = ensure_meta(t);
  if (!m.hooks) {
    m.hooks = std::make_shared<TensorHookList>();
    if (m.grad_fn) m.grad_fn->set_output_hooks(m.output_nr, m.hooks);
  }
  return add_hook(m.hooks, std::move(fn));
}

HookHandle register_post_accumulate_grad_hook(const Tensor& param, PostAccumulateGradHook fn) {
  if (!param.requires_grad() || !is_leaf(param)) {
    throw AutogradError("register_post_accumulate_grad_hook: expected a leaf tensor that requires grad, found " +
                        param.describe() + (param.requires_grad() ? " (not a leaf)" : " with requires_grad=false"));
  }
  AutogradMeta& m = ensure_meta(param);
  if (!m.post_accumulate_hooks) m.post_accumulate_hooks = std::make_shared<PostAccumulateGradHookList>();
  return add_hook(m.post_accumulate_hooks, std::move(fn));
}

}  // namespace shardkit::autograd
