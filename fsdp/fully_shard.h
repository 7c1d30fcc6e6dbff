// fsdp::fully_shard: fully sharded data parallel (ZeRO-3), FSDP2's composable shape (DESIGN.md section 5).
//
//   nn::GPT model(config, seed);                                   // every rank builds the same model
//   for (nn::Module* block : fsdp::modules_of_type(model, "TransformerBlock"))
//     fsdp::fully_shard(*block, pg).value();                       // bottom-up: one unit per call
//   fsdp::fully_shard(model, pg).value();                          // the root last
//   auto opt = optim::AdamW::make({{model.parameters(), hyper}}, hyper);   // steps the shards
//   for (...) {
//     opt->zero_grad();
//     autograd::try_backward(model.loss(x, y));                    // gathers / reduces unit by unit
//     fsdp::clip_grad_norm(model, 1.0);                           // optional: the global norm
//     opt->step();
//   }
//
// A call makes `module` one *unit*: it manages the module's parameters that no nested call already manages
// (those are nested units), and its forward gathers and releases them (fsdp/state.h: hooks, training states,
// roots). At rest each managed parameter *is* its dim-0 shard (fsdp/fsdp_param.h): model.parameters() lists
// the shards, so any optimizer steps them unchanged, and the memory ledger holds 16Ψ/N plus padding of model
// state. One all_gather per unit before its forward and (reshard_after_forward) again before its backward, one
// reduce_scatter of its gradients after its backward (fsdp/param_group.h).
//
// Deferred initialisation (issue 12 item 8): build the model inside an nn::DeferredInitScope (its parameters
// get shapes and recipes but no bytes) and call fully_shard inside the same scope: each parameter is
// materialised with exactly the values eager init gives (same seed: bitwise), its rows kept, its bytes released
// at once (Note [deferred init under fully_shard] in param_group.cc), so no rank ever holds the whole model: the
// ledger's construction peak is the shards plus the largest parameter.
//
//   nn::DeferredInit deferred;
//   nn::DeferredInitScope scope(deferred);
//   nn::GPT model(config, seed);                 // no parameter bytes
//   ... fully_shard(blocks), fully_shard(model) ...   // each rank: its rows only
//
// Rules (each breach is a Status from fully_shard, or an FsdpError from the forward that finds it):
//   * call bottom-up, each module at most once; a container without a forward of its own (ModuleList) cannot be a
//     unit (shard the modules it holds, or the module that calls them);
//   * every rank builds the same model (same seed) before sharding: each rank keeps its rows of its own copy.
//     Checked (Note [same values on every rank] in same_values.cc): each call hashes every parameter it shards
//     while the parameter is whole (eager or deferred init; a CUDA parameter through a host copy) and compares the
//     hashes, and its ignored_params' values, across every rank of its group (and of the replicate group under
//     HSDP): one all_gather of 8 bytes per parameter. What differs is told, on every rank, by the root's first
//     forward (an FsdpError), summon_full_params, unshard, the state dicts and exports (InvalidArgument), naming the
//     first differing parameter and the ranks, e.g. "fsdp: parameter 'blocks.0.attn.qkv.weight' on rank 1 differs
//     from rank 0's before sharding", again each time, until fsdp::load_full_state_dict / load_sharded_state_dict
//     replace those values with one checkpoint's;
//   * a parameter used by two units belongs to their common ancestor (fsdp::auto_shard assigns it, see
//     fsdp/wrap_policy.h; with manual calls, name it in FullyShardOptions::leave_to_ancestor of the lower calls, or
//     shard the ancestor instead of one of them: a parameter another unit already took is refused);
//   * the first forward goes through the root (the outermost sharded module); a sharded module that runs inside
//     the root's forward must be under the root;
//   * every rank runs the same units in forward (parameters unused inside a unit are fine): units of other sizes
//     fail on every rank ("ranks disagree on collective"), and so do two different units of the same size, by the
//     unit's fingerprint each collective carries (Note [unit fingerprints] in param_group.cc) on the in-process,
//     TCP, shared-memory and MPI backends; NCCL does not compare fingerprints, so there such units pair silently;
//   * frozen parameters (requires_grad false) are sharded like the others, whether frozen before or after the
//     call (as FSDP2): their shards carry requires_grad, get no gradient and no update while frozen, and may be
//     unfrozen or frozen at rest between steps, the same on every rank. A reduce moves the gradients of the
//     parameters that require grad only; a unit whose parameters are all frozen reduces nothing (Note [frozen
//     parameters are not reduced] in param_group.cc);
//   * FullyShardOptions::ignored_params stay whole and replicated; FSDP neither shards nor reduces them.
//
// Thread-safety: one rank's thread. Collectives: fully_shard itself (the comparison of the values above; and the
// group split of reshard_after_forward = k), unshard, the forward and backward hooks, clip_grad_norm, the state
// dicts.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/comm/device_mesh.h"
#include "common/comm/process_group.h"
#include "common/nn/module.h"
#include "fsdp/fully_shard_options.h"
#include "fsdp/state.h"

namespace shardkit::fsdp {

// An unshard in flight (FSDPModule::unshard(true)); wait() finishes it. Waiting twice is a no-op.
class UnshardHandle {
 public:
  UnshardHandle() = default;
  absl::Status wait();

 private:
  friend class FSDPModule;
  explicit UnshardHandle(FSDPState* state) : state_(state) {}
  FSDPState* state_ = nullptr;
};

// FSDP2's FSDPModule methods, on a module fully_shard made a unit. A handle: cheap to copy, valid while the
// module lives.
class FSDPModule {
 public:
  nn::Module& module() const { return state_->module(); }

  // Gathers this unit's parameters now (not its nested units': FSDP2's unshard is not recursive); the next
  // forward finds them unsharded and gathers nothing. With async_op the all_gather runs while the caller goes on
  // (wait() on the handle, or the unit's forward, finishes it). Collective.
  absl::StatusOr<UnshardHandle> unshard(bool async_op = false);
  // Every unit of the subtree's full parameters, kept until reshard(true): meanwhile the module can be read,
  // written (load_state_dict) or run forward on any subset of ranks (sampling on rank 0), and the hooks gather,
  // reduce and release nothing. Training state `summoned`. Collective.
  absl::Status summon_full_params();
  // Releases the full parameters of this unit (recurse: of every unit of the subtree), keeping values written to
  // them while summoned. Local (no collective). FailedPrecondition naming the training state inside a forward or
  // backward.
  absl::Status reshard(bool recurse = false);

  // Gradient accumulation without communication (DDP's no_sync): while off, backward keeps each parameter's full
  // gradient (4 bytes per parameter more) and reduces nothing; the next backward with sync on reduces the
  // accumulated gradients into the shards. recurse: the whole subtree (FSDP2's default).
  void set_requires_gradient_sync(bool sync, bool recurse = true);
  // Whether backward releases the unit's full parameters after reducing its gradients (default true). false keeps
  // them for the next forward (no all_gather there: accumulation steps), at the memory of the full unit. Once a
  // synchronised backward gives the shards their gradients the kept values count as stale (an optimizer step may
  // follow): the next forward or summon gathers again (Note [kept after backward, stale after a step] in
  // param_group.cc), so the saving holds between the backwards of an accumulation, not across steps.
  void set_reshard_after_backward(bool on, bool recurse = true);
  // false: the final callback of the next backwards keeps every unit as it is (unsharded units stay unsharded)
  // until a backward with true; for accumulation loops that step only after the last backward.
  void set_is_last_backward(bool last);
  // Gradients are summed over ranks and divided by `factor` (default: the world size, an average). A factor that is
  // not finite and > 0 fails the next backward's reduce with InvalidArgument on every rank.
  void set_reduce_scatter_divide_factor(double factor, bool recurse = true);
  // HSDP only (a unit on a 2-D mesh): false keeps each backward's reduce-scattered gradients on this rank without
  // the all-reduce across replicas; the next backward with true all-reduces them together with its own (gradient
  // accumulation with one all-reduce; Note [hybrid sharding] in param_group.cc). Default true.
  void set_requires_all_reduce(bool on, bool recurse = true);
  // Explicit prefetch (Note [prefetch] in state.cc): when this unit's forward (backward) starts, start the
  // all-gathers of `units`, in this order, instead of the implicit next unit's; an empty list prefetches nothing.
  // Every rank must set the same lists. The units must be under the same root (checked when the forward runs);
  // at most the root's max_prefetched_units are ahead at once. InvalidArgument: this unit itself in the list.
  absl::Status set_modules_to_forward_prefetch(const std::vector<FSDPModule>& units);
  absl::Status set_modules_to_backward_prefetch(const std::vector<FSDPModule>& units);
  // How much of the root's communication was overlapped (state.h CommOverlapStats), since the first forward or
  // the last reset. Call on the root.
  CommOverlapStats overlap_stats() const { return state_->overlap_stats(); }
  void reset_overlap_stats() { state_->reset_overlap_stats(); }

  TrainingState training_state() const { return state_->training_state(); }
  FSDPState& state() const { return *state_; }

 private:
  friend absl::StatusOr<FSDPModule> state_of(nn::Module&);
  explicit FSDPModule(FSDPState* state) : state_(state) {}
  FSDPState* state_;
};

// Makes `module` a unit over `group` (see above). InvalidArgument: a container without a forward, a non-f32
// trainable parameter, a parameter another (non-nested) unit already manages. FailedPrecondition: `module` is
// already sharded. Collective (every rank makes the same calls, in the same order): a rank that does not make it
// fails the others' with DeadlineExceeded after the unit's timeout.
absl::StatusOr<FSDPModule> fully_shard(nn::Module& module, std::shared_ptr<comm::ProcessGroup> group,
                                       FullyShardOptions options = {});
// On a DeviceMesh: 1-D, as over its group; 2-D (replicate × shard, comm/device_mesh.h), HSDP (Note [hybrid
// sharding] in param_group.cc): parameters sharded over the mesh's dim-1 group (a row) and replicated across its
// dim-0 group; gradients reduce-scattered within the row, then all-reduced across the column. Every unit of a
// model must use the same mesh.
absl::StatusOr<FSDPModule> fully_shard(nn::Module& module, const comm::DeviceMesh& mesh, FullyShardOptions options = {});

// The unit fully_shard made of `module`; NotFound when it is not one.
absl::StatusOr<FSDPModule> state_of(nn::Module& module);

// Every sharded parameter under `root` (each once), with its global shape and offset.
std::vector<ShardedTensor> sharded_parameters(const nn::Module& root);

// Parameter <-> fully qualified names under `root`: every parameter of root.parameters() (sharded or whole),
// each with all the names it is registered under, in named_parameters() order. The names are the module's own
// (fully_shard wraps nothing, so there are no wrapper prefixes); a shared parameter (GPT's tied embedding)
// lists every name, the first being the one named_parameters() and the state dicts key it by.
struct NamedParameter {
  std::vector<std::string> names;
  Tensor param;                        // what the optimizer steps (the shard, for a sharded parameter)
  std::optional<ShardedTensor> shard;  // set for a sharded parameter
};
std::vector<NamedParameter> named_parameters(const nn::Module& root);

// Makes `module`'s method `name` run FSDP's forward hooks (gather before, release after) when it runs through
// nn::Module::run_method (FSDP2's register_fsdp_forward_method), e.g. a generate() that reads the parameters
// directly. NotFound when `module` is not a unit.
absl::Status register_forward_method(nn::Module& module, const std::string& name);

// The modules of `root` (root excluded) whose type_name() is `type`, in module order (e.g. "TransformerBlock").
std::vector<nn::Module*> modules_of_type(nn::Module& root, const std::string& type);

}  // namespace shardkit::fsdp
