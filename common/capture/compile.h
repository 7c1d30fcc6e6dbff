// compile(): whole-step capture and replay (issue 16; seed 002's shape, PyTorch _spmd's compile).
//
//   auto step = [&](const std::vector<Tensor>& batch) {
//     Tensor loss = model.loss(batch[0], batch[1]);
//     autograd::backward(loss);
//     SK_CHECK(opt->step().ok());
//     opt->zero_grad();
//     return loss;
//   };
//   capture::CompiledStep compiled = capture::compile(step, model, *opt, {.parallel_mode = mode});
//   for (...) absl::StatusOr<Tensor> loss = compiled({x, y});
//
// The step function is written once, for a single rank. On the first call (and whenever a recapture is due) the
// step runs eagerly under a dry-run Recorder (recorder.h): forward and backward run, the optimizer's updates are
// recorded but not applied, and the rank's Generator is put back as the capture found it, so the capture changes
// no state (a dropout's replay draws what the eager step would). The graph is then expanded by the parallel mode (its
// collectives), passed through dedup and coalesce (graph_passes.h), handed to the user's transform, and executed
// (executor.h) for this same call. Later calls bind the batch's tensors to the graph's batch inputs (no copy) and
// replay.
//
// Note [recapture]
// A graph is only valid for what it was captured with. Before each call the compiled step compares what the graph
// was captured with against the present, and on any difference captures again, logging the reason (also kept in
// last_capture_reason()), so it never replays a graph for inputs it was not captured for:
//   * the batch: dtype and shape of each tensor;
//   * the module: which parameters require grad, and which modules are in training mode (train() / eval():
//     dropout);
//   * the optimizer: its param groups and their parameters (add_param_group), and the identity of its state
//     tensors (load_state_dict makes new ones; an update that creates state, as SGD turning momentum on, too);
//   * the parameters' gradients kept between steps (zero_grad(set_to_none = false)): which exist, and their identity;
//   * the parallel mode's own reason (ParallelMode::recapture_reason: fsdp's FullyShardMode after
//     unshard_parameters(), whose whole parameters may have been written);
//   * CompileOptions::guard's value, and invalidate().
// What the step function decides by itself (a branch on a flag of the user's, a head used in some steps only) is
// NOT seen: the replay runs the branch that was captured. Put such a choice in CompileOptions::guard (its value
// is compared before each call) or call invalidate() when it changes. Hyper-parameters are read when the update
// runs (lr schedules need no recapture; Note [tracing the update] in common/optim/optimizer.cc).
//
// Activation checkpointing: a step whose model has checkpointed modules (nn::checkpoint, nn::checkpoint_blocks) is
// captured with each checkpointed call's recompute and nested backward inside the backward, so replay runs the same
// kernels in the same order as the eager checkpointed step (bit for bit its results, dropout included) and keeps
// what eager checkpointing keeps: the calls' inputs, and one call's activations at a time (Note [capturing
// activation checkpointing] in common/nn/checkpoint.cc). The capture itself (the first call, and each recapture)
// holds every value the step made until the graph is built, the recompute's included: more than an eager step
// without checkpointing, for that one call.
//
// Lifetimes: the module, the optimizer and the mode's groups must outlive the compiled step (its kernels refer to
// them). Between calls, temporaries of the step (activations, gradients) have no bytes (Note [memory plan]): read
// results through the returned loss, not through .grad.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/capture/executor.h"
#include "common/capture/step_graph.h"
#include "common/nn/module.h"
#include "common/optim/optimizer.h"

namespace shardkit::capture {

// How a single-rank graph becomes a data-parallel one. Modes live with their layers: replicate in sddp/, fully
// shard in fsdp/.
class ParallelMode {
 public:
  virtual ~ParallelMode() = default;
  virtual std::string name() const = 0;
  // The groups the mode's collective nodes name.
  virtual std::map<std::string, std::shared_ptr<comm::ProcessGroup>> groups() const = 0;
  // Called before each capture runs the step eagerly: the parameters must then hold their full values.
  virtual absl::Status before_capture() { return absl::OkStatus(); }
  // Why the graph must be captured again before the next call (Note [recapture]), or nullopt.
  virtual std::optional<std::string> recapture_reason() const { return std::nullopt; }
  // Rewrites the captured single-rank graph for this mode.
  virtual absl::Status expand(StepGraph& graph) = 0;
};

// Stands for a part of the step that is not traced: while capturing, `replacement` runs instead of the part
// (it should record a placeholder node, capture::record_placeholder), and `expand` then gives the nodes that
// replace that placeholder in the graph (expand_placeholder in graph_passes.h).
struct Override {
  std::string name;
  std::function<absl::StatusOr<std::vector<Node>>(StepGraph& graph, const Node& placeholder)> expand;
};

struct CompileOptions {
  std::shared_ptr<ParallelMode> parallel_mode = nullptr;  // nullptr: one rank, no collectives
  std::vector<Override> overrides = {};
  // Runs last, on the expanded graph after the passes.
  std::function<absl::Status(StepGraph&)> transform = nullptr;
  // coalesce_collectives' bound; 0 turns coalescing off.
  std::int64_t coalesce_bytes = 0;
  // The replay's values come out of one StepArena (ExecutorOptions::arena).
  bool arena = true;
  // Called before each call; a value other than the captured one's captures again (Note [recapture]). For what the
  // step function decides by itself: e.g. [&] { return absl::StrCat(net.use_b); }.
  std::function<std::string()> guard = nullptr;
};

// While a step is captured: records a placeholder node named `name` reading `reads` and writing `writes` (an
// Override's replacement calls it). Outside capture it does nothing.
void record_placeholder(const std::string& name, const std::vector<Tensor>& reads, const std::vector<Tensor>& writes);

using StepFn = std::function<Tensor(const std::vector<Tensor>& batch)>;

class CompiledStep {
 public:
  CompiledStep(StepFn step, nn::Module& module, optim::Optimizer& optimizer, CompileOptions options);

  // One training step on `batch`; returns the loss (a new tensor). Errors: a capture that failed (Note [what cannot
  // be captured] in recorder.h), a mode or transform that failed, a failed collective.
  absl::StatusOr<Tensor> operator()(const std::vector<Tensor>& batch);

  // The graph being replayed (after expansion and passes); nullptr before the first call.
  const StepGraph* graph() const { return executor_ ? &executor_->graph() : nullptr; }
  const MemoryPlan* memory_plan() const { return executor_ ? &executor_->plan() : nullptr; }
  const ReplayStats* last_stats() const { return executor_ ? &executor_->last_stats() : nullptr; }
  // The step arena's size and where the last replay's allocations came from (Note [step arena]).
  StepArena::Stats arena_stats() const { return executor_ ? executor_->arena_stats() : StepArena::Stats{}; }
  // Node counts of the captured graph before expansion, and the collectives dedup / coalesce removed.
  const std::map<std::string, int>& captured_counts() const { return captured_counts_; }
  // Collective nodes right after the parallel mode's expansion (before dedup and coalescing).
  int expanded_collectives() const { return expanded_collectives_; }
  int deduplicated() const { return deduplicated_; }
  int coalesced() const { return coalesced_; }
  int captures() const { return captures_; }
  const std::string& last_capture_reason() const { return last_capture_reason_; }
  // The next call captures again (Note [recapture]): for a change the compiled step cannot see.
  void invalidate() { invalidated_ = true; }

 private:
  // What a graph was captured with, as far as the compiled step can see (Note [recapture]).
  struct CaptureKey {
    std::vector<std::pair<DType, Shape>> batch;
    std::vector<bool> trainable;
    std::vector<bool> training;
    std::vector<std::int64_t> group_sizes;
    std::vector<std::pair<std::string, const void*>> optimizer_state;  // "<index>.<key>", tensor identity
    std::vector<const void*> grads;  // per parameter, nullptr without a gradient
    std::string guard;
  };
  CaptureKey key_now(const std::vector<Tensor>& batch) const;
  std::optional<std::string> recapture_reason(const std::vector<Tensor>& batch) const;
  absl::Status capture(const std::vector<Tensor>& batch, std::string reason);

  StepFn step_;
  nn::Module& module_;
  optim::Optimizer& optimizer_;
  CompileOptions options_;
  std::optional<Executor> executor_;
  CaptureKey captured_;
  bool invalidated_ = false;
  std::vector<SlotId> batch_slots_;
  SlotId loss_slot_ = -1;
  std::map<std::string, int> captured_counts_;
  int expanded_collectives_ = 0;
  int deduplicated_ = 0;
  int coalesced_ = 0;
  int captures_ = 0;
  std::string last_capture_reason_;
};

inline CompiledStep compile(StepFn step, nn::Module& module, optim::Optimizer& optimizer, CompileOptions options = {}) {
  return CompiledStep(std::move(step), module, optimizer, std::move(options));
}

}  // namespace shardkit::capture
