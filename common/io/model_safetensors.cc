#include "common/io/model_safetensors.h"

#include <filesystem>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace shardkit::io {
namespace {

std::vector<std::string> NamesOf(const NamedTensors& tensors) {
  std::vector<std::string> out;
  out.reserve(tensors.size());
  for (const auto& [name, t] : tensors) out.push_back(name);
  return out;
}

std::vector<std::string> NamesOf(const std::vector<SafetensorsTensorInfo>& infos) {
  std::vector<std::string> out;
  out.reserve(infos.size());
  for (const auto& t : infos) out.push_back(t.name);
  return out;
}

// Each name to itself: shardkit's own names.
NameMap Identity(const std::vector<std::string>& names) {
  NameMap map;
  map.entries.reserve(names.size());
  for (const std::string& n : names) map.entries.push_back({n, n, false, ""});
  return map;
}

absl::Status WithPath(const absl::Status& s, const std::string& path) {
  if (s.ok() || absl::StrContains(s.message(), path)) return s;
  return absl::Status(s.code(), absl::StrCat("'", path, "': ", s.message()));
}

}  // namespace

TensorNames TensorNames::shardkit() { return TensorNames(); }

TensorNames TensorNames::gpt2(const nn::GPTConfig& config, Gpt2NameOptions options) {
  TensorNames n;
  n.kind_ = Kind::gpt2;
  n.config_ = config;
  n.gpt2_options_ = std::move(options);
  return n;
}

TensorNames TensorNames::custom(NameMap map) {
  TensorNames n;
  n.kind_ = Kind::custom;
  n.map_ = std::move(map);
  return n;
}

NameMap TensorNames::for_writing(const std::vector<std::string>& internal) const {
  switch (kind_) {
    case Kind::shardkit: return Identity(internal);
    case Kind::gpt2: return gpt2_name_map(config_, gpt2_options_);
    case Kind::custom: return map_;
  }
  return map_;
}

absl::StatusOr<NameMap> TensorNames::for_reading(const std::vector<std::string>& external) const {
  switch (kind_) {
    case Kind::shardkit: return Identity(external);
    case Kind::gpt2: {
      absl::StatusOr<std::string> prefix = detect_gpt2_prefix(external);
      if (!prefix.ok()) return prefix.status();
      return gpt2_name_map(config_, Gpt2NameOptions{.prefix = *prefix});
    }
    case Kind::custom: return map_;
  }
  return map_;
}

std::string TensorNames::describe() const {
  switch (kind_) {
    case Kind::shardkit: return "shardkit names";
    case Kind::gpt2: return "GPT-2 names";
    case Kind::custom: return "a custom name map";
  }
  return "?";
}

absl::StatusOr<NamedTensors> external_tensors(const NamedTensors& state, const ModelExportOptions& options) {
  return to_external(state, options.names.for_writing(NamesOf(state)));
}

absl::Status export_safetensors(const NamedTensors& state, const std::string& path, const ModelExportOptions& options) {
  absl::StatusOr<NamedTensors> out = external_tensors(state, options);
  if (!out.ok()) return WithPath(out.status(), path);
  return write_safetensors(path, *out, options.metadata);
}

absl::Status export_safetensors(const nn::Module& model, const std::string& path, const ModelExportOptions& options) {
  return export_safetensors(model.state_dict(), path, options);
}

absl::StatusOr<ShardedSafetensorsPlan> plan_model_export(const std::vector<SafetensorsTensorInfo>& internal,
                                                         int num_parts, const ModelExportOptions& options) {
  absl::StatusOr<std::vector<SafetensorsTensorInfo>> external =
      to_external_infos(internal, options.names.for_writing(NamesOf(internal)));
  if (!external.ok()) return external.status();
  return plan_sharded_safetensors(*std::move(external), num_parts, options.stem);
}

absl::Status export_sharded_safetensors(const NamedTensors& state, const std::string& dir, int rank, int world,
                                        const ModelExportOptions& options) {
  if (rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(absl::StrCat("expected a rank in [0, ", world, "), found ", rank));
  }
  absl::StatusOr<ShardedSafetensorsPlan> plan = plan_model_export(tensor_infos(state), world, options);
  if (!plan.ok()) return plan.status();
  // Only this rank's tensors are transposed (copied): the others are never touched.
  absl::flat_hash_set<std::string> mine;
  for (std::size_t i = 0; i < plan->tensors.size(); ++i) {
    if (plan->part[i] == rank) mine.insert(plan->tensors[i].name);
  }
  const NameMap map = options.names.for_writing(NamesOf(state));
  absl::flat_hash_map<std::string, const NameMapEntry*> by_internal;
  for (const NameMapEntry& e : map.entries) by_internal.emplace(e.internal, &e);
  NamedTensors subset;
  for (const auto& [name, t] : state) {
    const auto it = by_internal.find(name);  // present: plan_model_export checked every name
    if (it != by_internal.end() && it->second->tied_to.empty() && mine.contains(it->second->external)) {
      subset.emplace_back(name, t);
    }
  }
  absl::StatusOr<NamedTensors> out = to_external(subset, map);
  if (!out.ok()) return out.status();
  return write_sharded_safetensors(dir, *plan, rank, *out, options.metadata);
}

absl::StatusOr<SafetensorsModel> SafetensorsModel::open(const std::string& path, const SafetensorsReadOptions& options) {
  SafetensorsModel m;
  m.path_ = path;
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    const std::filesystem::path dir(path);
    const std::filesystem::path index = dir / "model.safetensors.index.json";
    m.path_ = (std::filesystem::exists(index, ec) ? index : dir / "model.safetensors").string();
  }
  if (absl::EndsWith(m.path_, ".json")) {
    absl::StatusOr<ShardedSafetensors> s = ShardedSafetensors::open(m.path_, options);
    if (!s.ok()) return s.status();
    m.sharded_.emplace(*std::move(s));
    m.entries_ = m.sharded_->entries();
  } else {
    absl::StatusOr<SafetensorsFile> f = SafetensorsFile::open(m.path_, options);
    if (!f.ok()) return f.status();
    m.file_.emplace(*std::move(f));
    for (const SafetensorsEntry& e : m.file_->entries()) m.entries_.push_back(&e);
  }
  return m;
}

const SafetensorsEntry* SafetensorsModel::find(std::string_view name) const {
  return sharded_ ? sharded_->find(name) : file_->find(name);
}

std::vector<std::string> SafetensorsModel::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const SafetensorsEntry* e : entries_) out.push_back(e->info.name);
  return out;
}

std::vector<SafetensorsTensorInfo> SafetensorsModel::infos() const {
  std::vector<SafetensorsTensorInfo> out;
  out.reserve(entries_.size());
  for (const SafetensorsEntry* e : entries_) out.push_back(e->info);
  return out;
}

absl::StatusOr<NamedTensors> import_safetensors(const std::string& path, const TensorNames& names,
                                                MemoryCategory category) {
  absl::StatusOr<SafetensorsModel> model = SafetensorsModel::open(path);
  if (!model.ok()) return model.status();
  absl::StatusOr<NameMap> map = names.for_reading(model->names());
  if (!map.ok()) return WithPath(map.status(), model->path());
  // Ignored tensors (GPT-2's attention masks: context² each) are named to to_internal but not copied.
  const absl::flat_hash_set<std::string> ignored(map->ignored_external.begin(), map->ignored_external.end());
  NamedTensors file;
  file.reserve(model->entries().size());
  for (const SafetensorsEntry* e : model->entries()) {
    file.emplace_back(e->info.name, ignored.contains(e->info.name) ? Tensor() : tensor_from_entry(*e, category));
  }
  absl::StatusOr<NamedTensors> state = to_internal(file, *map);
  if (!state.ok()) return WithPath(state.status(), model->path());
  return state;
}

absl::Status load_safetensors(nn::Module& model, const std::string& path, const TensorNames& names, bool strict) {
  absl::StatusOr<NamedTensors> state = import_safetensors(path, names);
  if (!state.ok()) return state.status();
  return WithPath(model.load_state_dict(*state, strict), path);
}

}  // namespace shardkit::io
