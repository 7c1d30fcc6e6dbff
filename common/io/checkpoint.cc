#include "common/io/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <stdexcept>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/io/atomic_file.h"
#include "common/io/checksum.h"
#include "common/io/strict_json.h"
#include "nlohmann/json.hpp"

namespace shardkit::io {
namespace {

using json = nlohmann::json;

constexpr char kShardMagic[] = "SKSHARD1";
constexpr char kManifestFormat[] = "shardkit-checkpoint";
constexpr int kManifestVersion = 1;
constexpr std::uint64_t kDataAlign = 64;
// Bounds on what a reader accepts before allocating from a length it read.
constexpr std::uint64_t kMaxIndexBytes = std::uint64_t{1} << 30;
constexpr std::uint64_t kMaxManifestBytes = std::uint64_t{1} << 30;
constexpr int kMaxJsonDepth = 8;

std::string ErrnoText(int err) { return std::error_code(err, std::generic_category()).message(); }

std::string Join(const std::string& dir, const std::string& name) { return absl::StrCat(dir, "/", name); }

absl::Status ValidateId(const std::string& id) {
  const bool ok = !id.empty() && id.size() <= 64 && std::all_of(id.begin(), id.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  });
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("expected a checkpoint id of 1 to 64 characters [A-Za-z0-9_-], found '", id, "'"));
}

std::optional<DType> ParseDType(std::string_view s) {
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::i64}) {
    if (dtype_name(t) == s) return t;
  }
  return std::nullopt;
}

std::string ShapeStr(const Shape& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) absl::StrAppend(&out, i ? ", " : "", s[i]);
  return out + "]";
}

std::string RangeStr(std::int64_t begin, std::int64_t count) { return absl::StrCat("[", begin, ", ", begin + count, ")"); }

// ---- files ------------------------------------------------------------------------------------------------

// A regular file opened for reading without following a symlink (O_NONBLOCK so a FIFO cannot block the
// open; it is refused by the S_ISREG check right after).
class ReadFile {
 public:
  static absl::StatusOr<std::unique_ptr<ReadFile>> open(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      const std::string msg = absl::StrCat("cannot read '", path, "': ", ErrnoText(err));
      return err == ENOENT ? absl::NotFoundError(msg) : absl::DataLossError(msg);
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return absl::DataLossError(absl::StrCat("cannot read '", path, "': expected a regular file, found another kind"));
    }
    return std::unique_ptr<ReadFile>(new ReadFile(path, fd, static_cast<std::uint64_t>(st.st_size)));
  }
  ~ReadFile() { ::close(fd_); }
  ReadFile(const ReadFile&) = delete;
  ReadFile& operator=(const ReadFile&) = delete;

  std::uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // Exactly n bytes at `offset`; DataLoss when the file ends first.
  absl::Status read_at(std::uint64_t offset, void* dst, std::uint64_t n) const {
    if (offset > size_ || n > size_ - offset) {
      return absl::DataLossError(absl::StrCat("'", path_, "' is corrupt: expected ", n, " bytes at offset ", offset,
                                              ", found a file of ", size_, " bytes"));
    }
    auto* out = static_cast<char*>(dst);
    while (n > 0) {
      const std::size_t chunk = static_cast<std::size_t>(std::min<std::uint64_t>(n, std::uint64_t{1} << 30));
      const ssize_t r = ::pread(fd_, out, chunk, static_cast<off_t>(offset));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        return absl::DataLossError(absl::StrCat("cannot read '", path_, "': ", r < 0 ? ErrnoText(errno) : "unexpected end"));
      }
      out += r;
      offset += static_cast<std::uint64_t>(r);
      n -= static_cast<std::uint64_t>(r);
    }
    return absl::OkStatus();
  }

 private:
  ReadFile(std::string path, int fd, std::uint64_t size) : path_(std::move(path)), fd_(fd), size_(size) {}
  std::string path_;
  int fd_;
  std::uint64_t size_;
};

// Counts the bytes handed to an AtomicFileWriter and fires the test fault (CheckpointWriteOptions) on time.
class FaultingWriter {
 public:
  FaultingWriter(AtomicFileWriter& w, const CheckpointWriteOptions& o) : w_(w), o_(o) {}
  absl::Status write(const void* data, std::size_t n) {
    const auto* p = static_cast<const std::byte*>(data);
    if (o_.fault_after_bytes >= 0 && written_ <= o_.fault_after_bytes &&
        static_cast<std::uint64_t>(o_.fault_after_bytes - written_) <= n) {
      const auto head = static_cast<std::size_t>(o_.fault_after_bytes - written_);
      if (absl::Status s = w_.write(absl::Span<const std::byte>(p, head)); !s.ok()) return s;
      if (absl::Status s = w_.flush(); !s.ok()) return s;
      if (o_.fault) o_.fault();
      return absl::AbortedError(absl::StrCat("writing '", w_.path(), "' stopped by the test fault after ",
                                             o_.fault_after_bytes, " bytes"));
    }
    written_ += static_cast<std::int64_t>(n);
    return w_.write(absl::Span<const std::byte>(p, n));
  }
  absl::Status write(std::string_view s) { return write(s.data(), s.size()); }
  absl::Status zeros(std::uint64_t n) {
    static constexpr char kZeros[kDataAlign] = {};
    return write(kZeros, static_cast<std::size_t>(n));
  }

 private:
  AtomicFileWriter& w_;
  const CheckpointWriteOptions& o_;
  std::int64_t written_ = 0;
};

std::string U64Bytes(std::uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); }

// ---- JSON fields ------------------------------------------------------------------------------------------
// Note [checked JSON numbers]: nlohmann's get<int64_t>() converts a float with a cast that is undefined out of
// range, and get<uint64_t>() wraps a negative number; every number of a checkpoint's JSON is read through these
// helpers instead, which accept integers in range only and throw BadField (a DataLoss for the caller) otherwise.

struct BadField : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr std::int64_t kMaxInt = std::numeric_limits<std::int64_t>::max();
constexpr std::int64_t kMaxWorld = std::int64_t{1} << 24;

std::int64_t IntOf(const json& v, const std::string& what, std::int64_t lo, std::int64_t hi) {
  if (!v.is_number_integer()) throw BadField(absl::StrCat("expected ", what, " an integer, found ", v.type_name()));
  if (v.is_number_unsigned()) {
    const std::uint64_t u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(hi)) throw BadField(absl::StrCat("expected ", what, " at most ", hi, ", found ", u));
    return static_cast<std::int64_t>(u);
  }
  const std::int64_t x = v.get<std::int64_t>();
  if (x < lo || x > hi) throw BadField(absl::StrCat("expected ", what, " in [", lo, ", ", hi, "], found ", x));
  return x;
}

std::int64_t Int(const json& j, const char* key, std::int64_t lo, std::int64_t hi) {
  return IntOf(j.at(key), absl::StrCat("\"", key, "\""), lo, hi);
}

std::string Str(const json& j, const char* key) {
  const json& v = j.at(key);
  if (!v.is_string()) throw BadField(absl::StrCat("expected \"", key, "\" a string, found ", v.type_name()));
  return v.get<std::string>();
}

std::uint64_t Hex(const json& j, const char* key) {
  std::uint64_t out = 0;
  const std::string s = Str(j, key);
  if (s.size() != 16 || !absl::SimpleHexAtoi(s, &out)) {
    throw BadField(absl::StrCat("expected \"", key, "\" 16 hex digits, found '", s, "'"));
  }
  return out;
}

Shape ShapeOf(const json& j, const char* key) {
  const json& v = j.at(key);
  if (!v.is_array() || v.size() > 64) throw BadField(absl::StrCat("expected \"", key, "\" an array of at most 64 dimensions"));
  Shape out;
  for (const json& d : v) out.push_back(IntOf(d, absl::StrCat("a dimension of \"", key, "\""), 0, kMaxInt));
  return out;
}

// ---- rank file index --------------------------------------------------------------------------------------

struct IndexPiece {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  std::int64_t offset = 0;
  std::int64_t numel = 0;
  std::uint64_t data_offset = 0;
  std::uint64_t checksum = 0;
};

struct ShardIndex {
  std::string id;
  int rank = 0;
  int world = 0;
  std::vector<IndexPiece> pieces;
  std::uint64_t data_start = 0;  // absolute offset of the data section
  std::uint64_t index_checksum = 0;
};

absl::Status Corrupt(const std::string& path, const std::string& what) {
  return absl::DataLossError(absl::StrCat("'", path, "' is corrupt: ", what));
}

std::int64_t CheckedNumelOrError(const Shape& shape, DType dtype, const std::string& path, const std::string& name,
                                 absl::Status& error) {
  for (std::int64_t d : shape) {
    if (d < 0) {
      error = Corrupt(path, absl::StrCat("shape of '", name, "': expected dimensions >= 0, found ", ShapeStr(shape)));
      return -1;
    }
  }
  absl::StatusOr<std::int64_t> n = checked_numel(shape, dtype);
  if (!n.ok()) {
    error = Corrupt(path, absl::StrCat("shape of '", name, "': ", n.status().message()));
    return -1;
  }
  return *n;
}

// Reads a rank file's header and index (not its data).
absl::StatusOr<ShardIndex> ReadShardIndex(const ReadFile& f) {
  const std::string& path = f.path();
  char head[16];
  if (f.size() < 24) return Corrupt(path, absl::StrCat("expected at least 24 bytes, found ", f.size()));
  if (absl::Status s = f.read_at(0, head, 16); !s.ok()) return s;
  if (std::memcmp(head, kShardMagic, 8) != 0) return Corrupt(path, absl::StrCat("expected a file starting with ", kShardMagic));
  std::uint64_t index_bytes = 0;
  std::memcpy(&index_bytes, head + 8, 8);
  if (index_bytes > kMaxIndexBytes || index_bytes > f.size() - 24) {
    return Corrupt(path, absl::StrCat("expected an index of at most ", std::min(kMaxIndexBytes, f.size() - 24),
                                      " bytes, found a length of ", index_bytes));
  }
  std::string text(static_cast<std::size_t>(index_bytes), '\0');
  if (absl::Status s = f.read_at(16, text.data(), index_bytes); !s.ok()) return s;
  std::uint64_t want = 0;
  if (absl::Status s = f.read_at(16 + index_bytes, &want, 8); !s.ok()) return s;
  ShardIndex idx;
  idx.index_checksum = checksum64(text);
  if (idx.index_checksum != want) {
    return Corrupt(path, absl::StrCat("expected index checksum ", checksum_hex(want), ", found ",
                                      checksum_hex(idx.index_checksum)));
  }
  idx.data_start = 24 + index_bytes;
  if (absl::Status s = check_json_strict(text, absl::StrCat("index of '", path, "'"), kMaxJsonDepth); !s.ok()) return s;
  absl::Status error;
  try {
    const json j = json::parse(text);
    idx.id = Str(j, "id");
    idx.rank = static_cast<int>(Int(j, "rank", 0, kMaxWorld));
    idx.world = static_cast<int>(Int(j, "world", 1, kMaxWorld));
    for (const json& p : j.at("pieces")) {
      IndexPiece ip;
      ip.name = Str(p, "name");
      const auto dt = ParseDType(Str(p, "dtype"));
      if (!dt) return Corrupt(path, absl::StrCat("piece of '", ip.name, "': unknown dtype"));
      ip.dtype = *dt;
      ip.shape = ShapeOf(p, "shape");
      ip.offset = Int(p, "offset", 0, kMaxInt);
      ip.numel = Int(p, "numel", 0, kMaxInt);
      ip.data_offset = static_cast<std::uint64_t>(Int(p, "data_offset", 0, kMaxInt));
      ip.checksum = Hex(p, "xxh3");
      const std::int64_t total = CheckedNumelOrError(ip.shape, ip.dtype, path, ip.name, error);
      if (total < 0) return error;
      if (ip.offset < 0 || ip.numel < 0 || ip.offset > total || ip.numel > total - ip.offset) {
        return Corrupt(path, absl::StrCat("piece of '", ip.name, "': expected a range inside [0, ", total, "), found ",
                                          RangeStr(ip.offset, ip.numel)));
      }
      const std::uint64_t bytes = static_cast<std::uint64_t>(ip.numel) * dtype_size(ip.dtype);
      const std::uint64_t data_bytes = f.size() - idx.data_start;
      if (ip.data_offset > data_bytes || bytes > data_bytes - ip.data_offset) {
        return Corrupt(path, absl::StrCat("piece of '", ip.name, "': expected ", bytes, " bytes at data offset ",
                                          ip.data_offset, " within the file, found ", data_bytes, " data bytes"));
      }
      idx.pieces.push_back(std::move(ip));
    }
  } catch (const json::exception& e) {
    return Corrupt(path, absl::StrCat("bad index: ", e.what()));
  } catch (const BadField& e) {
    return Corrupt(path, absl::StrCat("bad index: ", e.what()));
  }
  return idx;
}

// Sorts the pieces and checks that they cover the tensor exactly (Note [sharded checkpoint]).
absl::Status CheckCoverage(TensorInfo& t) {
  std::sort(t.pieces.begin(), t.pieces.end(), [](const PieceLocation& a, const PieceLocation& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.numel < b.numel;
  });
  std::int64_t covered = 0;
  const PieceLocation* prev = nullptr;
  for (const PieceLocation& p : t.pieces) {
    if (prev != nullptr && p.offset == prev->offset && p.numel == prev->numel) continue;  // a replica
    if (p.offset < covered) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': pieces ", RangeStr(prev->offset, prev->numel),
                                                     " and ", RangeStr(p.offset, p.numel), " overlap"));
    }
    if (p.offset > covered) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': elements ", RangeStr(covered, p.offset - covered),
                                                     " are in no piece"));
    }
    covered = p.offset + p.numel;
    prev = &p;
  }
  if (covered != t.numel) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': elements ", RangeStr(covered, t.numel - covered),
                                                   " are in no piece"));
  }
  return absl::OkStatus();
}

std::string ManifestText(const Manifest& m) {
  json j;
  j["format"] = kManifestFormat;
  j["version"] = kManifestVersion;
  j["id"] = m.id;
  j["world"] = m.world;
  j["meta"] = m.meta;
  json files = json::array();
  for (const ShardFile& f : m.files) {
    files.push_back({{"rank", f.rank}, {"file", f.file}, {"bytes", f.bytes}, {"index_xxh3", checksum_hex(f.index_checksum)}});
  }
  j["files"] = std::move(files);
  json tensors = json::array();
  for (const TensorInfo& t : m.tensors) {
    json pieces = json::array();
    for (const PieceLocation& p : t.pieces) {
      pieces.push_back({{"rank", p.rank}, {"offset", p.offset}, {"numel", p.numel}, {"file_offset", p.file_offset},
                        {"xxh3", checksum_hex(p.checksum)}});
    }
    tensors.push_back({{"name", t.name}, {"dtype", std::string(dtype_name(t.dtype))}, {"shape", t.shape},
                       {"pieces", std::move(pieces)}});
  }
  j["tensors"] = std::move(tensors);
  std::string text = j.dump(1);
  text += "\n";
  absl::StrAppend(&text, "xxh3 ", checksum_hex(checksum64(text)), "\n");
  return text;
}

bool IsPlainFileName(const std::string& s) {
  return !s.empty() && s != "." && s != ".." && s.find('/') == std::string::npos && s.find('\0') == std::string::npos;
}

// Removes rank files of other checkpoints and temporaries of killed writers (names this library makes only).
void RemoveStale(const std::string& dir, const std::string& id) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  const std::string mine = id + ".";
  std::vector<std::string> doomed;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    const bool shard = absl::EndsWith(name, ".skshard") && !absl::StartsWith(name, mine);
    const bool temp = absl::StrContains(name, ".skshard.tmp-") || absl::StartsWith(name, absl::StrCat(kManifestFile, ".tmp-"));
    if (shard || temp) doomed.push_back(name);
  }
  ::closedir(d);
  for (const std::string& name : doomed) ::unlink(Join(dir, name).c_str());
}

}  // namespace

std::string shard_file_name(const std::string& id, int rank, int world) {
  return absl::StrFormat("%s.rank%05d-of-%05d.skshard", id, rank, world);
}

absl::Status write_shard(const std::string& dir, const std::string& id, int rank, int world,
                         absl::Span<const TensorPiece> pieces, const CheckpointWriteOptions& options) {
  if (absl::Status s = ValidateId(id); !s.ok()) return s;
  if (world < 1 || rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(absl::StrCat("expected rank in [0, world), found rank ", rank, " of ", world));
  }
  struct Kept {
    const TensorPiece* piece;
    std::uint64_t data_offset;
    std::uint64_t checksum;
  };
  std::vector<Kept> kept;
  std::map<std::string, std::pair<DType, Shape>> seen;
  json index_pieces = json::array();
  std::uint64_t data_end = 0;
  for (const TensorPiece& p : pieces) {
    if (!p.data.defined() || !p.data.device().is_cpu()) {
      return absl::InvalidArgumentError(absl::StrCat("piece of '", p.name, "': expected a defined CPU tensor"));
    }
    absl::StatusOr<std::int64_t> total = checked_numel(p.global_shape, p.data.dtype());
    if (!total.ok()) return absl::InvalidArgumentError(absl::StrCat("piece of '", p.name, "': ", total.status().message()));
    const std::int64_t n = p.data.numel();
    if (p.name.empty() || p.offset < 0 || p.offset > *total || n > *total - p.offset) {
      return absl::InvalidArgumentError(absl::StrCat("piece of '", p.name, "': expected a named range inside [0, ", *total,
                                                     ") of ", ShapeStr(p.global_shape), ", found ", RangeStr(p.offset, n)));
    }
    auto [it, inserted] = seen.emplace(p.name, std::pair{p.data.dtype(), p.global_shape});
    if (!inserted && it->second != std::pair{p.data.dtype(), p.global_shape}) {
      return absl::InvalidArgumentError(absl::StrCat("pieces of '", p.name, "' disagree on dtype or global shape"));
    }
    if (n == 0 && *total != 0) continue;
    const std::uint64_t off = (data_end + kDataAlign - 1) / kDataAlign * kDataAlign;
    const std::uint64_t sum = checksum64(p.data.raw_data(), p.data.nbytes());
    kept.push_back({&p, off, sum});
    data_end = off + p.data.nbytes();
    index_pieces.push_back({{"name", p.name}, {"dtype", std::string(dtype_name(p.data.dtype()))},
                            {"shape", p.global_shape}, {"offset", p.offset}, {"numel", n}, {"data_offset", off},
                            {"xxh3", checksum_hex(sum)}});
  }
  const json index = {{"id", id}, {"rank", rank}, {"world", world}, {"pieces", std::move(index_pieces)}};
  const std::string text = index.dump();

  absl::StatusOr<AtomicFileWriter> file = AtomicFileWriter::create(Join(dir, shard_file_name(id, rank, world)));
  if (!file.ok()) return file.status();
  FaultingWriter w(*file, options);
  absl::Status s = w.write(kShardMagic);
  if (s.ok()) s = w.write(U64Bytes(text.size()));
  if (s.ok()) s = w.write(text);
  if (s.ok()) s = w.write(U64Bytes(checksum64(text)));
  std::uint64_t pos = 0;
  for (const Kept& k : kept) {
    if (!s.ok()) break;
    s = w.zeros(k.data_offset - pos);
    if (s.ok()) s = w.write(k.piece->data.raw_data(), k.piece->data.nbytes());
    pos = k.data_offset + k.piece->data.nbytes();
  }
  if (!s.ok()) return s;  // the writer's destructor removes the temporary file
  return file->commit();
}

absl::Status commit_checkpoint(const std::string& dir, const std::string& id, int world,
                               const std::map<std::string, std::string>& meta, const CheckpointWriteOptions& options) {
  if (absl::Status s = ValidateId(id); !s.ok()) return s;
  if (world < 1) return absl::InvalidArgumentError(absl::StrCat("expected world >= 1, found ", world));
  Manifest m;
  m.id = id;
  m.world = world;
  m.meta = meta;
  std::map<std::string, TensorInfo> tensors;
  for (int r = 0; r < world; ++r) {
    const std::string name = shard_file_name(id, r, world);
    const std::string path = Join(dir, name);
    absl::StatusOr<std::unique_ptr<ReadFile>> f = ReadFile::open(path);
    if (!f.ok()) {
      return absl::DataLossError(absl::StrCat("cannot commit checkpoint '", id, "': rank ", r, "'s file: ", f.status().message()));
    }
    absl::StatusOr<ShardIndex> idx = ReadShardIndex(**f);
    if (!idx.ok()) return idx.status();
    if (idx->id != id || idx->rank != r || idx->world != world) {
      return Corrupt(path, absl::StrCat("expected checkpoint '", id, "' rank ", r, " of ", world, ", found '", idx->id,
                                        "' rank ", idx->rank, " of ", idx->world));
    }
    m.files.push_back({r, name, (*f)->size(), idx->index_checksum});
    for (const IndexPiece& p : idx->pieces) {
      auto [it, inserted] = tensors.try_emplace(p.name);
      TensorInfo& t = it->second;
      if (inserted) {
        t.name = p.name;
        t.dtype = p.dtype;
        t.shape = p.shape;
        t.numel = *checked_numel(p.shape, p.dtype);  // checked by ReadShardIndex
      } else if (t.dtype != p.dtype || t.shape != p.shape) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", p.name, "': rank ", r, " wrote ", std::string(dtype_name(p.dtype)),
                                                       ShapeStr(p.shape), ", an earlier rank ", std::string(dtype_name(t.dtype)),
                                                       ShapeStr(t.shape)));
      }
      t.pieces.push_back({r, p.offset, p.numel, idx->data_start + p.data_offset, p.checksum});
    }
  }
  for (auto& [name, t] : tensors) {
    if (absl::Status s = CheckCoverage(t); !s.ok()) return s;
    m.tensors.push_back(std::move(t));
  }
  absl::StatusOr<AtomicFileWriter> file = AtomicFileWriter::create(Join(dir, kManifestFile));
  if (!file.ok()) return file.status();
  FaultingWriter w(*file, options);
  if (absl::Status s = w.write(ManifestText(m)); !s.ok()) return s;
  if (absl::Status s = file->commit(); !s.ok()) return s;
  RemoveStale(dir, id);
  return absl::OkStatus();
}

absl::StatusOr<DirectoryLock> open_checkpoint_dir(const std::string& dir, ExistingCheckpoint existing,
                                                  const std::vector<std::string>& other_checkpoint_files) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (!ec && !std::filesystem::is_directory(dir, ec)) ec = std::make_error_code(std::errc::not_a_directory);
  if (ec) return absl::FailedPreconditionError(absl::StrCat("cannot write checkpoint directory '", dir, "': ", ec.message()));
  absl::StatusOr<DirectoryLock> lock = DirectoryLock::acquire(dir);
  if (!lock.ok()) return lock.status();
  if (existing == ExistingCheckpoint::refuse) {
    std::vector<std::string> names = {kManifestFile};
    names.insert(names.end(), other_checkpoint_files.begin(), other_checkpoint_files.end());
    for (const std::string& name : names) {
      struct stat st {};
      const std::string path = Join(dir, name);
      if (::lstat(path.c_str(), &st) == 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("checkpoint directory '", dir, "' already holds a checkpoint ('", path, "')"));
      }
    }
  }
  return lock;
}

// ---- reading ----------------------------------------------------------------------------------------------

const TensorInfo* Manifest::find(const std::string& name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const TensorInfo& t, const std::string& n) { return t.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

absl::StatusOr<Manifest> read_manifest(const std::string& dir) {
  const std::string path = Join(dir, kManifestFile);
  absl::StatusOr<std::unique_ptr<ReadFile>> f = ReadFile::open(path);
  if (!f.ok()) {
    if (absl::IsNotFound(f.status())) return absl::NotFoundError(absl::StrCat("no checkpoint in '", dir, "': ", f.status().message()));
    return f.status();
  }
  if ((*f)->size() > kMaxManifestBytes) {
    return Corrupt(path, absl::StrCat("expected at most ", kMaxManifestBytes, " bytes, found ", (*f)->size()));
  }
  std::string text(static_cast<std::size_t>((*f)->size()), '\0');
  if (absl::Status s = (*f)->read_at(0, text.data(), text.size()); !s.ok()) return s;
  // The last line: "xxh3 <16 hex>\n", the checksum of everything before it.
  constexpr std::size_t kTail = 5 + 16 + 1;
  std::uint64_t want = 0;
  if (text.size() < kTail || text.compare(text.size() - kTail, 5, "xxh3 ") != 0 || text.back() != '\n' ||
      !absl::SimpleHexAtoi(text.substr(text.size() - 17, 16), &want)) {
    return Corrupt(path, "expected a last line 'xxh3 <16 hex digits>' (truncated file?)");
  }
  const std::string body = text.substr(0, text.size() - kTail);
  if (const std::uint64_t got = checksum64(body); got != want) {
    return Corrupt(path, absl::StrCat("expected checksum ", checksum_hex(want), ", found ", checksum_hex(got),
                                      " (truncated or modified file)"));
  }
  if (absl::Status s = check_json_strict(body, absl::StrCat("'", path, "'"), kMaxJsonDepth); !s.ok()) return s;
  Manifest m;
  absl::Status error;
  try {
    const json j = json::parse(body);
    if (Str(j, "format") != kManifestFormat || Int(j, "version", 0, kMaxInt) != kManifestVersion) {
      return Corrupt(path, absl::StrCat("expected format '", kManifestFormat, "' version ", kManifestVersion));
    }
    m.id = Str(j, "id");
    if (absl::Status s = ValidateId(m.id); !s.ok()) return Corrupt(path, std::string(s.message()));
    m.world = static_cast<int>(Int(j, "world", 1, kMaxWorld));
    if (m.world < 1) return Corrupt(path, absl::StrCat("expected world >= 1, found ", m.world));
    m.meta = j.at("meta").get<std::map<std::string, std::string>>();
    for (const json& fj : j.at("files")) {
      ShardFile sf;
      sf.rank = static_cast<int>(Int(fj, "rank", 0, kMaxWorld));
      sf.file = Str(fj, "file");
      sf.bytes = static_cast<std::uint64_t>(Int(fj, "bytes", 0, kMaxInt));
      sf.index_checksum = Hex(fj, "index_xxh3");
      if (sf.rank != static_cast<int>(m.files.size()) || !IsPlainFileName(sf.file)) {
        return Corrupt(path, absl::StrCat("expected file ", m.files.size(), " to be a plain file name of rank ",
                                          m.files.size(), ", found rank ", sf.rank, " '", sf.file, "'"));
      }
      m.files.push_back(std::move(sf));
    }
    if (static_cast<int>(m.files.size()) != m.world) {
      return Corrupt(path, absl::StrCat("expected ", m.world, " rank files, found ", m.files.size()));
    }
    for (const json& tj : j.at("tensors")) {
      TensorInfo t;
      t.name = Str(tj, "name");
      const auto dt = ParseDType(Str(tj, "dtype"));
      if (!dt) return Corrupt(path, absl::StrCat("tensor '", t.name, "': unknown dtype"));
      t.dtype = *dt;
      t.shape = ShapeOf(tj, "shape");
      t.numel = CheckedNumelOrError(t.shape, t.dtype, path, t.name, error);
      if (t.numel < 0) return error;
      for (const json& pj : tj.at("pieces")) {
        PieceLocation p;
        p.rank = static_cast<int>(Int(pj, "rank", 0, kMaxWorld));
        p.offset = Int(pj, "offset", 0, kMaxInt);
        p.numel = Int(pj, "numel", 0, kMaxInt);
        p.file_offset = static_cast<std::uint64_t>(Int(pj, "file_offset", 0, kMaxInt));
        p.checksum = Hex(pj, "xxh3");
        if (p.rank < 0 || p.rank >= m.world || p.offset < 0 || p.numel < 0 || p.offset > t.numel ||
            p.numel > t.numel - p.offset) {
          return Corrupt(path, absl::StrCat("tensor '", t.name, "': expected a piece of a rank in [0, ", m.world,
                                            ") inside [0, ", t.numel, "), found rank ", p.rank, " ",
                                            RangeStr(p.offset, p.numel)));
        }
        const std::uint64_t bytes = static_cast<std::uint64_t>(p.numel) * dtype_size(t.dtype);
        const std::uint64_t file_bytes = m.files[static_cast<std::size_t>(p.rank)].bytes;
        if (p.file_offset > file_bytes || bytes > file_bytes - p.file_offset) {
          return Corrupt(path, absl::StrCat("tensor '", t.name, "': piece ", RangeStr(p.offset, p.numel),
                                            " runs past the end of rank ", p.rank, "'s file"));
        }
        t.pieces.push_back(p);
      }
      if (!m.tensors.empty() && !(m.tensors.back().name < t.name)) {
        return Corrupt(path, absl::StrCat("expected tensors sorted by name without repeats, found '", t.name,
                                          "' after '", m.tensors.back().name, "'"));
      }
      if (absl::Status s = CheckCoverage(t); !s.ok()) return Corrupt(path, std::string(s.message()));
      m.tensors.push_back(std::move(t));
    }
  } catch (const json::exception& e) {
    return Corrupt(path, absl::StrCat("bad manifest: ", e.what()));
  } catch (const BadField& e) {
    return Corrupt(path, absl::StrCat("bad manifest: ", e.what()));
  }
  return m;
}

absl::StatusOr<std::vector<ReadStep>> plan_read(const Manifest& manifest, absl::Span<const ReadRequest> requests) {
  std::vector<ReadStep> plan;
  for (std::size_t r = 0; r < requests.size(); ++r) {
    const ReadRequest& req = requests[r];
    const TensorInfo* t = manifest.find(req.name);
    if (t == nullptr) return absl::NotFoundError(absl::StrCat("checkpoint '", manifest.id, "' has no tensor '", req.name, "'"));
    if (!req.dest.defined()) return absl::InvalidArgumentError(absl::StrCat("request for '", req.name, "': no destination"));
    const std::int64_t n = req.dest.numel();
    if (req.offset < 0 || req.offset > t->numel || n > t->numel - req.offset) {
      return absl::InvalidArgumentError(absl::StrCat("request for '", req.name, "': expected a range inside [0, ", t->numel,
                                                     "), found ", RangeStr(req.offset, n)));
    }
    const std::int64_t end = req.offset + n;
    const PieceLocation* prev = nullptr;
    for (std::size_t k = 0; k < t->pieces.size(); ++k) {
      const PieceLocation& p = t->pieces[k];
      const bool replica = prev != nullptr && p.offset == prev->offset && p.numel == prev->numel;
      prev = &p;
      if (replica) continue;
      const std::int64_t begin = std::max(req.offset, p.offset), stop = std::min(end, p.offset + p.numel);
      if (begin >= stop) continue;
      plan.push_back({r, static_cast<std::size_t>(t - manifest.tensors.data()), k, begin - p.offset, begin - req.offset,
                      stop - begin});
    }
  }
  return plan;
}

absl::Status read_pieces(const std::string& dir, const Manifest& manifest, absl::Span<const ReadRequest> requests) {
  absl::StatusOr<std::vector<ReadStep>> plan = plan_read(manifest, requests);
  if (!plan.ok()) return plan.status();
  std::vector<ReadStep> steps = std::move(*plan);
  std::sort(steps.begin(), steps.end(), [](const ReadStep& a, const ReadStep& b) {
    return std::pair{a.tensor, a.piece} < std::pair{b.tensor, b.piece};
  });
  std::map<int, std::unique_ptr<ReadFile>> files;  // opened and checked against the manifest once
  auto file_of = [&](int rank) -> absl::StatusOr<const ReadFile*> {
    auto it = files.find(rank);
    if (it != files.end()) return it->second.get();
    const ShardFile& sf = manifest.files.at(static_cast<std::size_t>(rank));
    absl::StatusOr<std::unique_ptr<ReadFile>> f = ReadFile::open(Join(dir, sf.file));
    if (!f.ok()) return absl::DataLossError(absl::StrCat("checkpoint '", manifest.id, "': ", f.status().message()));
    absl::StatusOr<ShardIndex> idx = ReadShardIndex(**f);
    if (!idx.ok()) return idx.status();
    if (idx->index_checksum != sf.index_checksum || (*f)->size() != sf.bytes) {
      return Corrupt((*f)->path(), absl::StrCat("expected the rank file of checkpoint '", manifest.id, "' (", sf.bytes,
                                                " bytes, index checksum ", checksum_hex(sf.index_checksum), "), found ",
                                                (*f)->size(), " bytes, index checksum ", checksum_hex(idx->index_checksum)));
    }
    return (files[rank] = std::move(*f)).get();
  };
  for (std::size_t i = 0; i < steps.size();) {
    const TensorInfo& t = manifest.tensors[steps[i].tensor];
    const PieceLocation& p = t.pieces[steps[i].piece];
    absl::StatusOr<const ReadFile*> f = file_of(p.rank);
    if (!f.ok()) return f.status();
    Tensor buf = Tensor::empty({p.numel}, TensorOptions{}.with_dtype(t.dtype));
    if (absl::Status s = (*f)->read_at(p.file_offset, buf.raw_data(), buf.nbytes()); !s.ok()) return s;
    if (const std::uint64_t got = checksum64(buf.raw_data(), buf.nbytes()); got != p.checksum) {
      return Corrupt((*f)->path(), absl::StrCat("tensor '", t.name, "' elements ", RangeStr(p.offset, p.numel),
                                                ": expected checksum ", checksum_hex(p.checksum), ", found ",
                                                checksum_hex(got)));
    }
    for (; i < steps.size() && steps[i].tensor == static_cast<std::size_t>(&t - manifest.tensors.data()) &&
           steps[i].piece == static_cast<std::size_t>(&p - t.pieces.data());
         ++i) {
      const ReadStep& s = steps[i];
      const Tensor& dest = requests[s.request].dest;
      dest.reshape({dest.numel()}).view(s.dest_begin, {s.count}).copy_(buf.view(s.piece_begin, {s.count}));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Tensor> read_tensor(const std::string& dir, const Manifest& manifest, const std::string& name) {
  const TensorInfo* t = manifest.find(name);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat("checkpoint '", manifest.id, "' has no tensor '", name, "'"));
  Tensor out = Tensor::empty(t->shape, TensorOptions{}.with_dtype(t->dtype));
  const ReadRequest req{name, 0, out};
  if (absl::Status s = read_pieces(dir, manifest, absl::MakeConstSpan(&req, 1)); !s.ok()) return s;
  return out;
}

}  // namespace shardkit::io
