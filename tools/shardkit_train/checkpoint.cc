#include "tools/shardkit_train/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/optim/finite.h"
#include "tools/shardkit_train/corpus.h"

namespace shardkit::train {
namespace {

constexpr char kMagic[] = "SKCKPT01";

void put_u64(std::string& out, std::uint64_t v) { out.append(reinterpret_cast<const char*>(&v), 8); }
void put_u32(std::string& out, std::uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); }

void put_tensor(std::string& out, const std::string& name, const Tensor& t) {
  put_u32(out, static_cast<std::uint32_t>(name.size()));
  out += name;
  out.push_back(static_cast<char>(t.dtype()));
  put_u32(out, static_cast<std::uint32_t>(t.dim()));
  for (std::int64_t d = 0; d < t.dim(); ++d) put_u64(out, static_cast<std::uint64_t>(t.size(d)));
  put_u64(out, t.nbytes());
  out.append(static_cast<const char*>(t.raw_data()), t.nbytes());
}

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

// A cursor over the file's bytes that never reads past the end.
struct Reader {
  const std::string& buf;
  std::size_t pos = 0;
  bool ok = true;
  bool take(void* dst, std::size_t n) {
    if (!ok || buf.size() - pos < n) return ok = false;
    std::memcpy(dst, buf.data() + pos, n);
    pos += n;
    return true;
  }
  std::uint64_t u64() { std::uint64_t v = 0; take(&v, 8); return v; }
  std::uint32_t u32() { std::uint32_t v = 0; take(&v, 4); return v; }
};

absl::Status corrupt(const std::string& path, const std::string& what) {
  return absl::DataLossError(absl::StrCat("checkpoint '", path, "' is corrupt: ", what));
}

}  // namespace

std::string checkpoint_path(const std::string& dir) { return dir + "/checkpoint.skck"; }

std::string value_str(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return absl::StrCat(v);
}

absl::Status check_finite(const Checkpoint& ckpt) {
  auto check = [](const std::string& name, const Tensor& t) -> absl::Status {
    const std::int64_t i = optim::find_non_finite(t);
    if (i < 0) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("expected finite values, found ", value_str(t.item_at(i)), " in ", name, " (element ", i, ")"));
  };
  for (const auto& [name, t] : ckpt.model) {
    if (absl::Status s = check("model/" + name, t); !s.ok()) return s;
  }
  for (const auto& [index, st] : ckpt.optimizer.state) {
    for (const auto& [key, t] : st.tensors) {
      if (absl::Status s = check(absl::StrCat("optim/", index, "/", key), t); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

absl::Status ensure_writable_dir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat("cannot write checkpoint directory '", dir, "': ", ec.message()));
  const std::string probe = dir + "/.shardkit-train-probe";
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat("cannot write checkpoint directory '", dir, "': ", std::strerror(errno)));
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return absl::OkStatus();
}

absl::Status write_checkpoint(const std::string& dir, const Checkpoint& ckpt) {
  std::string meta;
  for (const auto& [k, v] : ckpt.meta) absl::StrAppend(&meta, k, "=", v, "\n");
  const optim::OptimizerStateDict& opt = ckpt.optimizer;
  absl::StrAppend(&meta, "optim.name=", opt.optimizer, "\n", "optim.groups=", opt.param_groups.size(), "\n");
  for (std::size_t g = 0; g < opt.param_groups.size(); ++g) {
    std::string params;
    for (std::int64_t i : opt.param_groups[g].params) absl::StrAppend(&params, params.empty() ? "" : ",", i);
    absl::StrAppend(&meta, "optim.group.", g, ".hyper=", hyper_str(opt.param_groups[g].hyper), "\n", "optim.group.", g,
                    ".params=", params, "\n");
  }
  std::size_t num_tensors = ckpt.model.size();
  for (const auto& [index, st] : opt.state) {
    absl::StrAppend(&meta, "optim.step.", index, "=", st.step, "\n");
    num_tensors += st.tensors.size();
  }

  std::string out(kMagic, 8);
  put_u64(out, meta.size());
  out += meta;
  put_u64(out, num_tensors);
  for (const auto& [name, t] : ckpt.model) put_tensor(out, "model/" + name, t);
  for (const auto& [index, st] : opt.state) {
    for (const auto& [key, t] : st.tensors) put_tensor(out, absl::StrCat("optim/", index, "/", key), t);
  }
  put_u64(out, fnv1a64(out.data(), out.size()));

  const std::string tmp = checkpoint_path(dir) + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::FailedPreconditionError(absl::StrCat("cannot write '", tmp, "': ", std::strerror(errno)));
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::write(fd, out.data() + done, out.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string err = std::strerror(errno);
      ::close(fd);
      ::unlink(tmp.c_str());
      return absl::ResourceExhaustedError(absl::StrCat("cannot write '", tmp, "': ", err));
    }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    return absl::FailedPreconditionError(absl::StrCat("cannot flush '", tmp, "': ", std::strerror(errno)));
  }
  if (::rename(tmp.c_str(), checkpoint_path(dir).c_str()) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("cannot rename '", tmp, "': ", std::strerror(errno)));
  }
  if (const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dfd >= 0) {
    ::fsync(dfd);  // make the rename durable
    ::close(dfd);
  }
  return absl::OkStatus();
}

absl::StatusOr<Checkpoint> read_checkpoint(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read checkpoint '", path, "': ", std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  const std::string buf = ss.str();
  if (buf.size() < 8 + 8 + 8 + 8 || std::memcmp(buf.data(), kMagic, 8) != 0) {
    return corrupt(path, absl::StrCat("expected a file starting with ", kMagic, " of at least 32 bytes, found ",
                                      buf.size(), " bytes"));
  }
  std::uint64_t want = 0;
  std::memcpy(&want, buf.data() + buf.size() - 8, 8);
  if (const std::uint64_t got = fnv1a64(buf.data(), buf.size() - 8); got != want) {
    return corrupt(path, absl::StrCat("expected checksum ", absl::Hex(want), ", found ", absl::Hex(got),
                                      " (truncated or modified file)"));
  }
  Reader r{buf, 8};
  Checkpoint ck;
  const std::uint64_t meta_bytes = r.u64();
  if (!r.ok || meta_bytes > buf.size() - r.pos) return corrupt(path, "meta section runs past the end");
  for (absl::string_view line : absl::StrSplit(absl::string_view(buf.data() + r.pos, meta_bytes), '\n', absl::SkipEmpty())) {
    const auto eq = line.find('=');
    if (eq == absl::string_view::npos) return corrupt(path, absl::StrCat("expected key=value, found '", line, "'"));
    ck.meta[std::string(line.substr(0, eq))] = std::string(line.substr(eq + 1));
  }
  r.pos += meta_bytes;

  // Optimizer structure from the meta.
  auto& opt = ck.optimizer;
  opt.optimizer = ck.meta["optim.name"];
  std::size_t groups = 0;
  if (!absl::SimpleAtoi(ck.meta["optim.groups"], &groups)) return corrupt(path, "missing optim.groups");
  for (std::size_t g = 0; g < groups; ++g) {
    optim::ParamGroupState pg;
    if (!parse_hyper(ck.meta[absl::StrCat("optim.group.", g, ".hyper")], pg.hyper)) {
      return corrupt(path, absl::StrCat("bad hyper-parameters of group ", g));
    }
    for (absl::string_view s : absl::StrSplit(ck.meta[absl::StrCat("optim.group.", g, ".params")], ',', absl::SkipEmpty())) {
      std::int64_t i = 0;
      if (!absl::SimpleAtoi(s, &i)) return corrupt(path, absl::StrCat("bad parameter index '", s, "'"));
      pg.params.push_back(i);
    }
    opt.param_groups.push_back(std::move(pg));
  }
  for (const auto& [k, v] : ck.meta) {
    if (k.rfind("optim.step.", 0) != 0) continue;
    std::int64_t index = 0, step = 0;
    if (!absl::SimpleAtoi(k.substr(11), &index) || !absl::SimpleAtoi(v, &step)) return corrupt(path, "bad " + k);
    opt.state[index].step = step;
  }

  const std::uint64_t n = r.u64();
  for (std::uint64_t t = 0; t < n && r.ok; ++t) {
    const std::uint32_t name_bytes = r.u32();
    if (!r.ok || name_bytes > buf.size() - r.pos) return corrupt(path, "tensor name runs past the end");
    std::string name = buf.substr(r.pos, name_bytes);
    r.pos += name_bytes;
    std::uint8_t dtype = 0;
    r.take(&dtype, 1);
    const std::uint32_t ndim = r.u32();
    if (!r.ok || ndim > 8 || dtype > static_cast<std::uint8_t>(DType::i64)) return corrupt(path, "bad tensor header of " + name);
    // Note [checked shapes] (tensor.h): the shape comes from the file, so its counts are checked before
    // anything is computed or allocated from them.
    Shape shape;
    for (std::uint32_t d = 0; d < ndim; ++d) {
      const std::uint64_t s = r.u64();
      if (s > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        return corrupt(path, absl::StrCat("dimension ", d, " of ", name, ": expected at most ",
                                          std::numeric_limits<std::int64_t>::max(), ", found ", s));
      }
      shape.push_back(static_cast<std::int64_t>(s));
    }
    const DType dt = static_cast<DType>(dtype);
    const absl::StatusOr<std::int64_t> numel = checked_numel(shape, dt);
    if (!numel.ok()) return corrupt(path, absl::StrCat("shape of ", name, ": ", numel.status().message()));
    const std::uint64_t want_bytes = static_cast<std::uint64_t>(*numel) * dtype_size(dt);  // <= INT64_MAX
    const std::uint64_t nbytes = r.u64();
    if (!r.ok || nbytes != want_bytes || nbytes > buf.size() - r.pos) {
      return corrupt(path, absl::StrCat("expected ", want_bytes, " bytes of ", name, " within the file, found ", nbytes));
    }
    Tensor tensor = Tensor::empty(shape, TensorOptions{}.with_dtype(dt));
    std::memcpy(tensor.raw_data(), buf.data() + r.pos, nbytes);
    r.pos += nbytes;
    if (name.rfind("model/", 0) == 0) {
      ck.model.emplace_back(name.substr(6), tensor);
    } else if (name.rfind("optim/", 0) == 0) {
      const auto slash = name.find('/', 6);
      std::int64_t index = 0;
      if (slash == std::string::npos || !absl::SimpleAtoi(name.substr(6, slash - 6), &index)) return corrupt(path, "bad name " + name);
      opt.state[index].tensors[name.substr(slash + 1)] = tensor;
    } else {
      return corrupt(path, "unexpected tensor " + name);
    }
  }
  if (!r.ok || r.pos != buf.size() - 8) return corrupt(path, "tensor section does not end at the checksum");
  if (absl::Status s = check_finite(ck); !s.ok()) return corrupt(path, std::string(s.message()));
  return ck;
}

}  // namespace shardkit::train
