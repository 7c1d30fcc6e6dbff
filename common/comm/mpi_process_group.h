// The MPI backend: a ProcessGroup (process_group.h) over MPI, for rank processes started by `mpirun` or
// `srun` (DESIGN.md section 2, issue 15 item 3). Open MPI from Debian's packages; the backend is built when
// CMake finds MPI (target shardkit::comm_mpi, which always exists: without MPI, mpi_backend_built() is false
// and create_mpi_world() returns Unimplemented).
//
// Bootstrap: none of shardkit's own. MPI knows the ranks (MPI_COMM_WORLD); no Store is needed. Sub-groups
// (split / new_group) are communicators made with MPI_Comm_create_group over their members only.
//
// Execution (Note [mpi progress engine] in mpi_process_group.cc): calls are queued to one communication thread
// per process, the only thread that calls MPI. It runs each group's calls in issue order as nonblocking MPI
// operations (MPI_Iallreduce, MPI_Ireduce_scatter_block, ...) and keeps the current operation of every group
// progressing, so calls return at once, Work completes in the background, and groups do not wait for each other.
//
// Checks: before each collective the ranks exchange a 40-byte description of the call (kind, dtype, per-rank
// numel, root, op, sequence number, the options' fingerprint); ranks that disagree fail with InvalidArgument naming both calls, instead of
// handing MPI mismatched buffers (which MPI does not detect). A recv whose message has another size fails with
// InvalidArgument. Tensors must be CPU tensors with at most 2^31 - 1 elements per rank (MPI's int counts).
//
// Reductions (Note [mpi reductions] in mpi_process_group.cc): every rank receives every rank's copy of the segment
// it owns (all-to-all), reduces them in rank order with the in-process backend's arithmetic (f32 accumulation,
// bf16 / f16 rounded once), and all_reduce / reduce send the reduced segments back out. Results are therefore
// bit-identical to the in-process backend's, for every dtype (f32, bf16, f16, i64) and op, at any rank count; each
// rank sends and receives (n-1)/n of the tensor per phase, as a ring would.
//
// Failure (Note [mpi failure]): what MPI can and cannot abort.
//   * A call whose deadline passes fails with DeadlineExceeded on that rank (MPI cannot say which rank did not
//     join), and the group aborts: pending and later calls fail, and an abort notice goes to every other rank of
//     the group, whose calls fail with Aborted naming the rank at the origin within milliseconds.
//   * abort(reason) does the same with `reason`.
//   * MPI cannot cancel a collective it has started. After an abort the started operation's tensors are kept
//     alive until MPI finishes it (for the rest of the process if it never does), and a process that saw a
//     failure does not call MPI_Finalize: the program should report the error and exit. mpirun then ends the
//     job (a process that exits without finalizing is an error to Open MPI).
//   * A rank process that dies: mpirun (Open MPI's default) kills every process of the job at once, naming the
//     rank that died; shardkit is not told. Under Slurm, srun --kill-on-bad-exit=1 does the same. Where the job
//     outlives it (mpirun --enable-recovery), the other ranks' calls cannot complete and fail at their deadline,
//     like those of a stopped (SIGSTOP) rank, which mpirun does not notice (tests/common/comm/mpi_test.cc).
//   * MPI's own errors (the group's communicators return error codes, MPI_ERRORS_RETURN) fail the call with
//     Internal quoting MPI's message, and abort the group.
//   * Creating a sub-group is one blocking MPI call on the communication thread: a member that never joins
//     hangs it; the creation deadline is not enforced.
//
// Lifetime: MPI belongs to the process. The first create_mpi_world() initialises it (MPI_THREAD_FUNNELED, on
// the communication thread) unless the program already did, in which case the program must have asked for
// MPI_THREAD_MULTIPLE (shardkit calls MPI from its own thread). When the last MPI group handle is destroyed, the
// communication thread finalises MPI if shardkit initialised it and no call failed; MPI cannot be initialised
// twice in a process, so keep the world handle for the life of the program. Creating another world while one
// lives gives a second, independent group (a duplicate of MPI_COMM_WORLD).
//
// Thread-safety: as ProcessGroup.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/comm/process_group.h"

namespace shardkit::comm {

struct MpiOptions {
  absl::Duration default_timeout = absl::Minutes(5);
  std::string name = "world";
  // How long the communication thread keeps polling MPI without sleeping after its last progress (MPI
  // progresses only inside its calls); then it sleeps 50 us between polls.
  absl::Duration spin = absl::Milliseconds(2);
  // Exchange call descriptions before each collective (see Checks above). false saves one small collective per
  // call; ranks that disagree then hand MPI mismatched buffers (undefined behaviour).
  bool verify_calls = true;
};

// True when shardkit was built with MPI.
bool mpi_backend_built();

// This process's handle on MPI_COMM_WORLD (rank = MPI rank). A collective over every process of the job.
absl::StatusOr<std::shared_ptr<ProcessGroup>> create_mpi_world(const MpiOptions& options = {});

}  // namespace shardkit::comm
