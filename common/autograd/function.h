// Custom differentiable functions: user forward + user backward (DESIGN.md section 2, hook table).
//
//   class Scale2 : public autograd::Function {
//     TensorList forward(const TensorList& in) override { ... return {y}; }
//     TensorList backward(const TensorList& grad_out) override { return {dx}; }
//   };
//   TensorList y = autograd::apply_function(std::make_shared<Scale2>(), {x});
//
// forward() runs with grad mode off. When grad mode is on and an input requires grad, apply_function
// records one node whose backward calls the function's backward(). Its outputs then require grad and
// behave like any op's outputs (hooks, ordering by creation). An output that is one of the inputs
// (identity functions, as FSDP's unit-boundary markers) is returned as a new handle over the same
// bytes, so the input's own history is untouched.
//
// backward(grad_outputs) gets one gradient per forward output (zeros where none arrived) and returns
// one per input: undefined for inputs that get no gradient, otherwise the input's shape.
//
// Saving: keep what backward needs with save_for_backward() (dropped with the graph after backward).
// Do not keep output handles as members (a reference cycle: output -> node -> function -> output);
// save_for_backward stores bytes-only aliases (detach()) so it is safe for outputs.
#pragma once

#include <memory>
#include <string>

#include "common/autograd/node.h"

namespace shardkit::autograd {

class Function {
 public:
  virtual ~Function() = default;
  virtual std::string name() const { return "CustomFunction"; }
  virtual TensorList forward(const TensorList& inputs) = 0;
  virtual TensorList backward(const TensorList& grad_outputs) = 0;

  void save_for_backward(const TensorList& tensors);
  const TensorList& saved_tensors() const { return saved_; }
  // Called when the graph is freed: drops saved tensors (override to drop more, call the base).
  virtual void release_saved() { saved_.clear(); }

 private:
  TensorList saved_;
};

TensorList apply_function(const std::shared_ptr<Function>& fn, const TensorList& inputs);

}  // namespace shardkit::autograd
