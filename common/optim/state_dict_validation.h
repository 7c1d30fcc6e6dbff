// The one check of an optimizer state dict, shared by every loader: Optimizer::load_state_dict (over its own
// parameters), oss::Oss::load_state_dict (a full dict over the global parameters, before any rank is
// re-sharded) and fsdp::load_full_optimizer_state (a full dict over the module's parameters, before it is cut
// into unit shards). So a dict refused by one strategy is refused by all, with the same message.
//
// Note [state dict validation]
// A dict fits an optimizer of kind K over parameters P (grouped) when:
//   * dict.optimizer is K's name, and it has as many groups as P, each listing as many indices as P's group;
//   * every group's hyper-parameters are in K's ranges;
//   * indices are >= 0 and each is listed once (Note [parameter indices]: the dict's i-th index of group g
//     is P's i-th parameter of group g; index values need not be 0..N-1);
//   * `state` has entries only for listed indices, each with a step count >= 0, exactly K's required keys
//     for that parameter (its group's hyper-parameters, its dtype: "master" for bf16/f16) plus any of K's
//     optional ones, and every tensor f32, on the CPU, shaped like its parameter.
// Parameters without state are fine (they have not stepped yet). Messages say what was expected and what
// was found and name the entry ("parameter 7 (f32[3, 4] cpu): state 'exp_avg': expected shape [3, 4],
// found [12]"); the caller prefixes who was loading.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/optim/optimizer.h"
#include "common/optim/state_dict.h"
#include "common/tensor/tensor.h"

namespace shardkit::optim {

// What a state dict entry is checked against: the parameter's shape, dtype and device (not its values).
struct ParamSpec {
  Shape shape;
  DType dtype = DType::f32;
  Device device = Device::cpu();

  static ParamSpec of(const Tensor& param) { return {param.shape(), param.dtype(), param.device()}; }
  // "f32[3, 4] cpu", as Tensor::describe().
  std::string describe() const;
};

// The parameters a dict must describe, by group, in each group's order.
using ParamLayout = std::vector<std::vector<ParamSpec>>;

// The layout of these groups' parameters.
ParamLayout param_layout(const std::vector<ParamGroup>& groups);

// OK when `dict` fits an optimizer of `kind`'s type (its name, hyper-parameter ranges and state keys; its own
// parameters are not looked at) over `params` (Note [state dict validation]); otherwise InvalidArgument
// naming the first entry that does not fit. Reads only; changes nothing.
absl::Status validate_state_dict(const OptimizerStateDict& dict, const Optimizer& kind, const ParamLayout& params);

}  // namespace shardkit::optim
