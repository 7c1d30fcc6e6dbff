// Module: the base of every layer and model (DESIGN.md section 2, nn/).
//
// A Module has, in registration order, named parameters, named buffers and named child modules.
// Fully qualified names join the path with dots: "blocks.3.mlp.fc.weight".
//
//   class Net : public nn::Module {
//    public:
//     explicit Net(Generator& gen) : Module("Net") {
//       fc = register_module("fc", std::make_shared<nn::Linear>(4, 2, gen));
//     }
//     Tensor forward(const Tensor& x) override { return (*fc)(x); }
//     std::shared_ptr<nn::Linear> fc;
//   };
//
// Calling: `module(x)` (one tensor in, one out) or `module.call({...})` (lists) runs the forward pre-hooks,
// forward, then the forward hooks (DESIGN.md hook table: FSDP unshards before forward and reshards after,
// ShardedDDP syncs buffers), inside the module's call wrapper when it has one (set_call_wrapper). Composite
// modules must call their children this way, not child->forward(), so the children's hooks run. Override
// forward(Tensor) for one-in-one-out modules, or forward_list for several inputs/outputs.
//
// Shared parameters: the same tensor registered under two names (GPT's tied embedding) is listed once by
// named_parameters() under the first name in registration order (PyTorch's rule); pass
// remove_duplicate = false to list every name. state_dict() lists every name (as PyTorch).
//
// Parameters are leaves that require grad (unless registered otherwise or frozen with set_requires_grad).
// Modules create their parameters under MemoryCategory::parameter from a caller's Generator, so ranks
// that build a model from the same seed get bit-identical parameters.
//
// Ownership: children are held by shared_ptr; parameters and buffers are Tensor handles (the module and
// the caller share them). Thread-safety: none; a module belongs to one rank.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/autograd/hook_handle.h"
#include "common/autograd/node.h"
#include "common/tensor/tensor.h"

namespace shardkit::nn {

using autograd::HookHandle;
using autograd::TensorList;

// Name -> tensor, in module order.
using StateDict = std::vector<std::pair<std::string, Tensor>>;
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

class Module;

// Runs before forward with the inputs; returning a list replaces the inputs.
using ForwardPreHook = std::function<std::optional<TensorList>(Module& module, const TensorList& inputs)>;
// Runs after forward; returning a list replaces the outputs.
using ForwardHook =
    std::function<std::optional<TensorList>(Module& module, const TensorList& inputs, const TensorList& outputs)>;

class Module {
 public:
  explicit Module(std::string type_name);
  virtual ~Module();
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // "Linear", "GPT", ... (for wrap policies by module type and for messages).
  const std::string& type_name() const { return type_name_; }

  // ---- calling ---------------------------------------------------------------------------------
  Tensor operator()(const Tensor& x);
  TensorList call(const TensorList& inputs);

  // ---- registration (from constructors) --------------------------------------------------------
  // Registers `t` as parameter `name` and sets its requires_grad. Returns the handle.
  const Tensor& register_parameter(const std::string& name, Tensor t, bool requires_grad = true);
  const Tensor& register_buffer(const std::string& name, Tensor t);
  template <typename M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    add_child(name, module);
    return module;
  }

  // ---- local access ----------------------------------------------------------------------------
  // This module's own parameter / buffer / child by local name (InternalError if absent).
  const Tensor& parameter(const std::string& name) const;
  const Tensor& buffer(const std::string& name) const;
  bool has_parameter(const std::string& name) const;
  std::shared_ptr<Module> child(const std::string& name) const;
  // Replaces this module's parameter `name` by another tensor (FSDP swaps unsharded / sharded
  // parameters this way); forward reads parameters by name, so it sees the new tensor.
  void replace_parameter(const std::string& name, Tensor t);
  // Local (non-recursive) lists in registration order.
  const NamedTensors& local_parameters() const { return params_; }
  const NamedTensors& local_buffers() const { return buffers_; }
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& named_children() const { return children_; }

  // ---- recursive views -------------------------------------------------------------------------
  struct NamedOptions {
    bool recurse = true;
    bool remove_duplicate = true;  // a tensor registered under several names is listed once (first name)
  };
  NamedTensors named_parameters(const NamedOptions& options) const;
  NamedTensors named_parameters() const { return named_parameters(NamedOptions{}); }
  std::vector<Tensor> parameters() const;
  NamedTensors named_buffers() const;
  // This module ("") and every descendant, depth first in registration order, each once.
  std::vector<std::pair<std::string, Module*>> named_modules();
  // Number of distinct parameter elements.
  std::int64_t num_parameters() const;

  // ---- modes and bulk operations ---------------------------------------------------------------
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }
  // fn on every descendant, children before parents (PyTorch's order), then this module.
  void apply(const std::function<void(Module&)>& fn);
  void set_requires_grad(bool requires_grad);
  void zero_grad(bool set_to_none = true);
  // Converts every floating-point parameter to `dtype` (new tensors, charged like the originals,
  // requires_grad kept, gradients dropped; buffers such as BatchNorm's running statistics stay fp32). A tensor shared by several modules stays
  // shared (GPT's tied embedding). Layers compute in fp32 and cast bf16/f16 parameters on the fly,
  // so a converted model still trains; its gradients have the parameters' dtype (bf16 grads: 2 bytes
  // per parameter, the mixed-precision rows of DESIGN.md section 6).
  void to(DType dtype);
  // Moves every parameter and buffer to `device` (new tensors of the same dtype and ledger category, copied;
  // requires_grad kept, gradients dropped). Sharing is kept as by to(DType). Forward then runs where the
  // parameters are: the inputs must be on that device too (Note [ops on devices] in common/autograd/ops).
  // Inside an nn::DeferredInitScope a deferred parameter (no bytes yet) moves without bytes: materialising it later
  // (fsdp::fully_shard does) fills it on `device` (DeferredInit::transfer). A parameter without bytes that is not
  // deferred (one fully_shard took) cannot be moved: a check failure naming it.
  void to(Device device);

  // ---- state dict ------------------------------------------------------------------------------
  // Every parameter name (duplicates included) and every buffer, as handles over the live bytes
  // (detached: no autograd state). Copy them if you need a snapshot.
  StateDict state_dict() const;
  // Copies values in (dtype converted). Checked before anything is copied, so on error the module is
  // unchanged: InvalidArgument naming missing keys, unexpected keys (strict only) and shape mismatches
  // ("expected [4, 3], found [3, 4]").
  absl::Status load_state_dict(const StateDict& state, bool strict = true);

  // ---- hooks -----------------------------------------------------------------------------------
  HookHandle register_forward_pre_hook(ForwardPreHook hook);
  HookHandle register_forward_hook(ForwardHook hook);

  // Methods other than forward (generate, encode) that must run like a forward, with the forward pre-hooks
  // before and the forward hooks after (a composable API gathers parameters there: FSDP2's
  // register_fsdp_forward_method). Such a method runs its body through run_method(name, inputs, body): a name
  // registered with register_forward_method runs the hooks around body (the hooks see `inputs` and body's
  // outputs, and may replace them, as in call()); any other name runs body alone.
  void register_forward_method(const std::string& name);
  bool is_forward_method(const std::string& name) const;
  TensorList run_method(const std::string& name, const TensorList& inputs,
                        const std::function<TensorList(const TensorList&)>& body);

  // False for containers that only hold children and are never called themselves (ModuleList): a
  // composable API that hooks a module's forward (fsdp::fully_shard) refuses them.
  virtual bool has_forward() const { return true; }

  // ---- call wrapper (activation checkpointing) -------------------------------------------------
  // A function that runs each call of this module (operator(), call()) in place of the hooked forward: it
  // gets the inputs and `hooked`, which runs the forward pre-hooks, forward and the forward hooks, and returns
  // the outputs. Every hook runs inside the wrapper, whatever the order in which they and the wrapper were
  // installed. nn::checkpoint (nn/checkpoint.h) installs one that runs `hooked` without grad and again in
  // backward. One per module: set_call_wrapper replaces, nullptr removes. `hooked` is valid while the module
  // lives (it may be kept, e.g. by a backward node).
  using HookedCall = std::function<TensorList(const TensorList& inputs)>;
  using CallWrapper = std::function<TensorList(const TensorList& inputs, const HookedCall& hooked)>;
  void set_call_wrapper(CallWrapper wrapper);
  bool has_call_wrapper() const { return static_cast<bool>(call_wrapper_); }

  // ---- attached state (composable APIs) --------------------------------------------------------
  // A composable API applied to this module (fsdp::fully_shard) keeps its per-module state here, owned by
  // the module and destroyed with it (its hooks with it). One slot per key; set_attachment replaces.
  struct Attachment {
    virtual ~Attachment() = default;
  };
  void set_attachment(const std::string& key, std::shared_ptr<Attachment> value);
  // The attachment under `key`, or nullptr.
  Attachment* attachment(const std::string& key) const;

 protected:
  virtual Tensor forward(const Tensor& x);
  virtual TensorList forward_list(const TensorList& inputs);

 private:
  void add_child(const std::string& name, std::shared_ptr<Module> module);
  TensorList run_hooked(const TensorList& inputs, const std::function<TensorList(const TensorList&)>& body);
  TensorList call_hooked(const TensorList& inputs);
  void collect_parameters(const std::string& prefix, bool recurse, NamedTensors& out) const;
  void collect_buffers(const std::string& prefix, NamedTensors& out) const;

  std::string type_name_;
  bool training_ = true;
  NamedTensors params_;
  NamedTensors buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  std::shared_ptr<autograd::HookList<ForwardPreHook>> pre_hooks_;
  std::shared_ptr<autograd::HookList<ForwardHook>> post_hooks_;
  std::vector<std::pair<std::string, std::shared_ptr<Attachment>>> attachments_;
  std::vector<std::string> forward_methods_;
  CallWrapper call_wrapper_;
};

}  // namespace shardkit::nn
