#include "fsdp/optim_state.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/optim/state_dict_validation.h"

namespace shardkit::fsdp {
namespace {

// How the optimizer's parameters (shards) map to units, and the module parameters to full indices.
struct Mapping {
  std::vector<std::size_t> unit_of_shard;           // by the optimizer's parameter index
  std::vector<std::vector<std::int64_t>> full_index;  // [unit][param]: position in root.parameters()
  std::vector<FullyShardedModel::UnitLayout> layouts;
};

absl::StatusOr<Mapping> MapShards(const FullyShardedModel& fs, const nn::Module& root, const optim::Optimizer& opt) {
  Mapping m;
  std::map<const TensorImpl*, std::int64_t> position;
  std::int64_t next = 0;
  for (const Tensor& p : root.parameters()) position[p.id()] = next++;
  std::map<const TensorImpl*, std::size_t> unit_of;
  for (std::size_t u = 0; u < fs.num_units(); ++u) {
    m.layouts.push_back(fs.unit_layout(u));
    unit_of[m.layouts.back().shard.id()] = u;
    std::vector<std::int64_t> idx;
    for (const Tensor& p : m.layouts.back().params) idx.push_back(position.at(p.id()));
    m.full_index.push_back(std::move(idx));
  }
  for (std::int64_t k = 0; k < opt.num_params(); ++k) {
    auto it = unit_of.find(opt.param(k).id());
    if (it == unit_of.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fsdp optimizer state: expected the optimizer to step FullyShardedModel::parameters(), found parameter ",
          k, " that is not a unit shard"));
    }
    m.unit_of_shard.push_back(it->second);
  }
  return m;
}

}  // namespace

absl::StatusOr<optim::OptimizerStateDict> full_optimizer_state(const FullyShardedModel& fs, const nn::Module& root,
                                                               const optim::Optimizer& opt) {
  absl::StatusOr<Mapping> m = MapShards(fs, root, opt);
  if (!m.ok()) return m.status();
  const optim::OptimizerStateDict local = opt.state_dict();
  comm::ProcessGroup& pg = fs.process_group();
  const int world = pg.size();
  optim::OptimizerStateDict full;
  full.optimizer = local.optimizer;
  std::int64_t k = 0;  // the optimizer's parameter index (group order)
  for (const optim::ParamGroupState& g : local.param_groups) {
    optim::ParamGroupState fg{g.hyper, {}};
    for (std::size_t i = 0; i < g.params.size(); ++i, ++k) {
      const std::size_t u = m->unit_of_shard[static_cast<std::size_t>(k)];
      const FullyShardedModel::UnitLayout& lay = m->layouts[u];
      const auto& idx = m->full_index[u];
      fg.params.insert(fg.params.end(), idx.begin(), idx.end());
      auto st = local.state.find(k);
      if (st == local.state.end()) continue;  // not stepped yet (the same on every rank)
      for (const auto& [key, shard_tensor] : st->second.tensors) {  // map order: the same on every rank
        Tensor gathered = Tensor::empty({lay.shard_size * world}, TensorOptions{}.with_category(MemoryCategory::optimizer_state));
        if (absl::Status s = pg.all_gather(gathered, shard_tensor, {.tag = absl::StrCat("fsdp optim state ", key)})->wait();
            !s.ok()) {
          return s;
        }
        for (std::size_t p = 0; p < lay.params.size(); ++p) {
          optim::ParamState& ps = full.state[idx[p]];
          ps.step = st->second.step;
          ps.tensors[key] = gathered.view(lay.offsets[p], lay.params[p].shape()).clone(MemoryCategory::optimizer_state);
        }
      }
    }
    // In root.parameters() order: an optimizer over the module's parameters pairs them by position.
    std::sort(fg.params.begin(), fg.params.end());
    full.param_groups.push_back(std::move(fg));
  }
  return full;
}

absl::Status load_full_optimizer_state(const FullyShardedModel& fs, const nn::Module& root, optim::Optimizer& opt,
                                       const optim::OptimizerStateDict& full) {
  comm::ProcessGroup& pg = fs.process_group();
  const int world = pg.size(), rank = pg.rank();
  // 1. Check everything and build this rank's shard state, changing nothing.
  optim::OptimizerStateDict local;
  absl::Status checked = [&]() -> absl::Status {
    absl::StatusOr<Mapping> m = MapShards(fs, root, opt);
    if (!m.ok()) return m.status();
    // The parameters the full state describes: per group, the module parameters of the units whose shards
    // are in it, in root.parameters() order (as full_optimizer_state writes them).
    std::vector<std::vector<std::pair<std::int64_t, Tensor>>> by_group(opt.num_param_groups());
    std::int64_t k = 0;
    for (std::size_t g = 0; g < opt.num_param_groups(); ++g) {
      for (std::size_t i = 0; i < opt.param_group(g).params.size(); ++i, ++k) {
        const std::size_t u = m->unit_of_shard[static_cast<std::size_t>(k)];
        for (std::size_t p = 0; p < m->layouts[u].params.size(); ++p) {
          by_group[g].emplace_back(m->full_index[u][p], m->layouts[u].params[p]);
        }
      }
      std::sort(by_group[g].begin(), by_group[g].end(),
                [](const auto& a, const auto& b) { return a.first < b.first; });
    }
    optim::ParamLayout layout(by_group.size());
    for (std::size_t g = 0; g < by_group.size(); ++g) {
      for (const auto& [position, param] : by_group[g]) layout[g].push_back(optim::ParamSpec::of(param));
    }
    // The checks every loader makes (Note [state dict validation]); then the dict's i-th index of group g is
    // the group's i-th parameter.
    if (absl::Status s = optim::validate_state_dict(full, opt, layout); !s.ok()) return s;
    std::map<std::int64_t, const optim::ParamState*> state_of;  // by position in root.parameters()
    for (std::size_t g = 0; g < by_group.size(); ++g) {
      for (std::size_t i = 0; i < by_group[g].size(); ++i) {
        auto st = full.state.find(full.param_groups[g].params[i]);
        if (st != full.state.end()) state_of[by_group[g][i].first] = &st->second;
      }
    }
    // What only FSDP asks: a unit's parameters are one optimizer parameter (its shard), so they have state
    // together, with one step count and one set of keys.
    local.optimizer = full.optimizer;
    k = 0;
    for (std::size_t g = 0; g < opt.num_param_groups(); ++g) {
      optim::ParamGroupState lg{full.param_groups[g].hyper, {}};
      for (std::size_t i = 0; i < opt.param_group(g).params.size(); ++i, ++k) {
        lg.params.push_back(k);
        const std::size_t u = m->unit_of_shard[static_cast<std::size_t>(k)];
        const FullyShardedModel::UnitLayout& lay = m->layouts[u];
        const auto& idx = m->full_index[u];
        std::vector<const optim::ParamState*> states;
        for (std::int64_t fi : idx) {
          auto it = state_of.find(fi);
          if (it != state_of.end()) states.push_back(it->second);
        }
        if (states.empty()) continue;
        const std::string unit = absl::StrCat("unit ", u, " ('", fs.unit_name(u), "')");
        if (states.size() != idx.size()) {
          return absl::InvalidArgumentError(absl::StrCat("expected state for all or none of ", unit, "'s ",
                                                         idx.size(), " parameters, found ", states.size()));
        }
        const optim::ParamState& first = *states[0];
        optim::ParamState shard_state;
        shard_state.step = first.step;
        for (std::size_t p = 0; p < idx.size(); ++p) {
          const optim::ParamState& ps = *states[p];
          if (ps.step != first.step) {
            return absl::InvalidArgumentError(absl::StrCat("parameter ", idx[p], ": expected step ", first.step,
                                                           " like the rest of ", unit, ", found ", ps.step));
          }
          if (ps.tensors.size() != first.tensors.size() ||
              !std::equal(ps.tensors.begin(), ps.tensors.end(), first.tensors.begin(),
                          [](const auto& a, const auto& b) { return a.first == b.first; })) {
            return absl::InvalidArgumentError(
                absl::StrCat("parameter ", idx[p], ": expected the state keys of the rest of ", unit));
          }
        }
        for (const auto& [key, unused] : first.tensors) {
          Tensor flat = Tensor::zeros({lay.shard_size * world}, TensorOptions{}.with_category(MemoryCategory::optimizer_state));
          for (std::size_t p = 0; p < idx.size(); ++p) {
            const Tensor& t = states[p]->tensors.at(key);  // validated: f32, shaped like the parameter
            flat.view(lay.offsets[p], {lay.params[p].numel()}).copy_(t.reshape({t.numel()}));
          }
          shard_state.tensors[key] = flat.view(rank * lay.shard_size, {lay.shard_size});
        }
        local.state[k] = std::move(shard_state);
      }
      local.param_groups.push_back(std::move(lg));
    }
    return opt.check_state_dict(local);
  }();
  if (!checked.ok()) {
    checked = absl::Status(checked.code(), absl::StrCat("load_full_optimizer_state: ", checked.message()));
  }
  // 2. Agree, as Oss::load_state_dict does: the lowest rank that refused, or `world` when none did. Every rank
  //    loads, or none does.
  Tensor verdict = Tensor::from_int64({checked.ok() ? world : rank}, {1});
  const absl::Status agreed =
      pg.all_reduce(verdict, {.op = comm::ReduceOp::min(), .tag = "fsdp load_full_optimizer_state"})->wait();
  if (!checked.ok()) return checked;
  if (!agreed.ok()) return agreed;
  if (const auto refused_by = static_cast<int>(verdict.item()); refused_by != world) {
    return absl::InvalidArgumentError(absl::StrCat("load_full_optimizer_state: rank ", refused_by,
                                                   " rejected the state dict (its error says why); nothing was loaded"));
  }
  // 3. Commit.
  const absl::Status loaded = opt.load_state_dict(local);
  SK_CHECK(loaded.ok()) << "a checked optimizer state was refused: " << loaded;
  return absl::OkStatus();
}

}  // namespace shardkit::fsdp
