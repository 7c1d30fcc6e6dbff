// Sharded checkpoints: each rank writes its own file, rank 0 writes one manifest, and any world size or
// sharding strategy reads them back (DESIGN.md section 2, io/). The layout is PyTorch distributed
// checkpoint's (DCP): per-rank data files plus a metadata file with every piece's global place, and a load
// that plans, for the layout the reader wants, which pieces to read.
//
// Note [sharded checkpoint]
// A checkpoint is a set of tensors, each known by name, dtype and global shape, and split into *pieces*: a
// piece is the contiguous range [offset, offset + numel) of the tensor's elements in row-major order. Every
// strategy's state is such ranges: an FSDP dim-0 shard is rows, hence one range; an OSS flat-partition
// piece is a range of the flattened parameter; a replicated tensor is the whole range. The pieces of a
// tensor cover it exactly: any two are either disjoint or the same range (replicas; the reader reads the
// first). Non-tensor state (step numbers, hyper-parameters, what the run was) is the manifest's `meta`,
// string to string.
//
// A checkpoint directory holds:
//   manifest.json                   the commit point: written last, by rank 0, with AtomicFileWriter
//   <id>.rank<r>-of-<w>.skshard     one per rank: the pieces it wrote
//   .lock                           Note [directory lock] (dir_lock.h)
// Rank file: "SKSHARD1", u64 index_bytes, the index (JSON: {"id", "rank", "world", "pieces": [{"name",
// "dtype", "shape", "offset", "numel", "data_offset", "xxh3"}]}), u64 XXH3 of the index, then the pieces'
// bytes (little-endian, as in memory), each starting at a multiple of 64 bytes from the data start.
// Manifest: JSON {"format": "shardkit-checkpoint", "version": 1, "id", "world", "meta": {...}, "files":
// [{"rank", "file", "bytes", "index_xxh3"}], "tensors": [{"name", "dtype", "shape", "pieces": [{"rank",
// "offset", "numel", "file_offset", "xxh3"}]}]}, then a last line "xxh3 <16 hex digits>\n" holding the
// checksum of every byte before it. Checksums are XXH3-64 (checksum.h), one per piece.
//
// Writing (every rank, then rank 0; the caller provides the barriers, e.g. with its ProcessGroup):
//   1. each rank: write_shard(dir, id, rank, world, its pieces)       -> its rank file, atomically
//   2. all ranks agree that every write_shard succeeded
//   3. rank 0: commit_checkpoint(dir, id, world, meta)               -> reads the rank files' indices,
//      checks that the pieces cover every tensor, writes manifest.json atomically, then removes the files
//      of older checkpoints and temporaries left by killed writers
// `id` names one checkpoint and must differ from the id of the checkpoint the directory holds now (so the
// rank files the current manifest points at are never replaced): include the step and a value the ranks
// agreed on for this run. Until step 3's rename, the directory's manifest is the previous one, and it
// points only at the previous checkpoint's rank files, which nothing touches: a writer killed at any point
// leaves the last complete checkpoint readable. Atomicity: every file is written to a fresh temporary name
// (O_EXCL | O_NOFOLLOW, never through a planted symlink), fsynced, renamed into place, and the directory
// fsynced (Note [atomic replace] in atomic_file.h).
//
// Reading (any rank, any world size, after the manifest is committed): read_manifest(dir), then
// read_pieces(dir, manifest, requests) where each request is a range of a tensor and a destination; the
// plan (plan_read, a pure function) says which pieces overlap each request. Every piece read is read whole
// and its checksum verified before any of its bytes is used; values are converted to the destination's
// dtype. Rank files are checked against the manifest (the XXH3 of their index), so a rank file of another
// checkpoint is never mixed in. Errors: DataLoss for a damaged or inconsistent file (naming it and what was
// expected), NotFound for a missing manifest or tensor, InvalidArgument for a request outside a tensor.
// Readers need the directory on a file system every reading rank sees (as DCP's FileSystemReader).
//
// Files are opened with O_NOFOLLOW and must be regular files (a FIFO or device is refused, never read).
// No global state; functions on different directories are independent.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/io/dir_lock.h"
#include "common/tensor/tensor.h"

namespace shardkit::io {

inline constexpr char kManifestFile[] = "manifest.json";

// ---- writing ----------------------------------------------------------------------------------------------

// One piece this rank writes: elements [offset, offset + data.numel()) of tensor `name` of `global_shape`.
// `data` is a CPU tensor (any shape: its elements in order), stored in its own dtype.
struct TensorPiece {
  std::string name;
  Shape global_shape;
  std::int64_t offset = 0;
  Tensor data;
};

struct CheckpointWriteOptions {
  // Test-only: once this many bytes of the file being written have been handed to the kernel, `fault` is
  // called (a test raises SIGKILL there, to kill a writer at a deterministic point); if it returns, the
  // write fails with Aborted and the temporary file is removed. -1: never.
  std::int64_t fault_after_bytes = -1;
  std::function<void()> fault;
};

// "<id>.rank00002-of-00004.skshard".
std::string shard_file_name(const std::string& id, int rank, int world);

// Writes this rank's file (see above) atomically. Pieces with no elements are left out. InvalidArgument
// (nothing written) for an id that is empty, longer than 64 or not [A-Za-z0-9_-], rank outside [0, world), a
// piece whose range is outside its global shape, a non-CPU piece, or two pieces of one name that disagree
// on dtype or global shape; FailedPrecondition / ResourceExhausted from the file system, naming the path.
absl::Status write_shard(const std::string& dir, const std::string& id, int rank, int world,
                         absl::Span<const TensorPiece> pieces, const CheckpointWriteOptions& options = {});

// Rank 0, after every rank's write_shard succeeded: builds and writes the manifest, then removes other
// checkpoints' rank files and stale temporaries (see above). DataLoss naming the rank file when one is
// missing, damaged or of another id/world; InvalidArgument when the pieces of all ranks do not cover each
// tensor exactly ("tensor 'x': elements [8, 12) are in no piece", "... pieces [0, 8) and [4, 12) overlap"),
// or disagree on a tensor's dtype or shape. On any error the previous manifest stays.
absl::Status commit_checkpoint(const std::string& dir, const std::string& id, int world,
                               const std::map<std::string, std::string>& meta,
                               const CheckpointWriteOptions& options = {});

// ---- the directory ----------------------------------------------------------------------------------------

// What a writer does with a directory that already holds a checkpoint.
enum class ExistingCheckpoint {
  refuse,   // FailedPrecondition: the checkpoint of another run is never overwritten unasked
  resume,   // keep it: this run continues it (its next commit replaces it)
  replace,  // the caller asked to overwrite it (its next commit replaces it)
};

// Prepares `dir` for a writer: creates it (and parents), takes its DirectoryLock for as long as the result
// lives, and applies `existing` when the directory holds a checkpoint (a manifest.json, or any file named in
// `other_checkpoint_files`, e.g. an older format's). FailedPrecondition: "cannot write checkpoint directory
// 'd': Not a directory" (or another reason), the lock's errors, and for refuse "checkpoint directory 'd'
// already holds a checkpoint ('d/manifest.json')". Nothing in the directory is written but the lock file.
absl::StatusOr<DirectoryLock> open_checkpoint_dir(const std::string& dir, ExistingCheckpoint existing,
                                                  const std::vector<std::string>& other_checkpoint_files = {});

// ---- reading ----------------------------------------------------------------------------------------------

struct PieceLocation {
  int rank = 0;
  std::int64_t offset = 0;  // first element of the tensor
  std::int64_t numel = 0;
  std::uint64_t file_offset = 0;  // in the rank's file
  std::uint64_t checksum = 0;     // XXH3-64 of the piece's bytes
};

struct TensorInfo {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;                       // global
  std::int64_t numel = 0;            // of shape
  std::vector<PieceLocation> pieces;  // sorted by offset; replicas kept, the first of equal ranges read
};

struct ShardFile {
  int rank = 0;
  std::string file;  // name inside the directory
  std::uint64_t bytes = 0;
  std::uint64_t index_checksum = 0;
};

struct Manifest {
  std::string id;
  int world = 1;
  std::map<std::string, std::string> meta;
  std::vector<ShardFile> files;     // by rank
  std::vector<TensorInfo> tensors;  // sorted by name

  const TensorInfo* find(const std::string& name) const;  // nullptr when absent
};

// Reads and validates dir/manifest.json (checksum; well-formed; shapes through checked_numel; pieces cover
// every tensor exactly; file names plain). NotFound when there is none; DataLoss naming the file otherwise.
absl::StatusOr<Manifest> read_manifest(const std::string& dir);

// Elements [offset, offset + dest.numel()) of tensor `name`, into `dest` (CPU, any dtype: converted).
struct ReadRequest {
  std::string name;
  std::int64_t offset = 0;
  Tensor dest;
};

// One copy of the plan: `count` elements from element `piece_begin` of piece `piece` of tensor `tensor` of the
// manifest into element `dest_begin` of request `request`'s destination.
struct ReadStep {
  std::size_t request = 0;
  std::size_t tensor = 0;
  std::size_t piece = 0;
  std::int64_t piece_begin = 0;
  std::int64_t dest_begin = 0;
  std::int64_t count = 0;
};

// Which pieces each request reads (pure). NotFound for an unknown name; InvalidArgument for a range outside
// the tensor or an undefined destination.
absl::StatusOr<std::vector<ReadStep>> plan_read(const Manifest& manifest, absl::Span<const ReadRequest> requests);

// Plans and reads: each piece the plan touches is read once, whole, from its rank file and its checksum
// checked before its bytes are copied. On error the destinations may be partly written.
absl::Status read_pieces(const std::string& dir, const Manifest& manifest, absl::Span<const ReadRequest> requests);

// A whole tensor, in its stored dtype and global shape (charged to the calling thread's current category).
absl::StatusOr<Tensor> read_tensor(const std::string& dir, const Manifest& manifest, const std::string& name);

}  // namespace shardkit::io
