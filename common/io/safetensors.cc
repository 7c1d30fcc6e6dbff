#include "common/io/safetensors.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <tuple>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/io/atomic_file.h"
#include "common/io/strict_json.h"
#include "nlohmann/json.hpp"

namespace shardkit::io {

static_assert(std::endian::native == std::endian::little,
              "common/io reads and writes little-endian safetensors data in place: a big-endian host needs byte swaps");

namespace {

using nlohmann::json;

constexpr int kHeaderMaxDepth = 2;  // {"name": {"shape": [ ... ]}}
constexpr std::size_t kShownJsonChars = 80;

// A JSON value for a message, cut to a readable length.
std::string Shown(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > kShownJsonChars) s = absl::StrCat(s.substr(0, kShownJsonChars), "...");
  return s;
}

std::string ShapeDtype(DType dtype, const Shape& shape) {
  return absl::StrCat(std::string(safetensors_dtype_name(dtype)), shape_str(shape));
}

// Reads and validates the header of `bytes`; fills metadata and entries (in data order).
class HeaderParser {
 public:
  HeaderParser(absl::Span<const std::byte> bytes, const std::string& source, const SafetensorsReadOptions& options)
      : bytes_(bytes), source_(source), options_(options) {}

  absl::Status run(SafetensorsMetadata& metadata, std::vector<SafetensorsEntry>& entries) {
    if (bytes_.size() < 8) {
      return error("expected at least 8 bytes (the header length), found ", bytes_.size());
    }
    std::uint64_t n = 0;
    std::memcpy(&n, bytes_.data(), 8);
    if (n > options_.max_header_bytes) {
      return error("header length ", n, " exceeds the limit of ", options_.max_header_bytes, " bytes");
    }
    const std::uint64_t after_length = bytes_.size() - 8;
    if (n > after_length) {
      return error("header length ", n, " does not fit in the file: expected at most ", after_length, " (a file of ",
                   bytes_.size(), " bytes)");
    }
    data_size_ = after_length - n;
    data_ = bytes_.subspan(8 + n);
    const std::string_view text(reinterpret_cast<const char*>(bytes_.data() + 8), n);
    if (absl::Status s = check_json_strict(text, absl::StrCat("'", source_, "': header"), kHeaderMaxDepth); !s.ok()) {
      return s;
    }
    json header;
    try {
      header = json::parse(text);
    } catch (const json::exception& e) {
      return error("header is not valid JSON: ", e.what());
    }
    if (!header.is_object()) return error("expected the header to be a JSON object, found ", Shown(header));

    for (const auto& [key, value] : header.items()) {
      if (key == "__metadata__") {
        if (absl::Status s = parse_metadata(value, metadata); !s.ok()) return s;
        continue;
      }
      absl::StatusOr<SafetensorsEntry> e = parse_entry(key, value);
      if (!e.ok()) return e.status();
      entries.push_back(*std::move(e));
    }
    return check_coverage(entries);
  }

 private:
  template <typename... Parts>
  absl::Status error(const Parts&... parts) const {
    return absl::DataLossError(absl::StrCat("'", source_, "': ", parts...));
  }

  absl::Status parse_metadata(const json& value, SafetensorsMetadata& metadata) const {
    if (!value.is_object()) {
      return error("expected \"__metadata__\" to be an object of strings, found ", Shown(value));
    }
    for (const auto& [k, v] : value.items()) {
      if (!v.is_string()) {
        return error("expected \"__metadata__\" values to be strings, found \"", k, "\": ", Shown(v));
      }
      metadata.emplace(k, v.get<std::string>());
    }
    return absl::OkStatus();
  }

  absl::StatusOr<SafetensorsEntry> parse_entry(const std::string& name, const json& value) const {
    const std::string who = absl::StrCat("tensor '", name, "': ");
    if (name.empty()) return error("expected tensor names to be non-empty, found \"\"");
    if (!value.is_object()) {
      return error(who, "expected an object with \"dtype\", \"shape\" and \"data_offsets\", found ", Shown(value));
    }
    SafetensorsEntry e;
    e.info.name = name;

    const auto dt = value.find("dtype");
    if (dt == value.end()) return error(who, "expected a \"dtype\", found none");
    if (!dt->is_string()) return error(who, "expected \"dtype\" to be a string, found ", Shown(*dt));
    absl::StatusOr<DType> dtype = dtype_from_safetensors(dt->get<std::string>());
    if (!dtype.ok()) {
      return absl::Status(dtype.status().code() == absl::StatusCode::kUnimplemented ? absl::StatusCode::kUnimplemented
                                                                                     : absl::StatusCode::kDataLoss,
                          absl::StrCat("'", source_, "': ", who, dtype.status().message()));
    }
    e.info.dtype = *dtype;

    const auto sh = value.find("shape");
    if (sh == value.end()) return error(who, "expected a \"shape\", found none");
    if (!sh->is_array()) return error(who, "expected \"shape\" to be an array of integers, found ", Shown(*sh));
    for (const json& d : *sh) {
      if (d.is_number_unsigned()) {
        const std::uint64_t u = d.get<std::uint64_t>();
        if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
          return error(who, "expected dimensions at most ", std::numeric_limits<std::int64_t>::max(), ", found ", u,
                       " in \"shape\" ", Shown(*sh));
        }
        e.info.shape.push_back(static_cast<std::int64_t>(u));
      } else if (d.is_number_integer()) {
        return error(who, "expected dimensions >= 0, found ", d.get<std::int64_t>(), " in \"shape\" ", Shown(*sh));
      } else {
        return error(who, "expected \"shape\" to be an array of integers, found ", Shown(*sh));
      }
    }
    absl::StatusOr<std::int64_t> numel = checked_numel(e.info.shape, e.info.dtype);
    if (!numel.ok()) return error(who, numel.status().message());
    const std::uint64_t nbytes = static_cast<std::uint64_t>(*numel) * dtype_size(e.info.dtype);

    const auto off = value.find("data_offsets");
    if (off == value.end()) return error(who, "expected \"data_offsets\", found none");
    if (!off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned()) {
      return error(who, "expected \"data_offsets\" to be [begin, end] with integers >= 0, found ", Shown(*off));
    }
    e.begin = (*off)[0].get<std::uint64_t>();
    e.end = (*off)[1].get<std::uint64_t>();
    if (e.begin > e.end) {
      return error(who, "expected data_offsets [begin, end] with begin <= end, found [", e.begin, ", ", e.end, "]");
    }
    if (e.end > data_size_) {
      return error(who, "expected data_offsets within the data region of ", data_size_, " bytes, found [", e.begin,
                   ", ", e.end, "]");
    }
    if (e.end - e.begin != nbytes) {
      return error(who, "expected data_offsets spanning ", nbytes, " bytes (", ShapeDtype(e.info.dtype, e.info.shape),
                   "), found [", e.begin, ", ", e.end, "] (", e.end - e.begin, " bytes)");
    }
    e.bytes = data_.subspan(static_cast<std::size_t>(e.begin), static_cast<std::size_t>(nbytes));
    return e;
  }

  // The format requires the tensors to cover the data region exactly (reference: validate()).
  absl::Status check_coverage(std::vector<SafetensorsEntry>& entries) const {
    std::sort(entries.begin(), entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
      return std::tie(a.begin, a.end, a.info.name) < std::tie(b.begin, b.end, b.info.name);
    });
    std::uint64_t pos = 0;
    const SafetensorsEntry* prev = nullptr;
    for (const SafetensorsEntry& e : entries) {
      const std::string span = absl::StrCat("[", e.begin, ", ", e.end, "]");
      if (e.begin < pos) {
        return error("tensor '", e.info.name, "': data_offsets ", span, " overlap tensor '", prev->info.name, "' [",
                     prev->begin, ", ", prev->end, "]: expected tensors not to overlap");
      }
      if (e.begin > pos) {
        return error("tensor '", e.info.name, "': data_offsets ", span, " leave bytes [", pos, ", ", e.begin,
                     ") of the data region unused",
                     prev ? absl::StrCat(" after tensor '", prev->info.name, "'") : std::string(" at its start"),
                     ": expected the tensors to cover it without gaps");
      }
      pos = e.end;
      prev = &e;
    }
    if (pos != data_size_) {
      return error("expected the tensors to cover the data region of ", data_size_, " bytes, found them ending at byte ",
                   pos, " (", data_size_ - pos, " bytes unaccounted for)");
    }
    return absl::OkStatus();
  }

  absl::Span<const std::byte> bytes_;
  const std::string& source_;
  const SafetensorsReadOptions& options_;
  std::uint64_t data_size_ = 0;
  absl::Span<const std::byte> data_;
};

// Writer order: element size (alignment) first, largest first, then name -- the reference writer's order
// (its dtype enum sorts F16 < BF16 < F32 < I64, compared descending).
int WriteRank(DType d) {
  switch (d) {
    case DType::i64: return 3;
    case DType::f32: return 2;
    case DType::bf16: return 1;
    case DType::f16: return 0;
  }
  return -1;
}

bool ValidUtf8(const std::string& s) {
  try {
    (void)json(s).dump();
    return true;
  } catch (const json::exception&) {
    return false;
  }
}

struct Layout {
  std::string prefix;                 // u64 length + padded header
  std::vector<const Tensor*> order;   // tensors in data order
};

absl::StatusOr<Layout> PlanLayout(const NamedTensors& tensors, const SafetensorsMetadata& metadata) {
  absl::flat_hash_map<std::string_view, std::size_t> seen;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    const std::string who = absl::StrCat("tensor '", absl::CHexEscape(name), "': ");
    if (name.empty()) return absl::InvalidArgumentError("expected non-empty tensor names, found \"\"");
    if (name == "__metadata__") {
      return absl::InvalidArgumentError("expected tensor names other than \"__metadata__\" (the header's metadata key)");
    }
    if (!ValidUtf8(name)) return absl::InvalidArgumentError(absl::StrCat(who, "expected a UTF-8 name"));
    if (!seen.emplace(name, i).second) {
      return absl::InvalidArgumentError(absl::StrCat(who, "expected unique names, found it at positions ",
                                                     seen[name], " and ", i));
    }
    if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(who, "expected a defined tensor"));
    if (!t.device().is_cpu()) {
      return absl::InvalidArgumentError(absl::StrCat(who, "expected a CPU tensor (copy it to the CPU first), found ",
                                                     t.describe()));
    }
    if (t.storage_released()) {
      return absl::InvalidArgumentError(absl::StrCat(who, "expected its storage to be allocated, found it released"));
    }
  }
  for (const auto& [k, v] : metadata) {
    if (!ValidUtf8(k) || !ValidUtf8(v)) {
      return absl::InvalidArgumentError(
          absl::StrCat("metadata '", absl::CHexEscape(k), "': expected UTF-8 keys and values"));
    }
  }
  std::vector<std::size_t> idx(tensors.size());
  for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  std::sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) {
    const int ra = WriteRank(tensors[a].second.dtype()), rb = WriteRank(tensors[b].second.dtype());
    if (ra != rb) return ra > rb;
    return tensors[a].first < tensors[b].first;
  });

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  Layout layout;
  std::uint64_t pos = 0;
  for (std::size_t i : idx) {
    const auto& [name, t] = tensors[i];
    const std::uint64_t end = pos + t.nbytes();
    nlohmann::ordered_json entry = nlohmann::ordered_json::object();
    entry["dtype"] = std::string(safetensors_dtype_name(t.dtype()));
    entry["shape"] = t.shape();
    entry["data_offsets"] = {pos, end};
    header[name] = std::move(entry);
    layout.order.push_back(&t);
    pos = end;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const std::uint64_t n = text.size();
  layout.prefix.resize(8);
  std::memcpy(layout.prefix.data(), &n, 8);
  layout.prefix += text;
  return layout;
}

absl::Span<const std::byte> TensorBytes(const Tensor& t) {
  if (t.nbytes() == 0) return {};
  return {static_cast<const std::byte*>(t.raw_data()), t.nbytes()};
}

}  // namespace

std::string_view safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "F32";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::i64: return "I64";
  }
  return "?";
}

absl::StatusOr<DType> dtype_from_safetensors(std::string_view name) {
  if (name == "F32") return DType::f32;
  if (name == "BF16") return DType::bf16;
  if (name == "F16") return DType::f16;
  if (name == "I64") return DType::i64;
  static constexpr std::string_view kOthers[] = {"BOOL", "U8",  "I8",  "I16", "U16", "I32",     "U32",     "F64",
                                                 "U64",  "C64", "F4",  "F6_E2M3", "F6_E3M2", "F8_E5M2", "F8_E4M3",
                                                 "F8_E8M0"};
  for (std::string_view other : kOthers) {
    if (name == other) {
      return absl::UnimplementedError(absl::StrCat("expected dtype F32, BF16, F16 or I64 (the types shardkit has), found \"",
                                                   std::string(name), "\""));
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("expected dtype F32, BF16, F16 or I64, found \"",
                                                 absl::CHexEscape(std::string(name)), "\" (no safetensors type)"));
}

std::uint64_t SafetensorsTensorInfo::nbytes() const {
  return static_cast<std::uint64_t>(shape_numel(shape)) * dtype_size(dtype);
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::open(const std::string& path, const SafetensorsReadOptions& options) {
  absl::StatusOr<MappedFile> map = MappedFile::open(path);
  if (!map.ok()) return map.status();
  auto owned = std::make_unique<MappedFile>(*std::move(map));
  absl::StatusOr<SafetensorsFile> file = parse(owned->bytes(), path, options);
  if (!file.ok()) return file.status();
  file->map_ = std::move(owned);  // the entries' spans point into this mapping, which a move does not relocate
  return file;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::parse(absl::Span<const std::byte> bytes, std::string source,
                                                       const SafetensorsReadOptions& options) {
  SafetensorsFile file;
  file.source_ = std::move(source);
  HeaderParser parser(bytes, file.source_, options);
  if (absl::Status s = parser.run(file.metadata_, file.entries_); !s.ok()) return s;
  for (std::size_t i = 0; i < file.entries_.size(); ++i) file.by_name_.emplace(file.entries_[i].info.name, i);
  return file;
}

const SafetensorsEntry* SafetensorsFile::find(std::string_view name) const {
  const auto it = by_name_.find(absl::string_view(name.data(), name.size()));
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

Tensor tensor_from_entry(const SafetensorsEntry& entry, std::optional<MemoryCategory> category) {
  TensorOptions options;
  options.dtype = entry.info.dtype;
  options.category = category;
  Tensor t = Tensor::empty(entry.info.shape, options);
  SK_CHECK_EQ(t.nbytes(), entry.bytes.size()) << "tensor '" << entry.info.name << "'";
  if (t.nbytes() > 0) std::memcpy(t.raw_data(), entry.bytes.data(), t.nbytes());
  return t;
}

absl::StatusOr<Tensor> SafetensorsFile::tensor(std::string_view name, std::optional<MemoryCategory> category) const {
  const SafetensorsEntry* e = find(name);
  if (e == nullptr) return absl::NotFoundError(absl::StrCat("'", source_, "' has no tensor '", std::string(name), "'"));
  return tensor_from_entry(*e, category);
}

NamedTensors SafetensorsFile::tensors(std::optional<MemoryCategory> category) const {
  NamedTensors out;
  out.reserve(entries_.size());
  for (const SafetensorsEntry& e : entries_) out.emplace_back(e.info.name, tensor_from_entry(e, category));
  return out;
}

absl::Status write_safetensors(const std::string& path, const NamedTensors& tensors,
                               const SafetensorsMetadata& metadata) {
  absl::StatusOr<Layout> layout = PlanLayout(tensors, metadata);
  if (!layout.ok()) {
    return absl::Status(layout.status().code(), absl::StrCat("writing '", path, "': ", layout.status().message()));
  }
  absl::StatusOr<AtomicFileWriter> out = AtomicFileWriter::create(path);
  if (!out.ok()) return out.status();
  if (absl::Status s = out->write(layout->prefix); !s.ok()) return s;
  for (const Tensor* t : layout->order) {
    if (absl::Status s = out->write(TensorBytes(*t)); !s.ok()) return s;
  }
  return out->commit();
}

absl::StatusOr<std::string> serialize_safetensors(const NamedTensors& tensors, const SafetensorsMetadata& metadata) {
  absl::StatusOr<Layout> layout = PlanLayout(tensors, metadata);
  if (!layout.ok()) return layout.status();
  std::string out = std::move(layout->prefix);
  for (const Tensor* t : layout->order) {
    const absl::Span<const std::byte> b = TensorBytes(*t);
    out.append(reinterpret_cast<const char*>(b.data()), b.size());
  }
  return out;
}

}  // namespace shardkit::io
