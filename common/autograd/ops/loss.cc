#include "common/autograd/ops/loss.h"

#include <cmath>

#include "common/autograd/ops/fast_math.h"
#include "common/autograd/ops/op_utils.h"
#include "common/kernels/cuda/cuda_kernels.h"

namespace shardkit::autograd {
namespace {

// cross_entropy on a CUDA device (Note [ops on devices]): the loss and the number of kept rows stay on the device
// for the backward; the forward waits for the device to check the targets.
Tensor CrossEntropyOnDevice(const Tensor& logits, const Tensor& targets, std::int64_t ignore_index,
                            std::int64_t rows, std::int64_t v) {
  const Device device = logits.device();
  Tensor lse_t = detail::new_activation({rows}, DType::f32, device);
  Tensor count_t = detail::new_activation({1}, DType::f32, device);
  Tensor out = detail::new_activation({}, DType::f32, device);
  const std::int64_t bad = kernels::cuda::cross_entropy(
      device, detail::ptr_or_null<float>(logits), detail::ptr_or_null<std::int64_t>(targets),
      detail::ptr_or_null<float>(lse_t), out.data<float>(), count_t.data<float>(), rows, v, ignore_index);
  SK_CHECK(bad < 0) << "cross_entropy: target " << detail::i64_at(targets, bad) << " at position " << bad
                    << " is outside [0, " << v << ")";
  if (should_record({&logits})) {
    detail::record("CrossEntropyBackward", {&logits}, {&out},
                   [logits, targets, lse_t, count_t, rows, v, ignore_index](TensorList&& g) -> TensorList {
                     Tensor gx = detail::new_activation(logits.shape(), DType::f32, logits.device());
                     kernels::cuda::cross_entropy_backward(
                         logits.device(), detail::ptr_or_null<float>(logits),
                         detail::ptr_or_null<std::int64_t>(targets), detail::ptr_or_null<float>(lse_t),
                         g[0].data<float>(), count_t.data<float>(), detail::ptr_or_null<float>(gx), rows, v,
                         ignore_index);
                     return {gx};
                   });
  }
  return out;
}

}  // namespace

Tensor cross_entropy_compute(const Tensor& logits, const Tensor& targets, std::int64_t ignore_index) {
  detail::check_f32("cross_entropy", logits);
  SK_CHECK(targets.defined() && targets.dtype() == DType::i64 && targets.device() == logits.device())
      << "cross_entropy: expected i64 targets on " << logits.device().str() << ", found "
      << (targets.defined() ? targets.describe() : "undefined");
  SK_CHECK_GE(logits.dim(), 1);
  const std::int64_t v = logits.size(-1);
  const std::int64_t rows = v == 0 ? 0 : logits.numel() / v;
  SK_CHECK_EQ(targets.numel(), rows) << "cross_entropy: expected one target per row of logits " << logits.describe()
                                     << ", found targets " << targets.describe();
  if (logits.device().is_cuda()) return CrossEntropyOnDevice(logits, targets, ignore_index, rows, v);
  const float* x = logits.data<float>();
  const std::int64_t* t = targets.data<std::int64_t>();
  Tensor lse_t = detail::new_activation({rows});
  float* lse = lse_t.data<float>();
  double total = 0;
  std::int64_t count = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t target = t[r];
    if (target == ignore_index) {
      lse[r] = 0;
      continue;
    }
    SK_CHECK(target >= 0 && target < v) << "cross_entropy: target " << target << " at position " << r
                                        << " is outside [0, " << v << ")";
    const float* __restrict xr = x + r * v;
    // Max and sum of exps in lanes (Note [lane sums] in fast_math.h): vectorised.
    const float mx = detail::lane_max(xr, v);
    const float s = detail::lane_sum_exp(xr, v, mx);
    lse[r] = mx + std::log(s);
    total += static_cast<double>(lse[r]) - static_cast<double>(xr[target]);
    ++count;
  }
  Tensor out = detail::new_activation({});
  out.data<float>()[0] = count > 0 ? static_cast<float>(total / static_cast<double>(count)) : 0.f;
  if (should_record({&logits})) {
    detail::record("CrossEntropyBackward", {&logits}, {&out},
                   [logits, targets, lse_t, rows, v, count, ignore_index](TensorList&& g) -> TensorList {
                     Tensor gx = detail::new_activation(logits.shape());
                     const float scale = count > 0 ? g[0].data<float>()[0] / static_cast<float>(count) : 0.f;
                     const float* x = logits.data<float>();
                     const std::int64_t* t = targets.data<std::int64_t>();
                     const float* lse = lse_t.data<float>();
                     float* o = gx.data<float>();
                     for (std::int64_t r = 0; r < rows; ++r) {
                       float* __restrict orow = o + r * v;
                       if (t[r] == ignore_index) {
                         for (std::int64_t j = 0; j < v; ++j) orow[j] = 0.f;
                         continue;
                       }
                       const float* __restrict xr = x + r * v;
                       const float l = lse[r];
                       for (std::int64_t j = 0; j < v; ++j) orow[j] = scale * detail::fast_exp(xr[j] - l);
                       orow[t[r]] -= scale;
                     }
                     return {gx};
                   });
  }
  return out;
}

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, std::int64_t ignore_index) {
  return detail::traced("cross_entropy", {logits, targets}, [ignore_index](const TensorList& t) { return cross_entropy_compute(t[0], t[1], ignore_index); });
}

}  // namespace shardkit::autograd
