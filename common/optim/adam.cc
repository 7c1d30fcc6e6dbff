#include "common/optim/adam.h"

#include "absl/strings/str_cat.h"
#include "common/optim/cuda/cuda_optim_kernels.h"
#include "common/optim/device_update_batches.h"
#include "common/optim/fused_kernels.h"

namespace shardkit::optim {

absl::Status AdamBase::validate_hyper(const HyperParams& h) const {
  if (!(h.lr >= 0)) return absl::InvalidArgumentError(absl::StrCat("expected lr >= 0, found ", h.lr));
  if (!(h.eps >= 0)) return absl::InvalidArgumentError(absl::StrCat("expected eps >= 0, found ", h.eps));
  if (!(h.beta1 >= 0 && h.beta1 < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("expected 0 <= beta1 < 1, found ", h.beta1));
  }
  if (!(h.beta2 >= 0 && h.beta2 < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("expected 0 <= beta2 < 1, found ", h.beta2));
  }
  if (!(h.weight_decay >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("expected weight_decay >= 0, found ", h.weight_decay));
  }
  return absl::OkStatus();
}

void AdamBase::init_state(const HyperParams& h, const Tensor& param, ParamState& state) const {
  state.tensors[kExpAvg] = zeros_state(param);
  state.tensors[kExpAvgSq] = zeros_state(param);
}

void AdamBase::update(const HyperParams& h, const Tensor& weights, const Tensor& param, const Tensor& grad,
                      ParamState& state) {
  const bool master = !weights.is_same(param);
  fused::adam_step(weights.data<float>(), master ? param.raw_data() : nullptr, param.dtype(), grad.raw_data(),
                   grad.dtype(), state.tensors.at(kExpAvg).data<float>(), state.tensors.at(kExpAvgSq).data<float>(),
                   param.numel(), fused::adam_coeffs(h, state.step, decoupled_));
}

void AdamBase::update_on_device(const HyperParams& h, Device device, absl::Span<const DeviceUpdate> updates) {
  std::vector<std::pair<DtypePair, std::vector<cuda::AdamTensor>>> batches;
  for (const DeviceUpdate& u : updates) {
    const bool master = !u.weights.is_same(u.param);
    const fused::AdamCoeffs c = fused::adam_coeffs(h, u.state->step, decoupled_);
    add_to_batch(batches, {u.param.dtype(), u.grad.dtype()},
                 cuda::AdamTensor{.w = u.weights.data<float>(),
                                  .param_out = master ? u.param.raw_data() : nullptr,
                                  .grad = u.grad.raw_data(),
                                  .m = u.state->tensors.at(kExpAvg).data<float>(),
                                  .v = u.state->tensors.at(kExpAvgSq).data<float>(),
                                  .n = u.param.numel(),
                                  .step_size = c.step_size,
                                  .inv_sqrt_bc2 = c.inv_sqrt_bc2});
  }
  // Everything but step_size and inv_sqrt_bc2 (per tensor, above) is the same for every step count.
  const fused::AdamCoeffs shared = fused::adam_coeffs(h, 1, decoupled_);
  for (const auto& [dtypes, tensors] : batches) cuda::adam_step(device, dtypes.param, dtypes.grad, tensors, shared);
}

Adam::Adam(std::vector<Tensor> params, HyperParams hyper) : AdamBase("Adam", hyper, false) {
  absl::Status s = add_param_group(ParamGroup{std::move(params), hyper});
  SK_CHECK(s.ok()) << s.message();
}

absl::StatusOr<std::unique_ptr<Optimizer>> Adam::make(std::vector<ParamGroup> groups, HyperParams defaults) {
  return make_optimizer<Adam>(std::move(groups), defaults);
}

OptimizerFactory Adam::factory(HyperParams defaults) {
  return [defaults](std::vector<ParamGroup> groups) { return make(std::move(groups), defaults); };
}

AdamW::AdamW(std::vector<Tensor> params, HyperParams hyper) : AdamBase("AdamW", hyper, true) {
  absl::Status s = add_param_group(ParamGroup{std::move(params), hyper});
  SK_CHECK(s.ok()) << s.message();
}

absl::StatusOr<std::unique_ptr<Optimizer>> AdamW::make(std::vector<ParamGroup> groups, HyperParams defaults) {
  return make_optimizer<AdamW>(std::move(groups), defaults);
}

OptimizerFactory AdamW::factory(HyperParams defaults) {
  return [defaults](std::vector<ParamGroup> groups) { return make(std::move(groups), defaults); };
}

}  // namespace shardkit::optim
