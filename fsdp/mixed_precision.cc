#include "fsdp/mixed_precision.h"

#include <memory>

#include "common/autograd/function.h"

namespace shardkit::fsdp {
namespace {

// y = x rounded to a narrower dtype, kept f32; dy/dx = identity (the straight-through gradient of a cast).
class RoundTo : public autograd::Function {
 public:
  explicit RoundTo(DType dtype) : dtype_(dtype) {}
  std::string name() const override { return "FsdpRoundToParamDtype"; }
  nn::TensorList forward(const nn::TensorList& in) override { return {in[0].to(dtype_).to(DType::f32)}; }
  nn::TensorList backward(const nn::TensorList& grad_out) override { return {grad_out[0]}; }

 private:
  DType dtype_;
};

}  // namespace

nn::TensorList round_floating(const nn::TensorList& values, DType dtype) {
  if (dtype == DType::f32) return values;
  nn::TensorList out;
  out.reserve(values.size());
  for (const Tensor& t : values) {
    if (!t.defined() || t.dtype() != DType::f32) {
      out.push_back(t);
      continue;
    }
    out.push_back(autograd::apply_function(std::make_shared<RoundTo>(dtype), {t})[0]);
  }
  return out;
}

}  // namespace shardkit::fsdp
