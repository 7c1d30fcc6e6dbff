// Mixed precision shared by the sharding layers: the policy (FSDP2's MixedPrecisionPolicy; fsdp::fully_shard and
// sddp::DataParallel both take it), the rounding it applies to forward values, and MixedPrecisionHooks, which run
// a module's calls on its parameters rounded to the policy's param_dtype (DDP / ShardedDDP, and any training loop
// that keeps full parameters on every rank).
//
// Note [mixed precision on f32 ops]
// Parameters stay f32: they are the master the optimizer steps. With param_dtype = bf16 (or f16) the forward and
// backward compute with the parameters' values rounded to param_dtype. The CPU ops of this library compute in f32,
// so "computing in param_dtype" means f32 arithmetic on parameters (and, with cast_forward_inputs, inputs) whose
// values are param_dtype's: the values a bf16 model has, with f32 accumulation (the GPU path, issue 14, computes
// natively). fsdp: a unit's all-gather moves its shard cast to param_dtype (half the bytes) and the unsharded
// parameters hold those values. sddp (and MixedPrecisionHooks below): every call runs on rounded copies of the
// parameters. With reduce_dtype = bf16 the gradients are cast to it for their reduction (half the bytes; the
// backends accumulate in f32 and round once, process_group.h) and land f32 in the parameters' gradients.
// output_dtype rounds the root's floating outputs the same way. A single-rank model that rounds the same values at
// the same points is the reference the tests compare with.
//
// Note [rounded parameters in forward]
// MixedPrecisionHooks gives a call of a module its parameters rounded the way PyTorch DDP's _MixedPrecision swaps
// in low-precision parameters for the forward, without touching the masters' bytes: the call's pre-hook replaces
// each f32 parameter of the called module's subtree (Module::replace_parameter; forward reads parameters by name)
// by round_floating(p), an f32 tensor of param_dtype's values whose gradient is the identity, so backward
// accumulates the gradient into the master's .grad (post-accumulate-grad hooks, and so DDP's reducer, fire on the
// master as without mixed precision). A tensor registered by several modules (tied embeddings) gets one rounded
// copy per call, used by all of them. The call's post-hook puts the masters back: between calls, and for the
// optimizer, state_dict() and everything else, the module holds its f32 parameters; the rounded copies live on
// only as tensors the graph saved for backward. A call of a module made while no call is open (the root's call;
// an activation checkpoint's recompute inside backward, nn/checkpoint.h) opens one for that module's subtree, so a
// recompute sees the rounded values its forward saw; calls made inside an open call change nothing.
// Memory: the rounded copies are f32 (the ops are f32-only) and charged as MemoryCategory::parameter, so a call
// holds the masters (4 bytes per parameter) plus the copies (4 more) until the root's post-hook; on a GPU they
// would be param_dtype (2 bytes).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "common/autograd/hook_handle.h"
#include "common/nn/module.h"
#include "common/tensor/dtype.h"

namespace shardkit::nn {

struct MixedPrecisionPolicy {
  // The dtype whose values parameters have during forward and backward (fsdp: also the all-gather's dtype);
  // empty: f32 (no rounding).
  std::optional<DType> param_dtype = std::nullopt;
  // The dtype gradients are reduced in; empty: param_dtype's (or f32).
  std::optional<DType> reduce_dtype = std::nullopt;
  // The root's floating outputs are rounded to it; empty: unchanged.
  std::optional<DType> output_dtype = std::nullopt;
  // Floating inputs are rounded to param_dtype before the forward (fsdp: every unit's; sddp: the root's).
  bool cast_forward_inputs = true;

  DType compute_dtype() const { return param_dtype.value_or(DType::f32); }
  DType reduce_in() const { return reduce_dtype.value_or(compute_dtype()); }
};

// OK when every dtype set in `policy` is floating (f32, bf16, f16); otherwise InvalidArgument naming `who` and the
// field, e.g. "DistributedDataParallel: expected mixed_precision.param_dtype a floating dtype (f32, bf16 or f16),
// found i64".
absl::Status validate_mixed_precision(const MixedPrecisionPolicy& policy, std::string_view who);

// A new f32 tensor holding `src`'s (f32) values rounded to `dtype` (round to nearest even, dtype.h), charged to
// the current MemoryCategory; no temporary of dtype's size is allocated. Not differentiable (see round_floating).
Tensor rounded_to(const Tensor& src, DType dtype);

// The floating tensors of `values` rounded to `dtype` (an f32 tensor of dtype's values, charged to the current
// MemoryCategory), differentiable with an identity gradient; other tensors as they are. dtype f32: `values`
// unchanged.
TensorList round_floating(const TensorList& values, DType dtype);

// Hooks on `root` and every module below it (those present at construction) that run each call on rounded
// parameters (Note [rounded parameters in forward]); with cast_forward_inputs the root's floating inputs are
// rounded to param_dtype, and its floating outputs to output_dtype when set. reduce_dtype is not used here (the
// reducer's business). The policy must be valid (validate_mixed_precision). Destroying the object removes the
// hooks (and puts the masters back if a call is open). A call that throws leaves its rounded copies in the modules
// until the next call of the root (or of the module that threw), or until restore().
// Thread-safety: none; the module and this object belong to one rank. The module must outlive this object.
class MixedPrecisionHooks {
 public:
  MixedPrecisionHooks(Module& root, const MixedPrecisionPolicy& policy);
  ~MixedPrecisionHooks();
  MixedPrecisionHooks(const MixedPrecisionHooks&) = delete;
  MixedPrecisionHooks& operator=(const MixedPrecisionHooks&) = delete;

  // Puts the masters back if a call is open (a call that threw); no-op otherwise.
  void restore();
  // True while a call runs on rounded parameters.
  bool open() const { return opener_ != nullptr; }

 private:
  void open_for(Module& m);

  Module& root_;
  MixedPrecisionPolicy policy_;
  std::unordered_map<const Module*, std::vector<Module*>> subtree_;  // each hooked module: itself and below
  std::vector<autograd::HookHandle> hooks_;
  const Module* opener_ = nullptr;                                   // the module whose call opened the swap
  std::vector<std::tuple<Module*, std::string, Tensor>> swapped_;   // (module, local name, master)
};

}  // namespace shardkit::nn
