// Optimizer: the base of SGD, Adam and AdamW (DESIGN.md section 2, optim/), and what OSS wraps.
//
// What it holds: param groups (parameter tensor handles + HyperParams) and, per parameter, a ParamState
// created lazily at the parameter's first step (like PyTorch). It does not own the parameters' bytes: it
// holds handles, reads each parameter's grad slot and writes the parameter in place.
//
// step(): for every group and parameter, in order, skips parameters whose grad is undefined (like
// PyTorch), otherwise increments the parameter's step count and applies one fused update (one pass over
// the elements: see fused_kernels.h). Gradients may be f32, bf16 or f16 whatever the parameter's dtype;
// they are read in fp32. It returns a Status (Note [training step contract]): InvalidArgument when a group's
// hyper-parameters were set out of range (mutable_hyper), FailedPrecondition when a parameter's storage is
// released (typically: the optimizer was built from model.parameters() before fsdp::fully_shard, which
// releases the tensors it takes over); both are checked before anything is updated, so an error steps nothing.
// A grad whose element count differs from its parameter's is a broken invariant (InternalError).
// Parameters live on the CPU or, for SGD / Adam / AdamW (has_device_kernels), on a CUDA device: step() then
// updates each device's parameters of a group in one fused multi-tensor launch per (parameter, gradient) dtype
// pair, on the calling thread's stream, and returns without waiting for it. A grad lives on its parameter's
// device. On CUDA, state_dict / load_state_dict are not supported yet (they read state on the host).
//
// Note [training step contract]
// Every strategy's training loop is the same three lines, on the object that owns the step: the plain
// Optimizer (no sharding, DistributedDataParallel, fsdp::fully_shard: over model.parameters(), the shards) or the
// oss::Oss (ZeRO-1, and ZeRO-2 with sddp::ShardedDataParallel):
//
//   opt->zero_grad();
//   autograd::backward(model.loss(x, y));                  // a wrapper reduces the gradients during backward
//   if (absl::Status s = opt->step(); !s.ok()) return s;   // step() is [[nodiscard]]
//
//   * zero_grad(set_to_none = true) drops (or zeroes) the gradient of every parameter the object holds
//     (the Oss: all of them, owned or not, and the slices ShardedDataParallel delivered to it). It is the
//     only zeroing call: the wrappers (sddp::DataParallel, fsdp::fully_shard's units) have none, and keep no
//     gradient of their own after a synchronised backward (ShardedDataParallel hands the reduced slices
//     over to the Oss: Note [delivered gradient slices] in oss/oss.h).
//   * step() returns absl::Status: errors from input or from other ranks (a hyper-parameter set out of
//     range, a released parameter, a failed collective in oss::Oss::step) are Statuses naming what was
//     expected and what was found; broken internal invariants stay checks (InternalError).
//   * The plain Optimizer's step() leaves .grad in place (as PyTorch's); the Oss's releases the slices it
//     was handed. Either way, zero_grad() before each backward is the rule.
//
// Note [master weights]
// A bf16/f16 parameter gets, at its first step, an fp32 master copy (state key "master", charged to
// optimizer_state) initialised from the parameter's current values. From then on the master is the truth:
// each step updates the master in fp32 and writes the parameter as the master rounded to nearest even.
// If you overwrite such a parameter from outside afterwards (loading model weights), call
// sync_master_from_params(), or the next step will overwrite your values from the stale master.
//
// Hyper-parameters may be changed between steps through mutable_hyper(g) (LR schedules do this). The
// parameter lists are fixed once added (add_param_group appends a group).
//
// Memory: every state tensor is fp32 and shaped like its parameter, charged to optimizer_state. So for
// fp32 params: AdamW/Adam hold exactly 8 bytes per stepped element (m, v), SGD with momentum 4, SGD
// without momentum 0; bf16/f16 params add 4 bytes (master). Step counts are plain integers.
//
// Thread-safety: none; an Optimizer belongs to one rank (one thread at a time).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/optim/param_group.h"
#include "common/optim/state_dict.h"

namespace shardkit::optim {

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // "SGD", "Adam", "AdamW".
  const std::string& name() const { return name_; }

  // One update of every parameter that has a gradient; nothing is updated when it returns an error. See the
  // file comment and Note [training step contract].
  [[nodiscard]] absl::Status step();

  // Every parameter's grad becomes undefined (set_to_none) or is filled with zeros (Note [training step
  // contract]).
  void zero_grad(bool set_to_none = true);

  // Appends a group. InvalidArgument (and no change) if a parameter is undefined, not floating point, on a
  // CUDA device when the optimizer has no device kernels, already in a group (of this optimizer, or twice in
  // `group`), or if a hyper-parameter is out of range ("expected lr >= 0, found -1"). An empty group is allowed
  // (an OSS rank may own nothing of it).
  absl::Status add_param_group(ParamGroup group);
  // Same with this optimizer's default hyper-parameters.
  absl::Status add_param_group(std::vector<Tensor> params) { return add_param_group({std::move(params), defaults_}); }

  std::size_t num_param_groups() const { return groups_.size(); }
  const ParamGroup& param_group(std::size_t g) const;
  // Change a group's hyper-parameters between steps (lr schedules, OSS propagating a change).
  HyperParams& mutable_hyper(std::size_t g);
  const HyperParams& defaults() const { return defaults_; }

  // Total number of parameters; parameter `index` in group order (Note [parameter indices]).
  std::int64_t num_params() const { return num_params_; }
  const Tensor& param(std::int64_t index) const;
  // The state of parameter `index`, or nullptr before its first step.
  const ParamState* state(std::int64_t index) const;

  // A copy of the full state (tensors are new, charged to the calling thread's current category), with
  // parameters named 0..num_params()-1. See Note [parameter indices] for how OSS maps them.
  OptimizerStateDict state_dict() const;

  // Replaces the state and every group's hyper-parameters with the dict's (values are copied into new
  // optimizer_state tensors; the dict is not kept). On any mismatch it returns InvalidArgument saying what
  // was expected and what was found, and the optimizer is unchanged: optimizer name, number of groups,
  // number of params per group, negative or duplicate indices, state for an index no group lists, missing
  // or unexpected state keys, tensor shapes and dtypes (state tensors are f32), negative step counts, and
  // hyper-parameters out of range (Note [state dict validation] in state_dict_validation.h).
  absl::Status load_state_dict(const OptimizerStateDict& dict);
  // What load_state_dict(dict) would return, without loading anything.
  absl::Status check_state_dict(const OptimizerStateDict& dict) const;

  // The rules a state dict of this optimizer's type follows, whatever its parameters (validate_state_dict
  // uses them): the range checks of a group's hyper-parameters ("expected lr >= 0, found -1"), and the state
  // keys a parameter of dtype `dtype` in a group with `h` must have (required, "master" included for bf16 /
  // f16) and may have besides (optional).
  absl::Status check_hyper(const HyperParams& h) const { return validate_hyper(h); }
  struct StateKeys {
    std::set<std::string> required, optional;
  };
  StateKeys state_keys(const HyperParams& h, DType dtype) const;

  // Re-reads every bf16/f16 parameter's fp32 master from the parameter's current values.
  void sync_master_from_params();

 protected:
  Optimizer(std::string name, HyperParams defaults);

  // Range checks for this optimizer's hyper-parameters ("expected ..., found ..."; the message is
  // prefixed by the caller with the group).
  virtual absl::Status validate_hyper(const HyperParams& h) const = 0;
  // The state keys a parameter's state must have (besides "master", which the base class handles), and
  // those it may have. load_state_dict accepts exactly required ∪ (subset of optional).
  virtual std::vector<std::string> required_state_keys(const HyperParams& h) const = 0;
  virtual std::vector<std::string> optional_state_keys(const HyperParams& h) const { return {}; }
  // Creates the state tensors of a parameter before its first step (zeros; charged to optimizer_state by
  // the caller's scope). The base class has already added "master" if needed.
  virtual void init_state(const HyperParams& h, const Tensor& param, ParamState& state) const = 0;
  // One update. `state.step` has already been incremented (1 at the first step). `weights` is the fp32
  // tensor to update in place (the master for bf16/f16 params, else the param itself); `param` is the
  // parameter to write back to (the same tensor as `weights` for fp32 params).
  virtual void update(const HyperParams& h, const Tensor& weights, const Tensor& param, const Tensor& grad,
                      ParamState& state) = 0;

  // Parameters on a CUDA device (issue 14). An optimizer that returns true here updates them in
  // update_on_device; add_param_group refuses CUDA parameters for one that does not.
  virtual bool has_device_kernels() const { return false; }
  // One parameter of a batched update: update()'s arguments.
  struct DeviceUpdate {
    Tensor weights, param, grad;
    ParamState* state = nullptr;
  };
  // Updates parameters that all live on `device` (a CUDA device), each as update() would, in as few kernel
  // launches as the optimizer can (Note [multi-tensor launches] in multi_tensor_plan.h). Each state.step has
  // already been incremented. Launched on the calling thread's stream, not waited for. Called only when
  // has_device_kernels().
  virtual void update_on_device(const HyperParams& h, Device device, absl::Span<const DeviceUpdate> updates);

  // Helper for subclasses: a zero fp32 tensor shaped like `like`, on its device, charged to optimizer_state.
  static Tensor zeros_state(const Tensor& like);

 private:
  absl::Status check_group(const ParamGroup& group, std::size_t group_index) const;
  // What step() refuses before updating anything (hyper-parameters, released parameters).
  absl::Status check_step() const;
  // Reports one parameter's update to the calling thread's tracer, if any (Note [tracing the update]).
  void trace_update(std::size_t group_index, std::size_t index, const Tensor& weights, const Tensor& param,
                    const Tensor& grad, const ParamState& st);

  std::string name_;
  HyperParams defaults_;
  std::vector<ParamGroup> groups_;
  // Parallel to the concatenated params: empty until the parameter's first step.
  std::vector<std::optional<ParamState>> states_;
  std::int64_t num_params_ = 0;
};

// What OSS takes: builds an optimizer over the given groups (typically a rank's share of every group, with
// the full model's hyper-parameters). Status if add_param_group would fail.
using OptimizerFactory = std::function<absl::StatusOr<std::unique_ptr<Optimizer>>(std::vector<ParamGroup>)>;

// Builds a T (constructed from `defaults`) and adds `groups` in order; the first failing group's Status.
template <typename T>
absl::StatusOr<std::unique_ptr<Optimizer>> make_optimizer(std::vector<ParamGroup> groups, HyperParams defaults) {
  auto opt = std::make_unique<T>(defaults);
  for (ParamGroup& g : groups) {
    if (absl::Status s = opt->add_param_group(std::move(g)); !s.ok()) return s;
  }
  return std::unique_ptr<Optimizer>(std::move(opt));
}

}  // namespace shardkit::optim
