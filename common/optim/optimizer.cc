#include "common/optim/optimizer.h"

#include <algorithm>
#include <stdexcept>
#include <set>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/kernels/elementwise.h"
#include "common/optim/state_dict_validation.h"
#include "common/tensor/rank_context.h"
#include "common/tensor/trace_hook.h"

namespace shardkit::optim {

std::string hyper_params_str(const HyperParams& h) {
  return absl::StrCat("lr=", h.lr, " betas=(", h.beta1, ", ", h.beta2, ") eps=", h.eps, " weight_decay=", h.weight_decay,
                      " momentum=", h.momentum, " dampening=", h.dampening, " nesterov=", h.nesterov,
                      " maximize=", h.maximize);
}

Optimizer::Optimizer(std::string name, HyperParams defaults) : name_(std::move(name)), defaults_(defaults) {}

const ParamGroup& Optimizer::param_group(std::size_t g) const {
  SK_CHECK_LT(g, groups_.size()) << "param group index";
  return groups_[g];
}

HyperParams& Optimizer::mutable_hyper(std::size_t g) {
  SK_CHECK_LT(g, groups_.size()) << "param group index";
  return groups_[g].hyper;
}

const Tensor& Optimizer::param(std::int64_t index) const {
  SK_CHECK(index >= 0 && index < num_params_) << "parameter index " << index << " of " << num_params_;
  std::int64_t i = index;
  for (const ParamGroup& g : groups_) {
    const auto n = static_cast<std::int64_t>(g.params.size());
    if (i < n) return g.params[static_cast<std::size_t>(i)];
    i -= n;
  }
  SK_CHECK(false) << "unreachable";
  return groups_[0].params[0];
}

const ParamState* Optimizer::state(std::int64_t index) const {
  SK_CHECK(index >= 0 && index < num_params_) << "parameter index " << index << " of " << num_params_;
  const auto& s = states_[static_cast<std::size_t>(index)];
  return s.has_value() ? &*s : nullptr;
}

Tensor Optimizer::zeros_state(const Tensor& like) {
  TensorOptions options = TensorOptions{}.with_category(MemoryCategory::optimizer_state);
  options.device = like.device();
  return Tensor::zeros(like.shape(), options);
}

void Optimizer::update_on_device(const HyperParams& h, Device device, absl::Span<const DeviceUpdate> updates) {
  SK_CHECK(false) << name_ << " has no kernels for " << device.str() << " (add_param_group refuses its parameters)";
}

namespace {

// An fp32 copy of a bf16/f16 parameter, on its device: its master weights (kernels::cast converts on any device;
// Tensor::to only on the CPU).
Tensor master_of(const Tensor& p) {
  TensorOptions options = TensorOptions{}.with_category(MemoryCategory::optimizer_state);
  options.device = p.device();
  Tensor master = Tensor::empty(p.shape(), options);
  kernels::cast(p, master);
  return master;
}

}  // namespace

absl::Status Optimizer::check_group(const ParamGroup& group, std::size_t group_index) const {
  if (absl::Status s = validate_hyper(group.hyper); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(name_, " param group ", group_index, ": ", s.message()));
  }
  absl::flat_hash_set<const TensorImpl*> seen;
  for (const ParamGroup& g : groups_) {
    for (const Tensor& p : g.params) seen.insert(p.id());
  }
  for (std::size_t j = 0; j < group.params.size(); ++j) {
    const Tensor& p = group.params[j];
    const std::string where = absl::StrCat(name_, " param group ", group_index, ", parameter ", j, ": ");
    if (!p.defined()) return absl::InvalidArgumentError(where + "expected a defined tensor, found an undefined one");
    if (!is_floating(p.dtype())) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "expected a floating-point tensor, found ", p.describe()));
    }
    if (!p.device().is_cpu() && !has_device_kernels()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "expected a CPU tensor (", name_, " has no CUDA kernels), found ", p.describe()));
    }
    if (!seen.insert(p.id()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "expected each parameter in one group only, found ", p.describe(), " twice"));
    }
  }
  return absl::OkStatus();
}

absl::Status Optimizer::add_param_group(ParamGroup group) {
  if (absl::Status s = check_group(group, groups_.size()); !s.ok()) return s;
  num_params_ += static_cast<std::int64_t>(group.params.size());
  states_.resize(static_cast<std::size_t>(num_params_));
  groups_.push_back(std::move(group));
  return absl::OkStatus();
}

absl::Status Optimizer::check_step() const {
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const ParamGroup& group = groups_[g];
    if (absl::Status s = validate_hyper(group.hyper); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(name_, " step: param group ", g, ": ", s.message()));
    }
    for (std::size_t j = 0; j < group.params.size(); ++j) {
      const Tensor& p = group.params[j];
      if (!p.device().is_cpu() && trace::active_tracer() != nullptr) {
        return absl::UnimplementedError(absl::StrCat(
            name_, " step: param group ", g, ", parameter ", j, ": a captured step (common/capture) runs on the CPU "
            "only, found ", p.describe()));
      }
      if (!p.storage_released()) continue;
      return absl::FailedPreconditionError(absl::StrCat(
          name_, " step: param group ", g, ", parameter ", j, ": expected a parameter with live storage, found ", p.describe(),
          " (fsdp::fully_shard releases the parameters it takes over: build the optimizer from "
          "model.parameters() after fully_shard, which are the shards)"));
    }
  }
  return absl::OkStatus();
}

absl::Status Optimizer::step() {
  // Everything a user can get wrong is checked first, so an error updates nothing.
  if (absl::Status s = check_step(); !s.ok()) return s;
  MemoryCategoryScope category(MemoryCategory::optimizer_state);
  // A dry-run capture records the updates without applying them (trace_hook.h; Note [tracing the update]).
  const trace::Tracer* tracer = trace::active_tracer();
  const bool dry_run = tracer != nullptr && tracer->dry_run();
  std::size_t index = 0;
  std::size_t group_index = 0;
  // A group's parameters on CUDA devices, updated together after the loop over the group (update_on_device).
  std::vector<std::pair<Device, std::vector<DeviceUpdate>>> on_devices;
  for (const ParamGroup& group : groups_) {
    on_devices.clear();
    for (const Tensor& p : group.params) {
      std::optional<ParamState>& slot = states_[index++];
      const Tensor grad = p.grad();
      if (!grad.defined()) continue;
      SK_CHECK_EQ(grad.numel(), p.numel()) << name_ << ": grad " << grad.describe() << " for " << p.describe();
      SK_CHECK(grad.device() == p.device()) << name_ << ": grad " << grad.describe() << " for " << p.describe();
      if (!slot.has_value()) {
        slot.emplace();
        if (needs_master(p.dtype())) slot->tensors[kMaster] = master_of(p);
        init_state(group.hyper, p, *slot);
      }
      ParamState& st = *slot;
      const Tensor weights = needs_master(p.dtype()) ? st.tensors.at(kMaster) : p;
      if (!p.device().is_cpu()) {  // not traced: check_step refuses CUDA parameters under a tracer
        ++st.step;
        auto it = std::find_if(on_devices.begin(), on_devices.end(), [&](const auto& d) { return d.first == p.device(); });
        if (it == on_devices.end()) it = on_devices.insert(on_devices.end(), {p.device(), {}});
        it->second.push_back(DeviceUpdate{weights, p, grad, &st});
        continue;
      }
      if (!dry_run) {
        ++st.step;
        update(group.hyper, weights, p, grad, st);
      }
      trace_update(group_index, index - 1, weights, p, grad, st);
    }
    for (const auto& [device, updates] : on_devices) update_on_device(group.hyper, device, updates);
    ++group_index;
  }
  return absl::OkStatus();
}

// Note [tracing the update]
// While a step is captured (common/tensor/trace_hook.h), each parameter's update is one op, "<name>.update",
// over explicit tensors: reads [weights, param (bf16/f16 only), grad, state...] and writes [weights, param,
// state...], the state in key order. Its kernel counts the step on this optimizer's live state (bias correction
// follows the real step count) and takes the hyper-parameters as they are when it runs (LR schedules work), so
// replay is the same update as step(). A dry-run capture records it without applying it (nor counting the step).
// State an update makes when it first runs (SGD's momentum buffer when momentum was turned on after the capture;
// Note [SGD's momentum buffer] in sgd.cc) is not in the recording: the replay's update makes it in its view, and
// the kernel keeps it as live state when it is the whole parameter's, so the compiled step, seeing the optimizer's
// state changed, captures again with it before the next call (Note [recapture] in common/capture/compile.h).
// Made for a shard (a parallel mode handed the update shards), it cannot become the whole parameter's state: the
// replay fails saying so.
// Because the tensors are arguments, a parallel mode may hand it shards of
// all of them (the update is elementwise). The kernel refers to this optimizer: it must outlive the replay.
void Optimizer::trace_update(std::size_t group_index, std::size_t index, const Tensor& weights, const Tensor& param,
                             const Tensor& grad, const ParamState& st) {
  trace::OpTraceScope scope;
  if (!scope.tracing()) return;
  const bool master = !weights.is_same(param);
  std::vector<std::string> keys;
  std::vector<Tensor> reads = {weights};
  std::vector<Tensor> writes = {weights};
  if (master) {
    reads.push_back(param);
    writes.push_back(param);
  }
  reads.push_back(grad);
  for (const auto& [key, t] : st.tensors) {
    if (key == kMaster) continue;
    keys.push_back(key);
    reads.push_back(t);
    writes.push_back(t);
  }
  scope.record(absl::StrCat(name_, ".update"), std::move(reads), std::move(writes),
               [this, group_index, index, master, keys, numel = param.numel()](trace::KernelArgs& a) {
                 const std::vector<Tensor>& r = a.reads;
                 ParamState& live = *states_[index];
                 ++live.step;
                 ParamState view;
                 view.step = live.step;
                 const std::size_t first_state = master ? 3 : 2;
                 for (std::size_t k = 0; k < keys.size(); ++k) view.tensors[keys[k]] = r[first_state + k];
                 update(groups_[group_index].hyper, r[0], master ? r[1] : r[0], r[master ? 2 : 1], view);
                 for (auto& [key, t] : view.tensors) {  // state the update made (above)
                   if (std::find(keys.begin(), keys.end(), key) != keys.end()) continue;
                   if (t.numel() != numel) {
                     throw std::runtime_error(absl::StrCat(
                         name_, ": the update made optimizer state '", key, "' for a shard during a replay (a "
                         "hyper-parameter that needs state, e.g. SGD momentum, was turned on after the capture); "
                         "a sharded compiled step needs it from the start"));
                   }
                   live.tensors.emplace(key, std::move(t));
                 }
               });
}

void Optimizer::zero_grad(bool set_to_none) {
  for (const ParamGroup& group : groups_) {
    for (const Tensor& p : group.params) {
      Tensor g = p.grad();
      if (!g.defined()) continue;
      if (set_to_none) {
        p.set_grad(Tensor());
      } else {
        trace::OpTraceScope scope;  // a captured step replays the zeroing (accumulation reads it)
        g.zero_();
        scope.record("zero_grad", {}, {g}, [shape = g.shape(), dtype = g.dtype()](trace::KernelArgs& a) {
          if (!a.writes[0].defined()) {
            a.writes[0] = Tensor::empty(shape, TensorOptions{}.with_dtype(dtype).with_category(MemoryCategory::gradient));
          }
          a.writes[0].zero_();
        });
      }
    }
  }
}

void Optimizer::sync_master_from_params() {
  std::size_t index = 0;
  for (const ParamGroup& group : groups_) {
    for (const Tensor& p : group.params) {
      std::optional<ParamState>& slot = states_[index++];
      if (!slot.has_value()) continue;
      auto it = slot->tensors.find(kMaster);
      if (it == slot->tensors.end()) continue;
      if (p.device().is_cpu()) {
        it->second.copy_(p);
      } else {
        kernels::cast(p, it->second);
      }
    }
  }
}

OptimizerStateDict Optimizer::state_dict() const {
  OptimizerStateDict d;
  d.optimizer = name_;
  std::int64_t index = 0;
  for (const ParamGroup& group : groups_) {
    ParamGroupState gs;
    gs.hyper = group.hyper;
    for (std::size_t j = 0; j < group.params.size(); ++j, ++index) {
      gs.params.push_back(index);
      const auto& slot = states_[static_cast<std::size_t>(index)];
      if (!slot.has_value()) continue;
      ParamState copy;
      copy.step = slot->step;
      for (const auto& [key, t] : slot->tensors) copy.tensors[key] = t.clone();
      d.state.emplace(index, std::move(copy));
    }
    d.param_groups.push_back(std::move(gs));
  }
  return d;
}

Optimizer::StateKeys Optimizer::state_keys(const HyperParams& h, DType dtype) const {
  StateKeys keys;
  for (std::string& k : required_state_keys(h)) keys.required.insert(std::move(k));
  if (needs_master(dtype)) keys.required.insert(kMaster);
  for (std::string& k : optional_state_keys(h)) {
    if (!keys.required.contains(k)) keys.optional.insert(std::move(k));
  }
  return keys;
}

absl::Status Optimizer::check_state_dict(const OptimizerStateDict& dict) const {
  absl::Status s = validate_state_dict(dict, *this, param_layout(groups_));
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(name_, " load_state_dict: ", s.message()));
}

absl::Status Optimizer::load_state_dict(const OptimizerStateDict& dict) {
  if (absl::Status s = check_state_dict(dict); !s.ok()) return s;
  // Pair each dict index with one of our parameter positions (checked: same counts, unique indices).
  absl::flat_hash_map<std::int64_t, std::size_t> position_of;  // dict index -> our position
  std::size_t position = 0;
  for (const ParamGroupState& gs : dict.param_groups) {
    for (std::int64_t idx : gs.params) position_of.emplace(idx, position++);
  }
  // Build the new state off to the side, then commit (nothing below can fail).
  MemoryCategoryScope category(MemoryCategory::optimizer_state);
  std::vector<std::optional<ParamState>> states(states_.size());
  for (const auto& [idx, st] : dict.state) {
    ParamState copy;
    copy.step = st.step;
    const std::size_t at = position_of.at(idx);
    // On the parameter's device, where the step's kernels read it (a CPU dict loads onto a CUDA parameter).
    const Device device = param(static_cast<std::int64_t>(at)).device();
    for (const auto& [k, t] : st.tensors) copy.tensors[k] = t.to(device, MemoryCategory::optimizer_state);
    states[at] = std::move(copy);
  }
  states_ = std::move(states);
  for (std::size_t g = 0; g < groups_.size(); ++g) groups_[g].hyper = dict.param_groups[g].hyper;
  return absl::OkStatus();
}

// ---- state dict helpers ------------------------------------------------------------------------

std::int64_t OptimizerStateDict::num_params() const {
  std::int64_t n = 0;
  for (const auto& g : param_groups) n += static_cast<std::int64_t>(g.params.size());
  return n;
}

OptimizerStateDict OptimizerStateDict::clone() const {
  OptimizerStateDict d;
  d.optimizer = optimizer;
  d.param_groups = param_groups;
  for (const auto& [idx, st] : state) {
    ParamState copy;
    copy.step = st.step;
    for (const auto& [k, t] : st.tensors) copy.tensors[k] = t.defined() ? t.clone() : Tensor();
    d.state.emplace(idx, std::move(copy));
  }
  return d;
}

absl::StatusOr<OptimizerStateDict> remap_indices(const OptimizerStateDict& dict,
                                                 absl::Span<const std::int64_t> new_index) {
  auto map = [&](std::int64_t i) -> absl::StatusOr<std::int64_t> {
    if (i < 0 || i >= static_cast<std::int64_t>(new_index.size())) {
      return absl::InvalidArgumentError(absl::StrCat("remap_indices: expected an index below ", new_index.size(),
                                                     ", found ", i));
    }
    return new_index[static_cast<std::size_t>(i)];
  };
  OptimizerStateDict d;
  d.optimizer = dict.optimizer;
  for (const auto& g : dict.param_groups) {
    ParamGroupState gs;
    gs.hyper = g.hyper;
    for (std::int64_t i : g.params) {
      absl::StatusOr<std::int64_t> m = map(i);
      if (!m.ok()) return m.status();
      gs.params.push_back(*m);
    }
    d.param_groups.push_back(std::move(gs));
  }
  for (const auto& [i, st] : dict.state) {
    absl::StatusOr<std::int64_t> m = map(i);
    if (!m.ok()) return m.status();
    if (!d.state.emplace(*m, st).second) {
      return absl::InvalidArgumentError(absl::StrCat("remap_indices: two parameters map to index ", *m));
    }
  }
  return d;
}

}  // namespace shardkit::optim
