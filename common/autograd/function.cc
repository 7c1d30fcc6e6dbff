#include "common/autograd/function.h"

#include "absl/strings/str_cat.h"
#include "common/autograd/autograd_meta.h"
#include "common/autograd/engine.h"
#include "common/autograd/grad_mode.h"
#include "common/autograd/ops/op_utils.h"

namespace shardkit::autograd {
namespace {

class FunctionNode final : public Node {
 public:
  explicit FunctionNode(std::shared_ptr<Function> fn, std::vector<Shape> input_shapes)
      : fn_(std::move(fn)), input_shapes_(std::move(input_shapes)) {}
  std::string name() const override { return fn_->name() + "Backward"; }
  TensorList apply(TensorList&& grads) override {
    TensorList out = fn_->backward(grads);
    if (out.size() != input_shapes_.size()) {
      throw AutogradError(absl::StrCat(fn_->name(), "::backward: expected ", input_shapes_.size(),
                                       " gradients (one per input), found ", out.size()));
    }
    for (std::size_t i = 0; i < out.size(); ++i) {
      if (out[i].defined() && out[i].shape() != input_shapes_[i]) {
        throw AutogradError(absl::StrCat(fn_->name(), "::backward: expected gradient ", i, " of shape ",
                                         shape_str(input_shapes_[i]), ", found ", out[i].describe()));
      }
    }
    return out;
  }

 protected:
  void release_saved() override { fn_->release_saved(); }

 private:
  std::shared_ptr<Function> fn_;
  std::vector<Shape> input_shapes_;
};

}  // namespace

void Function::save_for_backward(const TensorList& tensors) {
  saved_.clear();
  for (const Tensor& t : tensors) saved_.push_back(t.defined() ? t.detach() : Tensor());
}

namespace {

TensorList apply_function_compute(const std::shared_ptr<Function>& fn, const TensorList& inputs) {
  const bool record = should_record(inputs);
  TensorList outputs;
  {
    NoGradGuard no_grad;
    outputs = fn->forward(inputs);
  }
  if (!record) return outputs;
  for (Tensor& o : outputs) {
    if (!o.defined()) continue;
    bool alias = o.autograd_meta() != nullptr || o.requires_grad();
    for (const Tensor& in : inputs) alias = alias || o.is_same(in);
    if (alias) o = o.detach();
  }
  std::vector<Shape> shapes;
  for (const Tensor& in : inputs) shapes.push_back(in.defined() ? in.shape() : Shape{});
  auto node = std::make_shared<FunctionNode>(fn, std::move(shapes));
  node->set_next_edges(collect_next_edges(inputs));
  for (const Tensor& o : outputs) {
    // Outputs that cannot carry a gradient still take a slot, so grad_outputs[i] matches outputs[i].
    if (o.defined() && is_floating(o.dtype())) {
      set_history(o, node);
    } else {
      node->add_output(o.defined() ? o.shape() : Shape{}, DType::f32);
    }
  }
  return outputs;
}

}  // namespace

// Traced as one op (Note [traced ops]): replay calls the function's forward again, which saves what its backward
// will read, and the node it makes is the one the replayed backward runs.
TensorList apply_function(const std::shared_ptr<Function>& fn, const TensorList& inputs) {
  return detail::traced_list(fn->name().c_str(), inputs,
                             [fn](const TensorList& in) { return apply_function_compute(fn, in); });
}

}  // namespace shardkit::autograd
