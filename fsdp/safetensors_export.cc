#include "fsdp/safetensors_export.h"

#include <cstring>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/tensor/rank_context.h"
#include "fsdp/fsdp_param.h"
#include "fsdp/fully_shard.h"
#include "fsdp/param_group.h"
#include "fsdp/same_values.h"
#include "fsdp/state.h"

namespace shardkit::fsdp {
namespace {

// One tensor of root's full state, as this rank holds it.
struct Source {
  std::string name;                  // its state_dict() name
  Tensor live;                       // the module's tensor at rest: whole, or this rank's rows of `param`
  const FSDPParam* param = nullptr;  // set for a sharded parameter
  Shape global_shape;
};

// root.state_dict()'s names, in its order (every name of a shared parameter, then the buffers). Root at rest.
std::vector<Source> FullStateSources(nn::Module& root) {
  std::map<const TensorImpl*, const FSDPParam*> by_shard;
  for (const auto& [unused, m] : root.named_modules()) {
    const FSDPState* s = state_attached(*m);
    if (s == nullptr || s->param_group() == nullptr) continue;
    for (const FSDPParam& p : s->param_group()->params()) by_shard[p.sharded.id()] = &p;
  }
  std::vector<Source> out;
  for (const auto& [name, t] : root.named_parameters({.recurse = true, .remove_duplicate = false})) {
    const auto it = by_shard.find(t.id());
    const FSDPParam* p = it == by_shard.end() ? nullptr : it->second;
    out.push_back({name, t, p, p != nullptr ? p->global_shape : t.shape()});
  }
  for (const auto& [name, t] : root.named_buffers()) out.push_back({name, t, nullptr, t.shape()});
  return out;
}

// Root resharded (values written while summoned are kept), and its group.
absl::StatusOr<comm::ProcessGroup*> AtRest(nn::Module& root) {
  absl::StatusOr<FSDPModule> unit = state_of(root);
  if (!unit.ok()) return unit.status();
  if (absl::Status s = unit->reshard(/*recurse=*/true); !s.ok()) return s;
  return &unit->state().process_group();
}

// Note [same values on every rank] in same_values.cc: an export of a model whose ranks sharded other values would
// write a mixed model.
absl::Status SameValues(nn::Module& root) {
  absl::StatusOr<FSDPModule> unit = state_of(root);
  if (!unit.ok()) return unit.status();
  return values_differ(root, unit->state().subtree_states());
}

// What an export writes: each tensor of the plan with the source it comes from and its map entry.
struct ExportPlan {
  std::vector<Source> sources;
  io::NameMap map;
  io::ShardedSafetensorsPlan plan;
  std::vector<std::pair<const Source*, const io::NameMapEntry*>> written;  // plan order
};

absl::StatusOr<ExportPlan> PlanExport(nn::Module& root, int num_parts, const io::ModelExportOptions& options) {
  ExportPlan e;
  e.sources = FullStateSources(root);
  std::vector<io::SafetensorsTensorInfo> internal;
  std::vector<std::string> names;
  for (const Source& s : e.sources) {
    internal.push_back({s.name, s.live.dtype(), s.global_shape});
    names.push_back(s.name);
  }
  absl::StatusOr<io::ShardedSafetensorsPlan> plan = io::plan_model_export(internal, num_parts, options);
  if (!plan.ok()) return plan.status();  // also: every name has an entry, transposed tensors are 2-D
  e.plan = *std::move(plan);
  e.map = options.names.for_writing(names);
  absl::flat_hash_map<std::string_view, const io::NameMapEntry*> by_internal;
  for (const io::NameMapEntry& entry : e.map.entries) by_internal.emplace(entry.internal, &entry);
  for (const Source& s : e.sources) {
    const io::NameMapEntry* entry = by_internal.at(s.name);
    if (entry->tied_to.empty()) e.written.emplace_back(&s, entry);  // to_external_infos' order
  }
  SK_CHECK_EQ(e.written.size(), e.plan.tensors.size()) << "fsdp safetensors export plan";
  return e;
}

// The whole tensor `s` on rank `owner`, undefined elsewhere: each other rank that holds rows of it sends them
// (Note [sharded export without gathering]). A whole tensor is the owner's own copy.
absl::StatusOr<Tensor> GatherTo(const Source& s, int owner, comm::ProcessGroup& pg) {
  const int rank = pg.rank(), world = pg.size();
  if (s.param == nullptr) return rank == owner ? s.live : Tensor();
  const std::string tag = absl::StrCat("safetensors export ", s.name);
  const RowSplit mine = s.param->split;
  if (rank != owner) {
    if (mine.local_rows * mine.row_numel > 0) {
      if (absl::Status st = pg.send(s.param->sharded.flatten(), owner, {.tag = tag})->wait(); !st.ok()) return st;
    }
    return Tensor();
  }
  const Tensor full =
      Tensor::empty(s.global_shape, TensorOptions{}.with_dtype(s.live.dtype()).with_category(MemoryCategory::other));
  const Tensor flat = full.reshape({full.numel()});
  for (int r = 0; r < world; ++r) {
    const RowSplit rs = split_rows(s.global_shape, r, world);
    if (rs.local_rows * rs.row_numel == 0) continue;
    const Tensor rows = flat.view(rs.row_offset * rs.row_numel, {rs.local_rows * rs.row_numel});
    if (r == rank) {
      rows.copy_(s.param->sharded.flatten());
    } else if (absl::Status st = pg.recv(rows, r, {.tag = tag})->wait(); !st.ok()) {
      return st;
    }
  }
  return full;
}

// The tensors this rank writes (file names, file layout): tensor k goes to rank owner[k].
absl::StatusOr<io::NamedTensors> CollectMine(const ExportPlan& e, const std::vector<int>& owner, comm::ProcessGroup& pg) {
  MemoryCategoryScope other(MemoryCategory::other);  // transposed copies too
  io::NamedTensors mine;
  for (std::size_t k = 0; k < e.written.size(); ++k) {
    const auto& [source, entry] = e.written[k];
    absl::StatusOr<Tensor> full = GatherTo(*source, owner[k], pg);
    if (!full.ok()) return full.status();
    if (owner[k] != pg.rank()) continue;
    mine.emplace_back(entry->external, entry->transpose ? io::transpose_2d(*full) : *full);
  }
  return mine;
}

absl::Status Barrier(comm::ProcessGroup& pg) { return pg.barrier({.tag = "safetensors export written"})->wait(); }

// ---- loading ------------------------------------------------------------------------------------------------

// Where one model tensor's values are in the file.
struct LoadItem {
  const Source* target;
  const io::SafetensorsEntry* entry;
  bool transpose;
};

std::string Described(const io::SafetensorsTensorInfo& t) {
  return absl::StrCat(std::string(io::safetensors_dtype_name(t.dtype)), shape_str(t.shape));
}

template <std::size_t kSize>
void CopyColumns(const std::byte* in, std::byte* out, std::int64_t f1, std::int64_t col0, std::int64_t cols,
                 std::int64_t f0) {
  for (std::int64_t i = 0; i < cols; ++i) {
    for (std::int64_t j = 0; j < f0; ++j) {
      std::memcpy(out + static_cast<std::size_t>(i * f0 + j) * kSize, in + static_cast<std::size_t>(j * f1 + col0 + i) * kSize,
                  kSize);
    }
  }
}

// Copies this rank's rows of `item.target` out of the file's bytes (columns of the file's tensor when it is
// transposed), converting dtype.
void CopyRows(const LoadItem& item) {
  const Source& s = *item.target;
  const Tensor dst = s.param != nullptr ? s.param->sharded : s.live;
  if (dst.numel() == 0) return;
  const RowSplit rs = s.param != nullptr ? s.param->split : split_rows(s.global_shape, 0, 1);
  const io::SafetensorsTensorInfo& info = item.entry->info;
  const std::size_t es = dtype_size(info.dtype);
  const Tensor tmp = Tensor::empty({dst.numel()}, TensorOptions{}.with_dtype(info.dtype).with_category(MemoryCategory::other));
  auto* out = static_cast<std::byte*>(tmp.raw_data());
  const std::byte* in = item.entry->bytes.data();
  if (!item.transpose) {
    std::memcpy(out, in + static_cast<std::size_t>(rs.row_offset * rs.row_numel) * es, tmp.nbytes());
  } else {
    // The file holds [f0, f1] = the model's tensor transposed: the model's row i is the file's column i.
    const std::int64_t f0 = info.shape[0], f1 = info.shape[1];
    switch (es) {
      case 2: CopyColumns<2>(in, out, f1, rs.row_offset, rs.local_rows, f0); break;
      case 4: CopyColumns<4>(in, out, f1, rs.row_offset, rs.local_rows, f0); break;
      case 8: CopyColumns<8>(in, out, f1, rs.row_offset, rs.local_rows, f0); break;
      default: SK_CHECK(false) << "element size " << es;
    }
  }
  dst.copy_(tmp);
}

// Every check of to_internal and nn::Module::load_state_dict, against the global shapes: the same on every rank.
absl::StatusOr<std::vector<LoadItem>> PlanLoad(const io::SafetensorsModel& file, const io::NameMap& map,
                                               const std::vector<Source>& sources, bool strict) {
  auto error = [&](const auto&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("'", file.path(), "': ", parts...));
  };
  if (absl::Status s = io::validate_name_map(map); !s.ok()) return error(s.message());
  absl::flat_hash_map<std::string_view, const io::NameMapEntry*> by_internal, by_external;
  for (const io::NameMapEntry& e : map.entries) {
    by_internal.emplace(e.internal, &e);
    by_external.emplace(e.external, &e);
  }
  const absl::flat_hash_set<std::string_view> ignored(map.ignored_external.begin(), map.ignored_external.end());
  for (const io::SafetensorsEntry* e : file.entries()) {
    if (!by_external.contains(e->info.name) && !ignored.contains(e->info.name)) {
      return error("importing tensor '", e->info.name, "': expected every tensor of the file to have an entry in the ",
                   "name map (or to be ignored), found none for it");
    }
  }
  for (const io::NameMapEntry& e : map.entries) {
    if (!e.tied_to.empty()) continue;
    if (file.find(e.external) == nullptr) {
      return error("importing: expected tensor '", e.external, "' (for '", e.internal, "'), found it missing from the file");
    }
  }
  absl::flat_hash_set<std::string_view> model_names;
  std::vector<LoadItem> items;
  for (const Source& s : sources) {
    model_names.insert(s.name);
    const auto it = by_internal.find(s.name);
    if (it == by_internal.end()) {
      if (!strict) continue;
      return error("model tensor '", s.name, "': expected the name map to name it, found no entry (missing from the file)");
    }
    const io::NameMapEntry* e = it->second;
    const io::NameMapEntry* source = e->tied_to.empty() ? e : by_internal.at(e->tied_to);
    const io::SafetensorsEntry* entry = file.find(source->external);
    if (source != e) {
      // A tied name carried by the file must hold its target's values (shardkit keeps one tensor there).
      if (const io::SafetensorsEntry* also = file.find(e->external); also != nullptr) {
        const bool same = also->info.dtype == entry->info.dtype && also->info.shape == entry->info.shape &&
                          (also->bytes.empty() || std::memcmp(also->bytes.data(), entry->bytes.data(), also->bytes.size()) == 0);
        if (!same) {
          return error("importing tensor '", e->external, "': expected the same values as '", source->external,
                       "' (shardkit ties '", e->internal, "' to '", e->tied_to, "'), found ", Described(also->info),
                       " with different values");
        }
      }
    }
    Shape want = s.global_shape;
    if (source->transpose) {
      if (entry->info.shape.size() != 2 || want.size() != 2) {
        return error("importing tensor '", source->external, "': expected a 2-D tensor to transpose (for '", s.name,
                     "' ", shape_str(s.global_shape), "), found ", Described(entry->info));
      }
      std::swap(want[0], want[1]);
    }
    if (entry->info.shape != want) {
      return error("tensor '", source->external, "' (for '", s.name, "'): expected shape ", shape_str(want),
                   source->transpose ? " (the model's transposed)" : "", ", found ", Described(entry->info));
    }
    items.push_back({&s, entry, source->transpose});
  }
  if (strict) {
    for (const io::NameMapEntry& e : map.entries) {
      if (!model_names.contains(e.internal)) {
        return error("importing tensor '", e.external, "': expected the model to have '", e.internal,
                     "', found no such tensor");
      }
    }
  }
  return items;
}

}  // namespace

absl::Status export_sharded_safetensors(nn::Module& root, const std::string& dir, const io::ModelExportOptions& options) {
  if (absl::Status s = SameValues(root); !s.ok()) return s;
  absl::StatusOr<comm::ProcessGroup*> pg = AtRest(root);
  if (!pg.ok()) return pg.status();
  absl::StatusOr<ExportPlan> e = PlanExport(root, (*pg)->size(), options);
  if (!e.ok()) return e.status();
  absl::StatusOr<io::NamedTensors> mine = CollectMine(*e, e->plan.part, **pg);
  if (!mine.ok()) return mine.status();
  if (absl::Status s = io::write_sharded_safetensors(dir, e->plan, (*pg)->rank(), *mine, options.metadata); !s.ok()) {
    return s;
  }
  mine->clear();
  return Barrier(**pg);
}

absl::Status export_single_safetensors(nn::Module& root, const std::string& path, const io::ModelExportOptions& options) {
  if (absl::Status s = SameValues(root); !s.ok()) return s;
  absl::StatusOr<comm::ProcessGroup*> pg = AtRest(root);
  if (!pg.ok()) return pg.status();
  absl::StatusOr<ExportPlan> e = PlanExport(root, 1, options);
  if (!e.ok()) return e.status();
  absl::StatusOr<io::NamedTensors> mine = CollectMine(*e, std::vector<int>(e->written.size(), 0), **pg);
  if (!mine.ok()) return mine.status();
  if ((*pg)->rank() == 0) {
    if (absl::Status s = io::write_safetensors(path, *mine, options.metadata); !s.ok()) return s;
  }
  mine->clear();
  return Barrier(**pg);
}

absl::Status load_safetensors_rows(nn::Module& root, const std::string& path, const io::TensorNames& names, bool strict) {
  if (absl::StatusOr<comm::ProcessGroup*> pg = AtRest(root); !pg.ok()) return pg.status();
  absl::StatusOr<io::SafetensorsModel> file = io::SafetensorsModel::open(path);
  if (!file.ok()) return file.status();
  absl::StatusOr<io::NameMap> map = names.for_reading(file->names());
  if (!map.ok()) {
    return absl::Status(map.status().code(), absl::StrCat("'", file->path(), "': ", map.status().message()));
  }
  const std::vector<Source> sources = FullStateSources(root);
  absl::StatusOr<std::vector<LoadItem>> items = PlanLoad(*file, *map, sources, strict);
  if (!items.ok()) return items.status();
  std::set<const TensorImpl*> written;
  for (const LoadItem& item : *items) {
    CopyRows(item);
    written.insert(item.target->live.id());
  }
  // Note [same values on every rank] in same_values.cc: one file's values, the same on every rank.
  for (FSDPState* s : state_of(root)->state().subtree_states()) s->forget_value_mismatches(written);
  return absl::OkStatus();
}

}  // namespace shardkit::fsdp
