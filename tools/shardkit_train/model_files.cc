#include "tools/shardkit_train/model_files.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/io/gpt2_names.h"

namespace shardkit::train {
namespace {

namespace fs = std::filesystem;

absl::Status cannot_write(const std::string& path, const std::string& why) {
  return absl::FailedPreconditionError(absl::StrCat("cannot write --export '", path, "': ", why));
}

// A file can be created in `dir` (root may write anywhere, so this is tried rather than inferred from modes).
absl::Status probe(const std::string& path, const fs::path& dir) {
  const std::string p = (dir / ".shardkit-train-probe").string();
  const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return cannot_write(path, absl::StrCat("directory '", dir.string(), "': ", std::strerror(errno)));
  ::close(fd);
  ::unlink(p.c_str());
  return absl::OkStatus();
}

std::string shape_of(const nn::GPTConfig& c) {
  return absl::StrCat("vocab ", c.vocab_size, ", context ", c.context, ", width ", c.width, ", ", c.num_layers, " layers");
}

}  // namespace

bool export_is_one_file(const std::string& path) { return absl::EndsWith(path, ".safetensors"); }

io::ModelExportOptions export_options(const nn::GPTConfig& config) {
  return io::ModelExportOptions{.names = io::TensorNames::gpt2(config)};
}

absl::Status check_export_target(const std::string& path) {
  std::error_code ec;
  if (!export_is_one_file(path)) {
    fs::create_directories(path, ec);
    if (ec) return cannot_write(path, ec.message());
    return probe(path, path);
  }
  if (fs::is_directory(path, ec)) return cannot_write(path, "it is a directory");
  const fs::path dir = fs::path(path).has_parent_path() ? fs::path(path).parent_path() : fs::path(".");
  if (!fs::is_directory(dir, ec)) return cannot_write(path, absl::StrCat("no directory '", dir.string(), "'"));
  return probe(path, dir);
}

absl::StatusOr<nn::StateDict> read_init_weights(const std::string& path, const ModelSize& model) {
  auto fail = [&](const absl::Status& s) {
    absl::string_view why = s.message();
    for (const std::string& named : {path, std::string(absl::StripSuffix(path, "/"))}) {
      if (absl::ConsumePrefix(&why, absl::StrCat("'", named, "': "))) break;  // said once, in front
    }
    return absl::Status(s.code(), absl::StrCat("cannot initialise from '", path, "': ", why));
  };
  absl::StatusOr<io::SafetensorsModel> file = io::SafetensorsModel::open(path);
  if (!file.ok()) return fail(file.status());
  // One head always divides the width: the heads come from the flags, the rest from the file.
  absl::StatusOr<nn::GPTConfig> found = io::infer_gpt2_config(file->infos(), 1);
  if (!found.ok()) return fail(absl::Status(found.status().code(), absl::StrCat("expected GPT-2 weights: ", found.status().message())));
  const nn::GPTConfig& want = model.config;
  if (found->vocab_size != want.vocab_size || found->context != want.context || found->width != want.width ||
      found->num_layers != want.num_layers) {
    return fail(absl::InvalidArgumentError(absl::StrCat("expected GPT-2 weights of model '", model.name, "' (",
                                                        shape_of(want), "), found ", shape_of(*found))));
  }
  absl::StatusOr<io::NamedTensors> state = io::import_safetensors(file->path(), io::TensorNames::gpt2(want));
  if (!state.ok()) return fail(state.status());
  return *std::move(state);
}

}  // namespace shardkit::train
