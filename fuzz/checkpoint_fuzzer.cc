// libFuzzer target: the sharded checkpoint reader (common/io/checkpoint.h: read_manifest, read_tensor), which
// reads what `shardkit-train --resume` and the state dict loaders trust. The input is one checkpoint directory
// packed as bytes: u32 manifest length (little-endian), manifest.json, then the rank file named
// shard_file_name("ck", 0, 1) (seeds: fuzz/corpus/checkpoint, made with write_shard + commit_checkpoint).
// Beyond "no crash, no sanitizer report": every tensor of a manifest that reads can be read or is refused with a
// Status, and nothing outside the directory is opened (a manifest naming "../x" must be refused: the directory
// sits inside a parent holding a file the reader must never reach).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/io/checkpoint.h"
#include "common/io/checksum.h"

using namespace shardkit;
namespace fs = std::filesystem;

namespace {

struct Dirs {
  fs::path parent, dir;
  Dirs() {
    parent = fs::temp_directory_path() / ("checkpoint_fuzzer." + std::to_string(::getpid()));
    dir = parent / "ck";
    fs::create_directories(dir);
    // A well-formed rank file outside the checkpoint directory: reading it would be a path escape.
    std::ofstream(parent / io::shard_file_name("ck", 0, 1), std::ios::binary) << "outside";
  }
  ~Dirs() {
    std::error_code ec;
    fs::remove_all(parent, ec);
  }
};

void write_file(const fs::path& p, const std::uint8_t* data, std::size_t n) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(n));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static Dirs dirs;  // one scratch directory per fuzzer process
  if (size < 4) return 0;
  std::uint32_t manifest_bytes = 0;
  std::memcpy(&manifest_bytes, data, 4);
  if (manifest_bytes > size - 4) return 0;
  std::string manifest_text(reinterpret_cast<const char*>(data + 4), manifest_bytes);
  manifest_text += "xxh3 " + io::checksum_hex(io::checksum64(manifest_text)) + "\n";
  write_file(dirs.dir / "manifest.json", reinterpret_cast<const std::uint8_t*>(manifest_text.data()),
             manifest_text.size());
  write_file(dirs.dir / io::shard_file_name("ck", 0, 1), data + 4 + manifest_bytes, size - 4 - manifest_bytes);
  auto manifest = io::read_manifest(dirs.dir.string());
  if (!manifest.ok()) return 0;
  for (const io::ShardFile& f : manifest->files) {
    if (f.file.find('/') != std::string::npos || f.file == ".." || f.file == ".") std::abort();  // escaped
  }
  for (const io::TensorInfo& t : manifest->tensors) {
    if (t.numel > (std::int64_t{1} << 24)) continue;  // a huge declared tensor: allocation, not parsing
    (void)io::read_tensor(dirs.dir.string(), *manifest, t.name);
  }
  return 0;
}
