#include "fsdp/fully_shard.h"

#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/nn/deferred_init.h"
#include "fsdp/same_values.h"

namespace shardkit::fsdp {
namespace {

// Marks a module inside a unit that is not a unit itself (Note [bottom-up calls]).
inline constexpr const char* kInsideUnit = "fsdp.inside_unit";
struct InsideUnit : nn::Module::Attachment {
  explicit InsideUnit(std::string type) : unit_type(std::move(type)) {}
  std::string unit_type;
};

std::string join_name(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : absl::StrCat(prefix, ".", name);
}

// Parameters of `module`'s subtree that are not this call's to take: those of nested units,
// ignored_params, and leave_to_ancestor (an ancestor's call takes them).
std::set<const TensorImpl*> not_this_calls(nn::Module& module, const FullyShardOptions& options) {
  std::set<const TensorImpl*> skip;
  for (const auto& [name, m] : module.named_modules()) {
    const FSDPState* nested = state_attached(*m);
    if (nested == nullptr || nested->param_group() == nullptr) continue;
    for (const FSDPParam& p : nested->param_group()->params()) skip.insert(p.sharded.id()), skip.insert(p.unsharded.id());
  }
  for (const Tensor& t : options.ignored_params) skip.insert(t.id());
  for (const Tensor& t : options.leave_to_ancestor) skip.insert(t.id());
  return skip;
}

// The parameters a fully_shard call on `module` manages (see fully_shard.h), grouped by tensor: every
// registration of a tensor in the subtree together, in named_parameters() order.
absl::StatusOr<std::vector<FSDPParam>> params_to_manage(nn::Module& module, const FullyShardOptions& options) {
  const std::set<const TensorImpl*> skip = not_this_calls(module, options);
  std::vector<FSDPParam> out;
  std::map<const TensorImpl*, std::size_t> index;
  for (const auto& [mname, m] : module.named_modules()) {
    for (const auto& [lname, t] : m->local_parameters()) {
      if (skip.count(t.id()) != 0) continue;  // nested, ignored or left to an ancestor
      const std::string fqn = join_name(mname, lname);
      if (auto it = index.find(t.id()); it != index.end()) {
        out[it->second].names.push_back(fqn);
        out[it->second].registrations.emplace_back(m, lname);
        continue;
      }
      const nn::DeferredInit* deferred = nn::current_deferred_init();
      if (t.storage_released() && (deferred == nullptr || !deferred->is_deferred(t))) {
        return absl::InvalidArgumentError(absl::StrCat(
            "fully_shard: parameter '", fqn, "' of this ", module.type_name(),
            " has no bytes: another fully_shard call already sharded it (a parameter shared by two units belongs to "
            "their common ancestor: shard the ancestor, use fsdp::auto_shard, or name it in the earlier call's "
            "FullyShardOptions::leave_to_ancestor), or it was built inside an nn::DeferredInitScope that is no "
            "longer installed (call fully_shard inside the scope)"));
      }
      if (t.dtype() != DType::f32) {
        return absl::InvalidArgumentError(absl::StrCat("fully_shard: expected f32 parameters, found ",
                                                       std::string(dtype_name(t.dtype())), " for '", fqn, "'"));
      }
      index[t.id()] = out.size();
      FSDPParam p;
      p.names = {fqn};
      p.registrations = {{m, lname}};
      p.global_shape = t.shape();
      out.push_back(std::move(p));
    }
  }
  return out;
}

}  // namespace

absl::Status UnshardHandle::wait() {
  if (state_ == nullptr) return absl::OkStatus();
  FSDPState* s = state_;
  state_ = nullptr;
  return s->wait_unshard();
}

namespace {

absl::StatusOr<FSDPModule> shard_module(nn::Module& module, std::shared_ptr<comm::ProcessGroup> group,
                                        std::shared_ptr<comm::ProcessGroup> replicate, FullyShardOptions options) {
  if (!module.has_forward()) {
    return absl::InvalidArgumentError(absl::StrCat("fully_shard: a ", module.type_name(),
                                                   " has no forward of its own, so its parameters would never be "
                                                   "gathered; shard the modules it holds, or the module that calls them"));
  }
  if (state_attached(module) != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("fully_shard: this ", module.type_name(),
                                                      " is already sharded; expected one fully_shard call per module"));
  }
  if (const auto* owner = dynamic_cast<const InsideUnit*>(module.attachment(kInsideUnit))) {
    return absl::FailedPreconditionError(absl::StrCat(
        "fully_shard: this ", module.type_name(), " is inside the ", owner->unit_type,
        " that fully_shard already sharded (its parameters are that unit's shards); expected the calls bottom-up, "
        "the submodules before the module that holds them"));
  }
  if (group == nullptr) return absl::InvalidArgumentError("fully_shard: expected a process group, found none");
  int reshard_group = 0;  // Note [reshard to a k-group] in param_group.h
  if (options.reshard_after_forward && std::holds_alternative<int>(*options.reshard_after_forward)) {
    reshard_group = std::get<int>(*options.reshard_after_forward);
    const int world = group->size();
    if (!(reshard_group > 1 && reshard_group < world && world % reshard_group == 0)) {
      return absl::InvalidArgumentError(absl::StrCat("fully_shard: expected reshard_after_forward = k with 1 < k < ",
                                                     world, " and k dividing the group size ", world, ", found ",
                                                     reshard_group));
    }
  }
  auto params = params_to_manage(module, options);
  if (!params.ok()) return params.status();
  // Ignored parameters stay whole on every rank: under deferred init they get their values here, as an eager
  // build has them (they would otherwise stay without bytes: a helper's audit, fsdp_combo7_deferred_test).
  if (nn::DeferredInit* deferred = nn::current_deferred_init()) {
    for (const Tensor& t : options.ignored_params) deferred->materialize(t);
  }
  std::vector<Tensor> originals;
  for (const FSDPParam& p : *params) originals.push_back(p.registrations.front().first->parameter(p.registrations.front().second));
  for (std::size_t i = 1; i < originals.size(); ++i) {  // Note [unit on a device] in param_group.cc
    if (originals[i].device() != originals[0].device()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fully_shard: expected the parameters of one call on one device, found '", (*params)[0].names.front(),
          "' on ", originals[0].device().str(), " and '", (*params)[i].names.front(), "' on ",
          originals[i].device().str(), "; move the module with Module::to(Device) first"));
    }
  }
  std::unique_ptr<ParamGroup> pg;
  const std::shared_ptr<comm::ProcessGroup> replicate_group = replicate;  // (moved into the ParamGroup below)
  if (!params->empty()) {
    // Note [unit fingerprints] in param_group.cc: where this call stands among its groups' collectives.
    const std::string identity =
        absl::StrCat("#", group->collectives_issued(),
                     replicate != nullptr ? absl::StrCat("/", replicate->collectives_issued()) : std::string());
    pg = std::make_unique<ParamGroup>(absl::StrCat(module.type_name(), " '", params->front().names.front(), "'..."),
                                      std::move(*params), group, std::move(replicate), options.timeout,
                                      options.mp_policy, options.own_collective_min_numel,
                                      options.offload_policy.cpu);
    pg->set_identity(identity);
  }
  if (pg != nullptr && reshard_group > 0) {
    if (absl::Status s = pg->enable_group_reshard(reshard_group); !s.ok()) return s;  // collective (a split)
  }
  // Note [same values on every rank] in same_values.cc: collective (one small all_gather); what differs is told by
  // the first forward, summon or unshard, where the parameters' full names are known.
  auto mismatches = compare_values(pg != nullptr ? pg->take_value_hashes() : std::vector<std::uint64_t>{},
                                   options.ignored_params, *group, replicate_group.get(),
                                   options.timeout.value_or(group->default_timeout()));
  if (!mismatches.ok()) return mismatches.status();
  // The full tensors are no longer the module's: free their bytes now (a registration outside this subtree, a
  // parameter shared with a sibling unit, is then refused by that unit's fully_shard instead of silently untied).
  for (const Tensor& t : originals) {
    if (t.offset_bytes() == 0 && t.storage()->nbytes() == t.nbytes() && !t.storage_released()) t.release_storage();
  }
  // Note [bottom-up calls]: the modules this unit took parameters of refuse a later fully_shard (their parameters
  // are this unit's shards now; sharding them again died in a shape check at the next forward: a helper's audit,
  // tests/fsdp/fsdp_misuse_test.cc).
  for (const auto& [name, m] : module.named_modules()) {
    if (m != &module && state_attached(*m) == nullptr && m->attachment(kInsideUnit) == nullptr) {
      m->set_attachment(kInsideUnit, std::make_shared<InsideUnit>(module.type_name()));
    }
  }
  auto state = std::make_shared<FSDPState>(module, std::move(group), std::move(options), std::move(pg));
  state->set_value_mismatches(std::move(*mismatches));
  module.set_attachment(kFsdpAttachment, std::move(state));
  return state_of(module);
}

}  // namespace

absl::StatusOr<FSDPModule> fully_shard(nn::Module& module, std::shared_ptr<comm::ProcessGroup> group,
                                       FullyShardOptions options) {
  return shard_module(module, std::move(group), nullptr, std::move(options));
}

absl::StatusOr<FSDPModule> fully_shard(nn::Module& module, const comm::DeviceMesh& mesh, FullyShardOptions options) {
  if (mesh.ndim() == 1) return shard_module(module, mesh.group_ptr(0), nullptr, std::move(options));
  return shard_module(module, mesh.group_ptr(1), mesh.group_ptr(0), std::move(options));
}

absl::StatusOr<FSDPModule> state_of(nn::Module& module) {
  FSDPState* s = state_attached(module);
  if (s == nullptr) {
    return absl::NotFoundError(absl::StrCat("fsdp: this ", module.type_name(), " was not sharded by fully_shard"));
  }
  return FSDPModule(s);
}

absl::StatusOr<UnshardHandle> FSDPModule::unshard(bool async_op) {
  if (absl::Status s = state_->start_unshard(); !s.ok()) return s;
  UnshardHandle h(state_);
  if (!async_op) {
    if (absl::Status s = h.wait(); !s.ok()) return s;
  }
  return h;
}

absl::Status FSDPModule::summon_full_params() { return state_->summon(); }
absl::Status FSDPModule::reshard(bool recurse) { return state_->reshard(recurse); }

void FSDPModule::set_requires_gradient_sync(bool sync, bool recurse) {
  for (FSDPState* s : recurse ? state_->subtree_states() : std::vector<FSDPState*>{state_}) s->set_requires_gradient_sync(sync);
}

void FSDPModule::set_reshard_after_backward(bool on, bool recurse) {
  for (FSDPState* s : recurse ? state_->subtree_states() : std::vector<FSDPState*>{state_}) s->set_reshard_after_backward(on);
}

void FSDPModule::set_is_last_backward(bool last) { state_->set_is_last_backward(last); }

void FSDPModule::set_requires_all_reduce(bool on, bool recurse) {
  for (FSDPState* s : recurse ? state_->subtree_states() : std::vector<FSDPState*>{state_}) s->set_requires_all_reduce(on);
}

void FSDPModule::set_reduce_scatter_divide_factor(double factor, bool recurse) {
  for (FSDPState* s : recurse ? state_->subtree_states() : std::vector<FSDPState*>{state_}) {
    s->set_reduce_scatter_divide_factor(factor);
  }
}

namespace {

absl::StatusOr<std::vector<FSDPState*>> prefetch_list(const FSDPState* self, const std::vector<FSDPModule>& units,
                                                      const char* which) {
  std::vector<FSDPState*> out;
  for (const FSDPModule& u : units) {
    if (&u.state() == self) {
      return absl::InvalidArgumentError(absl::StrCat("fsdp: set_modules_to_", which, "_prefetch on a ",
                                                     self->module().type_name(),
                                                     " lists the unit itself; expected other units"));
    }
    out.push_back(&u.state());
  }
  return out;
}

}  // namespace

absl::Status FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& units) {
  auto list = prefetch_list(state_, units, "forward");
  if (!list.ok()) return list.status();
  state_->set_forward_prefetch(std::move(*list));
  return absl::OkStatus();
}

absl::Status FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& units) {
  auto list = prefetch_list(state_, units, "backward");
  if (!list.ok()) return list.status();
  state_->set_backward_prefetch(std::move(*list));
  return absl::OkStatus();
}

std::vector<ShardedTensor> sharded_parameters(const nn::Module& root) {
  std::vector<ShardedTensor> out;
  for (const auto& [name, m] : const_cast<nn::Module&>(root).named_modules()) {
    const FSDPState* s = state_attached(*m);
    if (s == nullptr || s->param_group() == nullptr) continue;
    for (const FSDPParam& p : s->param_group()->params()) out.push_back(p.view());
  }
  return out;
}

std::vector<NamedParameter> named_parameters(const nn::Module& root) {
  std::map<const TensorImpl*, ShardedTensor> shards;
  for (const ShardedTensor& t : sharded_parameters(root)) shards.emplace(t.local.id(), t);
  std::vector<NamedParameter> out;
  std::map<const TensorImpl*, std::size_t> index;
  for (const auto& [name, t] : root.named_parameters({.recurse = true, .remove_duplicate = false})) {
    if (auto it = index.find(t.id()); it != index.end()) {
      out[it->second].names.push_back(name);
      continue;
    }
    index[t.id()] = out.size();
    auto s = shards.find(t.id());
    out.push_back({{name}, t, s == shards.end() ? std::nullopt : std::optional<ShardedTensor>(s->second)});
  }
  return out;
}

absl::Status register_forward_method(nn::Module& module, const std::string& name) {
  if (state_attached(module) == nullptr) {
    return absl::NotFoundError(absl::StrCat("fsdp: register_forward_method('", name, "'): this ", module.type_name(),
                                            " was not sharded by fully_shard"));
  }
  module.register_forward_method(name);
  return absl::OkStatus();
}

std::vector<nn::Module*> modules_of_type(nn::Module& root, const std::string& type) {
  std::vector<nn::Module*> out;
  for (const auto& [name, m] : root.named_modules()) {
    if (m != &root && m->type_name() == type) out.push_back(m);
  }
  return out;
}

}  // namespace shardkit::fsdp
