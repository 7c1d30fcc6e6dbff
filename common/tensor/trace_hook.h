// The trace hook: how ops, the backward engine and optimizers report what they compute while a training step is
// being captured (issue 16; DESIGN.md section 5b). common/capture implements the tracer; the folders below it
// (autograd, optim) only report, so they do not depend on capture.
//
// Every reporting site has the same shape: an op opens an OpTraceScope before it computes, and when done calls
// scope.record(name, reads, writes, kernel). `kernel` recomputes the op: replay calls it with the tensors of this
// replay in place of `reads`, and `writes` holding the current values of the written tensors (undefined for a value
// the op creates); the kernel leaves the op's results in `writes`: fresh tensors it made, or the ones it was given,
// updated in place.
//
// Note [outermost op only]
// An op implemented with other ops (attention from matmul and softmax, a backward that calls forward kernels)
// is recorded once, as itself: while an OpTraceScope is open, the thread has no active tracer, so the inner ops
// record nothing; the scope restores the tracer when it closes. Recording the outermost call is what makes the
// kernel self-contained.
//
// Per thread: the active tracer is thread_local (simulated ranks are threads), never process-global.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "common/tensor/tensor.h"

namespace shardkit::trace {

// What a kernel runs on (see the file comment). `reads` may be moved from: a value the replay will not use again is
// handed over as the only reference to it, so a kernel can reuse its bytes (as the backward engine does).
// `backward_node`: for a node of the backward engine, this replay's autograd::Node (the one the replayed forward
// op created), opaque here.
struct KernelArgs {
  std::vector<Tensor>& reads;
  std::vector<Tensor>& writes;
  void* backward_node = nullptr;
};
using Kernel = std::function<void(KernelArgs& args)>;

class Tracer {
 public:
  virtual ~Tracer() = default;
  // A computation ran: it read `reads` and produced (or updated in place) `writes`. Undefined tensors never
  // appear in either list. `backward_node`: for a node the backward engine ran, that node (an autograd::Node*,
  // opaque here): its kernel runs the node's counterpart of the replay, which the tracer finds through the
  // forward op whose outputs have that node as grad_fn.
  virtual void on_op(std::string_view name, std::vector<Tensor> reads, std::vector<Tensor> writes, Kernel kernel,
                     const void* backward_node) = 0;
  // Like on_op, for an op whose writes are new handles over the bytes of its reads (writes[i] over reads[i]'s bytes,
  // same dtype and shape) with an autograd identity of their own: nn::checkpoint gives its forward's outputs their
  // backward node and its recomputation's inputs a history that ends where their gradients are collected (Note
  // [capturing activation checkpointing] in common/nn/checkpoint.cc). Each write is a new value, and later reads of
  // those bytes resolve to it rather than to the value it was made from. A tracer that cannot tell them apart
  // refuses the step.
  virtual void on_rebind(std::string_view name, std::vector<Tensor> reads, std::vector<Tensor> writes, Kernel kernel) {
    on_unsupported(std::string(name) + " (this tracer cannot give bytes a new identity)");
  }
  // Something ran that cannot be replayed (a hook, an untraced computation): capture must fail naming it.
  virtual void on_unsupported(std::string_view what) = 0;
  // A part of the step that is deliberately not traced (an Override's stand-in): it read `reads` and produced
  // `writes`; the graph gets a placeholder node there, to be expanded later.
  virtual void on_placeholder(const std::string& name, const std::vector<Tensor>& reads,
                              const std::vector<Tensor>& writes) {
    on_unsupported("placeholder " + name + " (this tracer has no placeholders)");
  }
  // `t` is about to be written in place outside any recorded op (Tensor::fill_ / copy_ called by the step itself):
  // harmless for a tensor the step just made, a value replay would lose for one the step already read or wrote.
  virtual void on_untraced_write(const Tensor& t, std::string_view how) {}
  // True when ops with lasting effects (an optimizer's update of parameters and state) should be recorded without
  // being applied: the capture then changes nothing, and the step is done by replaying the graph.
  virtual bool dry_run() const { return false; }
};

// The calling thread's tracer, or nullptr (not capturing, or inside a recorded op: Note [outermost op only]).
Tracer* active_tracer();

// Installs `tracer` on the calling thread until destruction (restores the previous one).
class TracerScope {
 public:
  explicit TracerScope(Tracer* tracer);
  ~TracerScope();
  TracerScope(const TracerScope&) = delete;
  TracerScope& operator=(const TracerScope&) = delete;

 private:
  Tracer* previous_;
};

// Opened by an op before it computes: hides the tracer from the ops it calls (Note [outermost op only]).
class OpTraceScope {
 public:
  OpTraceScope();
  ~OpTraceScope();
  OpTraceScope(const OpTraceScope&) = delete;
  OpTraceScope& operator=(const OpTraceScope&) = delete;

  // True when this op is being captured (worth building a kernel for).
  bool tracing() const { return tracer_ != nullptr; }
  // The tracer this op reports to (nullptr when not tracing).
  Tracer* tracer() const { return tracer_; }
  // Reports the op when tracing; undefined tensors in the lists are dropped.
  void record(std::string_view name, std::vector<Tensor> reads, std::vector<Tensor> writes, Kernel kernel,
              const void* backward_node = nullptr) const;
  // Reports an op of Tracer::on_rebind when tracing.
  void record_rebind(std::string_view name, std::vector<Tensor> reads, std::vector<Tensor> writes,
                     Kernel kernel) const;

 private:
  Tracer* tracer_;
};

}  // namespace shardkit::trace
