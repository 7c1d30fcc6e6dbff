#include "common/optim/clip_grad.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/kernels/elementwise.h"
#include "common/kernels/reduce.h"
#include "common/tensor/trace_hook.h"

namespace shardkit::optim {
namespace {

bool IsInf(double norm_type) { return norm_type == std::numeric_limits<double>::infinity(); }

void CheckNormType(double norm_type) {
  SK_CHECK(norm_type == 2.0 || IsInf(norm_type)) << "clip_grad_norm: norm_type must be 2 or inf, found "
                                                 << norm_type;
}

double PartialOf(absl::Span<const Tensor> grads, double norm_type) {
  double acc = 0.0;
  for (const Tensor& g : grads) {
    if (IsInf(norm_type)) acc = std::max(acc, kernels::max_abs(g));
    else acc += kernels::sum_squares(g);
  }
  return acc;
}

void ScaleEach(absl::Span<const Tensor> grads, double factor) {
  for (const Tensor& g : grads) kernels::scale_(static_cast<float>(factor), g);  // checks the dtype is floating
}

std::vector<Tensor> GradsOf(absl::Span<const Tensor> params) {
  std::vector<Tensor> grads;
  for (const Tensor& p : params) {
    if (Tensor g = p.grad(); g.defined()) grads.push_back(std::move(g));
  }
  return grads;
}

double ClipEach(absl::Span<const Tensor> grads, double max_norm, double norm_type) {
  const double total = grad_norm_from_partial(PartialOf(grads, norm_type), norm_type);
  const double coef = clip_coefficient(total, max_norm);
  if (!(coef >= 1.0)) ScaleEach(grads, coef);  // NaN scales too, as PyTorch
  return total;
}

}  // namespace

double grad_norm_partial(absl::Span<const Tensor> params, double norm_type) {
  CheckNormType(norm_type);
  return PartialOf(GradsOf(params), norm_type);
}

double grad_norm_from_partial(double partial, double norm_type) {
  CheckNormType(norm_type);
  return IsInf(norm_type) ? partial : std::sqrt(partial);
}

double clip_coefficient(double total_norm, double max_norm) {
  const double c = max_norm / (total_norm + 1e-6);
  return c > 1.0 ? 1.0 : c;  // keeps NaN (std::min would not)
}

// Note [tracing clipping]
// clip_grad_norm writes the gradients in place with plain kernels, which a captured step would not see (replay would
// skip the clipping): it reports itself as one op over the gradients (trace_hook.h), whose kernel clips the
// gradients replay hands it. Its return value is the norm of the captured step only. scale_grads on its own (the
// sharded clip's last step) is reported unsupported while capturing: it is not replayed yet.
void scale_grads(absl::Span<const Tensor> params, double factor) {
  if (trace::Tracer* t = trace::active_tracer()) t->on_unsupported("optim::scale_grads (in-place gradient writes)");
  ScaleEach(GradsOf(params), factor);
}

double clip_grad_norm(absl::Span<const Tensor> params, double max_norm, double norm_type) {
  CheckNormType(norm_type);
  trace::OpTraceScope scope;
  const std::vector<Tensor> grads = GradsOf(params);
  const double total = ClipEach(grads, max_norm, norm_type);
  scope.record("clip_grad_norm", grads, grads, [max_norm, norm_type](trace::KernelArgs& a) {
    ClipEach(a.writes, max_norm, norm_type);
  });
  return total;
}

}  // namespace shardkit::optim
