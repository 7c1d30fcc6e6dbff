#include "common/capture/compile.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/logging.h"
#include "common/capture/graph_passes.h"
#include "common/capture/recorder.h"
#include "common/tensor/rank_context.h"
#include "common/tensor/trace_hook.h"

namespace shardkit::capture {

void record_placeholder(const std::string& name, const std::vector<Tensor>& reads, const std::vector<Tensor>& writes) {
  if (trace::Tracer* t = trace::active_tracer()) t->on_placeholder(name, reads, writes);
}

CompiledStep::CompiledStep(StepFn step, nn::Module& module, optim::Optimizer& optimizer, CompileOptions options)
    : step_(std::move(step)), module_(module), optimizer_(optimizer), options_(std::move(options)) {}

std::vector<bool> CompiledStep::trainable() const {
  std::vector<bool> t;
  for (const Tensor& p : module_.parameters()) t.push_back(p.requires_grad());
  return t;
}

std::optional<std::string> CompiledStep::recapture_reason(const std::vector<Tensor>& batch) const {
  if (!executor_) return "first call";
  if (batch.size() != captured_batch_.size()) {
    return absl::StrCat("the batch has ", batch.size(), " tensors, captured with ", captured_batch_.size());
  }
  for (std::size_t i = 0; i < batch.size(); ++i) {
    if (batch[i].dtype() != captured_batch_[i].first || batch[i].shape() != captured_batch_[i].second) {
      return absl::StrCat("batch tensor ", i, " is ", batch[i].describe(), ", captured with ",
                          std::string(dtype_name(captured_batch_[i].first)), shape_str(captured_batch_[i].second));
    }
  }
  if (trainable() != trainable_) return "the set of parameters that require grad changed";
  return std::nullopt;
}

absl::Status CompiledStep::capture(const std::vector<Tensor>& batch, std::string reason) {
  executor_.reset();
  if (options_.parallel_mode) {
    if (absl::Status s = options_.parallel_mode->before_capture(); !s.ok()) return s;
  }
  captured_batch_.clear();
  for (const Tensor& b : batch) captured_batch_.emplace_back(b.dtype(), b.shape());

  RecorderOptions ro{.batch = batch, .dry_run = true};
  for (const auto& [name, p] : module_.named_parameters()) ro.state.push_back({absl::StrCat("param.", name), p});
  for (const auto& [name, b] : module_.named_buffers()) ro.state.push_back({absl::StrCat("buffer.", name), b});
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
    trace::TracerScope scope(&recorder);
    Tensor loss;
    try {
      loss = step_(batch);
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("capture: the step threw: ", e.what()));
    }
    if (!loss.defined()) return absl::InvalidArgumentError("capture: expected the step to return its loss, found none");
    recorder.mark_output(loss, "loss");
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
  trainable_ = trainable();
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
