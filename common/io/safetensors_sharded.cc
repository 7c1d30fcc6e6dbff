#include "common/io/safetensors_sharded.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/io/atomic_file.h"
#include "common/io/strict_json.h"
#include "nlohmann/json.hpp"

namespace shardkit::io {
namespace {

using nlohmann::json;

constexpr int kIndexMaxDepth = 4;

std::string DirectoryOf(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string JoinPath(const std::string& dir, const std::string& file) {
  if (dir.empty()) return file;
  return dir.back() == '/' ? dir + file : absl::StrCat(dir, "/", file);
}

std::string Describe(const SafetensorsTensorInfo& t) {
  return absl::StrCat(std::string(safetensors_dtype_name(t.dtype)), shape_str(t.shape));
}

bool PlainFileName(const std::string& f) {
  return !f.empty() && f != "." && f != ".." && f.find('/') == std::string::npos && f.find('\0') == std::string::npos;
}

}  // namespace

std::vector<int> assign_parts_by_bytes(absl::Span<const std::uint64_t> nbytes, int num_parts) {
  SK_CHECK_GE(num_parts, 1) << "assign_parts_by_bytes";
  std::vector<std::size_t> order(nbytes.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return nbytes[a] > nbytes[b]; });
  std::vector<std::uint64_t> load(static_cast<std::size_t>(num_parts), 0);
  std::vector<int> part(nbytes.size(), 0);
  for (std::size_t i : order) {
    const auto lightest = std::min_element(load.begin(), load.end());  // first minimum: the lowest part
    part[i] = static_cast<int>(lightest - load.begin());
    *lightest += nbytes[i];
  }
  return part;
}

std::string ShardedSafetensorsPlan::part_file(int p) const {
  return absl::StrFormat("%s-%05d-of-%05d.safetensors", stem, p + 1, num_parts);
}

std::string ShardedSafetensorsPlan::index_file() const { return absl::StrCat(stem, ".safetensors.index.json"); }

std::uint64_t ShardedSafetensorsPlan::total_bytes() const {
  std::uint64_t total = 0;
  for (const auto& t : tensors) total += t.nbytes();
  return total;
}

std::vector<SafetensorsTensorInfo> ShardedSafetensorsPlan::tensors_of(int p) const {
  std::vector<SafetensorsTensorInfo> out;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (part[i] == p) out.push_back(tensors[i]);
  }
  return out;
}

absl::StatusOr<ShardedSafetensorsPlan> plan_sharded_safetensors(std::vector<SafetensorsTensorInfo> tensors,
                                                                int num_parts, std::string stem) {
  if (num_parts < 1) return absl::InvalidArgumentError(absl::StrCat("expected at least 1 part, found ", num_parts));
  if (stem.empty() || !PlainFileName(stem)) {
    return absl::InvalidArgumentError(absl::StrCat("expected a file name stem without '/', found \"", stem, "\""));
  }
  absl::flat_hash_set<std::string> names;
  std::vector<std::uint64_t> nbytes;
  for (const auto& t : tensors) {
    if (t.name.empty()) return absl::InvalidArgumentError("expected non-empty tensor names, found \"\"");
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("expected unique tensor names, found '", t.name, "' twice"));
    }
    if (absl::StatusOr<std::int64_t> n = checked_numel(t.shape, t.dtype); !n.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': ", n.status().message()));
    }
    nbytes.push_back(t.nbytes());
  }
  ShardedSafetensorsPlan plan;
  plan.stem = std::move(stem);
  plan.num_parts = num_parts;
  plan.part = assign_parts_by_bytes(nbytes, num_parts);
  plan.tensors = std::move(tensors);
  return plan;
}

std::vector<SafetensorsTensorInfo> tensor_infos(const NamedTensors& tensors) {
  std::vector<SafetensorsTensorInfo> out;
  out.reserve(tensors.size());
  for (const auto& [name, t] : tensors) out.push_back(SafetensorsTensorInfo{name, t.dtype(), t.shape()});
  return out;
}

absl::Status write_safetensors_part(const std::string& dir, const ShardedSafetensorsPlan& plan, int p,
                                    const NamedTensors& tensors, const SafetensorsMetadata& metadata) {
  if (p < 0 || p >= plan.num_parts) {
    return absl::InvalidArgumentError(absl::StrCat("expected a part in [0, ", plan.num_parts, "), found ", p));
  }
  const std::string file = JoinPath(dir, plan.part_file(p));
  std::map<std::string, const SafetensorsTensorInfo*> expected;
  for (std::size_t i = 0; i < plan.tensors.size(); ++i) {
    if (plan.part[i] == p) expected.emplace(plan.tensors[i].name, &plan.tensors[i]);
  }
  for (const auto& [name, t] : tensors) {
    const auto it = expected.find(name);
    if (it == expected.end()) {
      return absl::InvalidArgumentError(absl::StrCat("writing '", file, "': tensor '", name, "' is not in part ", p,
                                                     " of the plan"));
    }
    const SafetensorsTensorInfo found{name, t.defined() ? t.dtype() : DType::f32, t.defined() ? t.shape() : Shape{}};
    if (!t.defined() || found.dtype != it->second->dtype || found.shape != it->second->shape) {
      return absl::InvalidArgumentError(absl::StrCat("writing '", file, "': tensor '", name, "': expected ",
                                                     Describe(*it->second), " (the plan), found ",
                                                     t.defined() ? Describe(found) : std::string("an undefined tensor")));
    }
  }
  if (tensors.size() != expected.size()) {
    absl::flat_hash_set<std::string> given;
    for (const auto& [name, t] : tensors) given.insert(name);
    for (const auto& [name, info] : expected) {
      if (!given.contains(name)) {
        return absl::InvalidArgumentError(absl::StrCat("writing '", file, "': expected tensor '", name, "' (part ", p,
                                                       " of the plan), found it missing"));
      }
    }
    return absl::InvalidArgumentError(absl::StrCat("writing '", file, "': expected ", expected.size(),
                                                   " tensors, found ", tensors.size(), " (a name given twice)"));
  }
  return write_safetensors(file, tensors, metadata);
}

absl::Status write_safetensors_index(const std::string& dir, const ShardedSafetensorsPlan& plan) {
  json weight_map = json::object();
  for (std::size_t i = 0; i < plan.tensors.size(); ++i) weight_map[plan.tensors[i].name] = plan.part_file(plan.part[i]);
  json index = {{"metadata", {{"total_size", plan.total_bytes()}}}, {"weight_map", std::move(weight_map)}};
  std::string text;
  try {
    text = index.dump(2) + "\n";
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("expected UTF-8 tensor names: ", e.what()));
  }
  const std::string path = JoinPath(dir, plan.index_file());
  absl::StatusOr<AtomicFileWriter> out = AtomicFileWriter::create(path);
  if (!out.ok()) return out.status();
  if (absl::Status s = out->write(text); !s.ok()) return s;
  return out->commit();
}

absl::Status write_sharded_safetensors(const std::string& dir, const ShardedSafetensorsPlan& plan, int rank,
                                       const NamedTensors& tensors, const SafetensorsMetadata& metadata) {
  if (absl::Status s = write_safetensors_part(dir, plan, rank, tensors, metadata); !s.ok()) return s;
  if (rank == 0) return write_safetensors_index(dir, plan);
  return absl::OkStatus();
}

absl::StatusOr<SafetensorsIndex> parse_safetensors_index(std::string_view text, const std::string& source) {
  auto error = [&](const auto&... parts) { return absl::DataLossError(absl::StrCat("'", source, "': ", parts...)); };
  if (absl::Status s = check_json_strict(text, absl::StrCat("'", source, "'"), kIndexMaxDepth); !s.ok()) return s;
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    return error("not valid JSON: ", e.what());
  }
  if (!root.is_object()) return error("expected a JSON object with \"weight_map\", found ", root.type_name());
  SafetensorsIndex index;
  if (const auto m = root.find("metadata"); m != root.end()) {
    if (!m->is_object()) return error("expected \"metadata\" to be an object, found ", m->type_name());
    for (const auto& [k, v] : m->items()) {
      if (k == "total_size") {
        if (!v.is_number_unsigned()) return error("expected \"total_size\" to be an integer >= 0, found ", v.dump());
        index.total_size = v.get<std::uint64_t>();
      } else {
        index.metadata.emplace(k, v.is_string() ? v.get<std::string>() : v.dump());
      }
    }
  }
  const auto wm = root.find("weight_map");
  if (wm == root.end()) return error("expected a \"weight_map\", found none");
  if (!wm->is_object()) return error("expected \"weight_map\" to be an object, found ", wm->type_name());
  for (const auto& [name, file] : wm->items()) {
    if (!file.is_string()) {
      return error("tensor '", name, "': expected a part file name, found ", file.dump());
    }
    const std::string f = file.get<std::string>();
    if (!PlainFileName(f)) {
      return error("tensor '", name, "': expected a plain file name in the index's directory, found \"", f, "\"");
    }
    index.weight_map.emplace_back(name, f);  // json objects iterate in key order: sorted by name
  }
  return index;
}

absl::StatusOr<ShardedSafetensors> ShardedSafetensors::open(const std::string& index_path,
                                                            const SafetensorsReadOptions& options) {
  absl::StatusOr<MappedFile> map = MappedFile::open(index_path);
  if (!map.ok()) return map.status();
  if (map->size() > options.max_header_bytes) {
    return absl::DataLossError(absl::StrCat("'", index_path, "': expected an index of at most ",
                                            options.max_header_bytes, " bytes, found ", map->size()));
  }
  const std::string_view text(reinterpret_cast<const char*>(map->bytes().data()), map->size());
  absl::StatusOr<SafetensorsIndex> index = parse_safetensors_index(text, index_path);
  if (!index.ok()) return index.status();

  ShardedSafetensors out;
  out.index_path_ = index_path;
  out.index_ = *std::move(index);
  std::map<std::string, std::size_t> part_of_file;  // file name -> position in parts_
  for (const auto& [name, file] : out.index_.weight_map) part_of_file.emplace(file, 0);
  const std::string dir = DirectoryOf(index_path);
  for (auto& [file, pos] : part_of_file) {
    absl::StatusOr<SafetensorsFile> part = SafetensorsFile::open(JoinPath(dir, file), options);
    if (!part.ok()) {
      return absl::Status(part.status().code(),
                          absl::StrCat("index '", index_path, "' names part '", file, "': ", part.status().message()));
    }
    pos = out.parts_.size();
    out.parts_.push_back(*std::move(part));
  }
  // Every mapped tensor is in its part; every tensor of a part is mapped to it.
  absl::flat_hash_map<std::string, std::string> file_of;
  for (const auto& [name, file] : out.index_.weight_map) {
    const SafetensorsFile& part = out.parts_[part_of_file[file]];
    const SafetensorsEntry* e = part.find(name);
    if (e == nullptr) {
      return absl::DataLossError(absl::StrCat("'", index_path, "': tensor '", name, "': expected it in part '", file,
                                              "', found no such tensor there"));
    }
    out.entries_.push_back(e);
    out.by_name_.emplace(name, e);
    file_of.emplace(name, file);
  }
  for (const auto& [file, pos] : part_of_file) {
    for (const SafetensorsEntry& e : out.parts_[pos].entries()) {
      const auto it = file_of.find(e.info.name);
      if (it == file_of.end() || it->second != file) {
        return absl::DataLossError(absl::StrCat(
            "'", index_path, "': part '", file, "' holds tensor '", e.info.name, "', which the index ",
            it == file_of.end() ? std::string("does not list") : absl::StrCat("maps to '", it->second, "'")));
      }
    }
  }
  return out;
}

const SafetensorsEntry* ShardedSafetensors::find(std::string_view name) const {
  const auto it = by_name_.find(absl::string_view(name.data(), name.size()));
  return it == by_name_.end() ? nullptr : it->second;
}

absl::StatusOr<Tensor> ShardedSafetensors::tensor(std::string_view name, std::optional<MemoryCategory> category) const {
  const SafetensorsEntry* e = find(name);
  if (e == nullptr) {
    return absl::NotFoundError(absl::StrCat("'", index_path_, "' has no tensor '", std::string(name), "'"));
  }
  return tensor_from_entry(*e, category);
}

NamedTensors ShardedSafetensors::tensors(std::optional<MemoryCategory> category) const {
  NamedTensors out;
  out.reserve(entries_.size());
  for (const SafetensorsEntry* e : entries_) out.emplace_back(e->info.name, tensor_from_entry(*e, category));
  return out;
}

absl::StatusOr<NamedTensors> read_safetensors_tensors(const std::string& path, const SafetensorsReadOptions& options) {
  if (absl::EndsWith(path, ".json")) {
    absl::StatusOr<ShardedSafetensors> model = ShardedSafetensors::open(path, options);
    if (!model.ok()) return model.status();
    return model->tensors();
  }
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::open(path, options);
  if (!file.ok()) return file.status();
  return file->tensors();
}

}  // namespace shardkit::io
