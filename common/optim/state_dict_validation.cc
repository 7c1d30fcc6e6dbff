#include "common/optim/state_dict_validation.h"

#include <cstdint>
#include <set>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardkit::optim {
namespace {

std::string KeyList(const std::set<std::string>& keys) {
  if (keys.empty()) return "none";
  return absl::StrJoin(keys, ", ");
}

// One state entry against its parameter; `where` names it ("parameter 7 (f32[3, 4] cpu): ").
absl::Status CheckEntry(const ParamState& st, const ParamSpec& param, const Optimizer::StateKeys& keys,
                        const std::string& where) {
  if (st.step < 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, "expected a step count >= 0, found ", st.step));
  }
  for (const std::string& k : keys.required) {
    if (!st.tensors.contains(k)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "missing state key '", k, "' (expected keys: ", KeyList(keys.required), ")"));
    }
  }
  for (const auto& [k, t] : st.tensors) {
    if (!keys.required.contains(k) && !keys.optional.contains(k)) {
      return absl::InvalidArgumentError(absl::StrCat(where, "unexpected state key '", k, "' (expected keys: ",
                                                     KeyList(keys.required),
                                                     keys.optional.empty() ? "" : " and optionally others", ")"));
    }
    if (!t.defined()) {
      return absl::InvalidArgumentError(absl::StrCat(where, "state '", k, "': expected a tensor, found undefined"));
    }
    if (t.dtype() != DType::f32 || !(t.device().is_cpu() || t.device() == param.device)) {
      return absl::InvalidArgumentError(absl::StrCat(where, "state '", k, "': expected an f32 CPU tensor",
                                                     param.device.is_cpu() ? "" : " or one on the parameter's device",
                                                     ", found ", t.describe()));
    }
    if (t.shape() != param.shape) {
      return absl::InvalidArgumentError(absl::StrCat(where, "state '", k, "': expected shape ",
                                                     shape_str(param.shape), ", found ", shape_str(t.shape())));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::string ParamSpec::describe() const {
  return absl::StrCat(std::string(dtype_name(dtype)), shape_str(shape), " ", device.str());
}

ParamLayout param_layout(const std::vector<ParamGroup>& groups) {
  ParamLayout layout;
  for (const ParamGroup& g : groups) {
    std::vector<ParamSpec>& specs = layout.emplace_back();
    for (const Tensor& p : g.params) specs.push_back(ParamSpec::of(p));
  }
  return layout;
}

absl::Status validate_state_dict(const OptimizerStateDict& dict, const Optimizer& kind, const ParamLayout& params) {
  if (dict.optimizer != kind.name()) {
    return absl::InvalidArgumentError(absl::StrCat("expected a state dict of ", kind.name(), ", found one of ",
                                                   dict.optimizer.empty() ? std::string("<unnamed>") : dict.optimizer));
  }
  if (dict.param_groups.size() != params.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected ", params.size(), " param groups, found ", dict.param_groups.size()));
  }
  struct Where {
    std::size_t group, param;
  };
  absl::flat_hash_map<std::int64_t, Where> where;  // dict index -> the parameter it names
  for (std::size_t g = 0; g < params.size(); ++g) {
    const ParamGroupState& gs = dict.param_groups[g];
    if (gs.params.size() != params[g].size()) {
      return absl::InvalidArgumentError(absl::StrCat("param group ", g, ": expected ", params[g].size(),
                                                     " parameters, found ", gs.params.size()));
    }
    if (absl::Status s = kind.check_hyper(gs.hyper); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("param group ", g, ": ", s.message()));
    }
    for (std::size_t i = 0; i < gs.params.size(); ++i) {
      const std::int64_t idx = gs.params[i];
      if (idx < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("param group ", g, ", entry ", i, ": expected a parameter index >= 0, found ", idx));
      }
      if (!where.emplace(idx, Where{g, i}).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("expected each parameter index once, found index ", idx, " twice"));
      }
    }
  }
  for (const auto& [idx, st] : dict.state) {
    auto it = where.find(idx);
    if (it == where.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected state for parameter index ", idx, ", which no param group lists"));
    }
    const ParamSpec& p = params[it->second.group][it->second.param];
    const Optimizer::StateKeys keys = kind.state_keys(dict.param_groups[it->second.group].hyper, p.dtype);
    if (absl::Status s = CheckEntry(st, p, keys, absl::StrCat("parameter ", idx, " (", p.describe(), "): "));
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace shardkit::optim
