// Recorder: builds an executable StepGraph while one training step runs eagerly (issue 16 item 1).
//
//   capture::Recorder recorder({.state = named_state, .batch = {x, y}});
//   {
//     trace::TracerScope scope(&recorder);
//     Tensor loss = step_fn(x, y);        // forward, backward, optimizer update: all eager, all recorded
//     recorder.mark_output(loss, "loss");
//   }
//   absl::StatusOr<StepGraph> graph = std::move(recorder).finish();
//
// What is recorded: every public autograd op (Note [traced ops] in autograd/ops/op_utils.h), every node the
// backward engine runs with the gradient bookkeeping around it (Note [tracing backward] in autograd/engine.cc),
// and every optimizer update (Note [tracing the update] in optim/optimizer.cc), each as one op node with its
// kernel. Slots are the distinct tensors the step touched (a storage, offset, dtype and shape); a tensor read before
// anything recorded wrote it is a graph input, and must be one of the declared inputs (or a view of one).
//
// Note [what cannot be captured]
// Replay runs the recorded kernels and nothing else, so anything the tracer does not see would be silently
// dropped. The recorder therefore fails the capture (finish() returns FailedPrecondition naming the op and the
// tensor) when an op reads a tensor that no recorded op wrote and that is not a declared input (it was computed
// by an untraced kernel, a Tensor method like fill_ or to(), or outside the step), when the step writes a tensor it
// already read or wrote with Tensor::fill_ / copy_ outside any recorded op (replay would not repeat the write), and
// when something reports itself unsupported (a hook, batch_norm's in-place statistics, the backward of a checkpointed
// call whose forward ran before the capture). Writes through raw data pointers are not seen: a step must not write
// its tensors that way. The message names the Override that would fix it: keep that part out of tracing and splice
// its graph in at a placeholder (graph_passes.h).
//
// Activation checkpointing (nn::checkpoint) is captured: its forward's ops as any op, its recompute and nested
// backward inside the recorded backward, and the handles it gives an autograd identity of their own as ops of
// on_rebind (a new slot each, which later reads of those bytes resolve to). Note [capturing activation
// checkpointing] in common/nn/checkpoint.cc.
//
// Thread-safety: one recorder per rank thread.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "absl/status/statusor.h"
#include "common/capture/step_graph.h"
#include "common/tensor/trace_hook.h"

namespace shardkit::capture {

struct NamedTensor {
  std::string name;
  Tensor tensor;
};

struct RecorderOptions {
  // Read and updated in place by the step, kept between steps: parameters, buffers, optimizer state. The names
  // become the input slots' names.
  std::vector<NamedTensor> state = {};
  // The step's data (slots "batch.<i>"); replay binds each call's tensors to those slots (Executor::set_input).
  std::vector<Tensor> batch = {};
  // Inputs that may come into being during the step (an optimizer creates its state at a parameter's first
  // update): asked again when an op reads a tensor that is neither recorded nor a known input.
  std::function<std::vector<NamedTensor>()> late_state = nullptr;
  // Record the optimizer's updates without applying them (trace::Tracer::dry_run): the capture changes no state.
  bool dry_run = false;
  // Tensors that are not inputs but that a step may read by mistake, with what to say when it does (a parameter's
  // gradient kept from before the step: Note [gradients kept between steps] in compile.cc).
  std::vector<NamedTensor> not_inputs = {};
};

class Recorder final : public trace::Tracer {
 public:
  explicit Recorder(RecorderOptions options);

  void on_op(std::string_view name, std::vector<Tensor> reads, std::vector<Tensor> writes, trace::Kernel kernel,
             const void* backward_node) override;
  void on_unsupported(std::string_view what) override;
  void on_rebind(std::string_view name, std::vector<Tensor> reads, std::vector<Tensor> writes,
                 trace::Kernel kernel) override;
  bool dry_run() const override { return dry_run_; }
  void on_untraced_write(const Tensor& t, std::string_view how) override;
  void on_placeholder(const std::string& name, const std::vector<Tensor>& reads,
                      const std::vector<Tensor>& writes) override;

  // A value that leaves the step (the loss); replay leaves the step's value in it.
  void mark_output(const Tensor& t, std::string name);

  // The graph: input nodes first (in first-read order), then the ops in the order they ran, then the outputs.
  // FailedPrecondition when something could not be captured (Note [what cannot be captured]).
  absl::StatusOr<StepGraph> finish() &&;

  // The batch inputs' slots, in RecorderOptions::batch order (-1 for a batch tensor the step never read).
  const std::vector<SlotId>& batch_slots() const { return batch_slots_; }

 private:
  using Key = std::tuple<const void*, std::size_t, int, Shape>;
  static Key key_of(const Tensor& t);
  SlotId slot_for_read(const Tensor& t, std::string_view op);
  SlotId slot_for_write(const Tensor& t, std::string_view op);
  SlotId new_slot(const Tensor& t, std::string name);

  StepGraph graph_;
  std::vector<Node> inputs_;  // input nodes, placed before the ops by finish()
  std::vector<Node> ops_;
  std::vector<Node> outputs_;
  std::map<Key, SlotId> slots_;
  std::map<const void*, std::string> input_names_;  // declared inputs by storage
  std::map<const void*, std::string> not_inputs_;   // RecorderOptions::not_inputs by storage
  std::map<const void*, SlotId> forward_op_of_;     // autograd node -> a slot the op that created it wrote
  std::vector<SlotId> batch_slots_;
  std::vector<Tensor> batch_;
  std::function<std::vector<NamedTensor>()> late_state_;
  bool dry_run_ = false;
  std::string error_;
};

}  // namespace shardkit::capture
