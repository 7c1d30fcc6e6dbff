#include "common/capture/recorder.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/autograd/autograd_meta.h"
#include "common/autograd/grad_mode.h"

namespace shardkit::capture {
namespace {

constexpr std::string_view kOverrideHint =
    " (replay runs only what was recorded; compute it with autograd ops inside the step, pass it as an input, or "
    "keep that part out of tracing with an Override and splice its graph in at the placeholder)";

}  // namespace

Recorder::Recorder(RecorderOptions options)
    : batch_(std::move(options.batch)), late_state_(std::move(options.late_state)), dry_run_(options.dry_run) {
  for (const NamedTensor& s : options.state) {
    if (s.tensor.defined()) input_names_.emplace(s.tensor.storage().get(), s.name);
  }
  for (std::size_t i = 0; i < batch_.size(); ++i) {
    if (batch_[i].defined()) input_names_.emplace(batch_[i].storage().get(), absl::StrCat("batch.", i));
  }
  for (const NamedTensor& s : options.not_inputs) {
    if (s.tensor.defined()) not_inputs_.emplace(s.tensor.storage().get(), s.name);
  }
  batch_slots_.assign(batch_.size(), -1);
}

Recorder::Key Recorder::key_of(const Tensor& t) {
  return Key{t.storage().get(), t.offset_bytes(), static_cast<int>(t.dtype()), t.shape()};
}

SlotId Recorder::new_slot(const Tensor& t, std::string name) {
  const SlotId id = graph_.add_slot(std::move(name), t.dtype(), t.shape());
  graph_.mutable_slot(id).value = t;
  slots_.emplace(key_of(t), id);
  return id;
}

SlotId Recorder::slot_for_read(const Tensor& t, std::string_view op) {
  if (auto it = slots_.find(key_of(t)); it != slots_.end()) return it->second;
  // Another view of bytes a slot already covers (a Tensor::reshape inside a module): an alias, not a computation;
  // replay makes the same view of the replay's value.
  for (const auto& [key, id] : slots_) {
    if (std::get<0>(key) != t.storage().get()) continue;
    const Tensor& base = graph_.slot(id).value;
    if (t.offset_bytes() < base.offset_bytes()) continue;
    const std::size_t delta = t.offset_bytes() - base.offset_bytes();
    const SlotId view = new_slot(t, absl::StrCat(graph_.slot(id).name, ".view"));
    ops_.push_back(Node{.kind = NodeKind::op, .name = "view", .reads = {id}, .writes = {view},
                        .kernel = [delta, shape = t.shape(), dtype = t.dtype()](trace::KernelArgs& a) {
                          const Tensor& b = a.reads[0];
                          a.writes[0] = Tensor::over(b.storage(), b.offset_bytes() + delta, shape, dtype);
                        },
                        .grad_enabled = autograd::is_grad_enabled()});
    return view;
  }
  auto input = input_names_.find(t.storage().get());
  if (input == input_names_.end() && late_state_) {
    for (const NamedTensor& s : late_state_()) {
      if (s.tensor.defined()) input_names_.emplace(s.tensor.storage().get(), s.name);
    }
    input = input_names_.find(t.storage().get());
  }
  if (input == input_names_.end()) {
    if (auto known = not_inputs_.find(t.storage().get()); known != not_inputs_.end() && error_.empty()) {
      error_ = absl::StrCat("capture: op '", std::string(op), "' reads ", known->second);
    } else if (error_.empty()) {
      error_ = absl::StrCat("capture: op '", std::string(op), "' reads ", t.describe(),
                            ", which no recorded op wrote and which is not an input of the step", std::string(kOverrideHint));
    }
    return new_slot(t, "unknown");
  }
  const SlotId id = new_slot(t, input->second);
  inputs_.push_back(Node{.kind = NodeKind::input, .name = input->second, .reads = {}, .writes = {id}});
  for (std::size_t i = 0; i < batch_.size(); ++i) {
    if (batch_slots_[i] < 0 && batch_[i].defined() && batch_[i].storage() == t.storage()) batch_slots_[i] = id;
  }
  return id;
}

SlotId Recorder::slot_for_write(const Tensor& t, std::string_view op) {
  if (auto it = slots_.find(key_of(t)); it != slots_.end()) return it->second;
  return new_slot(t, absl::StrCat(std::string(op), ".", graph_.slots().size()));
}

void Recorder::on_op(std::string_view name, std::vector<Tensor> reads, std::vector<Tensor> writes,
                     trace::Kernel kernel, const void* backward_node) {
  Node node{.kind = NodeKind::op, .name = std::string(name)};
  for (const Tensor& r : reads) node.reads.push_back(slot_for_read(r, name));
  for (const Tensor& w : writes) node.writes.push_back(slot_for_write(w, name));
  node.kernel = std::move(kernel);
  node.grad_enabled = autograd::is_grad_enabled();
  if (backward_node != nullptr) {
    // nn::checkpoint's nodes never get here: they are traced by parts (Note [capturing activation checkpointing]
    // in common/nn/checkpoint.cc).
    auto it = forward_op_of_.find(backward_node);
    if (it == forward_op_of_.end()) {
      on_unsupported(absl::StrCat("backward node ", std::string(name),
                                  " (the forward computation that created it was not recorded)"));
    } else {
      node.grad_fn_slot = it->second;
    }
  }
  ops_.push_back(std::move(node));
  if (backward_node == nullptr) {
    const std::vector<SlotId>& written = ops_.back().writes;
    for (std::size_t i = 0; i < writes.size(); ++i) {
      if (const autograd::AutogradMeta* meta = autograd::meta_of(writes[i]); meta != nullptr && meta->grad_fn) {
        forward_op_of_[meta->grad_fn.get()] = written[i];
      }
    }
  }
}

void Recorder::on_rebind(std::string_view name, std::vector<Tensor> reads, std::vector<Tensor> writes,
                         trace::Kernel kernel) {
  Node node{.kind = NodeKind::op, .name = std::string(name)};
  for (const Tensor& r : reads) node.reads.push_back(slot_for_read(r, name));
  // New values, even though their key (storage, offset, dtype, shape) is that of what they alias: the key now
  // resolves to them, so the ops after this one read the new handles (trace_hook.h, Tracer::on_rebind).
  for (const Tensor& w : writes) {
    const SlotId id = graph_.add_slot(absl::StrCat(std::string(name), ".", graph_.slots().size()), w.dtype(), w.shape());
    graph_.mutable_slot(id).value = w;
    slots_[key_of(w)] = id;
    node.writes.push_back(id);
  }
  node.kernel = std::move(kernel);
  node.grad_enabled = autograd::is_grad_enabled();
  ops_.push_back(std::move(node));
}

void Recorder::on_placeholder(const std::string& name, const std::vector<Tensor>& reads,
                              const std::vector<Tensor>& writes) {
  Node node{.kind = NodeKind::placeholder, .name = name};
  for (const Tensor& r : reads) node.reads.push_back(slot_for_read(r, name));
  for (const Tensor& w : writes) node.writes.push_back(slot_for_write(w, name));
  ops_.push_back(std::move(node));
}

void Recorder::on_untraced_write(const Tensor& t, std::string_view how) {
  const void* storage = t.storage().get();
  bool known = input_names_.count(storage) > 0;
  for (auto it = slots_.begin(); !known && it != slots_.end(); ++it) known = std::get<0>(it->first) == storage;
  if (known) on_unsupported(absl::StrCat(std::string(how), " on ", t.describe(), ", a tensor of the step, outside any op"));
}

void Recorder::on_unsupported(std::string_view what) {
  if (error_.empty()) error_ = absl::StrCat("capture: cannot replay ", std::string(what), std::string(kOverrideHint));
}

void Recorder::mark_output(const Tensor& t, std::string name) {
  const SlotId id = slot_for_read(t, "output");
  outputs_.push_back(Node{.kind = NodeKind::output, .name = std::move(name), .reads = {id}, .writes = {}});
}

absl::StatusOr<StepGraph> Recorder::finish() && {
  if (!error_.empty()) return absl::FailedPreconditionError(error_);
  for (std::vector<Node>* part : {&inputs_, &ops_, &outputs_}) {
    for (Node& n : *part) graph_.add(std::move(n));
  }
  // Only the inputs keep their tensors; every other value is made by the replay (and the captured ones are freed).
  std::vector<bool> is_input(graph_.slots().size(), false);
  for (const Node& n : graph_.nodes()) {
    if (n.kind == NodeKind::input) is_input[static_cast<std::size_t>(n.writes[0])] = true;
  }
  for (std::size_t i = 0; i < is_input.size(); ++i) {
    if (!is_input[i]) graph_.mutable_slot(static_cast<SlotId>(i)).value = Tensor();
  }
  if (absl::Status s = graph_.validate(); !s.ok()) {
    return absl::InternalError(absl::StrCat("capture: the recorded graph is malformed: ", s.message()));
  }
  return std::move(graph_);
}

}  // namespace shardkit::capture
