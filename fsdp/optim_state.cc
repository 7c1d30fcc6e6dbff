#include "fsdp/optim_state.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

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
  absl::StatusOr<Mapping> m = MapShards(fs, root, opt);
  if (!m.ok()) return m.status();
  if (full.param_groups.size() != opt.num_param_groups()) {
    return absl::InvalidArgumentError(absl::StrCat("fsdp optimizer state: expected ", opt.num_param_groups(),
                                                   " param groups, found ", full.param_groups.size()));
  }
  const int world = fs.process_group().size(), rank = fs.process_group().rank();
  optim::OptimizerStateDict local;
  local.optimizer = full.optimizer;
  std::int64_t k = 0;
  for (std::size_t g = 0; g < opt.num_param_groups(); ++g) {
    optim::ParamGroupState lg{full.param_groups[g].hyper, {}};
    for (std::size_t i = 0; i < opt.param_group(g).params.size(); ++i, ++k) {
      lg.params.push_back(k);
      const std::size_t u = m->unit_of_shard[static_cast<std::size_t>(k)];
      const FullyShardedModel::UnitLayout& lay = m->layouts[u];
      const auto& idx = m->full_index[u];
      std::size_t with_state = 0;
      for (std::int64_t fi : idx) with_state += full.state.count(fi);
      if (with_state == 0) continue;
      if (with_state != idx.size()) {
        return absl::InvalidArgumentError(absl::StrCat("fsdp optimizer state: expected state for all or none of unit ",
                                                       u, "'s ", idx.size(), " parameters, found ", with_state));
      }
      optim::ParamState shard_state;
      shard_state.step = full.state.at(idx[0]).step;
      for (const auto& [key, unused] : full.state.at(idx[0]).tensors) {
        Tensor flat = Tensor::zeros({lay.shard_size * world}, TensorOptions{}.with_category(MemoryCategory::optimizer_state));
        for (std::size_t p = 0; p < idx.size(); ++p) {
          const optim::ParamState& ps = full.state.at(idx[p]);
          auto t = ps.tensors.find(key);
          if (ps.step != shard_state.step || t == ps.tensors.end() || t->second.numel() != lay.params[p].numel()) {
            return absl::InvalidArgumentError(absl::StrCat(
                "fsdp optimizer state: parameter ", idx[p], " does not match its unit (expected step ", shard_state.step,
                ", state '", key, "' of ", lay.params[p].numel(), " elements)"));
          }
          flat.view(lay.offsets[p], {lay.params[p].numel()}).copy_(t->second.reshape({t->second.numel()}));
        }
        shard_state.tensors[key] = flat.view(rank * lay.shard_size, {lay.shard_size});
      }
      local.state[k] = std::move(shard_state);
    }
    local.param_groups.push_back(std::move(lg));
  }
  return opt.load_state_dict(local);
}

}  // namespace shardkit::fsdp
