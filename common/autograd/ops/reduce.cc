#include "common/autograd/ops/reduce.h"

#include "common/autograd/ops/op_utils.h"

namespace shardkit::autograd {
namespace {

Tensor Reduce(const char* op, const char* node_name, const Tensor& x, bool average) {
  detail::check_f32_cpu(op, x);
  const std::int64_t n = x.numel();
  const float* p = x.data<float>();
  double acc = 0;
  for (std::int64_t i = 0; i < n; ++i) acc += p[i];
  const double factor = average ? (n > 0 ? 1.0 / static_cast<double>(n) : 0.0) : 1.0;
  Tensor out = detail::new_activation({});
  out.data<float>()[0] = static_cast<float>(acc * factor);
  if (should_record({&x})) {
    detail::record(node_name, {&x}, {&out}, [shape = x.shape(), factor](TensorList&& g) -> TensorList {
      Tensor gx = detail::new_activation(shape);
      gx.fill_(static_cast<double>(g[0].data<float>()[0]) * factor);
      return {gx};
    });
  }
  return out;
}

}  // namespace

Tensor sum(const Tensor& x) {
  return detail::traced("sum", {x}, [](const TensorList& t) { return Reduce("sum", "SumBackward", t[0], false); });
}
Tensor mean(const Tensor& x) {
  return detail::traced("mean", {x}, [](const TensorList& t) { return Reduce("mean", "MeanBackward", t[0], true); });
}

}  // namespace shardkit::autograd
