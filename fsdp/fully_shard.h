// FullyShardedModel: fully sharded data parallel (ZeRO-3, DESIGN.md section 5), first slice.
//
// A model is cut into *units*: each module listed in FullyShardOptions::units (its parameters not claimed by
// an earlier unit) and the root (every trainable parameter left). Each unit's trainable parameters are laid
// out in one flat buffer of world · S elements (S = ceil(unit numel / world)), the parameters re-bound
// (Tensor::rebind) as views of it, and rank r keeps elements [r·S, (r+1)·S) in its *shard*, a 1-D leaf
// tensor that the optimizer steps. At rest the flat buffer's bytes are released: a rank holds Ψ/N
// parameter elements (+ padding). Per pass, each unit costs one all_gather and one reduce_scatter:
//
//   forward pre-hook   unshard: reallocate the flat buffer, all_gather the shards into it (wait); on the
//                      unit's inputs that require grad, a post-backward tensor hook (below)
//   forward hook       non-root units with reshard_after_forward: release the buffer again; on the unit's
//                      outputs that require grad, a tensor hook that unshards before the unit's backward
//   post-backward      when the gradient of the unit's input is complete (Note [post-backward on a unit's
//                      inputs] in fully_shard.cc): copy the parameters' gradients into a flat buffer (zeros
//                      for missing ones and padding), reduce_scatter (average) into the shard's .grad (added
//                      to a gradient already there: accumulation), release the full gradients, reshard
//   final callback     (queued by the first hook of a backward) reduces the units that had no post-backward
//                      (the root) or got gradients after it, in unit order, and reshards all units
//
// Differences from PyTorch FSDP2, on purpose or not yet done (see the closing notes):
//   * the optimizer is built from parameters() (one flat shard per unit), not model.parameters() (an
//     optimizer over the released module parameters refuses to step: FailedPrecondition saying so); the
//     training loop zeroes and steps that optimizer, as every strategy's loop does (Note [training step
//     contract] in common/optim/optimizer.h): FullyShardedModel itself has no zero_grad() or step();
//   * units hold f32 parameters; frozen parameters (requires_grad false at construction) are not sharded and
//     stay replicated; freezing a sharded parameter, or unfreezing one of those, later is refused
//     (FsdpError from the next forward);
//   * every rank must run the same units in forward (a unit skipped on some ranks makes the collectives
//     disagree; parameters unused inside a unit are fine);
//   * destroying the FullyShardedModel leaves the module's parameters as they are: call unshard() first
//     to keep a usable full model;
//   * no prefetch, mixed precision or CPU offload yet; unshard()/reshard() bring every unit's full
//     parameters back (e.g. to read or save them) and release them; fsdp/optim_state.h translates the
//     optimizer state for checkpoints.
//
// Errors: a failed collective inside a hook throws FsdpError (propagates out of forward or
// autograd::backward; autograd::try_backward returns it as a Status). Thread-safety: one rank's thread.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/autograd/engine.h"
#include "common/comm/process_group.h"
#include "common/nn/module.h"
#include "common/tensor/tensor.h"

namespace shardkit::fsdp {

// An autograd::StatusError, so autograd::try_backward returns FSDP's own Status.
class FsdpError : public autograd::StatusError {
 public:
  using autograd::StatusError::StatusError;
};

struct FullyShardOptions {
  // Submodules of the root that become units, innermost first: a parameter belongs to the first listed
  // module that holds it, and to the root when none does (a shared parameter: list the common ancestor).
  std::vector<nn::Module*> units = {};
  // Release non-root units' full parameters after forward (all-gathered again before their backward).
  // false keeps them from forward to the end of backward: less communication, more memory.
  bool reshard_after_forward = true;
  // Broadcast rank 0's parameters at construction, so every rank starts from the same model.
  bool sync_module_states = true;
  // Deadline of each collective; empty: the group's default.
  std::optional<absl::Duration> timeout = std::nullopt;
};

// The modules of `root` (root excluded) whose type_name() is `type`, in module order (a wrap policy by
// module type, e.g. "TransformerBlock").
std::vector<nn::Module*> modules_of_type(nn::Module& root, const std::string& type);

class FullyShardedModel {
 public:
  // Shards `root` over `group`. InvalidArgument: a unit that is not a submodule of root, a non-f32 trainable
  // parameter, a failed startup broadcast. Collective (the broadcast).
  static absl::StatusOr<std::unique_ptr<FullyShardedModel>> create(nn::Module& root,
                                                                   std::shared_ptr<comm::ProcessGroup> group,
                                                                   FullyShardOptions options = {});
  ~FullyShardedModel();
  FullyShardedModel(const FullyShardedModel&) = delete;
  FullyShardedModel& operator=(const FullyShardedModel&) = delete;

  // What the optimizer steps: this rank's shard of each unit (1-D, f32, requires grad), in unit order.
  std::vector<Tensor> parameters() const;
  // Every unit's full parameters all-gathered into the module (e.g. to read, evaluate, save or load them),
  // until reshard(): meanwhile forwards (on any subset of ranks, e.g. sampling on rank 0) and backwards
  // gather and release nothing. Collective.
  absl::Status unshard();
  // Each rank's shards take their part of the full parameters (so values written meanwhile, e.g. by
  // model.load_state_dict() on every rank, are kept), then the full parameters are released.
  void reshard();

  // Gradient accumulation without communication (FSDP2's set_requires_gradient_sync, DDP's no_sync):
  // while off, backward keeps each parameter's full gradient (4 bytes per parameter more, as FSDP) and
  // reduces nothing; the next backward with sync on reduces the accumulated gradients into the shards. A
  // backward that fails drops the full gradients accumulated so far (start the accumulation again).
  void set_requires_gradient_sync(bool sync) { sync_ = sync; }
  bool requires_gradient_sync() const { return sync_; }

  // Clips the shards' gradients (what the optimizer over parameters() steps) by the total norm of the whole
  // model's gradient (norm_type 2 or inf, oss/sharded_grad_norm.h: padding holds zeros and adds nothing):
  // scales them by min(1, max_norm / (norm + 1e-6)) and returns the norm before clipping, identical on
  // every rank. Call it after backward, before the optimizer's step. Collective.
  absl::StatusOr<double> clip_grad_norm(double max_norm, double norm_type = 2.0);

  std::size_t num_units() const;
  // Unit u: its fully qualified module name ("" for the root) and its parameter elements (unpadded).
  std::string unit_name(std::size_t u) const;
  std::int64_t unit_numel(std::size_t u) const;
  // Elements of this rank's shards (padding included): Ψ/N within (world - 1) per unit.
  std::int64_t shard_numel() const;

  // How unit u is laid out (for state-dict translation, fsdp/optim_state.h): its module parameters, where
  // each starts in the unit's flat index space, the shard size S (rank r holds [r·S, (r+1)·S)), the shard.
  struct UnitLayout {
    std::vector<Tensor> params;
    std::vector<std::int64_t> offsets;
    std::int64_t shard_size = 0;
    Tensor shard;
  };
  UnitLayout unit_layout(std::size_t u) const;
  comm::ProcessGroup& process_group() const { return *pg_; }

 private:
  struct Unit;
  FullyShardedModel(std::shared_ptr<comm::ProcessGroup> group, FullyShardOptions options);
  absl::Status unshard_unit(Unit& u);
  void reshard_unit(Unit& u);
  void reduce_unit(Unit& u);
  void ensure_final_callback();
  void in_hook(const std::function<void()>& body);
  void reset_backward_state();
  absl::Status check_trainable() const;
  void finalize_backward();
  absl::Duration timeout() const;

  std::shared_ptr<comm::ProcessGroup> pg_;
  FullyShardOptions options_;
  std::vector<std::unique_ptr<Unit>> units_;
  std::vector<Tensor> frozen_;  // parameters left unsharded because they were frozen at construction
  bool in_backward_ = false;
  bool sync_ = true;
  bool pinned_ = false;  // between unshard() and reshard()
  std::int64_t forwards_ = 0;   // root forwards so far (ages the pending pre-backward hooks)
  // During a forward: the outputs of the units run so far, with the units whose post-backward is to run
  // in that output's pre-backward hook (Note [post-backward on a unit's inputs]).
  struct UnitOutput {
    Tensor tensor;  // held so its id is not reused during the forward
    std::shared_ptr<std::vector<Unit*>> reduce_first;
  };
  std::map<const TensorImpl*, UnitOutput> unit_outputs_;
};

}  // namespace shardkit::fsdp
