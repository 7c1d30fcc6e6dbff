// AccumulateGrad: the node that adds a gradient into a leaf's .grad and then runs the leaf's
// post-accumulate-grad hooks (DESIGN.md section 2; hooks.h for the contract).
#pragma once

#include "common/autograd/node.h"

namespace shardkit::autograd {

class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(Tensor variable);

  std::string name() const override { return "AccumulateGrad"; }
  TensorList apply(TensorList&& grads) override;
  bool releasable() const override { return false; }
  bool is_accumulate_grad() const override { return true; }

  const Tensor& variable() const { return variable_; }

 private:
  Tensor variable_;
};

}  // namespace shardkit::autograd
