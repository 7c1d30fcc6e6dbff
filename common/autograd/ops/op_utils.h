// Internal helpers for writing differentiable ops (not part of the public API).
//
// An op computes its result with plain kernels, then, when should_record(inputs), records a
// LambdaBackward node whose function maps the output gradients to the input gradients. The lambda
// captures what backward needs: input handles as they are, the op's own outputs only as detach()
// aliases (Note in node.h: no cycles). Dropping the lambda on release() frees the saved activations.
#pragma once

#include <functional>
#include <initializer_list>
#include <string>

#include "common/autograd/autograd_meta.h"
#include "common/autograd/grad_accumulation.h"
#include "common/tensor/trace_hook.h"

namespace shardkit::autograd::detail {

class LambdaBackward final : public Node {
 public:
  using Fn = std::function<TensorList(TensorList&& grads)>;
  LambdaBackward(const char* name, Fn fn) : name_(name), fn_(std::move(fn)) {}
  std::string name() const override { return name_; }
  TensorList apply(TensorList&& grads) override { return fn_(std::move(grads)); }

 protected:
  void release_saved() override { fn_ = nullptr; }

 private:
  const char* name_;
  Fn fn_;
};

// Records the backward `fn` of an op: edges to `inputs` (nullptr = no gradient slot), and the op's
// `outputs` get it as grad_fn (in order). Call only when should_record(inputs).
inline void record(const char* name, std::initializer_list<const Tensor*> inputs,
                   std::initializer_list<const Tensor*> outputs, LambdaBackward::Fn fn) {
  auto node = std::make_shared<LambdaBackward>(name, std::move(fn));
  node->set_next_edges(collect_next_edges(inputs));
  for (const Tensor* o : outputs) set_history(*o, node);
}

inline void record(const char* name, const TensorList& inputs, const TensorList& outputs, LambdaBackward::Fn fn) {
  auto node = std::make_shared<LambdaBackward>(name, std::move(fn));
  node->set_next_edges(collect_next_edges(inputs));
  for (const Tensor& o : outputs) set_history(o, node);
}

// True when `t` is defined and requires grad (its gradient is worth computing).
inline bool needs_grad(const Tensor& t) { return t.defined() && t.requires_grad(); }

// Note [ops on devices]: ops compute in fp32. Those the GPT uses (linear, matmul / bmm, add / sub / mul, gelu,
// layer_norm, causal_attention, cross_entropy, embedding, narrow, cast, reshape) run on CPU tensors and on CUDA
// tensors: their results, saved tensors and gradients live on the inputs' device, the CPU through the loops and
// BLAS here, a GPU through the kernels::cuda functions (common/kernels/cuda/cuda_kernels.h) on the calling
// thread's stream. Every other op is CPU only and names itself when handed a CUDA tensor.

// An fp32 CPU tensor, else an error naming the op (for the CPU-only ops).
inline void check_f32_cpu(const char* op, const Tensor& t) {
  SK_CHECK(t.defined()) << op << ": undefined input";
  SK_CHECK(t.dtype() == DType::f32 && t.device().is_cpu())
      << op << ": expected an f32 CPU tensor, found " << t.describe()
      << " (this op computes in fp32 on the CPU only; cast first, or move the tensor to the CPU)";
}

// An fp32 tensor on any device (the ops of Note [ops on devices]).
inline void check_f32(const char* op, const Tensor& t) {
  SK_CHECK(t.defined()) << op << ": undefined input";
  SK_CHECK(t.dtype() == DType::f32) << op << ": expected an f32 tensor, found " << t.describe()
                                    << " (autograd ops compute in fp32; cast first)";
}

// `t` (when defined) lives on `device`, else an error naming the op and both devices.
inline void check_on(const char* op, const Tensor& t, Device device) {
  SK_CHECK(!t.defined() || t.device() == device)
      << op << ": tensors on different devices: " << t.describe() << " is not on " << device.str();
}

// T's data as a typed pointer, or nullptr for an undefined or empty tensor (for kernels that take optional
// operands).
template <typename T>
T* ptr_or_null(const Tensor& t) {
  return t.defined() && t.numel() > 0 ? t.data<T>() : nullptr;
}

// Element i of an i64 tensor on any device (a synchronous copy from a device), for error messages.
inline std::int64_t i64_at(const Tensor& t, std::int64_t i) {
  if (t.device().is_cpu()) return t.data<std::int64_t>()[i];
  return t.view(i, {1}).to(Device::cpu()).data<std::int64_t>()[0];
}

// Note [traced ops]
// Every public op is a thin wrapper: traced(name, inputs, compute) runs `compute(inputs)` (the op's body, named
// <op>_compute in its .cc) and, while a step is captured (common/tensor/trace_hook.h), reports it with a kernel that
// calls `compute` again on the tensors replay hands it, leaving its fresh outputs (with their backward node, when
// grad mode is on) as the op's writes. `inputs` are positional: undefined ones (an absent bias) stay in place for
// `compute`, the tracer never sees them.
template <class Compute>
TensorList traced_list(const char* name, TensorList inputs, Compute compute) {
  trace::OpTraceScope scope;
  TensorList outs = compute(inputs);
  if (!scope.tracing()) return outs;
  std::vector<bool> defined;
  for (const Tensor& in : inputs) defined.push_back(in.defined());
  scope.record(name, inputs, outs, [compute, defined](trace::KernelArgs& a) {
    TensorList args(defined.size());
    std::size_t next = 0;
    for (std::size_t i = 0; i < defined.size(); ++i) {
      if (defined[i]) args[i] = a.reads[next++];
    }
    TensorList fresh = compute(args);
    SK_CHECK_EQ(fresh.size(), a.writes.size()) << "replayed op returned a different number of outputs";
    a.writes = std::move(fresh);
  });
  return outs;
}

template <class Compute>
Tensor traced(const char* name, TensorList inputs, Compute compute) {
  return traced_list(name, std::move(inputs), [compute](const TensorList& in) { return TensorList{compute(in)}; })[0];
}

}  // namespace shardkit::autograd::detail
