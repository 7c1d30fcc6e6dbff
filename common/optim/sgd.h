// SGD with momentum, dampening, Nesterov momentum, weight decay and maximize, as torch.optim.SGD defines
// them (see fused_kernels.h for the update). State per parameter: "momentum_buffer" (fp32) once the
// parameter has stepped with momentum != 0; none otherwise. Like PyTorch, the first step with momentum
// sets the buffer to the gradient (no dampening), and a buffer is created lazily if momentum is switched
// on mid-run.
//
// maximize negates the gradient before weight decay and momentum, as PyTorch's implementation does (and as
// its Adam/AdamW documentation states); the SGD documentation box instead flips the sign of the final
// update, which differs only when weight_decay != 0 (the decay then still shrinks the weights here).
#pragma once

#include <memory>
#include <vector>

#include "common/optim/optimizer.h"

namespace shardkit::optim {

class Sgd final : public Optimizer {
 public:
  // PyTorch's defaults, with lr = 1e-3 (PyTorch requires it explicitly).
  static HyperParams default_hyper() { return HyperParams{.lr = 1e-3}; }

  // One group holding `params`, with `hyper`. Invalid arguments are a broken invariant here (InternalError);
  // use make() or add_param_group() for a Status.
  explicit Sgd(std::vector<Tensor> params, HyperParams hyper = default_hyper());
  // No groups yet: add them with add_param_group (which uses `defaults` for a bare parameter list).
  explicit Sgd(HyperParams defaults = default_hyper()) : Optimizer("SGD", defaults) {}

  static absl::StatusOr<std::unique_ptr<Optimizer>> make(std::vector<ParamGroup> groups,
                                                         HyperParams defaults = default_hyper());
  static OptimizerFactory factory(HyperParams defaults = default_hyper());

 protected:
  absl::Status validate_hyper(const HyperParams& h) const override;
  std::vector<std::string> required_state_keys(const HyperParams& h) const override { return {}; }
  std::vector<std::string> optional_state_keys(const HyperParams& h) const override { return {kMomentumBuffer}; }
  void init_state(const HyperParams& h, const Tensor& param, ParamState& state) const override;
  void update(const HyperParams& h, const Tensor& weights, const Tensor& param, const Tensor& grad,
              ParamState& state) override;
  bool has_device_kernels() const override { return true; }
  void update_on_device(const HyperParams& h, Device device, absl::Span<const DeviceUpdate> updates) override;

 private:
  // The momentum buffer (nullptr when momentum is off) and whether this is its first step (Note [SGD's momentum
  // buffer] in sgd.cc).
  struct Momentum {
    float* buf = nullptr;
    bool first = false;
  };
  static Momentum momentum_buffer(const HyperParams& h, const Tensor& param, ParamState& state);
};

}  // namespace shardkit::optim
