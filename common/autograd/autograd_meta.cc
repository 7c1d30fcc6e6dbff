#include "common/autograd/autograd_meta.h"

#include "common/autograd/accumulate_grad.h"
#include "common/autograd/grad_mode.h"

namespace shardkit::autograd {

AutogradMeta& ensure_meta(const Tensor& t) {
  if (!t.autograd_meta()) t.set_autograd_meta(std::make_shared<AutogradMeta>());
  return *t.autograd_meta();
}

std::shared_ptr<Node> grad_fn(const Tensor& t) {
  const AutogradMeta* m = meta_of(t);
  return m ? m->grad_fn : nullptr;
}

bool is_leaf(const Tensor& t) { return grad_fn(t) == nullptr; }

std::shared_ptr<Node> grad_accumulator(const Tensor& t) {
  SK_CHECK(t.requires_grad() && is_leaf(t)) << "grad_accumulator of a tensor that is not a leaf requiring grad: "
                                            << t.describe();
  AutogradMeta& m = ensure_meta(t);
  if (auto existing = m.grad_accumulator.lock()) return existing;
  auto acc = std::make_shared<AccumulateGrad>(t);
  m.grad_accumulator = acc;
  return acc;
}

Edge gradient_edge(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return {};
  if (const AutogradMeta* m = meta_of(t); m && m->grad_fn) return Edge{m->grad_fn, m->output_nr};
  return Edge{grad_accumulator(t), 0};
}

bool should_record(std::initializer_list<const Tensor*> inputs) {
  if (!is_grad_enabled()) return false;
  for (const Tensor* t : inputs) {
    if (t != nullptr && t->defined() && t->requires_grad()) return true;
  }
  return false;
}

bool should_record(const TensorList& inputs) {
  if (!is_grad_enabled()) return false;
  for (const Tensor& t : inputs) {
    if (t.defined() && t.requires_grad()) return true;
  }
  return false;
}

std::vector<Edge> collect_next_edges(std::initializer_list<const Tensor*> inputs) {
  std::vector<Edge> edges;
  edges.reserve(inputs.size());
  for (const Tensor* t : inputs) edges.push_back(t != nullptr ? gradient_edge(*t) : Edge{});
  return edges;
}

std::vector<Edge> collect_next_edges(const TensorList& inputs) {
  std::vector<Edge> edges;
  edges.reserve(inputs.size());
  for (const Tensor& t : inputs) edges.push_back(gradient_edge(t));
  return edges;
}

void set_history(const Tensor& out, const std::shared_ptr<Node>& node) {
  AutogradMeta& m = ensure_meta(out);
  SK_CHECK(m.grad_fn == nullptr) << "set_history on a tensor that already has a grad_fn (" << m.grad_fn->name()
                                 << "): " << out.describe();
  m.grad_fn = node;
  m.output_nr = node->add_output(out.shape(), out.dtype(), out.device());
  out.set_requires_grad(true);
  if (m.hooks) node->set_output_hooks(m.output_nr, m.hooks);
}

}  // namespace shardkit::autograd
