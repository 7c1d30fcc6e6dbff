#include "common/capture/compile.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/logging.h"
#include "common/capture/graph_passes.h"
#include "common/capture/recorder.h"
#include "common/tensor/rank_context.h"
#include "common/tensor/trace_hook.h"

namespace shardkit::capture {
namespace {

bool all_zero(const Tensor& t) {
  const std::vector<float> v = t.to_vector();
  return std::all_of(v.begin(), v.end(), [](float x) { return x == 0.0f; });
}

}  // namespace

void record_placeholder(const std::string& name, const std::vector<Tensor>& reads, const std::vector<Tensor>& writes) {
  if (trace::Tracer* t = trace::active_tracer()) t->on_placeholder(name, reads, writes);
}

CompiledStep::CompiledStep(StepFn step, nn::Module& module, optim::Optimizer& optimizer, CompileOptions options)
    : step_(std::move(step)), module_(module), optimizer_(optimizer), options_(std::move(options)) {}

CompiledStep::CaptureKey CompiledStep::key_now(const std::vector<Tensor>& batch) const {
  CaptureKey k;
  for (const Tensor& b : batch) k.batch.emplace_back(b.dtype(), b.shape());
  for (const Tensor& p : module_.parameters()) {
    k.trainable.push_back(p.requires_grad());
    k.grads.push_back(p.grad().defined() ? static_cast<const void*>(p.grad().id()) : nullptr);
  }
  for (const auto& [name, m] : module_.named_modules()) k.training.push_back(m->is_training());
  for (std::size_t g = 0; g < optimizer_.num_param_groups(); ++g) {
    k.group_sizes.push_back(static_cast<std::int64_t>(optimizer_.param_group(g).params.size()));
  }
  for (std::int64_t i = 0; i < optimizer_.num_params(); ++i) {
    if (const optim::ParamState* st = optimizer_.state(i)) {
      for (const auto& [key, t] : st->tensors) k.optimizer_state.emplace_back(absl::StrCat(i, ".", key), t.id());
    }
  }
  if (options_.guard) k.guard = options_.guard();
  return k;
}

std::optional<std::string> CompiledStep::recapture_reason(const std::vector<Tensor>& batch) const {
  if (!executor_) return "first call";
  if (invalidated_) return "invalidate() was called";
  const CaptureKey now = key_now(batch);
  const CaptureKey& was = captured_;
  if (now.batch.size() != was.batch.size()) {
    return absl::StrCat("the batch has ", now.batch.size(), " tensors, captured with ", was.batch.size());
  }
  for (std::size_t i = 0; i < batch.size(); ++i) {
    if (now.batch[i] != was.batch[i]) {
      return absl::StrCat("batch tensor ", i, " is ", batch[i].describe(), ", captured with ",
                          std::string(dtype_name(was.batch[i].first)), shape_str(was.batch[i].second));
    }
  }
  if (now.trainable != was.trainable) return "the set of parameters that require grad changed";
  if (now.training != was.training) return "a module's training mode changed (train() / eval())";
  if (now.group_sizes != was.group_sizes) return "the optimizer's param groups changed (add_param_group)";
  if (now.optimizer_state != was.optimizer_state) {
    return "the optimizer's state tensors changed (load_state_dict, or state an update created)";
  }
  if (now.grads != was.grads) return "the gradients kept between steps changed";
  if (options_.parallel_mode) {
    if (std::optional<std::string> r = options_.parallel_mode->recapture_reason()) return r;
  }
  if (now.guard != was.guard) return absl::StrCat("the guard's value changed (captured with '", was.guard, "', now '", now.guard, "')");
  return std::nullopt;
}

absl::Status CompiledStep::capture(const std::vector<Tensor>& batch, std::string reason) {
  executor_.reset();
  if (options_.parallel_mode) {
    if (absl::Status s = options_.parallel_mode->before_capture(); !s.ok()) return s;
  }
  RecorderOptions ro{.batch = batch, .dry_run = true};
  for (const auto& [name, p] : module_.named_parameters()) ro.state.push_back({absl::StrCat("param.", name), p});
  for (const auto& [name, b] : module_.named_buffers()) ro.state.push_back({absl::StrCat("buffer.", name), b});
  // Note [gradients kept between steps]
  // A replay's gradients are values of the step, not the parameters' .grad, so a gradient kept from before the step
  // (zero_grad(set_to_none = false)) cannot be read as it is. Kept all zeros (what zero_grad(false) ending the step
  // leaves), it is recorded as written with zeros at the start of the step: the replay starts each call from zero
  // gradients for those parameters, as eager does, and the optimizer still steps one that gets no new gradient
  // (weight decay on a zero gradient). The capture checks that the step leaves it zero again (else the next call
  // would not start from zeros) and refuses the step otherwise. Kept with values in it (the step does not zero a
  // parameter the optimizer does not hold, or gradients were accumulated before compiling), it is refused by name if
  // the step reads it before writing it. Found by a helper's audit: a recapture after steps ending in
  // zero_grad(false) failed with a message naming no gradient (tests/common/capture/compile_combo_test.cc).
  std::vector<std::pair<std::string, Tensor>> kept_zero;
  for (const auto& [name, p] : module_.named_parameters()) {
    const Tensor g = p.grad();
    if (!g.defined()) continue;
    if (g.device().is_cpu() && g.dtype() == DType::f32 && g.nbytes() > 0 && !g.storage_released() && all_zero(g)) {
      kept_zero.emplace_back(name, g);
      continue;
    }
    ro.not_inputs.push_back({absl::StrCat("the gradient of parameter '", name, "' (", g.describe(),
                                          "), kept from before the step with values in it: a replay cannot accumulate "
                                          "into it (Note [gradients kept between steps] in common/capture/compile.cc); "
                                          "zero it in the step or drop it (zero_grad) before compiling"),
                             g});
  }
  ro.late_state = [this] {
    std::vector<NamedTensor> state;
    for (std::int64_t i = 0; i < optimizer_.num_params(); ++i) {
      if (const optim::ParamState* st = optimizer_.state(i)) {
        for (const auto& [key, t] : st->tensors) state.push_back({absl::StrCat("optim.", i, ".", key), t});
      }
    }
    return state;
  };
  Recorder recorder(std::move(ro));
  {
    // The dry run leaves the rank's Generator as it found it too (compile.h): the replay of this same call
    // then draws what an eager step would (dropout), not the draws after the capture's.
    struct GeneratorKept {
      Generator saved = current_rank_context().generator;
      ~GeneratorKept() { current_rank_context().generator = saved; }
    } generator_kept;
    // And the module's buffers: a step that writes one (batch_norm's running statistics) is refused, but its dry
    // run wrote them already (a helper's audit, compile_combo2_test); they are put back, whatever the outcome.
    struct BuffersKept {
      std::vector<std::pair<Tensor, Tensor>> saved;  // (buffer, copy)
      ~BuffersKept() {
        for (auto& [b, copy] : saved) b.copy_(copy);
      }
    } buffers_kept;
    for (const auto& [name, b] : module_.named_buffers()) {
      if (b.defined() && b.nbytes() > 0 && !b.storage_released()) buffers_kept.saved.emplace_back(b, b.clone());
    }
    trace::TracerScope scope(&recorder);
    for (const auto& [name, g] : kept_zero) {  // Note [gradients kept between steps]
      trace::OpTraceScope op;
      op.record("kept_zero_grad", {}, {g}, [shape = g.shape()](trace::KernelArgs& a) {
        a.writes[0] = Tensor::zeros(shape, TensorOptions{}.with_category(MemoryCategory::gradient));
      });
    }
    Tensor loss;
    try {
      loss = step_(batch);
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("capture: the step threw: ", e.what()));
    }
    if (!loss.defined()) return absl::InvalidArgumentError("capture: expected the step to return its loss, found none");
    recorder.mark_output(loss, "loss");
  }
  for (const auto& [name, g] : kept_zero) {  // Note [gradients kept between steps]
    if (!all_zero(g)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "capture: the step starts with parameter '", name, "''s gradient kept as zeros but leaves values in it (it "
          "does not zero it, e.g. a parameter the optimizer does not hold): a replay would start the next call from "
          "zeros, not from those values (Note [gradients kept between steps] in common/capture/compile.cc); zero it "
          "in the step, or drop gradients with zero_grad() (set_to_none)"));
    }
  }
  batch_slots_ = recorder.batch_slots();
  absl::StatusOr<StepGraph> captured = std::move(recorder).finish();
  if (!captured.ok()) return captured.status();
  StepGraph graph = *std::move(captured);
  captured_counts_ = graph.counts();

  for (const Override& o : options_.overrides) {
    const auto& nodes = graph.nodes();
    auto it = std::find_if(nodes.begin(), nodes.end(),
                           [&](const Node& n) { return n.kind == NodeKind::placeholder && n.name == o.name; });
    if (it == nodes.end()) continue;  // the overridden part did not run in this step
    absl::StatusOr<std::vector<Node>> replacement = o.expand(graph, *it);
    if (!replacement.ok()) return replacement.status();
    if (absl::Status s = expand_placeholder(graph, o.name, *std::move(replacement)); !s.ok()) return s;
  }
  std::map<std::string, std::shared_ptr<comm::ProcessGroup>> groups;
  if (options_.parallel_mode) {
    if (absl::Status s = options_.parallel_mode->expand(graph); !s.ok()) return s;
    groups = options_.parallel_mode->groups();
  }
  const std::map<std::string, int> expanded = graph.counts();
  expanded_collectives_ = expanded.count("collective") ? expanded.at("collective") : 0;
  deduplicated_ = dedup_collectives(graph).removed;
  coalesced_ = options_.coalesce_bytes > 0 ? coalesce_collectives(graph, options_.coalesce_bytes).removed : 0;
  if (options_.transform) {
    if (absl::Status s = options_.transform(graph); !s.ok()) return s;
  }
  for (const Node& n : graph.nodes()) {
    if (n.kind == NodeKind::output && n.name == "loss") loss_slot_ = n.reads[0];
  }
  absl::StatusOr<Executor> executor =
      Executor::create(std::move(graph), ExecutorOptions{.groups = std::move(groups), .arena = options_.arena});
  if (!executor.ok()) return executor.status();
  executor_.emplace(*std::move(executor));
  captured_ = key_now(batch);  // after expand: a mode may have replaced what it shards
  invalidated_ = false;
  ++captures_;
  last_capture_reason_ = reason;
  SK_LOG(kInfo, "capture: captured the step (", reason, "): ", executor_->graph().nodes().size(), " nodes");
  return absl::OkStatus();
}

absl::StatusOr<Tensor> CompiledStep::operator()(const std::vector<Tensor>& batch) {
  if (std::optional<std::string> reason = recapture_reason(batch)) {
    if (absl::Status s = capture(batch, *reason); !s.ok()) return s;
  }
  for (std::size_t i = 0; i < batch.size(); ++i) {
    if (batch_slots_[i] >= 0) executor_->set_input(batch_slots_[i], batch[i]);
  }
  if (absl::Status s = executor_->run(); !s.ok()) return s;
  return executor_->value(loss_slot_).detach();
}

}  // namespace shardkit::capture
