// FSDPState: what fully_shard attaches to a module, its hooks, and the training-state machine
// (FSDP2's FSDPState; seed 001's TrainingState).
//
// Roots. The first fully_shard'ed module whose forward runs, outside any other's forward, becomes a *root*
// (lazily, as FSDP2): it finds the states of its submodules and shares one RootContext with them. The root
// owns what spans a whole step: the count of forwards, the map of unit outputs (Note [post-backward on a
// unit's inputs]) and the final callback of backward.
//
// Training states, per unit (TrainingState) — a call that needs another state is refused with a Status naming
// both:
//   idle            at rest (sharded) or unsharded between passes
//   forward         between the unit's pre-forward and post-forward hooks
//   pre_backward    its pre-backward hook ran (unsharded for its backward)
//   post_backward   its gradients are being reduced
//   summoned        unsharded by the user (FSDPModule::unshard(recurse)): forwards and backwards on any
//                   subset of ranks gather and release nothing until reshard()
//
// Hooks (named member functions, registered once by fully_shard):
//   pre_forward      root: start a step (age pending hooks, reset a backward that ended without its final
//                    callback); every unit: issue its all-gather, prefetch the next unit's (Note [prefetch] in
//                    state.cc), wait for its own, hook its inputs for its post-backward
//   post_forward     reshard (reshard_after_forward, or no gradient follows), hook its outputs for its
//                    pre-backward
//   pre_backward     (a tensor hook on the outputs) reduce the units whose inputs are these outputs, unshard
//                    (prefetching the next unit in backward order)
//   post_backward    (a tensor hook on the inputs) issue the unit's reduce-scatter (finished by the next one,
//                    Note [reduce-scatter in flight]), reshard
//   final callback   (queued by the first backward hook) reduce every unit not reduced yet, finish every
//                    reduce-scatter, reshard, idle
//
// Errors inside hooks are thrown as FsdpError (an autograd::StatusError): autograd::try_backward returns the
// Status, and a forward propagates it.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/autograd/engine.h"
#include "common/autograd/hooks.h"
#include "common/comm/process_group.h"
#include "common/nn/module.h"
#include "fsdp/fully_shard_options.h"
#include "fsdp/param_group.h"

namespace shardkit::fsdp {

using nn::TensorList;

class FsdpError : public autograd::StatusError {
 public:
  using autograd::StatusError::StatusError;
};

enum class TrainingState { idle, forward, pre_backward, post_backward, summoned };
const char* training_state_name(TrainingState s);

inline constexpr const char* kFsdpAttachment = "fsdp";

class FSDPState;

// A parameter of a unit whose values differed across ranks at fully_shard (Note [same values on every rank] in
// same_values.cc).
struct ValueMismatch {
  std::size_t param = 0;  // index into the unit's ParamGroup::params(), when `ignored` is undefined
  Tensor ignored = {};    // the ignored parameter (FullyShardOptions::ignored_params), or undefined
  int rank = 0;           // the lowest global rank whose values differ from `reference`'s
  int reference = 0;      // the lowest global rank of the unit's group(s)
};

// Unsharded bytes (N × S × 4 per unit) of a root's unshard all-gathers and gradient reduce-scatters, and how many
// of them were overlapped: issued ahead of the unit's use (a prefetched all-gather) or waited for after later work was issued (a
// reduce-scatter finished by a later unit or the final callback, not right after its own issue).
struct CommOverlapStats {
  std::int64_t bytes = 0;
  std::int64_t overlapped_bytes = 0;
  double overlap_frac() const { return bytes == 0 ? 0.0 : static_cast<double>(overlapped_bytes) / static_cast<double>(bytes); }
};

// Shared by a root and every state under it.
struct RootContext {
  FSDPState* root = nullptr;
  std::vector<FSDPState*> states;  // every state under the root (the root last), in module order
  std::int64_t forwards = 0;       // root forwards so far (ages pending backward hooks)
  bool in_backward = false;
  bool is_last_backward = true;
  struct UnitOutput {
    Tensor tensor;  // held so its id is not reused during the forward
    std::shared_ptr<std::vector<FSDPState*>> reduce_first;
  };
  std::map<const TensorImpl*, UnitOutput> unit_outputs;
  // Note [prefetch]: the orders of the first forward (units with parameters), and the units unsharding ahead.
  bool order_recorded = false;
  std::vector<FSDPState*> forward_order, post_forward_order;
  std::vector<FSDPState*> prefetched;
  // Note [reduce-scatter in flight]: units whose reduce_scatter is issued and not finished, oldest first, with
  // the hook that issued it.
  struct Reducing {
    FSDPState* state;
    std::int64_t hook;
  };
  std::vector<Reducing> reducing;
  std::int64_t hooks = 0;  // hooks run so far (tells a reduce-scatter finished by a later hook)
  bool values_verified = false;  // Note [same values on every rank] in same_values.cc: no state holds a mismatch
  CommOverlapStats overlap;
};

class FSDPState : public nn::Module::Attachment {
 public:
  FSDPState(nn::Module& module, std::shared_ptr<comm::ProcessGroup> group, FullyShardOptions options,
            std::unique_ptr<ParamGroup> params);
  ~FSDPState() override;

  nn::Module& module() const { return *module_; }
  // The unit's parameters; nullptr when the call found none to manage.
  ParamGroup* param_group() const { return params_.get(); }
  comm::ProcessGroup& process_group() const { return *pg_; }
  const FullyShardOptions& options() const { return options_; }
  TrainingState training_state() const { return state_; }
  bool is_root() const { return ctx_ != nullptr && ctx_->root == this; }
  // The states of `module` and its submodules (this one included), in module order.
  std::vector<FSDPState*> subtree_states() const;

  // FSDPModule's methods (fully_shard.h documents them).
  absl::Status start_unshard();  // async, this unit only; the forward (or wait_unshard) finishes it
  absl::Status wait_unshard();
  absl::Status summon();         // every unit of the subtree, pinned
  absl::Status reshard(bool recurse);
  void set_requires_gradient_sync(bool sync) { requires_gradient_sync_ = sync; }
  bool requires_gradient_sync() const { return requires_gradient_sync_; }
  void set_reshard_after_backward(bool on) { reshard_after_backward_ = on; }
  void set_requires_all_reduce(bool on) { requires_all_reduce_ = on; }
  void set_reduce_scatter_divide_factor(std::optional<double> f) { divide_factor_ = f; }
  void set_is_last_backward(bool last);
  // Explicit prefetch lists (Note [prefetch]); empty optional: implicit.
  void set_forward_prefetch(std::vector<FSDPState*> units) { forward_prefetch_ = std::move(units); }
  void set_backward_prefetch(std::vector<FSDPState*> units) { backward_prefetch_ = std::move(units); }
  // Note [same values on every rank] in same_values.cc: the unit's parameters whose values differed across ranks
  // at fully_shard (empty: none), until a load replaces them (forget_value_mismatches: those whose tensors, shard,
  // unsharded or ignored, are in `written`).
  const std::vector<ValueMismatch>& value_mismatches() const { return value_mismatches_; }
  void set_value_mismatches(std::vector<ValueMismatch> m) { value_mismatches_ = std::move(m); }
  void forget_value_mismatches(const std::set<const TensorImpl*>& written);
  // The root's counters (zeros before the first forward).
  CommOverlapStats overlap_stats() const { return ctx_ != nullptr ? ctx_->overlap : CommOverlapStats{}; }
  void reset_overlap_stats() {
    if (ctx_ != nullptr) ctx_->overlap = {};
  }

  void pre_forward(const TensorList& inputs);
  void post_forward(const TensorList& inputs, const TensorList& outputs);

 private:
  void lazy_init();
  bool reshard_after_forward() const;      // the bool form (the root's default: false)
  int reshard_after_forward_group() const;  // k of the int form, 0 otherwise
  absl::Status unshard_unit(bool exact = false);
  // Issues this unit's all-gather unless it is unsharded or one is in flight (exact: ParamGroup::unshard_async).
  absl::Status issue_unshard(bool exact = false);
  // Prefetches the units of `explicit_list`, or else `implicit_next` (Note [prefetch]).
  void prefetch(const std::optional<std::vector<FSDPState*>>& explicit_list, FSDPState* implicit_next);
  // The unit after (step +1) or before (step -1) this one in `order`, or nullptr.
  FSDPState* neighbour_in(const std::vector<FSDPState*>& order, int step) const;
  void record_order(std::vector<FSDPState*>& order);
  // Finishes the oldest reduce-scatters in flight until at most `keep` remain (Note [reduce-scatter in flight]).
  void finish_reduces(std::size_t keep);
  void reshard_unit();
  void reduce_unit();
  void pre_backward(const std::shared_ptr<std::vector<FSDPState*>>& reduce_first);
  void post_backward();
  void ensure_final_callback();
  void finalize_backward();
  void reset_forward_state();  // Note [a forward that threw]
  void reset_backward_state();
  void in_hook(const std::function<void()>& body);
  void require_state(TrainingState wanted, const char* call) const;

  nn::Module* module_;
  std::shared_ptr<comm::ProcessGroup> pg_;
  FullyShardOptions options_;
  std::unique_ptr<ParamGroup> params_;
  std::optional<ParamGroup::UnshardHandle> pending_unshard_;
  std::optional<std::vector<FSDPState*>> forward_prefetch_, backward_prefetch_;
  std::shared_ptr<RootContext> ctx_;
  TrainingState state_ = TrainingState::idle;
  bool requires_gradient_sync_ = true;
  bool reshard_after_backward_ = true;
  bool requires_all_reduce_ = true;  // HSDP (Note [hybrid sharding] in param_group.cc)
  std::optional<double> divide_factor_;
  bool reduced_ = false;  // in the current backward
  bool pending_is_last_backward_ = true;
  std::vector<ValueMismatch> value_mismatches_;  // Note [same values on every rank]
  std::vector<autograd::HookHandle> module_hooks_;
  struct BackwardHook {
    std::int64_t forward = 0;  // the root forward that registered it
    autograd::HookHandle handle;
  };
  std::vector<BackwardHook> backward_hooks_;  // Note [pending pre-backward hooks]
};

// The state fully_shard attached to `module`, or nullptr.
FSDPState* state_attached(const nn::Module& module);

}  // namespace shardkit::fsdp
