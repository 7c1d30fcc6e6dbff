#include "fsdp/state_dict.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/autograd/grad_mode.h"
#include "common/base/check.h"
#include "common/comm/host_staged.h"
#include "common/optim/state_dict_validation.h"
#include "fsdp/fully_shard.h"
#include "fsdp/same_values.h"

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

// The whole tensor of one sharded parameter's `local` rows (a state tensor shaped like the shard), on every rank,
// on local's device.
absl::StatusOr<Tensor> gather_rows(const FSDPParam& p, const Tensor& local, comm::ProcessGroup& pg) {
  const int world = pg.size();
  const std::int64_t padded = p.padded_numel();
  const TensorOptions comm_opts =
      TensorOptions{}.with_category(MemoryCategory::communication_buffer).with_device(local.device());
  Tensor send = Tensor::zeros({padded}, comm_opts);
  if (local.numel() > 0) send.view(0, {local.numel()}).copy_(local.flatten());
  Tensor all = Tensor::empty({padded * world}, comm_opts);
  // all_gather_host: optimizer state is on the host under cpu offload, whatever the group moves.
  if (absl::Status s = comm::all_gather_host(pg, all, send, {.tag = absl::StrCat("fsdp state ", p.names.front())});
      !s.ok()) {
    return s;
  }
  Tensor full = Tensor::empty(p.global_shape, TensorOptions{}.with_category(MemoryCategory::other).with_device(local.device()));
  for (int r = 0; r < world; ++r) {
    const RowSplit rs = split_rows(p.global_shape, r, world);
    const std::int64_t n = rs.local_rows * rs.row_numel;
    if (n > 0) full.view(rs.row_offset * rs.row_numel, {n}).copy_(all.view(r * padded, {n}));
  }
  return full;
}

// This rank's rows of a whole tensor.
Tensor local_rows(const FSDPParam& p, const Tensor& full) {
  Tensor out = Tensor::empty(p.local_shape, TensorOptions{}.with_category(MemoryCategory::optimizer_state).with_device(full.device()));
  if (out.numel() > 0) out.flatten().copy_(full.view(p.split.row_offset * p.split.row_numel, {out.numel()}));
  return out;
}

// ---- sharded state dicts: geometry and the pieces' plan (Note [loading sharded pieces]) ----------------------

// Every FSDPParam under root, found by either tensor the module may register for it (its shard at rest, its
// unsharded tensor while its unit is unsharded).
std::map<const TensorImpl*, const FSDPParam*> managed_params(nn::Module& root) {
  std::map<const TensorImpl*, const FSDPParam*> out;
  for (const auto& [name, mod] : root.named_modules()) {
    const FSDPState* s = state_attached(*mod);
    if (s == nullptr || s->param_group() == nullptr) continue;
    for (const FSDPParam& p : s->param_group()->params()) {
      out[p.sharded.id()] = &p;
      if (p.unsharded.defined()) out[p.unsharded.id()] = &p;
    }
  }
  return out;
}

// The registered tensors in root.state_dict()'s order (every name of a parameter, then the buffers), as handles
// (state_dict() detaches them, which hides which tensor they are).
nn::NamedTensors named_state(const nn::Module& root) {
  nn::NamedTensors out = root.named_parameters({.recurse = true, .remove_duplicate = false});
  for (auto& nt : root.named_buffers()) out.push_back(std::move(nt));
  return out;
}

// This rank's rows of one tensor of the module.
struct Rows {
  Tensor tensor;  // rows [row_offset, row_offset + rows) of a tensor of global_shape
  Shape global_shape;
  std::int64_t row_offset = 0;
};

// Where this rank's rows live at rest: a sharded parameter's shard, or the whole tensor.
Rows rows_at_rest(const Tensor& registered, const std::map<const TensorImpl*, const FSDPParam*>& managed) {
  auto it = managed.find(registered.id());
  if (it == managed.end()) return {registered, registered.shape(), 0};
  const FSDPParam& p = *it->second;
  return {p.sharded, p.global_shape, p.split.row_offset};
}

// This rank's rows as the module shows them now: while a unit is unsharded, the module's values are the unsharded
// tensor's (written while summoned, not yet in the shard).
Rows rows_now(const Tensor& registered, const std::map<const TensorImpl*, const FSDPParam*>& managed) {
  Rows r = rows_at_rest(registered, managed);
  auto it = managed.find(registered.id());
  if (it != managed.end() && registered.is_same(it->second->unsharded) && it->second->unsharded_exact) {
    const FSDPParam& p = *it->second;
    r.tensor = p.unsharded.view(p.split.row_offset * p.split.row_numel, p.local_shape);
  }
  return r;
}

std::int64_t global_rows(const Shape& global) { return global.empty() ? 1 : global[0]; }

std::int64_t row_numel(const Shape& global) {
  const std::int64_t rows = global_rows(global);
  return rows == 0 ? 0 : shape_numel(global) / rows;
}

// How many rows a tensor of shape `local` holds of one of shape `global`: [rows, d1, ...] with global's d1, ...
// (a 0-d tensor: [] is its one row, [0] none). Empty when the shape is not of that form.
std::optional<std::int64_t> rows_held(const Shape& local, const Shape& global) {
  if (global.empty()) {
    if (local.empty()) return 1;
    if (local == Shape{0}) return 0;
    return std::nullopt;
  }
  if (local.size() != global.size() || local[0] < 0 || !std::equal(local.begin() + 1, local.end(), global.begin() + 1)) {
    return std::nullopt;
  }
  return local[0];
}

// One piece's rows of one tensor, as written.
struct PieceRows {
  std::size_t piece = 0;
  Tensor local;
  Shape global_shape;
  std::int64_t row_offset = 0;
};

// A piece to read from: its rows [first, first + rows).
struct Span {
  std::size_t piece = 0;
  Tensor local;
  std::int64_t first = 0;
  std::int64_t rows = 0;
};

std::string rows_str(std::int64_t first, std::int64_t end) { return absl::StrCat("rows [", first, ", ", end, ")"); }

// Checks the pieces of one tensor of shape `global` (Note [loading sharded pieces]) and returns the ones that hold
// rows: one replica, or disjoint spans covering [0, d0) in row order. `what` begins each message.
absl::StatusOr<std::vector<Span>> plan_rows(const std::string& what, const Shape& global,
                                            const std::vector<PieceRows>& pieces) {
  const std::int64_t d0 = global_rows(global);
  std::vector<Span> spans;
  for (const PieceRows& p : pieces) {
    if (p.global_shape != global) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": expected global shape ", shape_str(global), ", found ",
                                                     shape_str(p.global_shape), " in piece ", p.piece));
    }
    if (!p.local.defined()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": piece ", p.piece, " holds an undefined tensor"));
    }
    const std::optional<std::int64_t> rows = rows_held(p.local.shape(), global);
    if (!rows || p.row_offset < 0 || p.row_offset > d0 - *rows) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": piece ", p.piece, " holds ", p.local.describe(), " at row ", p.row_offset,
          "; expected rows of the global shape ", shape_str(global), " (same trailing dimensions) inside ",
          rows_str(0, d0)));
    }
    if (*rows > 0) spans.push_back({p.piece, p.local, p.row_offset, *rows});
  }
  if (!spans.empty() && std::all_of(spans.begin(), spans.end(), [&](const Span& s) { return s.rows == d0; })) {
    return std::vector<Span>{spans.front()};  // whole in every piece: replicas
  }
  std::stable_sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.first < b.first; });
  // Replicas of a range (HSDP): the first piece holding it is read.
  spans.erase(std::unique(spans.begin(), spans.end(),
                          [](const Span& a, const Span& b) { return a.first == b.first && a.rows == b.rows; }),
              spans.end());
  std::int64_t covered = 0;  // rows [0, covered) are held
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const Span& s = spans[i];
    if (s.first < covered) {
      const Span& prev = spans[i - 1];
      return absl::InvalidArgumentError(absl::StrCat(what, ": pieces overlap: piece ", prev.piece, " holds ",
                                                     rows_str(prev.first, prev.first + prev.rows), " and piece ",
                                                     s.piece, " ", rows_str(s.first, s.first + s.rows)));
    }
    if (s.first > covered) break;
    covered = s.first + s.rows;
  }
  if (covered < d0) {
    std::int64_t end = d0;
    for (const Span& s : spans) {
      if (s.first > covered) {
        end = s.first;
        break;
      }
    }
    return absl::InvalidArgumentError(absl::StrCat(what, " (global shape ", shape_str(global), "): missing ",
                                                   rows_str(covered, end), ": no piece holds them"));
  }
  return spans;
}

// Copies rows [first, first + rows of dst) of the tensor `spans` cover (plan_rows) into dst, converting dtype.
void copy_rows(const std::vector<Span>& spans, const Shape& global, const Tensor& dst, std::int64_t first) {
  const std::int64_t rn = row_numel(global);
  const std::optional<std::int64_t> rows = rows_held(dst.shape(), global);
  SK_CHECK(rows.has_value()) << dst.describe() << " as rows of " << shape_str(global);
  const std::int64_t end = first + *rows;
  std::int64_t copied = 0;
  for (const Span& s : spans) {
    const std::int64_t lo = std::max(first, s.first), hi = std::min(end, s.first + s.rows);
    if (lo >= hi) continue;
    dst.view((lo - first) * rn, {(hi - lo) * rn}).copy_(s.local.view((lo - s.first) * rn, {(hi - lo) * rn}));
    copied += hi - lo;
  }
  SK_CHECK_EQ(copied, *rows) << "rows of " << dst.describe() << " at row " << first;
}

// The first name of each of root's parameters (root.named_parameters()), by the tensor an optimizer steps (a
// sharded parameter's shard), with the rows a rank holds.
struct OptimizerParam {
  std::string name;
  Shape global_shape;
  std::int64_t row_offset = 0;
};
std::map<const TensorImpl*, OptimizerParam> optimizer_params(nn::Module& root) {
  const auto managed = managed_params(root);
  std::map<const TensorImpl*, OptimizerParam> out;
  for (const auto& [name, t] : root.named_parameters()) {
    const Rows r = rows_at_rest(t, managed);
    out[r.tensor.id()] = {name, r.global_shape, r.row_offset};
  }
  return out;
}

absl::Status not_a_parameter(const char* who, std::int64_t k, const Tensor& param) {
  return absl::InvalidArgumentError(absl::StrCat(
      who, ": expected the optimizer to step the root's parameters (model.parameters() after fully_shard), found "
           "parameter ",
      k, " (", param.describe(), ") that is not one of them"));
}

// Note [same values on every rank] in same_values.cc: a load writes the values of one checkpoint, the same on every
// rank, so the parameters it writes (by state_dict() name) no longer differ across ranks, whatever fully_shard found.
void forget_loaded_values(nn::Module& root, const std::set<std::string>& names) {
  std::set<const TensorImpl*> loaded;
  for (const auto& [name, t] : named_state(root)) {
    if (names.count(name) != 0) loaded.insert(t.id());
  }
  for (const auto& [n, mod] : root.named_modules()) {
    if (FSDPState* s = state_attached(*mod)) s->forget_value_mismatches(loaded);
  }
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
  // Values the load replaces no longer differ (before the summon, which refuses a model whose values differ); a
  // refused load (the module unchanged) keeps what was found.
  std::vector<std::pair<FSDPState*, std::vector<ValueMismatch>>> found;
  for (FSDPState* s : unit->state().subtree_states()) found.emplace_back(s, s->value_mismatches());
  std::set<std::string> names;
  for (const auto& [name, t] : state) names.insert(name);
  forget_loaded_values(root, names);
  absl::Status summoned = unit->summon_full_params();
  absl::Status loaded = summoned.ok() ? root.load_state_dict(state, strict) : summoned;
  if (!loaded.ok()) {
    for (auto& [s, m] : found) s->set_value_mismatches(std::move(m));
  }
  if (!summoned.ok()) return summoned;
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


// ---- name-keyed full optimizer state ----------------------------------------------------------------------------

absl::StatusOr<NamedOptimizerState> to_named(const nn::Module& root, const optim::OptimizerStateDict& full) {
  const nn::NamedTensors params = root.named_parameters();
  auto name_of = [&](std::int64_t index) -> absl::StatusOr<std::string> {
    if (index < 0 || index >= static_cast<std::int64_t>(params.size())) {
      return absl::InvalidArgumentError(absl::StrCat("fsdp to_named: expected parameter indices in [0, ",
                                                     params.size(), ") (positions in root.parameters()), found ",
                                                     index));
    }
    return params[static_cast<std::size_t>(index)].first;
  };
  NamedOptimizerState out;
  out.optimizer = full.optimizer;
  for (const optim::ParamGroupState& g : full.param_groups) {
    NamedParamGroup ng{g.hyper, {}};
    for (std::int64_t index : g.params) {
      auto name = name_of(index);
      if (!name.ok()) return name.status();
      ng.params.push_back(*std::move(name));
    }
    out.param_groups.push_back(std::move(ng));
  }
  for (const auto& [index, st] : full.state) {
    auto name = name_of(index);
    if (!name.ok()) return name.status();
    out.state[*name] = st;
  }
  return out;
}

absl::StatusOr<optim::OptimizerStateDict> from_named(const nn::Module& root, const NamedOptimizerState& named) {
  std::map<std::string, std::int64_t> index_of;
  for (const auto& [name, t] : root.named_parameters()) {
    index_of.emplace(name, static_cast<std::int64_t>(index_of.size()));
  }
  optim::OptimizerStateDict out;
  out.optimizer = named.optimizer;
  std::set<std::string> listed;
  for (std::size_t g = 0; g < named.param_groups.size(); ++g) {
    optim::ParamGroupState pg{named.param_groups[g].hyper, {}};
    for (const std::string& name : named.param_groups[g].params) {
      auto it = index_of.find(name);
      if (it == index_of.end()) {
        return absl::InvalidArgumentError(absl::StrCat("fsdp from_named: group ", g, " lists unknown parameter '",
                                                       name, "'; expected a name of root.named_parameters()"));
      }
      if (!listed.insert(name).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("fsdp from_named: parameter '", name, "' is listed twice (again in group ", g, ")"));
      }
      pg.params.push_back(it->second);
    }
    out.param_groups.push_back(std::move(pg));
  }
  for (const auto& [name, st] : named.state) {
    auto it = index_of.find(name);
    if (it == index_of.end()) {
      return absl::InvalidArgumentError(absl::StrCat("fsdp from_named: state for unknown parameter '", name,
                                                     "'; expected a name of root.named_parameters()"));
    }
    out.state[it->second] = st;
  }
  return out;
}

// ---- sharded model state ---------------------------------------------------------------------------------------

absl::StatusOr<ShardedStateDict> sharded_state_dict(nn::Module& root) {
  auto unit = state_of(root);
  if (!unit.ok()) return unit.status();
  // Note [same values on every rank] in same_values.cc: the pieces of a mixed model would load as one.
  if (absl::Status s = values_differ(root, unit->state().subtree_states()); !s.ok()) return s;
  const auto managed = managed_params(root);
  ShardedStateDict out;
  for (const auto& [name, t] : named_state(root)) {
    const Rows r = rows_now(t, managed);
    out.entries.push_back({name, r.tensor.clone(MemoryCategory::other), r.global_shape, r.row_offset});
  }
  return out;
}

absl::Status load_sharded_state_dict(nn::Module& root, const std::vector<ShardedStateDict>& pieces, bool strict) {
  constexpr char kWho[] = "fsdp load_sharded_state_dict";
  auto unit = state_of(root);
  if (!unit.ok()) return unit.status();
  const auto managed = managed_params(root);
  std::vector<std::pair<std::string, Rows>> targets;
  std::map<std::string, std::vector<PieceRows>> by_name;
  for (const auto& [name, t] : named_state(root)) {
    targets.emplace_back(name, rows_at_rest(t, managed));
    by_name[name];
  }
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    for (const ShardedEntry& e : pieces[i].entries) {
      auto it = by_name.find(e.name);
      if (it != by_name.end()) {
        it->second.push_back({i, e.local, e.global_shape, e.row_offset});
      } else if (strict) {
        return absl::InvalidArgumentError(absl::StrCat(kWho, ": unknown name '", e.name, "' in piece ", i,
                                                       "; expected a name of the module's state_dict() (strict)"));
      }
    }
  }
  // Every check first (the module is unchanged on error), then the copies.
  std::vector<std::optional<std::vector<Span>>> plans(targets.size());
  for (std::size_t k = 0; k < targets.size(); ++k) {
    const auto& [name, rows] = targets[k];
    const std::vector<PieceRows>& held = by_name.at(name);
    if (held.empty()) {
      if (!strict) continue;
      return absl::InvalidArgumentError(absl::StrCat(kWho, ": no piece holds '", name, "' (strict; ",
                                                     pieces.size(), " pieces)"));
    }
    auto plan = plan_rows(absl::StrCat(kWho, ": '", name, "'"), rows.global_shape, held);
    if (!plan.ok()) return plan.status();
    plans[k] = *std::move(plan);
  }
  if (absl::Status s = unit->reshard(/*recurse=*/true); !s.ok()) return s;  // the shards are the truth again
  autograd::NoGradGuard no_grad;
  std::set<std::string> loaded;
  for (std::size_t k = 0; k < targets.size(); ++k) {
    if (!plans[k]) continue;
    const Rows& r = targets[k].second;
    copy_rows(*plans[k], r.global_shape, r.tensor, r.row_offset);
    loaded.insert(targets[k].first);
  }
  forget_loaded_values(root, loaded);
  return absl::OkStatus();
}

// ---- sharded optimizer state -------------------------------------------------------------------------------------

absl::StatusOr<ShardedOptimizerState> sharded_optimizer_state(nn::Module& root, const optim::Optimizer& opt) {
  if (auto unit = state_of(root); !unit.ok()) return unit.status();
  const auto params = optimizer_params(root);
  ShardedOptimizerState out;
  out.optimizer = opt.name();
  std::int64_t k = 0;
  for (std::size_t g = 0; g < opt.num_param_groups(); ++g) {
    NamedParamGroup ng{opt.param_group(g).hyper, {}};
    for (std::size_t i = 0; i < opt.param_group(g).params.size(); ++i, ++k) {
      auto it = params.find(opt.param(k).id());
      if (it == params.end()) return not_a_parameter("fsdp sharded_optimizer_state", k, opt.param(k));
      const OptimizerParam& p = it->second;
      ng.params.push_back(p.name);
      const optim::ParamState* st = opt.state(k);
      if (st == nullptr) continue;  // not stepped yet
      ShardedParamState ps{p.name, st->step, {}, p.global_shape, p.row_offset};
      for (const auto& [key, t] : st->tensors) ps.tensors[key] = t.clone(MemoryCategory::other);
      out.state.push_back(std::move(ps));
    }
    out.param_groups.push_back(std::move(ng));
  }
  return out;
}

namespace {

// The first difference between two pieces' groups, or "".
std::string groups_differ(const std::vector<NamedParamGroup>& a, const std::vector<NamedParamGroup>& b) {
  if (a.size() != b.size()) return absl::StrCat(a.size(), " param groups against ", b.size());
  for (std::size_t g = 0; g < a.size(); ++g) {
    if (!(a[g].hyper == b[g].hyper)) {
      return absl::StrCat("group ", g, " has ", optim::hyper_params_str(a[g].hyper), " against ",
                          optim::hyper_params_str(b[g].hyper));
    }
    if (a[g].params != b[g].params) return absl::StrCat("group ", g, " lists other parameters");
  }
  return "";
}

}  // namespace

absl::Status load_sharded_optimizer_state(nn::Module& root, optim::Optimizer& opt,
                                          const std::vector<ShardedOptimizerState>& pieces) {
  constexpr char kWho[] = "fsdp load_sharded_optimizer_state";
  if (auto unit = state_of(root); !unit.ok()) return unit.status();
  if (pieces.empty()) return absl::InvalidArgumentError(absl::StrCat(kWho, ": expected every rank's piece, found none"));
  const ShardedOptimizerState& first = pieces.front();
  for (std::size_t i = 1; i < pieces.size(); ++i) {
    if (pieces[i].optimizer != first.optimizer) {
      return absl::InvalidArgumentError(absl::StrCat(kWho, ": piece ", i, " is of optimizer ", pieces[i].optimizer,
                                                     ", piece 0 of ", first.optimizer));
    }
    if (std::string d = groups_differ(pieces[i].param_groups, first.param_groups); !d.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(kWho, ": the pieces disagree: piece ", i, "'s ", d, " in piece 0"));
    }
  }
  // The optimizer's parameters by name, and the groups they must be listed in.
  const auto params = optimizer_params(root);
  struct Slot {
    std::int64_t index = 0;  // in the optimizer
    std::size_t group = 0;
    const OptimizerParam* param = nullptr;
  };
  std::map<std::string, Slot> slots;
  std::int64_t k = 0;
  for (std::size_t g = 0; g < opt.num_param_groups(); ++g) {
    for (std::size_t i = 0; i < opt.param_group(g).params.size(); ++i, ++k) {
      auto it = params.find(opt.param(k).id());
      if (it == params.end()) return not_a_parameter(kWho, k, opt.param(k));
      slots[it->second.name] = {k, g, &it->second};
    }
  }
  if (first.param_groups.size() != opt.num_param_groups()) {
    return absl::InvalidArgumentError(absl::StrCat(kWho, ": expected ", opt.num_param_groups(),
                                                   " param groups (the optimizer's), found ", first.param_groups.size()));
  }
  for (std::size_t g = 0; g < first.param_groups.size(); ++g) {
    std::set<std::string> listed;
    for (const std::string& name : first.param_groups[g].params) {
      auto it = slots.find(name);
      if (it == slots.end()) {
        return absl::InvalidArgumentError(absl::StrCat(kWho, ": group ", g, " lists unknown parameter '", name,
                                                       "'; expected a parameter the optimizer steps"));
      }
      if (it->second.group != g || !listed.insert(name).second) {
        return absl::InvalidArgumentError(absl::StrCat(kWho, ": group ", g, " lists '", name,
                                                       "', which is not once in the optimizer's group ", g));
      }
    }
    if (listed.size() != opt.param_group(g).params.size()) {
      return absl::InvalidArgumentError(absl::StrCat(kWho, ": group ", g, " lists ", listed.size(),
                                                     " parameters; expected the optimizer's ",
                                                     opt.param_group(g).params.size()));
    }
  }
  // Each parameter's state, from every piece that has some.
  std::map<std::string, std::vector<std::pair<std::size_t, const ShardedParamState*>>> held;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    for (const ShardedParamState& ps : pieces[i].state) {
      if (!slots.contains(ps.name)) {
        return absl::InvalidArgumentError(absl::StrCat(kWho, ": piece ", i, " holds state for unknown parameter '",
                                                       ps.name, "'; expected a parameter the optimizer steps"));
      }
      held[ps.name].emplace_back(i, &ps);
    }
  }
  const auto managed = managed_params(root);
  optim::OptimizerStateDict local;
  local.optimizer = first.optimizer;
  for (std::size_t g = 0; g < opt.num_param_groups(); ++g) local.param_groups.push_back({first.param_groups[g].hyper, {}});
  for (const auto& [name, slot] : slots) local.param_groups[slot.group].params.push_back(slot.index);
  for (optim::ParamGroupState& g : local.param_groups) std::sort(g.params.begin(), g.params.end());
  for (const auto& [name, states] : held) {
    const Slot& slot = slots.at(name);
    const auto& [i0, s0] = states.front();
    optim::ParamState ps{s0->step, {}};
    for (const auto& [i, s] : states) {
      if (s->step != s0->step) {
        return absl::InvalidArgumentError(absl::StrCat(kWho, ": '", name, "': step counts differ: ", s0->step,
                                                       " in piece ", i0, ", ", s->step, " in piece ", i));
      }
      const bool same_keys = s->tensors.size() == s0->tensors.size() &&
                             std::equal(s->tensors.begin(), s->tensors.end(), s0->tensors.begin(),
                                        [](const auto& a, const auto& b) { return a.first == b.first; });
      if (!same_keys) {
        return absl::InvalidArgumentError(
            absl::StrCat(kWho, ": '", name, "': pieces ", i0, " and ", i, " hold different state keys"));
      }
    }
    // This rank's rows of the parameter (its shard's shape), from the pieces that cover them.
    const Rows mine = rows_at_rest(opt.param(slot.index), managed);
    for (const auto& [key, t0] : s0->tensors) {
      std::vector<PieceRows> rows;
      for (const auto& [i, s] : states) rows.push_back({i, s->tensors.at(key), s->global_shape, s->row_offset});
      auto plan = plan_rows(absl::StrCat(kWho, ": state '", key, "' of '", name, "'"), slot.param->global_shape, rows);
      if (!plan.ok()) return plan.status();
      Tensor t = Tensor::empty(mine.tensor.shape(), TensorOptions{}.with_category(MemoryCategory::other));
      copy_rows(*plan, slot.param->global_shape, t, slot.param->row_offset);
      ps.tensors[key] = std::move(t);
    }
    local.state[slot.index] = std::move(ps);
  }
  if (absl::Status s = opt.load_state_dict(local); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(kWho, ": ", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace shardkit::fsdp
