#include "common/io/name_map.h"

#include <cstring>
#include <map>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/io/strict_json.h"
#include "nlohmann/json.hpp"

namespace shardkit::io {
namespace {

template <typename T>
void TransposeLoop(const T* __restrict in, T* __restrict out, std::int64_t rows, std::int64_t cols) {
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = 0; j < cols; ++j) out[j * rows + i] = in[i * cols + j];
  }
}

std::string EntryStr(const NameMapEntry& e) { return absl::StrCat("'", e.internal, "' <-> '", e.external, "'"); }

absl::StatusOr<Tensor> Oriented(const Tensor& t, const NameMapEntry& e, std::string_view direction) {
  if (!e.transpose) return t;
  if (t.dim() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(direction), " tensor '",
                                                   direction == "exporting" ? e.internal : e.external,
                                                   "': expected a 2-D tensor to transpose (map entry ", EntryStr(e),
                                                   "), found ", t.describe()));
  }
  return transpose_2d(t);
}

bool SameValues(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         (a.nbytes() == 0 || std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0);
}

// Lookup by name for the bulk functions (NameMap::find_* are linear: fine for one name, not for a model).
absl::flat_hash_map<std::string_view, const NameMapEntry*> ByInternal(const NameMap& map) {
  absl::flat_hash_map<std::string_view, const NameMapEntry*> out;
  for (const NameMapEntry& e : map.entries) out.emplace(e.internal, &e);
  return out;
}

absl::flat_hash_map<std::string_view, const NameMapEntry*> ByExternal(const NameMap& map) {
  absl::flat_hash_map<std::string_view, const NameMapEntry*> out;
  for (const NameMapEntry& e : map.entries) out.emplace(e.external, &e);
  return out;
}

const NameMapEntry* Lookup(const absl::flat_hash_map<std::string_view, const NameMapEntry*>& index,
                           const std::string& name) {
  const auto it = index.find(std::string_view(name));
  return it == index.end() ? nullptr : it->second;
}

}  // namespace

const NameMapEntry* NameMap::find_internal(std::string_view internal) const {
  for (const NameMapEntry& e : entries) {
    if (e.internal == internal) return &e;
  }
  return nullptr;
}

const NameMapEntry* NameMap::find_external(std::string_view external) const {
  for (const NameMapEntry& e : entries) {
    if (e.external == external) return &e;
  }
  return nullptr;
}

absl::Status validate_name_map(const NameMap& map) {
  absl::flat_hash_map<std::string, const NameMapEntry*> internal, external;
  for (const NameMapEntry& e : map.entries) {
    if (e.internal.empty() || e.external.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("name map entry ", EntryStr(e), ": expected non-empty names"));
    }
    if (!internal.emplace(e.internal, &e).second) {
      return absl::InvalidArgumentError(absl::StrCat("name map: internal name '", e.internal, "' appears twice"));
    }
    if (!external.emplace(e.external, &e).second) {
      return absl::InvalidArgumentError(absl::StrCat("name map: external name '", e.external, "' appears twice"));
    }
  }
  for (const NameMapEntry& e : map.entries) {
    if (e.tied_to.empty()) continue;
    const auto it = internal.find(e.tied_to);
    if (it == internal.end() || !it->second->tied_to.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("name map entry ", EntryStr(e), ": expected tied_to '", e.tied_to,
                                                     "' to name an entry that is not tied itself"));
    }
    if (e.transpose) {
      return absl::InvalidArgumentError(
          absl::StrCat("name map entry ", EntryStr(e), ": a tied entry cannot transpose (it is not written)"));
    }
  }
  return absl::OkStatus();
}

Tensor transpose_2d(const Tensor& t) {
  SK_CHECK_EQ(t.dim(), 2) << "transpose_2d of " << t.describe();
  const std::int64_t rows = t.size(0), cols = t.size(1);
  TensorOptions options;
  options.dtype = t.dtype();
  Tensor out = Tensor::empty({cols, rows}, options);
  if (out.numel() == 0) return out;
  switch (dtype_size(t.dtype())) {
    case 2: TransposeLoop(t.data<std::uint16_t>(), out.data<std::uint16_t>(), rows, cols); break;
    case 4: TransposeLoop(t.data<std::uint32_t>(), out.data<std::uint32_t>(), rows, cols); break;
    case 8: TransposeLoop(t.data<std::uint64_t>(), out.data<std::uint64_t>(), rows, cols); break;
    default: SK_CHECK(false) << "transpose_2d: element size " << dtype_size(t.dtype());
  }
  return out;
}

absl::StatusOr<NamedTensors> to_external(const NamedTensors& internal, const NameMap& map) {
  if (absl::Status s = validate_name_map(map); !s.ok()) return s;
  const auto by_internal = ByInternal(map);
  NamedTensors out;
  for (const auto& [name, t] : internal) {
    const NameMapEntry* e = Lookup(by_internal, name);
    if (e == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("exporting tensor '", name, "': expected an entry for it in the name map, found none"));
    }
    if (!e->tied_to.empty()) continue;
    absl::StatusOr<Tensor> o = Oriented(t, *e, "exporting");
    if (!o.ok()) return o.status();
    out.emplace_back(e->external, *std::move(o));
  }
  return out;
}

absl::StatusOr<std::vector<SafetensorsTensorInfo>> to_external_infos(const std::vector<SafetensorsTensorInfo>& internal,
                                                                     const NameMap& map) {
  if (absl::Status s = validate_name_map(map); !s.ok()) return s;
  const auto by_internal = ByInternal(map);
  std::vector<SafetensorsTensorInfo> out;
  for (const SafetensorsTensorInfo& t : internal) {
    const NameMapEntry* e = Lookup(by_internal, t.name);
    if (e == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("exporting tensor '", t.name, "': expected an entry for it in the name map, found none"));
    }
    if (!e->tied_to.empty()) continue;
    SafetensorsTensorInfo x{e->external, t.dtype, t.shape};
    if (e->transpose) {
      if (x.shape.size() != 2) {
        return absl::InvalidArgumentError(absl::StrCat("exporting tensor '", t.name,
                                                       "': expected a 2-D tensor to transpose (map entry ", EntryStr(*e),
                                                       "), found shape ", shape_str(t.shape)));
      }
      std::swap(x.shape[0], x.shape[1]);
    }
    out.push_back(std::move(x));
  }
  return out;
}

absl::StatusOr<NamedTensors> to_internal(const NamedTensors& external, const NameMap& map) {
  if (absl::Status s = validate_name_map(map); !s.ok()) return s;
  const absl::flat_hash_set<std::string> ignored(map.ignored_external.begin(), map.ignored_external.end());
  const auto by_external = ByExternal(map);
  absl::flat_hash_map<std::string, const Tensor*> file;
  for (const auto& [name, t] : external) {
    if (!file.emplace(name, &t).second) {
      return absl::InvalidArgumentError(absl::StrCat("importing: tensor '", name, "' appears twice"));
    }
    if (Lookup(by_external, name) == nullptr && !ignored.contains(name)) {
      return absl::InvalidArgumentError(absl::StrCat("importing tensor '", name,
                                                     "': expected every tensor of the file to have an entry in the "
                                                     "name map (or to be ignored), found none for it"));
    }
  }
  std::map<std::string, Tensor> value;  // internal name -> tensor (untied entries)
  for (const NameMapEntry& e : map.entries) {
    if (!e.tied_to.empty()) continue;
    const auto it = file.find(e.external);
    if (it == file.end()) {
      return absl::InvalidArgumentError(absl::StrCat("importing: expected tensor '", e.external, "' (for '", e.internal,
                                                     "'), found it missing from the file"));
    }
    absl::StatusOr<Tensor> o = Oriented(*it->second, e, "importing");
    if (!o.ok()) return o.status();
    value.emplace(e.internal, *std::move(o));
  }
  NamedTensors out;
  for (const NameMapEntry& e : map.entries) {
    if (e.tied_to.empty()) {
      out.emplace_back(e.internal, value.at(e.internal));
      continue;
    }
    const Tensor& target = value.at(e.tied_to);
    if (const auto it = file.find(e.external); it != file.end() && !SameValues(*it->second, target)) {
      const NameMapEntry* t = Lookup(ByInternal(map), e.tied_to);
      return absl::InvalidArgumentError(absl::StrCat(
          "importing tensor '", e.external, "': expected the same values as '", t->external, "' (shardkit ties '",
          e.internal, "' to '", e.tied_to, "'), found ", it->second->describe(), " with different values"));
    }
    out.emplace_back(e.internal, target);
  }
  return out;
}

absl::StatusOr<NameMap> parse_name_map_json(std::string_view text, const std::string& source) {
  using nlohmann::json;
  auto error = [&](const auto&... parts) { return absl::DataLossError(absl::StrCat("'", source, "': ", parts...)); };
  if (absl::Status s = check_json_strict(text, absl::StrCat("'", source, "'"), 3); !s.ok()) return s;
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    return error("not valid JSON: ", e.what());
  }
  if (!root.is_object()) return error("expected an object with \"entries\", found ", root.type_name());
  NameMap map;
  for (const auto& [key, value] : root.items()) {
    if (key == "entries") {
      if (!value.is_array()) return error("expected \"entries\" to be an array, found ", value.type_name());
      for (std::size_t i = 0; i < value.size(); ++i) {
        const json& v = value[i];
        const std::string where = absl::StrCat("entries[", i, "]: ");
        if (!v.is_object()) return error(where, "expected an object, found ", v.type_name());
        NameMapEntry e;
        for (const auto& [k, f] : v.items()) {
          if (k == "internal" || k == "external" || k == "tied_to") {
            if (!f.is_string()) return error(where, "expected \"", k, "\" to be a string, found ", f.type_name());
            (k == "internal" ? e.internal : k == "external" ? e.external : e.tied_to) = f.get<std::string>();
          } else if (k == "transpose") {
            if (!f.is_boolean()) return error(where, "expected \"transpose\" to be true or false, found ", f.dump());
            e.transpose = f.get<bool>();
          } else {
            return error(where, "expected keys internal, external, transpose, tied_to, found \"", k, "\"");
          }
        }
        if (e.internal.empty() || e.external.empty()) {
          return error(where, "expected non-empty \"internal\" and \"external\"");
        }
        map.entries.push_back(std::move(e));
      }
    } else if (key == "ignored_external") {
      if (!value.is_array()) return error("expected \"ignored_external\" to be an array, found ", value.type_name());
      for (const json& v : value) {
        if (!v.is_string()) return error("expected \"ignored_external\" to hold strings, found ", v.dump());
        map.ignored_external.push_back(v.get<std::string>());
      }
    } else {
      return error("expected keys \"entries\" and \"ignored_external\", found \"", key, "\"");
    }
  }
  if (absl::Status s = validate_name_map(map); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("'", source, "': ", s.message()));
  }
  return map;
}

}  // namespace shardkit::io
