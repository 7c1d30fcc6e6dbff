#include "common/optim/sgd.h"

#include "absl/strings/str_cat.h"
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

void Sgd::update(const HyperParams& h, const Tensor& weights, const Tensor& param, const Tensor& grad,
                 ParamState& state) {
  float* buf = nullptr;
  bool first = false;
  if (h.momentum != 0.0) {
    auto it = state.tensors.find(kMomentumBuffer);
    if (it == state.tensors.end()) {
      it = state.tensors.emplace(kMomentumBuffer, zeros_state(param)).first;
      first = true;
    }
    buf = it->second.data<float>();
  }
  const bool master = !weights.is_same(param);
  fused::sgd_step(weights.data<float>(), master ? param.raw_data() : nullptr, param.dtype(), grad.raw_data(),
                  grad.dtype(), buf, param.numel(), fused::sgd_coeffs(h, first));
}

}  // namespace shardkit::optim
