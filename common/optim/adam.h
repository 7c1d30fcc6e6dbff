// Adam and AdamW as torch.optim.Adam / torch.optim.AdamW define them (bias correction, eps added after
// the square root; Adam adds weight_decay * param to the gradient, AdamW decays the parameter by
// lr * weight_decay before the update). amsgrad is not supported. State per parameter: "exp_avg" and
// "exp_avg_sq" (fp32), plus the step count; see fused_kernels.h for the single-pass update.
#pragma once

#include <memory>
#include <vector>

#include "common/optim/optimizer.h"

namespace shardkit::optim {

class AdamBase : public Optimizer {
 protected:
  AdamBase(std::string name, HyperParams defaults, bool decoupled)
      : Optimizer(std::move(name), defaults), decoupled_(decoupled) {}
  absl::Status validate_hyper(const HyperParams& h) const override;
  std::vector<std::string> required_state_keys(const HyperParams& h) const override { return {kExpAvg, kExpAvgSq}; }
  void init_state(const HyperParams& h, const Tensor& param, ParamState& state) const override;
  void update(const HyperParams& h, const Tensor& weights, const Tensor& param, const Tensor& grad,
              ParamState& state) override;
  bool has_device_kernels() const override { return true; }
  void update_on_device(const HyperParams& h, Device device, absl::Span<const DeviceUpdate> updates) override;

 private:
  bool decoupled_;
};

class Adam final : public AdamBase {
 public:
  static HyperParams default_hyper() { return HyperParams{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8}; }
  // One group holding `params` (InternalError on invalid arguments; make() returns a Status instead).
  explicit Adam(std::vector<Tensor> params, HyperParams hyper = default_hyper());
  explicit Adam(HyperParams defaults = default_hyper()) : AdamBase("Adam", defaults, false) {}
  static absl::StatusOr<std::unique_ptr<Optimizer>> make(std::vector<ParamGroup> groups,
                                                         HyperParams defaults = default_hyper());
  static OptimizerFactory factory(HyperParams defaults = default_hyper());
};

class AdamW final : public AdamBase {
 public:
  // PyTorch's defaults (weight_decay 0.01).
  static HyperParams default_hyper() {
    return HyperParams{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 1e-2};
  }
  explicit AdamW(std::vector<Tensor> params, HyperParams hyper = default_hyper());
  explicit AdamW(HyperParams defaults = default_hyper()) : AdamBase("AdamW", defaults, true) {}
  static absl::StatusOr<std::unique_ptr<Optimizer>> make(std::vector<ParamGroup> groups,
                                                         HyperParams defaults = default_hyper());
  static OptimizerFactory factory(HyperParams defaults = default_hyper());
};

}  // namespace shardkit::optim
