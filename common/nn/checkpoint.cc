#include "common/nn/checkpoint.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/autograd/autograd_meta.h"
#include "common/autograd/engine.h"
#include "common/autograd/grad_mode.h"
#include "common/nn/gpt.h"
#include "common/tensor/rank_context.h"
#include "common/tensor/trace_hook.h"

namespace shardkit::nn {
namespace {

constexpr const char* kCheckpointAttachment = "checkpoint";

// Marks a checkpointed module (the call wrapper is the mechanism; this says the wrapper is ours).
struct CheckpointMark : Module::Attachment {};

// The recompute's inputs end here: output i of this node is the i-th input that requires grad, and whatever
// gradient the nested backward computes for it is kept for the CheckpointBackward node to hand on.
class InputGrads final : public autograd::Node {
 public:
  std::string name() const override { return "CheckpointInputs"; }
  // Nothing to record: it hands on gradients that recorded ops wrote (Note [capturing activation checkpointing]).
  bool traced_by_parts() const override { return true; }
  autograd::TensorList apply(autograd::TensorList&& grads) override {
    grads_ = std::move(grads);
    return {};
  }
  // The gradient of output i, undefined when the nested backward did not reach this node.
  Tensor take(int i) { return static_cast<std::size_t>(i) < grads_.size() ? std::move(grads_[static_cast<std::size_t>(i)]) : Tensor(); }

 private:
  autograd::TensorList grads_;
};

// Puts the rank's Generator back as it was when constructed (also when the recompute throws).
class GeneratorRestore {
 public:
  GeneratorRestore() : saved_(current_rank_context().generator) {}
  ~GeneratorRestore() { current_rank_context().generator = saved_; }
  GeneratorRestore(const GeneratorRestore&) = delete;
  GeneratorRestore& operator=(const GeneratorRestore&) = delete;

 private:
  Generator saved_;
};

// Puts a module's buffers' values back as they were when constructed (the recompute must not update running
// statistics a second time). Copies only when the module has buffers.
class BufferRestore {
 public:
  explicit BufferRestore(const Module& module) {
    for (auto& [name, b] : module.named_buffers()) {
      if (b.defined() && !b.storage_released()) saved_.emplace_back(b, b.clone());
    }
  }
  ~BufferRestore() {
    for (auto& [live, copy] : saved_) live.copy_(copy);
  }
  BufferRestore(const BufferRestore&) = delete;
  BufferRestore& operator=(const BufferRestore&) = delete;

 private:
  std::vector<std::pair<Tensor, Tensor>> saved_;
};

// Note [capturing activation checkpointing]
// capture::compile records a step as the ops it ran and replays exactly those (common/capture/recorder.h). A
// checkpointed call is recorded as what it runs, so that replay runs the same kernels in the same order as eager:
//   forward   the call's ops, run with grad off, are recorded as any op (with grad mode off: replay makes no
//             backward nodes for them and frees their values after their last use in the forward). Then one op,
//             "checkpoint_outputs", gives the outputs an autograd identity of their own (trace::Tracer::on_rebind):
//             in eager they hang from CheckpointBackward; in replay from a ReplayedCheckpoint node that never runs,
//             so that the ops that read them record nodes that compute their gradients, as in eager.
//   backward  CheckpointBackward and InputGrads are traced by parts (autograd::Node::traced_by_parts): the engine
//             neither records them nor hides the tracer from them. So what CheckpointBackward::apply runs is
//             recorded: "checkpoint_inputs" (on_rebind: the recompute's inputs over the kept bytes, with a history
//             of their own so that the recomputed ops compute the inputs' gradients), the recompute's ops with
//             grad mode on (replay makes their backward nodes), and every node, accumulate_grad, "add" and
//             "zeros" of the nested backward, found through the recomputed ops like those of the outer backward.
//             The gradients InputGrads collects are values recorded ops wrote; the outer backward goes on with them.
//   generator with preserve_rng_state, "checkpoint_rng_save" (at the call), "checkpoint_rng_swap" and
//             "checkpoint_rng_restore" (around the recompute) copy the rank's Generator as eager does, through a
//             ReplayRng the three kernels share: a dropout in the recompute draws in replay what it drew in forward.
//   buffers   while captured, the recompute does not copy and put back the module's buffers (a copy_ outside any
//             op cannot be replayed, and the capture refuses it): the only traced in-place write of a buffer,
//             batch_norm's running statistics, already fails the capture.
// Memory: what the replay keeps is what eager keeps. The values of the forward inside the call are freed after their
// last use there (Note [memory plan] in common/capture/executor.h); the call's inputs live until
// "checkpoint_inputs" reads them in backward (eager keeps them in the node); the recompute's saved activations are
// held by the backward nodes the replay made, each freed when its node has run. So the replay holds one checkpointed
// call's activations at a time, as eager does (tests/common/capture/compile_checkpoint_test.cc measures it on a
// GPT). Not so the capture: the recorder keeps every value of the step until it builds the graph (its slots hold
// them), the forward's and the recompute's, so the call that captures holds more than an eager step without
// checkpointing would.
// A checkpointed call whose forward ran outside the capture but whose backward runs inside it cannot be replayed:
// the capture fails naming it.

// The Generator states one recorded checkpointed call passes from its forward to its recompute in replay: the
// replay's forward_rng_ and GeneratorRestore, shared by the call's three rng kernels.
struct ReplayRng {
  Generator forward;
  Generator after;
};

// What a replayed call's outputs and recompute inputs hang from (Note [capturing activation checkpointing]): an
// autograd identity, so that ops reading them with grad mode on compute their gradients, and nothing to run.
class ReplayedCheckpoint final : public autograd::Node {
 public:
  std::string name() const override { return "ReplayedCheckpoint"; }
  autograd::TensorList apply(autograd::TensorList&&) override {
    throw autograd::AutogradError(
        "checkpoint: a backward reached the node of a replayed checkpointed call; a compiled step's backward is the "
        "recorded one (run the step through capture::CompiledStep, not autograd::backward on its values)");
  }
};

// The kernel of "checkpoint_outputs" / "checkpoint_inputs": new handles over the bytes read, one ReplayedCheckpoint
// their grad_fn.
trace::Kernel RebindKernel() {
  return [](trace::KernelArgs& a) {
    auto node = std::make_shared<ReplayedCheckpoint>();
    for (std::size_t i = 0; i < a.reads.size(); ++i) {
      Tensor t = a.reads[i].detach();
      autograd::set_history(t, node);
      a.writes[i] = std::move(t);
    }
  };
}

// Note [checkpoint node]
// The node's inputs are the call's inputs (its next edges go where their gradients go), its outputs the call's
// outputs. It keeps bytes-only handles of the inputs (never of its outputs: Note in node.h), the Generator as the
// forward found it, and `hooked` (the module's call without the wrapper: hooks + forward). apply() recomputes on
// fresh handles over the kept bytes, each input that requires grad made an output of an InputGrads node, so that
// the nested backward from the recomputed outputs ends there with the inputs' gradients, without touching the
// outer graph (the inputs' own histories) and without a leaf's .grad (which would be charged as a gradient).
class CheckpointBackward final : public autograd::Node {
 public:
  // `recorded`: the forward was recorded by a capture; `replay_rng` its Generator states in replay (when it
  // restores them), Note [capturing activation checkpointing].
  CheckpointBackward(const Module& module, Module::HookedCall hooked, autograd::TensorList inputs,
                     std::vector<bool> needs_grad, Generator forward_rng, bool restore_rng, MemoryCategory category,
                     bool recorded, std::shared_ptr<ReplayRng> replay_rng)
      : module_(&module),
        module_type_(module.type_name()),
        hooked_(std::move(hooked)),
        inputs_(std::move(inputs)),
        needs_grad_(std::move(needs_grad)),
        forward_rng_(forward_rng),
        restore_rng_(restore_rng),
        category_(category),
        recorded_(recorded),
        replay_rng_(std::move(replay_rng)) {}

  std::string name() const override { return "CheckpointBackward"; }
  bool traced_by_parts() const override { return true; }

  autograd::TensorList apply(autograd::TensorList&& grads) override {
    if (trace::Tracer* tracer = trace::active_tracer(); tracer != nullptr && !recorded_) {
      tracer->on_unsupported(absl::StrCat("the backward of a checkpointed ", module_type_,
                                          " whose forward ran before the capture (activation checkpointing: its "
                                          "forward and recompute must both be in the captured step)"));
    }
    auto input_grads = std::make_shared<InputGrads>();
    std::vector<int> slot(inputs_.size(), -1);
    autograd::TensorList inputs;
    inputs.reserve(inputs_.size());
    std::vector<Tensor> kept_read, fresh_written;  // for the capture: "checkpoint_inputs"
    for (std::size_t i = 0; i < inputs_.size(); ++i) {
      Tensor in = inputs_[i].defined() ? inputs_[i].detach() : Tensor();
      if (needs_grad_[i]) {
        autograd::set_history(in, input_grads);
        slot[i] = input_grads->num_outputs() - 1;
        kept_read.push_back(inputs_[i]);
        fresh_written.push_back(in);
      }
      inputs.push_back(std::move(in));
    }
    if (!kept_read.empty()) {
      trace::OpTraceScope scope;
      scope.record_rebind("checkpoint_inputs", std::move(kept_read), std::move(fresh_written), RebindKernel());
    }

    autograd::TensorList outputs = recompute(inputs);
    inputs.clear();
    check_outputs(outputs);

    autograd::TensorList roots, root_grads;
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grads[i].defined()) {
        roots.push_back(std::move(outputs[i]));
        root_grads.push_back(std::move(grads[i]));
      }
    }
    outputs.clear();
    grads.clear();
    if (!roots.empty()) {
      // Note [checkpoint and the sharding layers] in checkpoint.h: hooks fire in here, callbacks go outside.
      autograd::backward(roots, root_grads, {.retain_graph = false, .callbacks_to_enclosing = true});
    }
    roots.clear();
    root_grads.clear();

    autograd::TensorList out(inputs_.size());
    for (std::size_t i = 0; i < inputs_.size(); ++i) {
      if (slot[i] >= 0) out[i] = input_grads->take(slot[i]);
    }
    return out;
  }

 protected:
  void release_saved() override { inputs_.clear(); }

 private:
  autograd::TensorList recompute(const autograd::TensorList& inputs) {
    const bool tracing = trace::active_tracer() != nullptr;
    std::optional<GeneratorRestore> rng_after;  // backward's Generator, whatever the recompute drew
    if (restore_rng_) {
      rng_after.emplace();
      current_rank_context().generator = forward_rng_;
      if (replay_rng_) {
        trace::OpTraceScope scope;
        scope.record("checkpoint_rng_swap", {}, {}, [r = replay_rng_](trace::KernelArgs&) {
          r->after = current_rank_context().generator;
          current_rank_context().generator = r->forward;
        });
      }
    }
    // Running statistics as the forward left them; not while captured (Note [capturing activation checkpointing]).
    std::optional<BufferRestore> buffers;
    if (!tracing) buffers.emplace(*module_);
    MemoryCategoryScope category(category_);
    autograd::GradModeGuard grad(true);
    autograd::TensorList outputs = hooked_(inputs);
    if (restore_rng_ && replay_rng_) {
      trace::OpTraceScope scope;
      scope.record("checkpoint_rng_restore", {}, {},
                   [r = replay_rng_](trace::KernelArgs&) { current_rank_context().generator = r->after; });
    }
    return outputs;
  }

  void check_outputs(const autograd::TensorList& outputs) const {
    if (static_cast<int>(outputs.size()) != num_outputs()) {
      throw autograd::AutogradError(absl::StrCat(
          "checkpoint: the recompute of a checkpointed ", module_type_, " in backward returned ", outputs.size(),
          " outputs, its forward returned ", num_outputs(),
          "; expected the same outputs (a checkpointed module must compute the same thing when run again)"));
    }
    for (int i = 0; i < num_outputs(); ++i) {
      const Tensor& o = outputs[static_cast<std::size_t>(i)];
      const Shape want = output_shape(i);
      if (o.defined() ? o.shape() != want : !want.empty()) {
        throw autograd::AutogradError(absl::StrCat(
            "checkpoint: the recompute of a checkpointed ", module_type_, " in backward returned output ", i, " ",
            o.defined() ? o.describe() : std::string("undefined"), ", its forward returned shape ", shape_str(want),
            "; expected the same outputs (a checkpointed module must compute the same thing when run again)"));
      }
    }
  }

  const Module* module_;
  std::string module_type_;
  Module::HookedCall hooked_;
  autograd::TensorList inputs_;
  std::vector<bool> needs_grad_;
  Generator forward_rng_;
  bool restore_rng_;
  MemoryCategory category_;
  bool recorded_;
  std::shared_ptr<ReplayRng> replay_rng_;
};

bool AnyTrainableParameter(const Module& module) {
  for (const Tensor& p : module.parameters()) {
    if (p.requires_grad()) return true;
  }
  return false;
}

// One call of a checkpointed module (Note [checkpoint node]).
autograd::TensorList CheckpointedCall(Module& module, const CheckpointOptions& options, const TensorList& inputs,
                                      const Module::HookedCall& hooked) {
  // Nothing to recompute for: no graph would be recorded (grad mode off, e.g. inside another checkpointed
  // call's forward), or nothing in the call can get a gradient.
  if (!autograd::is_grad_enabled() || (!autograd::should_record(inputs) && !AnyTrainableParameter(module))) {
    return hooked(inputs);
  }
  const Generator forward_rng = current_rank_context().generator;
  const MemoryCategory category = current_memory_category();
  // Note [capturing activation checkpointing]: the Generator as the replay's forward finds it.
  const bool recorded = trace::active_tracer() != nullptr;
  std::shared_ptr<ReplayRng> replay_rng;
  if (recorded && options.preserve_rng_state) {
    replay_rng = std::make_shared<ReplayRng>();
    trace::OpTraceScope scope;
    scope.record("checkpoint_rng_save", {}, {},
                 [r = replay_rng](trace::KernelArgs&) { r->forward = current_rank_context().generator; });
  }
  TensorList outputs;
  {
    autograd::NoGradGuard no_grad;
    outputs = hooked(inputs);
  }
  TensorList kept;
  std::vector<bool> needs_grad;
  for (const Tensor& in : inputs) {
    kept.push_back(in.defined() ? in.detach() : Tensor());
    needs_grad.push_back(in.defined() && in.requires_grad() && is_floating(in.dtype()));
  }
  auto node = std::make_shared<CheckpointBackward>(module, hooked, std::move(kept), std::move(needs_grad),
                                                   forward_rng, options.preserve_rng_state, category, recorded,
                                                   std::move(replay_rng));
  node->set_next_edges(autograd::collect_next_edges(inputs));
  std::vector<Tensor> computed, given;  // for the capture: "checkpoint_outputs"
  for (Tensor& o : outputs) {
    if (!o.defined() || !is_floating(o.dtype())) {
      // Outputs that cannot carry a gradient still take a slot, so the node's output i is outputs[i].
      node->add_output(o.defined() ? o.shape() : Shape{}, DType::f32);
      continue;
    }
    computed.push_back(o);
    // An output that is an input, or has a history of its own (a module returning its input), becomes a new
    // handle over the same bytes, so that tensor's history is untouched.
    bool alias = o.autograd_meta() != nullptr || o.requires_grad();
    for (const Tensor& in : inputs) alias = alias || o.is_same(in);
    if (alias) o = o.detach();
    autograd::set_history(o, node);
    given.push_back(o);
  }
  if (!computed.empty()) {
    trace::OpTraceScope scope;
    scope.record_rebind("checkpoint_outputs", std::move(computed), std::move(given), RebindKernel());
  }
  return outputs;
}

}  // namespace

absl::Status checkpoint(Module& module, const CheckpointOptions& options) {
  if (!module.has_forward()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nn::checkpoint: expected a module with a forward of its own, found a ", module.type_name(),
        " (a container that is never called itself: checkpoint the modules it holds)"));
  }
  if (module.has_call_wrapper() && !is_checkpointed(module)) {
    return absl::FailedPreconditionError(absl::StrCat("nn::checkpoint: expected a ", module.type_name(),
                                                      " without a call wrapper, found one installed by another API"));
  }
  module.set_attachment(kCheckpointAttachment, std::make_shared<CheckpointMark>());
  module.set_call_wrapper([&module, options](const TensorList& inputs, const Module::HookedCall& hooked) {
    return CheckpointedCall(module, options, inputs, hooked);
  });
  return absl::OkStatus();
}

void remove_checkpoint(Module& module) {
  if (!is_checkpointed(module)) return;
  module.set_call_wrapper(nullptr);
  module.set_attachment(kCheckpointAttachment, nullptr);
}

bool is_checkpointed(const Module& module) {
  return dynamic_cast<const CheckpointMark*>(module.attachment(kCheckpointAttachment)) != nullptr;
}

absl::Status checkpoint_blocks(GPT& gpt, const CheckpointOptions& options) {
  for (const auto& [name, block] : gpt.blocks->named_children()) {
    if (absl::Status s = checkpoint(*block, options); !s.ok()) return s;
  }
  return absl::OkStatus();
}

void remove_checkpoint_blocks(GPT& gpt) {
  for (const auto& [name, block] : gpt.blocks->named_children()) remove_checkpoint(*block);
}

}  // namespace shardkit::nn
