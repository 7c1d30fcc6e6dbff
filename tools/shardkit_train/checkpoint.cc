#include "tools/shardkit_train/checkpoint.h"

#include <signal.h>
#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/optim/finite.h"
#ifdef SHARDKIT_TRAIN_HAS_FSDP
#include "fsdp/state_dict.h"
#endif

namespace shardkit::train {
namespace {

std::string hyper_str(const optim::HyperParams& h) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%.17g,%.17g,%.17g,%.17g,%.17g,%.17g,%.17g,%d,%d", h.lr, h.beta1, h.beta2, h.eps,
                h.weight_decay, h.momentum, h.dampening, h.nesterov ? 1 : 0, h.maximize ? 1 : 0);
  return buf;
}

bool parse_hyper(const std::string& s, optim::HyperParams& h) {
  std::vector<std::string> f = absl::StrSplit(s, ',');
  if (f.size() != 9) return false;
  double* d[] = {&h.lr, &h.beta1, &h.beta2, &h.eps, &h.weight_decay, &h.momentum, &h.dampening};
  for (int i = 0; i < 7; ++i) {
    if (!absl::SimpleAtod(f[static_cast<std::size_t>(i)], d[i])) return false;
  }
  h.nesterov = f[7] == "1";
  h.maximize = f[8] == "1";
  return true;
}

std::string model_name(const std::string& name) { return "model/" + name; }
std::string optim_name(const std::string& param, const std::string& key) { return absl::StrCat("optim/", param, "/", key); }

Tensor step_tensor(std::int64_t step) {
  return Tensor::from_int64({step}, {}, TensorOptions{}.with_category(MemoryCategory::other));
}

void add_group_meta(std::map<std::string, std::string>& meta, std::size_t g, const optim::HyperParams& hyper,
                    const std::vector<std::string>& names) {
  meta[absl::StrCat("optim.group.", g, ".hyper")] = hyper_str(hyper);
  meta[absl::StrCat("optim.group.", g, ".params")] = absl::StrJoin(names, ",");
}

// The first name of each of the model's parameters, in parameters() order (Note [parameter indices]).
std::vector<std::string> param_names(const nn::Module& model) {
  std::vector<std::string> names;
  for (const auto& [name, t] : model.named_parameters()) names.push_back(name);
  return names;
}

absl::StatusOr<std::string> name_of(const std::vector<std::string>& names, std::int64_t index) {
  if (index < 0 || index >= static_cast<std::int64_t>(names.size())) {
    return absl::InternalError(absl::StrCat("optimizer parameter index ", index, " is not one of the model's ", names.size(),
                                            " parameters"));
  }
  return names[static_cast<std::size_t>(index)];
}

// A full (index-keyed) optimizer state: every tensor whole, meta from its groups.
absl::Status add_full_optimizer_state(CheckpointContents& c, const optim::OptimizerStateDict& full,
                                      const std::vector<std::string>& names, const nn::Module& model) {
  c.meta["optim.name"] = full.optimizer;
  c.meta["optim.groups"] = std::to_string(full.param_groups.size());
  for (std::size_t g = 0; g < full.param_groups.size(); ++g) {
    std::vector<std::string> group;
    for (std::int64_t i : full.param_groups[g].params) {
      auto n = name_of(names, i);
      if (!n.ok()) return n.status();
      group.push_back(*n);
    }
    add_group_meta(c.meta, g, full.param_groups[g].hyper, group);
  }
  const nn::NamedTensors params = model.named_parameters();
  for (const auto& [index, st] : full.state) {
    auto n = name_of(names, index);
    if (!n.ok()) return n.status();
    const Shape& shape = params[static_cast<std::size_t>(index)].second.shape();
    for (const auto& [key, t] : st.tensors) c.pieces.push_back({optim_name(*n, key), shape, 0, t});
    c.pieces.push_back({optim_name(*n, "step"), {}, 0, step_tensor(st.step)});
  }
  return absl::OkStatus();
}

#ifdef SHARDKIT_TRAIN_HAS_FSDP
// Rows [row_offset, ...) of a tensor of `global` (Note [loading sharded pieces] in fsdp/state_dict.h): its range
// of elements; a tensor whole on every rank is written by rank 0 only.
void add_rows(std::vector<io::TensorPiece>& out, std::string name, const Tensor& local, const Shape& global,
              std::int64_t row_offset, int rank) {
  std::int64_t total = 1;
  for (std::int64_t d : global) total *= d;  // the global shape of a live tensor: no overflow
  const std::int64_t row_numel = global.empty() ? 1 : (global[0] == 0 ? 0 : total / global[0]);
  const bool whole = local.numel() == total;
  if (whole ? rank != 0 : local.numel() == 0) return;
  out.push_back({std::move(name), global, whole ? 0 : row_offset * row_numel, local});
}
#endif

bool old_format_present(const std::string& dir) {
  struct stat st {};
  return ::lstat(absl::StrCat(dir, "/", kOldCheckpointFile).c_str(), &st) == 0;
}

absl::Status corrupt(const std::string& dir, const std::string& what) {
  return absl::DataLossError(absl::StrCat("checkpoint '", checkpoint_path(dir), "' is corrupt: ", what));
}

// Every rank learns the flags of all (max over ranks).
absl::Status agree(comm::ProcessGroup& pg, Tensor& flags, const std::string& tag) {
  return pg.all_reduce(flags, {.op = comm::ReduceOp::max(), .tag = tag})->wait();
}

}  // namespace

std::string checkpoint_path(const std::string& dir) { return absl::StrCat(dir, "/", io::kManifestFile); }

std::string value_str(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return absl::StrCat(v);
}

absl::Status check_finite(const Checkpoint& ckpt) {
  auto check = [](const std::string& name, const Tensor& t) -> absl::Status {
    if (!is_floating(t.dtype())) return absl::OkStatus();
    const std::int64_t i = optim::find_non_finite(t);
    if (i < 0) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("expected finite values, found ", value_str(t.item_at(i)), " in ", name, " (element ", i, ")"));
  };
  for (const auto& [name, t] : ckpt.model) {
    if (absl::Status s = check(model_name(name), t); !s.ok()) return s;
  }
  std::vector<std::string> names;  // by index, for the messages
  for (std::size_t g = 0; g < ckpt.optimizer.param_groups.size(); ++g) {
    auto it = ckpt.meta.find(absl::StrCat("optim.group.", g, ".params"));
    if (it == ckpt.meta.end()) continue;
    for (absl::string_view n : absl::StrSplit(it->second, ',', absl::SkipEmpty())) names.emplace_back(n);
  }
  for (const auto& [index, st] : ckpt.optimizer.state) {
    const std::string param =
        index >= 0 && index < static_cast<std::int64_t>(names.size()) ? names[static_cast<std::size_t>(index)] : absl::StrCat(index);
    for (const auto& [key, t] : st.tensors) {
      if (absl::Status s = check(optim_name(param, key), t); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<io::DirectoryLock> open_dir(const Options& o) {
  const io::ExistingCheckpoint existing = o.resume      ? io::ExistingCheckpoint::resume
                                          : o.overwrite ? io::ExistingCheckpoint::replace
                                                        : io::ExistingCheckpoint::refuse;
  absl::StatusOr<io::DirectoryLock> lock = io::open_checkpoint_dir(o.checkpoint_dir, existing, {kOldCheckpointFile});
  if (!lock.ok() && absl::StrContains(lock.status().message(), "already holds a checkpoint")) {
    return absl::FailedPreconditionError(
        absl::StrCat(lock.status().message(), "; pass --resume to continue it or --overwrite to replace it"));
  }
  return lock;
}

absl::StatusOr<CheckpointContents> sharded_contents(const CheckpointSource& s, int rank) {
  CheckpointContents c;
  const std::vector<std::string> names = param_names(*s.model);
  if (s.fsdp) {
#ifdef SHARDKIT_TRAIN_HAS_FSDP
    auto model = fsdp::sharded_state_dict(*s.model);
    if (!model.ok()) return model.status();
    for (const fsdp::ShardedEntry& e : model->entries) add_rows(c.pieces, model_name(e.name), e.local, e.global_shape, e.row_offset, rank);
    auto opt = fsdp::sharded_optimizer_state(*s.model, *s.optimizer);
    if (!opt.ok()) return opt.status();
    c.meta["optim.name"] = opt->optimizer;
    c.meta["optim.groups"] = std::to_string(opt->param_groups.size());
    for (std::size_t g = 0; g < opt->param_groups.size(); ++g) add_group_meta(c.meta, g, opt->param_groups[g].hyper, opt->param_groups[g].params);
    for (const fsdp::ShardedParamState& ps : opt->state) {
      for (const auto& [key, t] : ps.tensors) add_rows(c.pieces, optim_name(ps.name, key), t, ps.global_shape, ps.row_offset, rank);
      // Rank 0 holds rows [0, ...) of every sharded parameter (or all of a whole one): it writes the step.
      if (rank == 0) c.pieces.push_back({optim_name(ps.name, "step"), {}, 0, step_tensor(ps.step)});
    }
    return c;
#else
    return absl::UnimplementedError("strategy fsdp is not built into this shardkit-train");
#endif
  }
  if (rank == 0) {
    for (const auto& [name, t] : s.model->state_dict()) c.pieces.push_back({model_name(name), t.shape(), 0, t});
  }
  if (s.oss != nullptr) {
    const optim::OptimizerStateDict local = s.oss->shard_optimizer().state_dict();
    c.meta["optim.name"] = local.optimizer;
    c.meta["optim.groups"] = std::to_string(s.oss->num_param_groups());
    for (std::size_t g = 0; g < s.oss->num_param_groups(); ++g) {
      std::vector<std::string> group;
      for (std::size_t i = 0; i < s.oss->param_group(g).params.size(); ++i) {
        auto n = name_of(names, s.oss->global_index(static_cast<int>(g), static_cast<int>(i)));
        if (!n.ok()) return n.status();
        group.push_back(*n);
      }
      add_group_meta(c.meta, g, s.oss->param_group(g).hyper, group);
    }
    const nn::NamedTensors params = s.model->named_parameters();
    for (const auto& [local_index, st] : local.state) {
      const oss::OwnedPiece& piece = s.oss->owned_pieces().at(static_cast<std::size_t>(local_index));
      auto n = name_of(names, piece.index);
      if (!n.ok()) return n.status();
      const Shape& shape = params[static_cast<std::size_t>(piece.index)].second.shape();
      for (const auto& [key, t] : st.tensors) c.pieces.push_back({optim_name(*n, key), shape, piece.offset, t});
      if (piece.offset == 0) c.pieces.push_back({optim_name(*n, "step"), {}, 0, step_tensor(st.step)});
    }
    return c;
  }
  // A replicated optimizer (ddp): rank 0 writes it (and the meta, which only rank 0's commit uses).
  if (rank != 0) return c;
  if (absl::Status st = add_full_optimizer_state(c, s.optimizer->state_dict(), names, *s.model); !st.ok()) return st;
  return c;
}

absl::StatusOr<CheckpointContents> consolidated_contents(const nn::Module& model, const optim::OptimizerStateDict* full,
                                                         int rank) {
  CheckpointContents c;
  if (rank != 0) return c;
  if (full == nullptr) return absl::InternalError("rank 0 has no consolidated optimizer state");
  for (const auto& [name, t] : model.state_dict()) c.pieces.push_back({model_name(name), t.shape(), 0, t});
  if (absl::Status s = add_full_optimizer_state(c, *full, param_names(model), model); !s.ok()) return s;
  return c;
}

absl::Status save_checkpoint(const Options& o, std::int64_t step, std::map<std::string, std::string> meta,
                             const CheckpointContents& contents, comm::ProcessGroup& pg) {
  const int rank = pg.rank(), world = pg.size();
  const std::string refusing = absl::StrCat("refusing to write the checkpoint of step ", step, ": ");
  const std::string cannot = absl::StrCat("cannot write the checkpoint of step ", step, ": ");
  // Finite values only (Note [non-finite loss] in trainer.cc); the lowest rank that found one is named.
  absl::Status finite;
  for (const io::TensorPiece& p : contents.pieces) {
    if (!is_floating(p.data.dtype())) continue;
    const std::int64_t i = optim::find_non_finite(p.data);
    if (i < 0) continue;
    finite = absl::FailedPreconditionError(absl::StrCat(refusing, "expected finite values, found ", value_str(p.data.item_at(i)),
                                                        " in ", p.name, " (element ", p.offset + i, ")"));
    break;
  }
  // [world - lowest rank that refuses, or 0; rank 0's id value] (an f32 holds integers below 2^24 exactly).
  std::uint32_t nonce = 0;
  if (rank == 0) nonce = std::random_device{}() & 0xffffffu;
  Tensor flags = Tensor::zeros({2}, TensorOptions{}.with_category(MemoryCategory::other));
  flags.data<float>()[0] = finite.ok() ? 0.f : static_cast<float>(world - rank);
  flags.data<float>()[1] = static_cast<float>(nonce);
  if (absl::Status s = agree(pg, flags, "checkpoint finite"); !s.ok()) return s;
  if (flags.data<float>()[0] > 0) {
    if (!finite.ok()) return finite;
    return absl::FailedPreconditionError(absl::StrCat(refusing, "rank ", world - static_cast<int>(flags.data<float>()[0]),
                                                      " found a non-finite value"));
  }
  const std::string id = absl::StrFormat("step%d-%06x", step, static_cast<std::uint32_t>(flags.data<float>()[1]));

  auto kill_after = [&](const char* file) {
    io::CheckpointWriteOptions w;
    if (o.kill_checkpoint_file == file) {
      w.fault_after_bytes = o.kill_checkpoint_bytes;
      w.fault = [] { ::raise(SIGKILL); };
    }
    return w;
  };
  const absl::Status wrote = io::write_shard(o.checkpoint_dir, id, rank, world, contents.pieces, kill_after("shard"));
  flags.data<float>()[0] = wrote.ok() ? 0.f : static_cast<float>(world - rank);
  if (absl::Status s = agree(pg, flags, "checkpoint written"); !s.ok()) return s;
  if (flags.data<float>()[0] > 0) {
    if (!wrote.ok()) return absl::Status(wrote.code(), absl::StrCat(cannot, wrote.message()));
    return absl::FailedPreconditionError(absl::StrCat(cannot, "rank ", world - static_cast<int>(flags.data<float>()[0]),
                                                      " could not write its checkpoint file"));
  }

  absl::Status committed;
  if (rank == 0) {
    meta.insert(contents.meta.begin(), contents.meta.end());
    committed = io::commit_checkpoint(o.checkpoint_dir, id, world, meta, kill_after("manifest"));
    if (committed.ok() && old_format_present(o.checkpoint_dir)) {
      // --overwrite of a directory in the old format: the new checkpoint replaces it.
      (void)::unlink(absl::StrCat(o.checkpoint_dir, "/", kOldCheckpointFile).c_str());
    }
  }
  flags.data<float>()[0] = committed.ok() ? 0.f : 1.f;
  if (absl::Status s = agree(pg, flags, "checkpoint committed"); !s.ok()) return s;
  if (flags.data<float>()[0] > 0) {
    if (!committed.ok()) return absl::Status(committed.code(), absl::StrCat(cannot, committed.message()));
    return absl::FailedPreconditionError(absl::StrCat(cannot, "rank 0 could not commit it"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Checkpoint> read_checkpoint(const std::string& dir) {
  absl::StatusOr<io::Manifest> m = io::read_manifest(dir);
  if (!m.ok()) {
    if (!absl::IsNotFound(m.status())) return m.status();
    if (old_format_present(dir)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot resume from '", dir, "/", kOldCheckpointFile, "': it is a checkpoint in the single-file format of "
          "earlier shardkit-train versions (SKCKPT01), which this version does not read; resume it with the "
          "shardkit-train that wrote it, or start a new run (--overwrite replaces it)"));
    }
    return absl::NotFoundError(absl::StrCat("cannot read checkpoint: no checkpoint in '", dir, "' (expected '",
                                            checkpoint_path(dir), "')"));
  }
  Checkpoint ck;
  ck.meta = m->meta;
  auto meta = [&](const std::string& k) -> std::string {
    auto it = ck.meta.find(k);
    return it == ck.meta.end() ? "" : it->second;
  };
  // The optimizer's groups and parameter indices (Note [parameter indices]) from the meta.
  optim::OptimizerStateDict& opt = ck.optimizer;
  opt.optimizer = meta("optim.name");
  std::size_t groups = 0;
  if (!absl::SimpleAtoi(meta("optim.groups"), &groups) || groups > 1024) return corrupt(dir, "missing or bad optim.groups");
  std::map<std::string, std::int64_t> index_of;
  for (std::size_t g = 0; g < groups; ++g) {
    optim::ParamGroupState pg;
    if (!parse_hyper(meta(absl::StrCat("optim.group.", g, ".hyper")), pg.hyper)) {
      return corrupt(dir, absl::StrCat("bad hyper-parameters of group ", g));
    }
    for (absl::string_view n : absl::StrSplit(meta(absl::StrCat("optim.group.", g, ".params")), ',', absl::SkipEmpty())) {
      const auto index = static_cast<std::int64_t>(index_of.size());
      if (!index_of.emplace(std::string(n), index).second) return corrupt(dir, absl::StrCat("parameter '", n, "' listed twice"));
      pg.params.push_back(index);
    }
    opt.param_groups.push_back(std::move(pg));
  }
  for (const io::TensorInfo& t : m->tensors) {
    absl::StatusOr<Tensor> value = io::read_tensor(dir, *m, t.name);
    if (!value.ok()) return value.status();
    if (t.name.rfind("model/", 0) == 0) {
      ck.model.emplace_back(t.name.substr(6), *value);
      continue;
    }
    const std::size_t slash = t.name.rfind('/');
    if (t.name.rfind("optim/", 0) != 0 || slash <= 6) return corrupt(dir, absl::StrCat("unexpected tensor '", t.name, "'"));
    const std::string param = t.name.substr(6, slash - 6), key = t.name.substr(slash + 1);
    auto it = index_of.find(param);
    if (it == index_of.end()) return corrupt(dir, absl::StrCat("tensor '", t.name, "' of a parameter no optimizer group lists"));
    optim::ParamState& st = opt.state[it->second];
    if (key == "step") {
      if (value->dtype() != DType::i64 || value->numel() != 1 || value->data<std::int64_t>()[0] < 0) {
        return corrupt(dir, absl::StrCat("expected '", t.name, "' a step count (i64 >= 0)"));
      }
      st.step = value->data<std::int64_t>()[0];
    } else {
      st.tensors[key] = *value;
    }
  }
  if (absl::Status s = check_finite(ck); !s.ok()) return corrupt(dir, std::string(s.message()));
  return ck;
}

}  // namespace shardkit::train
