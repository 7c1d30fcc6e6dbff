// The backward engine (DESIGN.md section 2).
//
// backward(loss) runs the graph recorded by the forward, from `loss` back to the leaves, and
// accumulates into each leaf's .grad (created under MemoryCategory::gradient on first use; later
// backwards add to it until the user zeroes or drops it).
//
// Order: ready nodes run in reverse creation order (highest sequence number first), and a leaf's
// accumulation runs as soon as all its gradient contributions have arrived, so parameters become
// "gradient ready" in reverse forward order (what lets ShardedDDP / FSDP overlap reductions with the
// rest of backward). Note [execution order] in engine.cc.
//
// Graph lifetime: unless retain_graph, each node drops its saved tensors (activations) as soon as it
// has run; running backward again through such a node throws AutogradError naming the node.
//
// Final callbacks: queue_callback(fn), only while a backward runs on the calling thread (typically
// from a hook), queues fn to run once after every node and hook of this backward; callbacks run in
// queue order and may queue more callbacks, which run in the same backward. A backward started from
// inside another one (from a node or hook) has callbacks of its own, unless it passes
// BackwardOptions::callbacks_to_enclosing.
//
// State: all engine state (grad mode, the running backward, its callback queue, node sequence numbers)
// is per thread, never process-global: simulated ranks are threads and run backward concurrently.
// Exceptions thrown by nodes, hooks or callbacks propagate out of backward(); the thread's engine
// state is restored, so a later backward works (the failed graph may be partly consumed).
#pragma once

#include <functional>
#include <stdexcept>
#include <string>

#include "absl/status/status.h"
#include "common/autograd/node.h"

namespace shardkit::autograd {

// Misuse of autograd by the caller (backward through a freed graph, non-scalar loss without a
// gradient, queue_callback outside backward, a root that does not require grad).
class AutogradError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An exception that carries a Status, for hooks and callbacks whose failure comes from outside (a
// collective that timed out, a peer that died). It propagates out of backward(); try_backward()
// returns its status unchanged (code and message). Derive from it to keep a richer type.
class StatusError : public std::runtime_error {
 public:
  explicit StatusError(absl::Status status)
      : std::runtime_error(std::string(status.message())), status_(std::move(status)) {}
  const absl::Status& status() const { return status_; }

 private:
  absl::Status status_;
};

struct BackwardOptions {
  // Keep saved tensors so backward can run through the graph again.
  bool retain_graph = false;
  // For a backward run from inside another backward on the same thread (activation checkpointing runs one
  // from a node, nn/checkpoint.h): queue_callback() during it queues on the enclosing backward, so final
  // callbacks (ShardedDDP's flush, FSDP's finalize) run once, after the whole outer backward, not at the end of
  // this inner one. Without an enclosing backward it changes nothing.
  bool callbacks_to_enclosing = false;
};

// `root` must require grad. `grad` is the gradient w.r.t. root (same shape); when undefined, root must
// have exactly one element and the gradient is 1.
void backward(const Tensor& root, const Tensor& grad = Tensor(), const BackwardOptions& options = {});
// Several roots at once (one graph traversal), one gradient per root (undefined = 1 for one-element roots).
void backward(const TensorList& roots, const TensorList& grads, const BackwardOptions& options = {});

// backward() that reports errors as a Status instead of throwing: the carried status for StatusError,
// FailedPrecondition for AutogradError, Internal for anything else (a hook's exception, a broken invariant).
absl::Status try_backward(const Tensor& root, const Tensor& grad = Tensor(), const BackwardOptions& options = {});

// Queues `fn` to run after the whole running backward (see above). Throws AutogradError when no
// backward runs on the calling thread.
void queue_callback(std::function<void()> fn);

// True while a backward runs on the calling thread (inside hooks, nodes and callbacks).
bool is_backward_running();

// DESIGN.md spells the callback entry point Engine::queue_callback; this is that spelling.
struct Engine {
  static void queue_callback(std::function<void()> fn) { autograd::queue_callback(std::move(fn)); }
  static bool is_backward_running() { return autograd::is_backward_running(); }
};

}  // namespace shardkit::autograd
