#include "fsdp/wrap_policy.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "fsdp/state.h"

namespace shardkit::fsdp {
namespace {

std::string join_name(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : absl::StrCat(prefix, ".", name);
}

// The modules of `bottom_up` (root last) that are in `chosen`, in that order, root excluded.
std::vector<nn::Module*> in_bottom_up_order(const std::vector<std::pair<std::string, nn::Module*>>& bottom_up,
                                            const absl::flat_hash_set<const nn::Module*>& chosen) {
  std::vector<nn::Module*> out;
  for (std::size_t i = 0; i + 1 < bottom_up.size(); ++i) {
    if (chosen.contains(bottom_up[i].second)) out.push_back(bottom_up[i].second);
  }
  return out;
}

std::string describe(const std::string& fqn, const nn::Module& m) {
  return fqn.empty() ? absl::StrCat("the root ", m.type_name()) : absl::StrCat("'", fqn, "' (a ", m.type_name(), ")");
}

// Note [shared parameters to their lowest common ancestor]
// Every registration of a trainable, not ignored tensor is reached along a path of modules from the root (a
// module registered under two parents gives two paths). The tensor's owner is the deepest unit on the common
// prefix of all its paths: the lowest unit whose subtree holds every registration (seed 000's
// _get_fully_sharded_module_to_states). On each path, the units below the owner leave the tensor to it
// (FullyShardOptions::leave_to_ancestor); units above it skip it anyway, since a nested unit manages it. With one
// registration the owner is simply the nearest enclosing unit, what fully_shard alone would do.
struct TensorUse {
  Tensor tensor;
  std::string first_name;                     // first name under the root, named_parameters order
  std::vector<std::vector<nn::Module*>> paths;  // root .. registering module, one per registration
  std::vector<nn::Module*> common;            // the common prefix of `paths`
};

void collect_uses(nn::Module* m, const std::string& prefix, std::vector<nn::Module*>& path,
                  const absl::flat_hash_set<const TensorImpl*>& ignored, std::vector<TensorUse>& uses,
                  absl::flat_hash_map<const TensorImpl*, std::size_t>& index) {
  if (std::find(path.begin(), path.end(), m) != path.end()) return;  // a cycle: reached already on this path
  path.push_back(m);
  for (const auto& [name, t] : m->local_parameters()) {
    if (ignored.contains(t.id())) continue;  // fully_shard leaves these whole
    auto [it, fresh] = index.try_emplace(t.id(), uses.size());
    if (fresh) {
      uses.push_back({t, join_name(prefix, name), {path}, path});
      continue;
    }
    TensorUse& use = uses[it->second];
    use.paths.push_back(path);
    std::size_t k = 0;
    while (k < use.common.size() && k < path.size() && use.common[k] == path[k]) ++k;
    use.common.resize(k);
  }
  for (const auto& [name, child] : m->named_children()) {
    collect_uses(child.get(), join_name(prefix, name), path, ignored, uses, index);
  }
  path.pop_back();
}

}  // namespace

std::vector<std::pair<std::string, nn::Module*>> modules_bottom_up(nn::Module& root) {
  std::vector<std::pair<std::string, nn::Module*>> out;
  absl::flat_hash_set<const nn::Module*> seen;
  std::function<void(const std::string&, nn::Module*)> visit = [&](const std::string& prefix, nn::Module* m) {
    if (!seen.insert(m).second) return;
    for (const auto& [name, child] : m->named_children()) visit(join_name(prefix, name), child.get());
    out.emplace_back(prefix, m);
  };
  visit("", &root);
  return out;
}

WrapPolicy by_module_type(std::set<std::string> types) {
  return [types = std::move(types)](nn::Module& root) {
    std::vector<nn::Module*> out;
    for (const auto& [fqn, m] : modules_bottom_up(root)) {
      if (m != &root && types.count(m->type_name()) != 0) out.push_back(m);
    }
    return out;
  };
}

WrapPolicy by_parameter_count(std::int64_t min_num_params) {
  return [min_num_params](nn::Module& root) {
    std::vector<nn::Module*> out;
    absl::flat_hash_set<const TensorImpl*> taken;  // by a module chosen below (or beside) the current one
    for (const auto& [fqn, m] : modules_bottom_up(root)) {
      if (m == &root || !m->has_forward()) continue;
      std::int64_t left = 0;
      std::vector<const TensorImpl*> mine;
      for (const auto& [name, t] : m->named_parameters()) {  // each distinct tensor once
        if (taken.contains(t.id())) continue;
        left += t.numel();
        mine.push_back(t.id());
      }
      if (left == 0 || left < min_num_params) continue;
      out.push_back(m);
      taken.insert(mine.begin(), mine.end());
    }
    return out;
  };
}

WrapPolicy by_predicate(std::function<bool(const std::string& fqn, const nn::Module& module)> pred) {
  return [pred = std::move(pred)](nn::Module& root) {
    std::vector<nn::Module*> out;
    for (const auto& [fqn, m] : modules_bottom_up(root)) {
      if (m != &root && pred(fqn, *m)) out.push_back(m);
    }
    return out;
  };
}

WrapPolicy any_of(std::vector<WrapPolicy> policies) {
  return [policies = std::move(policies)](nn::Module& root) {
    absl::flat_hash_set<const nn::Module*> chosen;
    for (const WrapPolicy& p : policies) {
      if (!p) continue;
      for (nn::Module* m : p(root)) chosen.insert(m);
    }
    return in_bottom_up_order(modules_bottom_up(root), chosen);
  };
}

absl::StatusOr<ShardPlan> plan_auto_shard(nn::Module& root, const WrapPolicy& policy, const AutoShardOptions& auto_options,
                                          absl::Span<const Tensor> ignored_params) {
  if (!policy) return absl::InvalidArgumentError("auto_shard: expected a wrap policy, found an empty one");
  const auto bottom_up = modules_bottom_up(root);
  absl::flat_hash_map<const nn::Module*, std::string> fqn_of;
  for (const auto& [fqn, m] : bottom_up) fqn_of.emplace(m, fqn);

  // Ignored modules: their subtrees' parameters join ignored_params, and nothing inside them becomes a unit.
  ShardPlan plan;
  plan.ignored.assign(ignored_params.begin(), ignored_params.end());
  absl::flat_hash_set<const nn::Module*> inside_ignored;
  for (std::size_t i = 0; i < auto_options.ignored_modules.size(); ++i) {
    const nn::Module* im = auto_options.ignored_modules[i];
    if (im == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("auto_shard: ignored_modules[", i, "] is null; expected a module under the root"));
    }
    if (im == &root) {
      return absl::InvalidArgumentError(absl::StrCat("auto_shard: ignored_modules[", i, "] is the root ",
                                                     root.type_name(), " itself; expected modules under the root"));
    }
    if (!fqn_of.contains(im)) {
      return absl::InvalidArgumentError(absl::StrCat("auto_shard: ignored_modules[", i, "] is a ", im->type_name(),
                                                     " that is not under the root ", root.type_name(),
                                                     "; expected modules under the root"));
    }
    for (const auto& [name, m] : const_cast<nn::Module*>(im)->named_modules()) {
      if (!inside_ignored.insert(m).second) continue;
      for (const auto& [pname, t] : m->local_parameters()) plan.ignored.push_back(t);
    }
  }

  const std::vector<nn::Module*> chosen = policy(root);
  absl::flat_hash_set<const nn::Module*> units;
  for (std::size_t i = 0; i < chosen.size(); ++i) {
    nn::Module* m = chosen[i];
    if (m == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("auto_shard: the wrap policy returned a null module (entry ", i,
                                                     "); expected modules under the root"));
    }
    auto it = fqn_of.find(m);
    if (it == fqn_of.end()) {
      return absl::InvalidArgumentError(absl::StrCat("auto_shard: the wrap policy returned a ", m->type_name(),
                                                     " that is not under the root ", root.type_name(),
                                                     " (entry ", i, "); expected modules of the root's subtree"));
    }
    if (m == &root) {
      return absl::InvalidArgumentError(absl::StrCat("auto_shard: the wrap policy returned the root ", root.type_name(),
                                                     " itself (entry ", i,
                                                     "); expected modules under it (auto_shard shards the root last)"));
    }
    if (!m->has_forward()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "auto_shard: the wrap policy chose ", describe(it->second, *m),
          ", which has no forward of its own; expected modules that are called (choose the modules it holds)"));
    }
    if (!inside_ignored.contains(m)) units.insert(m);
  }
  units.insert(&root);

  absl::flat_hash_set<const TensorImpl*> ignored_ids;
  for (const Tensor& t : plan.ignored) ignored_ids.insert(t.id());
  std::vector<TensorUse> uses;
  absl::flat_hash_map<const TensorImpl*, std::size_t> index;
  std::vector<nn::Module*> path;
  collect_uses(&root, "", path, ignored_ids, uses, index);

  // Note [shared parameters to their lowest common ancestor]
  absl::flat_hash_map<const nn::Module*, std::size_t> unit_index;
  for (const auto& [fqn, m] : bottom_up) {
    if (!units.contains(m)) continue;
    unit_index.emplace(m, plan.units.size());
    plan.units.push_back({m, fqn, {}, {}});
  }
  std::vector<absl::flat_hash_set<const TensorImpl*>> left(plan.units.size());
  for (const TensorUse& use : uses) {
    std::size_t owner_depth = 0;  // the root is a unit
    for (std::size_t d = 0; d < use.common.size(); ++d) {
      if (units.contains(use.common[d])) owner_depth = d;
    }
    plan.units[unit_index.at(use.common[owner_depth])].params.push_back(use.first_name);
    for (const auto& p : use.paths) {
      for (std::size_t d = owner_depth + 1; d < p.size(); ++d) {
        auto u = unit_index.find(p[d]);
        if (u == unit_index.end() || !left[u->second].insert(use.tensor.id()).second) continue;
        plan.units[u->second].leave_to_ancestor.push_back(use.tensor);
      }
    }
  }
  return plan;
}

absl::StatusOr<FSDPModule> auto_shard(nn::Module& root, const WrapPolicy& policy,
                                      std::shared_ptr<comm::ProcessGroup> group, FullyShardOptions options,
                                      AutoShardOptions auto_options) {
  if (!options.leave_to_ancestor.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("auto_shard: expected empty options.leave_to_ancestor (auto_shard "
                                                   "sets it from its plan), found ",
                                                   options.leave_to_ancestor.size(), " tensors"));
  }
  auto plan = plan_auto_shard(root, policy, auto_options, options.ignored_params);
  if (!plan.ok()) return plan.status();
  for (const auto& [fqn, m] : root.named_modules()) {
    if (state_attached(*m) != nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("auto_shard: ", describe(fqn, *m),
                                                        " is already sharded; expected a model no fully_shard call has "
                                                        "touched"));
    }
  }
  std::optional<FSDPModule> last;
  for (ShardPlan::Unit& unit : plan->units) {
    FullyShardOptions o = options;
    o.ignored_params = plan->ignored;
    o.leave_to_ancestor = std::move(unit.leave_to_ancestor);
    if (unit.module == &root) o.reshard_after_forward = std::nullopt;  // FSDP2's root: kept for backward
    auto s = fully_shard(*unit.module, group, std::move(o));
    if (!s.ok()) {
      return absl::Status(s.status().code(),
                          absl::StrCat("auto_shard: unit ", describe(unit.fqn, *unit.module), ": ", s.status().message()));
    }
    last = *s;
  }
  return *last;
}

}  // namespace shardkit::fsdp
