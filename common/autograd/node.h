// Node: one step of the backward graph (DESIGN.md section 2).
//
// Each differentiable operation run with grad mode on creates one Node. The node knows, for each of
// the operation's inputs, the Edge to where that input's gradient goes (the node that produced the
// input, or the AccumulateGrad node of a leaf), and keeps whatever the forward saved for backward.
// Its outputs are the operation's forward outputs: output i of the node is the tensor whose
// `output_nr` is i, and backward feeds the node one gradient per output.
//
// Ordering: every node gets a sequence number from a per-thread counter when it is created; the
// engine runs ready nodes highest sequence number first, i.e. in reverse creation order where the
// dependencies allow (Note [execution order] in engine.cc).
//
// Ownership: a node owns its next edges (strong pointers to the producers of its inputs), so a graph
// lives as long as its outputs do. Saved tensors are dropped by release() once the node ran in a
// backward that did not retain the graph. A node must not save one of its own outputs' handles (that
// would be a cycle: output -> meta -> node -> output); save `t.detach()` instead.
//
// Thread-safety: a graph belongs to the thread (rank) that built it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/autograd/hook_handle.h"
#include "common/tensor/tensor.h"

namespace shardkit::autograd {

using TensorList = std::vector<Tensor>;

class Node;

// Where a gradient goes: input slot `input_nr` of `node` (the producing node's output index).
struct Edge {
  std::shared_ptr<Node> node;
  int input_nr = 0;
  bool valid() const { return node != nullptr; }
};

// A tensor hook: sees the gradient w.r.t. a tensor; returning a tensor replaces that gradient.
using TensorHook = std::function<std::optional<Tensor>(const Tensor& grad)>;
using TensorHookList = HookList<TensorHook>;

class Node {
 public:
  Node();
  virtual ~Node() = default;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  // For error messages and debugging: "LinearBackward".
  virtual std::string name() const = 0;

  // Computes the gradients w.r.t. the forward inputs from `grads`, one per forward output. The engine
  // passes a defined tensor in every slot (zeros where no gradient arrived). Returns one tensor per
  // next edge; undefined means "no gradient" and is allowed for edges that are not valid.
  // Runs with grad mode off.
  virtual TensorList apply(TensorList&& grads) = 0;

  // Drops the tensors saved for backward. Called by the engine after the node ran in a backward that
  // does not retain the graph; a released node refuses to run again (clear error).
  void release();
  bool released() const { return released_; }
  // AccumulateGrad is reused by every graph a leaf takes part in, so it is never released.
  virtual bool releasable() const { return true; }
  // True for the node that accumulates into a leaf's .grad (runs as soon as it is ready).
  virtual bool is_accumulate_grad() const { return false; }
  // While a step is captured (Note [tracing backward] in engine.cc) the engine records each node it runs as one op
  // and hides the tracer from what the node computes. A node that answers true is run with the tracer visible and
  // is not recorded itself: the ops it runs (a recomputation, a nested backward) are recorded one by one, and replay
  // runs those, never the node. nn::checkpoint's nodes (Note [capturing activation checkpointing] in
  // common/nn/checkpoint.cc).
  virtual bool traced_by_parts() const { return false; }

  std::uint64_t sequence_nr() const { return sequence_nr_; }

  const std::vector<Edge>& next_edges() const { return next_edges_; }
  void set_next_edges(std::vector<Edge> edges) { next_edges_ = std::move(edges); }

  // Forward outputs: shape, dtype and device of each, recorded by set_history (used to make zero gradients).
  int num_outputs() const { return static_cast<int>(output_shapes_.size()); }
  int add_output(const Shape& shape, DType dtype, Device device = Device::cpu());
  const Shape& output_shape(int i) const { return output_shapes_.at(static_cast<std::size_t>(i)); }
  DType output_dtype(int i) const { return output_dtypes_.at(static_cast<std::size_t>(i)); }
  Device output_device(int i) const { return output_devices_.at(static_cast<std::size_t>(i)); }

  // Hooks on the gradient w.r.t. forward output i (shared with that tensor's AutogradMeta).
  const std::shared_ptr<TensorHookList>& output_hooks(int i) const;
  void set_output_hooks(int i, std::shared_ptr<TensorHookList> hooks);

 protected:
  // Subclasses drop what they saved. Default: nothing saved.
  virtual void release_saved() {}

 private:
  std::uint64_t sequence_nr_;
  bool released_ = false;
  std::vector<Edge> next_edges_;
  std::vector<Shape> output_shapes_;
  std::vector<DType> output_dtypes_;
  std::vector<Device> output_devices_;
  std::vector<std::shared_ptr<TensorHookList>> output_hooks_;
};

// The next value of the calling thread's node sequence counter (exposed for tests).
std::uint64_t peek_sequence_nr();

}  // namespace shardkit::autograd
