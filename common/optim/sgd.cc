#include "common/optim/sgd.h"

#include "absl/strings/str_cat.h"
#include "common/optim/cuda/cuda_optim_kernels.h"
#include "common/optim/device_update_batches.h"
#include "common/optim/fused_kernels.h"

namespace shardkit::optim {

Sgd::Sgd(std::vector<Tensor> params, HyperParams hyper) : Optimizer("SGD", hyper) {
  absl::Status s = add_param_group(ParamGroup{std::move(params), hyper});
  SK_CHECK(s.ok()) << s.message();
}

absl::StatusOr<std::unique_ptr<Optimizer>> Sgd::make(std::vector<ParamGroup> groups, HyperParams defaults) {
  return make_optimizer<Sgd>(std::move(groups), defaults);
}

OptimizerFactory Sgd::factory(HyperParams defaults) {
  return [defaults](std::vector<ParamGroup> groups) { return make(std::move(groups), defaults); };
}

absl::Status Sgd::validate_hyper(const HyperParams& h) const {
  if (!(h.lr >= 0)) return absl::InvalidArgumentError(absl::StrCat("expected lr >= 0, found ", h.lr));
  if (!(h.momentum >= 0)) return absl::InvalidArgumentError(absl::StrCat("expected momentum >= 0, found ", h.momentum));
  if (!(h.weight_decay >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("expected weight_decay >= 0, found ", h.weight_decay));
  }
  if (h.nesterov && (h.momentum <= 0 || h.dampening != 0)) {
    return absl::InvalidArgumentError(absl::StrCat("Nesterov momentum expects momentum > 0 and dampening = 0, found ",
                                                   "momentum=", h.momentum, " dampening=", h.dampening));
  }
  return absl::OkStatus();
}

// Note [SGD's momentum buffer]
// With momentum on from the start the buffer is state from the parameter's first step (init_state), so a captured
// step records it and its replay carries it from call to call; made inside the update instead, each replay (which
// hands the update a fresh view of the recorded state) made a new zero buffer, and a step compiled from the start
// never built up momentum (a helper's audit, tests/common/capture/compile_combo_test.cc). Its first step takes the
// gradient as it is (PyTorch: buf = grad; it differs from a zero buffer's step with dampening only), told by the step
// count: a state dict holding a buffer must hold its step count too (ours do). Momentum turned on mid-run makes the
// buffer at its first use (Note [tracing the update] in optimizer.cc says what a replay does with it).
void Sgd::init_state(const HyperParams& h, const Tensor& param, ParamState& state) const {
  if (h.momentum != 0.0) state.tensors.emplace(kMomentumBuffer, zeros_state(param));
}

Sgd::Momentum Sgd::momentum_buffer(const HyperParams& h, const Tensor& param, ParamState& state) {
  if (h.momentum == 0.0) return {};
  auto it = state.tensors.find(kMomentumBuffer);
  if (it != state.tensors.end()) return {it->second.data<float>(), state.step == 1};
  return {state.tensors.emplace(kMomentumBuffer, zeros_state(param)).first->second.data<float>(), true};
}

void Sgd::update(const HyperParams& h, const Tensor& weights, const Tensor& param, const Tensor& grad,
                 ParamState& state) {
  const auto [buf, first] = momentum_buffer(h, param, state);
  const bool master = !weights.is_same(param);
  fused::sgd_step(weights.data<float>(), master ? param.raw_data() : nullptr, param.dtype(), grad.raw_data(),
                  grad.dtype(), buf, param.numel(), fused::sgd_coeffs(h, first));
}

void Sgd::update_on_device(const HyperParams& h, Device device, absl::Span<const DeviceUpdate> updates) {
  std::vector<std::pair<DtypePair, std::vector<cuda::SgdTensor>>> batches;
  for (const DeviceUpdate& u : updates) {
    const auto [buf, first] = momentum_buffer(h, u.param, *u.state);
    const bool master = !u.weights.is_same(u.param);
    const fused::SgdCoeffs c = fused::sgd_coeffs(h, first);
    add_to_batch(batches, {u.param.dtype(), u.grad.dtype()},
                 cuda::SgdTensor{.w = u.weights.data<float>(),
                                 .param_out = master ? u.param.raw_data() : nullptr,
                                 .grad = u.grad.raw_data(),
                                 .buf = buf,
                                 .n = u.param.numel(),
                                 .keep = c.keep,
                                 .take = c.take});
  }
  // Everything but keep and take (per tensor, above: a new buffer takes the gradient as is) is shared.
  const fused::SgdCoeffs shared = fused::sgd_coeffs(h, false);
  for (const auto& [dtypes, tensors] : batches) cuda::sgd_step(device, dtypes.param, dtypes.grad, tensors, shared);
}

}  // namespace shardkit::optim
