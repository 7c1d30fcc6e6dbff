// AutogradMeta: what autograd attaches to a tensor (the opaque slot in TensorImpl), and the helpers
// that wire operation outputs into the graph (DESIGN.md section 2).
//
// A tensor that requires grad is either a leaf (no grad_fn: parameters, inputs the user marked) or
// the output `output_nr` of the node `grad_fn`. Leaves get an AccumulateGrad node on first use in a
// graph; the leaf holds it weakly (the graphs hold it strongly), so all graphs alive at once share
// one accumulator per leaf, which is what makes a shared parameter's hooks fire once per backward.
//
// Thread-safety: none; a tensor's autograd state belongs to the rank (thread) that owns the tensor.
#pragma once

#include <memory>

#include "common/autograd/node.h"
#include "common/tensor/tensor.h"

namespace shardkit::autograd {

// Hook run after a leaf's .grad has been accumulated for this backward.
using PostAccumulateGradHook = std::function<void(const Tensor& param)>;
using PostAccumulateGradHookList = HookList<PostAccumulateGradHook>;

struct AutogradMeta {
  std::shared_ptr<Node> grad_fn;  // null for leaves
  int output_nr = 0;
  std::weak_ptr<Node> grad_accumulator;  // leaves only
  std::shared_ptr<TensorHookList> hooks;  // created on first register_hook
  std::shared_ptr<PostAccumulateGradHookList> post_accumulate_hooks;  // leaves only
};

// The tensor's meta, created on demand.
AutogradMeta& ensure_meta(const Tensor& t);
// The tensor's meta or nullptr.
inline AutogradMeta* meta_of(const Tensor& t) { return t.autograd_meta().get(); }

// The node that produced `t`, or null (leaf, or no autograd history).
std::shared_ptr<Node> grad_fn(const Tensor& t);
// requires_grad and no grad_fn.
bool is_leaf(const Tensor& t);

// The AccumulateGrad node of leaf `t` (requires_grad), created on first use.
std::shared_ptr<Node> grad_accumulator(const Tensor& t);

// Where the gradient w.r.t. `t` must go: its grad_fn's slot, its accumulator, or an invalid edge when
// `t` does not require grad.
Edge gradient_edge(const Tensor& t);

// True when grad mode is on and any of the defined tensors requires grad: an op should record a node.
bool should_record(std::initializer_list<const Tensor*> inputs);
bool should_record(const TensorList& inputs);

// One edge per input (invalid for inputs that do not require grad or are undefined).
std::vector<Edge> collect_next_edges(std::initializer_list<const Tensor*> inputs);
std::vector<Edge> collect_next_edges(const TensorList& inputs);

// Makes `out` output number node.add_output(...) of `node`: sets requires_grad and grad_fn.
// `out` must be a fresh tensor (no autograd history yet).
void set_history(const Tensor& out, const std::shared_ptr<Node>& node);

}  // namespace shardkit::autograd
