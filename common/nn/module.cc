#include "common/nn/module.h"

#include <algorithm>
#include <map>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/autograd/grad_mode.h"
#include "common/nn/deferred_init.h"

namespace shardkit::nn {
namespace {

std::string Join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : absl::StrCat(prefix, ".", name);
}

void CheckName(const std::string& name) {
  SK_CHECK(!name.empty() && name.find('.') == std::string::npos)
      << "module member names must be non-empty and contain no '.', found \"" << name << "\"";
}

}  // namespace

Module::Module(std::string type_name)
    : type_name_(std::move(type_name)),
      pre_hooks_(std::make_shared<autograd::HookList<ForwardPreHook>>()),
      post_hooks_(std::make_shared<autograd::HookList<ForwardHook>>()) {}

Module::~Module() = default;

Tensor Module::operator()(const Tensor& x) {
  TensorList out = call({x});
  SK_CHECK_EQ(out.size(), 1u) << type_name_ << " returned " << out.size() << " outputs; use call()";
  return out[0];
}

TensorList Module::call(const TensorList& inputs) {
  if (call_wrapper_) return call_wrapper_(inputs, [this](const TensorList& in) { return call_hooked(in); });
  return call_hooked(inputs);
}

TensorList Module::call_hooked(const TensorList& inputs) {
  if (pre_hooks_->empty() && post_hooks_->empty()) return forward_list(inputs);
  return run_hooked(inputs, [this](const TensorList& in) { return forward_list(in); });
}

void Module::set_call_wrapper(CallWrapper wrapper) { call_wrapper_ = std::move(wrapper); }

TensorList Module::run_hooked(const TensorList& inputs, const std::function<TensorList(const TensorList&)>& body) {
  TensorList in = inputs;
  pre_hooks_->for_each([&](const ForwardPreHook& hook) {
    if (std::optional<TensorList> replaced = hook(*this, in)) in = std::move(*replaced);
  });
  TensorList out = body(in);
  post_hooks_->for_each([&](const ForwardHook& hook) {
    if (std::optional<TensorList> replaced = hook(*this, in, out)) out = std::move(*replaced);
  });
  return out;
}

void Module::register_forward_method(const std::string& name) {
  if (!is_forward_method(name)) forward_methods_.push_back(name);
}

bool Module::is_forward_method(const std::string& name) const {
  return std::find(forward_methods_.begin(), forward_methods_.end(), name) != forward_methods_.end();
}

TensorList Module::run_method(const std::string& name, const TensorList& inputs,
                              const std::function<TensorList(const TensorList&)>& body) {
  if (!is_forward_method(name)) return body(inputs);
  return run_hooked(inputs, body);
}

Tensor Module::forward(const Tensor&) {
  SK_CHECK(false) << type_name_ << " does not implement forward(Tensor); call it with call({...})";
  return Tensor();
}

TensorList Module::forward_list(const TensorList& inputs) {
  SK_CHECK_EQ(inputs.size(), 1u) << type_name_ << " takes one input";
  return {forward(inputs[0])};
}

const Tensor& Module::register_parameter(const std::string& name, Tensor t, bool requires_grad) {
  CheckName(name);
  SK_CHECK(!has_parameter(name)) << type_name_ << " already has a parameter " << name;
  SK_CHECK(t.defined()) << "parameter " << name << " is undefined";
  t.set_requires_grad(requires_grad);
  params_.emplace_back(name, std::move(t));
  return params_.back().second;
}

const Tensor& Module::register_buffer(const std::string& name, Tensor t) {
  CheckName(name);
  buffers_.emplace_back(name, std::move(t));
  return buffers_.back().second;
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> module) {
  CheckName(name);
  SK_CHECK(module != nullptr) << "child " << name << " is null";
  for (const auto& [n, m] : children_) SK_CHECK(n != name) << type_name_ << " already has a child " << name;
  children_.emplace_back(name, std::move(module));
}

const Tensor& Module::parameter(const std::string& name) const {
  for (const auto& [n, t] : params_) {
    if (n == name) return t;
  }
  SK_CHECK(false) << type_name_ << " has no parameter " << name;
  return params_.front().second;
}

bool Module::has_parameter(const std::string& name) const {
  for (const auto& [n, t] : params_) {
    if (n == name) return true;
  }
  return false;
}

const Tensor& Module::buffer(const std::string& name) const {
  for (const auto& [n, t] : buffers_) {
    if (n == name) return t;
  }
  SK_CHECK(false) << type_name_ << " has no buffer " << name;
  return buffers_.front().second;
}

std::shared_ptr<Module> Module::child(const std::string& name) const {
  for (const auto& [n, m] : children_) {
    if (n == name) return m;
  }
  SK_CHECK(false) << type_name_ << " has no child " << name;
  return nullptr;
}

void Module::set_attachment(const std::string& key, std::shared_ptr<Attachment> value) {
  for (auto& [k, v] : attachments_) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  attachments_.emplace_back(key, std::move(value));
}

Module::Attachment* Module::attachment(const std::string& key) const {
  for (const auto& [k, v] : attachments_) {
    if (k == key) return v.get();
  }
  return nullptr;
}

void Module::replace_parameter(const std::string& name, Tensor t) {
  for (auto& [n, p] : params_) {
    if (n == name) {
      p = std::move(t);
      return;
    }
  }
  SK_CHECK(false) << type_name_ << " has no parameter " << name;
}

void Module::collect_parameters(const std::string& prefix, bool recurse, NamedTensors& out) const {
  for (const auto& [n, t] : params_) out.emplace_back(Join(prefix, n), t);
  if (!recurse) return;
  for (const auto& [n, m] : children_) m->collect_parameters(Join(prefix, n), true, out);
}

NamedTensors Module::named_parameters(const NamedOptions& options) const {
  NamedTensors all;
  collect_parameters("", options.recurse, all);
  if (!options.remove_duplicate) return all;
  NamedTensors out;
  absl::flat_hash_set<const TensorImpl*> seen;
  for (auto& [n, t] : all) {
    if (seen.insert(t.id()).second) out.emplace_back(std::move(n), std::move(t));
  }
  return out;
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_parameters()) out.push_back(std::move(t));
  return out;
}

void Module::collect_buffers(const std::string& prefix, NamedTensors& out) const {
  for (const auto& [n, t] : buffers_) out.emplace_back(Join(prefix, n), t);
  for (const auto& [n, m] : children_) m->collect_buffers(Join(prefix, n), out);
}

NamedTensors Module::named_buffers() const {
  NamedTensors out;
  collect_buffers("", out);
  return out;
}

std::vector<std::pair<std::string, Module*>> Module::named_modules() {
  std::vector<std::pair<std::string, Module*>> out;
  absl::flat_hash_set<const Module*> seen;
  std::function<void(const std::string&, Module*)> visit = [&](const std::string& prefix, Module* m) {
    if (!seen.insert(m).second) return;
    out.emplace_back(prefix, m);
    for (const auto& [n, c] : m->children_) visit(Join(prefix, n), c.get());
  };
  visit("", this);
  return out;
}

std::int64_t Module::num_parameters() const {
  std::int64_t n = 0;
  for (const auto& [name, t] : named_parameters()) n += t.numel();
  return n;
}

void Module::train(bool on) {
  apply([on](Module& m) { m.training_ = on; });
}

void Module::apply(const std::function<void(Module&)>& fn) {
  for (const auto& [n, c] : children_) c->apply(fn);
  fn(*this);
}

void Module::set_requires_grad(bool requires_grad) {
  for (const auto& [n, t] : named_parameters()) t.set_requires_grad(requires_grad);
}

void Module::zero_grad(bool set_to_none) {
  for (const auto& [n, t] : named_parameters()) {
    if (!t.grad().defined()) continue;
    if (set_to_none) {
      t.set_grad(Tensor());
    } else {
      t.grad().zero_();
    }
  }
}

void Module::to(DType dtype) {
  SK_CHECK(is_floating(dtype)) << "Module::to: expected a floating dtype";
  absl::flat_hash_map<const TensorImpl*, Tensor> converted;
  auto convert = [&](const Tensor& t) -> Tensor {
    if (!t.defined() || !is_floating(t.dtype()) || t.dtype() == dtype) return t;
    auto it = converted.find(t.id());
    if (it != converted.end()) return it->second;
    Tensor n = t.to(dtype, t.storage() ? std::optional<MemoryCategory>(t.storage()->category()) : std::nullopt);
    n.set_requires_grad(t.requires_grad());
    converted.emplace(t.id(), n);
    return n;
  };
  for (auto& [name, m] : named_modules()) {
    for (auto& [n, t] : m->params_) t = convert(t);
  }
}

void Module::to(Device device) {
  absl::flat_hash_map<const TensorImpl*, Tensor> moved;
  DeferredInit* deferred = current_deferred_init();
  auto move = [&](const Tensor& t) -> Tensor {
    if (!t.defined() || t.device() == device) return t;
    auto it = moved.find(t.id());
    if (it != moved.end()) return it->second;
    Tensor n;
    if (t.nbytes() > 0 && t.storage_released()) {
      // No bytes to move: a deferred parameter moves its recipe (it is filled where it lives when materialised);
      // any other (a parameter fully_shard took) cannot be moved.
      SK_CHECK(deferred != nullptr && deferred->is_deferred(t))
          << "Module::to: " << t.describe() << " has no bytes and is not a deferred parameter of the current "
          << "nn::DeferredInitScope (fsdp::fully_shard releases what it shards: move the module before sharding it)";
      n = Tensor::empty(t.shape(), TensorOptions{}.with_dtype(t.dtype()).with_device(device).with_category(t.storage()->category()));
      n.release_storage();
      deferred->transfer(t, n);
    } else {
      n = t.to(device, t.storage() ? std::optional<MemoryCategory>(t.storage()->category()) : std::nullopt);
    }
    n.set_requires_grad(t.requires_grad());
    moved.emplace(t.id(), n);
    return n;
  };
  for (auto& [name, m] : named_modules()) {
    for (auto& [n, t] : m->params_) t = move(t);
    for (auto& [n, t] : m->buffers_) t = move(t);
  }
}

StateDict Module::state_dict() const {
  StateDict out;
  for (auto& [n, t] : named_parameters({.recurse = true, .remove_duplicate = false})) out.emplace_back(n, t.detach());
  for (auto& [n, t] : named_buffers()) out.emplace_back(n, t.detach());
  return out;
}

absl::Status Module::load_state_dict(const StateDict& state, bool strict) {
  std::map<std::string, const Tensor*> given;
  for (const auto& [n, t] : state) given[n] = &t;
  const StateDict mine = state_dict();
  std::vector<std::string> missing, unexpected, mismatched;
  std::vector<std::pair<Tensor, const Tensor*>> copies;
  absl::flat_hash_set<std::string> expected;
  for (const auto& [n, t] : mine) {
    expected.insert(n);
    auto it = given.find(n);
    if (it == given.end()) {
      missing.push_back(n);
      continue;
    }
    const Tensor& src = *it->second;
    if (!src.defined() || src.shape() != t.shape()) {
      mismatched.push_back(absl::StrCat(n, ": expected ", shape_str(t.shape()), ", found ",
                                        src.defined() ? shape_str(src.shape()) : std::string("undefined")));
      continue;
    }
    copies.emplace_back(t, &src);
  }
  for (const auto& [n, t] : state) {
    if (!expected.contains(n)) unexpected.push_back(n);
  }
  std::vector<std::string> problems;
  if (strict && !missing.empty()) problems.push_back(absl::StrCat("missing keys: [", absl::StrJoin(missing, ", "), "]"));
  if (strict && !unexpected.empty()) {
    problems.push_back(absl::StrCat("unexpected keys: [", absl::StrJoin(unexpected, ", "), "]"));
  }
  if (!mismatched.empty()) problems.push_back(absl::StrCat("shape mismatch for ", absl::StrJoin(mismatched, "; ")));
  if (!problems.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("load_state_dict into ", type_name_, ": ", absl::StrJoin(problems, "; ")));
  }
  autograd::NoGradGuard no_grad;
  for (auto& [dst, src] : copies) {
    if (dst.storage() == src->storage() && dst.offset_bytes() == src->offset_bytes()) continue;  // same bytes
    dst.copy_(*src);  // between any devices
  }
  return absl::OkStatus();
}

HookHandle Module::register_forward_pre_hook(ForwardPreHook hook) { return autograd::add_hook(pre_hooks_, std::move(hook)); }

HookHandle Module::register_forward_hook(ForwardHook hook) { return autograd::add_hook(post_hooks_, std::move(hook)); }

}  // namespace shardkit::nn
