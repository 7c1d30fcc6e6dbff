#include "common/optim/adam.h"

#include "absl/strings/str_cat.h"
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
