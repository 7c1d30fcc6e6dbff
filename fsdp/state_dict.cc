#include "fsdp/state_dict.h"

#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/optim/state_dict_validation.h"
#include "fsdp/fully_shard.h"

namespace shardkit::fsdp {
namespace {

// Root's parameters at rest (shards and whole parameters), each with its FSDPParam when it is a shard.
struct ParamMap {
  std::vector<Tensor> params;  // root.parameters()
  std::map<const TensorImpl*, std::int64_t> position;
  std::map<const TensorImpl*, const FSDPParam*> fsdp_param;
};

ParamMap map_params(nn::Module& root) {
  ParamMap m;
  m.params = root.parameters();
  for (std::size_t i = 0; i < m.params.size(); ++i) m.position[m.params[i].id()] = static_cast<std::int64_t>(i);
  for (const auto& [name, mod] : root.named_modules()) {
    const FSDPState* s = state_attached(*mod);
    if (s == nullptr || s->param_group() == nullptr) continue;
    for (const FSDPParam& p : s->param_group()->params()) m.fsdp_param[p.sharded.id()] = &p;
  }
  return m;
}

// The whole tensor of one sharded parameter's `local` rows (a state tensor shaped like the shard), on every rank.
absl::StatusOr<Tensor> gather_rows(const FSDPParam& p, const Tensor& local, comm::ProcessGroup& pg) {
  const int world = pg.size();
  const std::int64_t padded = p.padded_numel();
  Tensor send = Tensor::zeros({padded}, TensorOptions{}.with_category(MemoryCategory::communication_buffer));
  if (local.numel() > 0) std::memcpy(send.raw_data(), local.raw_data(), local.nbytes());
  Tensor all = Tensor::empty({padded * world}, TensorOptions{}.with_category(MemoryCategory::communication_buffer));
  if (absl::Status s = pg.all_gather(all, send, {.tag = absl::StrCat("fsdp state ", p.names.front())})->wait(); !s.ok()) {
    return s;
  }
  Tensor full = Tensor::empty(p.global_shape, TensorOptions{}.with_category(MemoryCategory::other));
  for (int r = 0; r < world; ++r) {
    const RowSplit rs = split_rows(p.global_shape, r, world);
    if (rs.local_rows == 0) continue;
    std::memcpy(static_cast<float*>(full.raw_data()) + rs.row_offset * rs.row_numel, all.data<float>() + r * padded,
                static_cast<std::size_t>(rs.local_rows * rs.row_numel) * sizeof(float));
  }
  return full;
}

// This rank's rows of a whole tensor.
Tensor local_rows(const FSDPParam& p, const Tensor& full) {
  Tensor out = Tensor::empty(p.local_shape, TensorOptions{}.with_category(MemoryCategory::optimizer_state));
  if (out.numel() > 0) {
    std::memcpy(out.raw_data(), full.data<float>() + p.split.row_offset * p.split.row_numel, out.nbytes());
  }
  return out;
}


}  // namespace

absl::StatusOr<nn::StateDict> full_state_dict(nn::Module& root) {
  auto unit = state_of(root);
  if (!unit.ok()) return unit.status();
  if (absl::Status s = unit->summon_full_params(); !s.ok()) return s;
  nn::StateDict out;
  for (const auto& [name, t] : root.state_dict()) out.emplace_back(name, t.clone(MemoryCategory::other));
  if (absl::Status s = unit->reshard(/*recurse=*/true); !s.ok()) return s;
  return out;
}

absl::Status load_full_state_dict(nn::Module& root, const nn::StateDict& state, bool strict) {
  auto unit = state_of(root);
  if (!unit.ok()) return unit.status();
  if (absl::Status s = unit->summon_full_params(); !s.ok()) return s;
  absl::Status loaded = root.load_state_dict(state, strict);
  if (absl::Status s = unit->reshard(/*recurse=*/true); !s.ok()) return s;  // keeps the loaded rows
  return loaded;
}

absl::StatusOr<optim::OptimizerStateDict> full_optimizer_state(nn::Module& root, const optim::Optimizer& opt) {
  auto unit = state_of(root);
  if (!unit.ok()) return unit.status();
  comm::ProcessGroup& pg = unit->state().process_group();
  const ParamMap m = map_params(root);
  const optim::OptimizerStateDict local = opt.state_dict();
  optim::OptimizerStateDict full;
  full.optimizer = local.optimizer;
  std::int64_t k = 0;
  for (const optim::ParamGroupState& g : local.param_groups) {
    optim::ParamGroupState fg{g.hyper, {}};
    for (std::size_t i = 0; i < g.params.size(); ++i, ++k) {
      const Tensor& param = opt.param(k);
      auto pos = m.position.find(param.id());
      if (pos == m.position.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "fsdp optimizer state: expected the optimizer to step the root's parameters (model.parameters() after "
            "fully_shard), found parameter ",
            k, " (", param.describe(), ") that is not one of them"));
      }
      fg.params.push_back(pos->second);
      auto st = local.state.find(g.params[i]);
      if (st == local.state.end()) continue;  // not stepped yet (the same on every rank)
      optim::ParamState& ps = full.state[pos->second];
      ps.step = st->second.step;
      auto fp = m.fsdp_param.find(param.id());
      for (const auto& [key, t] : st->second.tensors) {  // map order: the same on every rank
        if (fp == m.fsdp_param.end()) {
          ps.tensors[key] = t;
          continue;
        }
        auto whole = gather_rows(*fp->second, t, pg);
        if (!whole.ok()) return whole.status();
        ps.tensors[key] = *whole;
      }
    }
    full.param_groups.push_back(std::move(fg));
  }
  return full;
}

absl::Status load_full_optimizer_state(nn::Module& root, optim::Optimizer& opt, const optim::OptimizerStateDict& full) {
  const ParamMap m = map_params(root);
  // The checks every loader makes, against the unsharded parameters (Note [state dict validation]).
  optim::ParamLayout layout(opt.num_param_groups());
  std::vector<const FSDPParam*> fsdp_of;  // by the optimizer's parameter index
  for (std::size_t g = 0; g < opt.num_param_groups(); ++g) {
    for (const Tensor& p : opt.param_group(g).params) {
      auto fp = m.fsdp_param.find(p.id());
      fsdp_of.push_back(fp == m.fsdp_param.end() ? nullptr : fp->second);
      layout[g].push_back(fp == m.fsdp_param.end() ? optim::ParamSpec::of(p)
                                                   : optim::ParamSpec{fp->second->global_shape, DType::f32, p.device()});
    }
  }
  if (absl::Status s = optim::validate_state_dict(full, opt, layout); !s.ok()) return s;
  optim::OptimizerStateDict local;
  local.optimizer = full.optimizer;
  std::int64_t k = 0;
  for (std::size_t g = 0; g < opt.num_param_groups(); ++g) {
    optim::ParamGroupState lg{full.param_groups[g].hyper, {}};
    for (std::size_t i = 0; i < opt.param_group(g).params.size(); ++i, ++k) {
      lg.params.push_back(k);
      auto st = full.state.find(full.param_groups[g].params[i]);
      if (st == full.state.end()) continue;
      optim::ParamState ps{st->second.step, {}};
      for (const auto& [key, t] : st->second.tensors) {
        ps.tensors[key] = fsdp_of[static_cast<std::size_t>(k)] == nullptr ? t : local_rows(*fsdp_of[static_cast<std::size_t>(k)], t);
      }
      local.state[k] = std::move(ps);
    }
    local.param_groups.push_back(std::move(lg));
  }
  return opt.load_state_dict(local);
}

}  // namespace shardkit::fsdp
