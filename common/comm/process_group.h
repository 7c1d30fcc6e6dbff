// ProcessGroup: the one interface every sharding layer uses to talk to other ranks (DESIGN.md section 2).
//
// A ProcessGroup is one rank's handle on a group of `size()` ranks numbered 0..size()-1. Backends:
// in-process (ranks are threads; in_process_group.h), TCP (tcp_*.h), NCCL (CUDA builds). Nothing above
// common/comm/ sees a backend.
//
// THE CONTRACT (every backend relies on it; breaking it is a bug in the caller):
//   * Every rank of the group issues the same collectives, in the same order, with matching arguments
//     (same kind, dtype, numel, root, op). Sends and recvs between a pair of ranks are matched in the
//     order they are issued (the k-th send from a to b pairs with the k-th recv at b from a).
//   * Every rank passes the same `fingerprint` (options) for a call: a caller's name for what the call is (e.g. a
//     hash of "which unit, which purpose"), so that calls that match in kind and size but not in meaning fail
//     instead of pairing silently. 0 means none, and is a value like any other: 0 on one rank and 7 on another
//     disagree. The in-process, TCP and shared-memory backends compare it, and so does MPI's with
//     MpiOptions::verify_calls (the default): a disagreement is InvalidArgument naming both fingerprints (below).
//     The NCCL backend does not (no description travels with its calls), so there a caller that breaks this gets
//     no error.
//   * A rank's collectives on one group are issued from one thread at a time (the order must be
//     well defined). Different groups (e.g. sub-groups) may be used from different threads.
//   * Tensors passed to a call must stay alive and must not be read (outputs) or written (inputs) by the
//     caller until the returned Work has completed. (The Work keeps the Tensor handles, so their storage
//     stays alive; the caller must still not touch the bytes.)
//
// Calls return a Work at once (every backend completes it in the background; a backend may have completed
// it already, e.g. a group of one rank). Work::wait(timeout) returns the call's status.
//
// Failure (Note [group failure]): a call fails when the arguments are wrong on this rank
// (InvalidArgument), when ranks disagree about a call (InvalidArgument naming both ranks, "expected X,
// found Y"), when a rank does not join within the call's timeout (DeadlineExceeded naming the missing
// ranks and the operation), or when any rank failed / aborted (Aborted naming that rank and the
// operation). Any such failure ABORTS the group: every rank's pending and later calls on the group fail
// with a Status that names the rank and operation at the origin of the failure. The group is not usable
// again; create a new one. No call waits longer than its timeout: a hang is a bug.
//
// Dtypes: f32, bf16, f16, i64. Reductions of bf16/f16 are accumulated in f32 and rounded to the tensor's
// dtype (a backend that has to forward partial sums, e.g. a ring, may round partial sums to the tensor
// dtype; the in-process backend rounds once). Summation order is backend-defined but identical on every
// rank: all ranks end with bit-identical results.
//
// Counters: each handle counts, per collective kind, calls and the ring-equivalent bytes sent and
// received (comm_counters.h, Note [ring-equivalent volume]); identical across backends.
//
// Thread-safety: rank(), size(), name(), counters(), reset_counters() and abort() may be called from any
// thread; calls that issue communication follow the contract above. Work may be waited on from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/comm/comm_counters.h"
#include "common/tensor/tensor.h"

namespace shardkit::comm {

// ---- Work --------------------------------------------------------------------------------------

// The handle of one issued call. Shared: the backend and the caller both hold it.
class Work {
 public:
  virtual ~Work() = default;

  // Waits until the call completes or `timeout` passes, whichever is first. Returns the call's status
  // once completed (OK, or the error that failed it, see Note [group failure]), or DeadlineExceeded if
  // `timeout` passed first; in that case the call stays pending (a wait timeout does not fail the call
  // or the group; the call's own deadline, from its options, does). Because every call has its own
  // deadline, wait() with the default infinite timeout still returns in bounded time.
  virtual absl::Status wait(absl::Duration timeout = absl::InfiniteDuration()) = 0;

  // True once the call has completed (successfully or not). Never blocks.
  virtual bool is_completed() const = 0;
};

// A Work that is already complete with `status` (for validation errors and trivially finished calls).
std::shared_ptr<Work> make_completed_work(absl::Status status);

// ---- reduction operations ----------------------------------------------------------------------

enum class ReduceKind : std::uint8_t { sum = 0, avg, min, max, premul_sum };

std::string_view reduce_kind_name(ReduceKind k);

// How elements from the ranks are combined. For float dtypes (bf16/f16 accumulated in f32):
//   sum: x_0 + … + x_{n−1};  avg: sum / n;  min / max: elementwise (NaN inputs give an unspecified
//   result);  premul_sum(f): (f·x_0) + … + (f·x_{n−1}) with f rounded to f32.
// For i64: exact integer arithmetic; avg truncates toward zero (sum / n in C++); premul_sum requires
// an integral factor (otherwise InvalidArgument) and computes Σ f·x_r.
struct ReduceOp {
  ReduceKind kind = ReduceKind::sum;
  double factor = 1.0;  // premul_sum only

  static ReduceOp sum() { return {ReduceKind::sum, 1.0}; }
  static ReduceOp avg() { return {ReduceKind::avg, 1.0}; }
  static ReduceOp min() { return {ReduceKind::min, 1.0}; }
  static ReduceOp max() { return {ReduceKind::max, 1.0}; }
  static ReduceOp premul_sum(double f) { return {ReduceKind::premul_sum, f}; }

  // "sum", "avg", ..., "premul_sum(0.25)".
  std::string to_string() const;
};

// "0x0000002a": a fingerprint (options below) as error messages print it.
std::string fingerprint_str(std::uint32_t fingerprint);
// A fingerprint naming `text` (32-bit FNV-1a; never 0, which means none): the same on every rank for the same text.
std::uint32_t fingerprint_of(std::string_view text);

// ---- options -----------------------------------------------------------------------------------
// Every options struct has:
//   timeout: the call's own deadline, counted from when it is issued on this rank; empty = the group's
//            default (ProcessGroup::default_timeout()). When it passes before the call completes, the
//            call fails with DeadlineExceeded naming the ranks that had not joined, and the group aborts.
//   tag:     a free-form label quoted in error messages and logs (e.g. "grad bucket 3"); no semantics.
//   fingerprint: a value every rank must pass alike for the call (THE CONTRACT above); 0 = none. Compared by the
//            in-process, TCP, shared-memory and MPI (verify_calls) backends, not by NCCL.
// Designated initializers read well: pg.all_reduce(t, {.op = ReduceOp::avg(), .tag = "grads"}).

struct BroadcastOptions {
  int root = 0;
  std::optional<absl::Duration> timeout = std::nullopt;
  std::string tag = {};
  std::uint32_t fingerprint = 0;
};

struct AllReduceOptions {
  ReduceOp op = ReduceOp::sum();
  std::optional<absl::Duration> timeout = std::nullopt;
  std::string tag = {};
  std::uint32_t fingerprint = 0;
};

struct ReduceOptions {
  int root = 0;
  ReduceOp op = ReduceOp::sum();
  std::optional<absl::Duration> timeout = std::nullopt;
  std::string tag = {};
  std::uint32_t fingerprint = 0;
};

struct AllGatherOptions {
  std::optional<absl::Duration> timeout = std::nullopt;
  std::string tag = {};
  std::uint32_t fingerprint = 0;
};

struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::sum();
  std::optional<absl::Duration> timeout = std::nullopt;
  std::string tag = {};
  std::uint32_t fingerprint = 0;
};

struct BarrierOptions {
  std::optional<absl::Duration> timeout = std::nullopt;
  std::string tag = {};
  std::uint32_t fingerprint = 0;
};

struct P2POptions {
  std::optional<absl::Duration> timeout = std::nullopt;
  std::string tag = {};
  std::uint32_t fingerprint = 0;
};

// Options for creating a sub-group (split / new_group).
struct SubGroupOptions {
  // The sub-group's default timeout; empty = the parent's.
  std::optional<absl::Duration> default_timeout = std::nullopt;
  // Name used in error messages; empty = "<parent name>/<index>".
  std::string name = {};
  // Deadline for the creation itself (it is a collective over the parent); empty = parent's default.
  std::optional<absl::Duration> timeout = std::nullopt;
};

// ---- the call a backend executes ---------------------------------------------------------------

// One validated call, as handed to a backend (ProcessGroup::run). Field use per kind:
//   broadcast:      tensor (in/out), root
//   all_reduce:     tensor (in/out), op
//   reduce:         tensor (in; out on root; non-root contents unspecified afterwards), root, op
//   all_gather:     input, output (output numel = size·input numel; rank r's input lands in
//                   output[r·m, (r+1)·m)); input may alias exactly that slice of output (in place)
//   reduce_scatter: input, output (input numel = size·output numel; rank r gets the reduction of slice
//                   r of every rank's input); output may alias exactly slice r of input (in place);
//                   input's contents are unspecified afterwards (backends may use it as scratch)
//   barrier:        nothing
//   send / recv:    tensor, peer (group rank)
// For single-tensor kinds, `input` and `output` are both `tensor`.
struct CollectiveCall {
  CollectiveKind kind = CollectiveKind::barrier;
  Tensor input;
  Tensor output;
  int root = 0;  // broadcast / reduce
  int peer = -1;  // send / recv
  ReduceOp op;
  absl::Duration timeout;  // resolved (never empty)
  absl::Time deadline;     // issue time + timeout
  std::string tag;
  std::uint32_t fingerprint = 0;  // options' fingerprint (THE CONTRACT); 0 = none
  std::int64_t seq = 0;    // index of this call among this handle's collectives (p2p not counted)

  // "all_reduce #12 'grads' (f32[1000], sum)" for error messages; ", fingerprint 0x0000002a" before the closing
  // parenthesis when the fingerprint is not 0.
  std::string describe() const;
};

// ---- ProcessGroup ------------------------------------------------------------------------------

class ProcessGroup : public std::enable_shared_from_this<ProcessGroup> {
 public:
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // e.g. "world" or "world/mesh.dim1.0"; quoted in error messages.
  const std::string& name() const { return name_; }
  // The global (world) rank of each group rank; identity for a world group.
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  // "rank 2" on a world group; "rank 1 (global rank 3)" on a sub-group.
  std::string describe_rank(int group_rank) const;
  absl::Duration default_timeout() const { return default_timeout_; }
  virtual std::string backend_name() const = 0;
  // Where a layer's own small tensors (a hash, a norm, a flag: Note [host tensors over device-only groups] in
  // host_staged.h) must live to travel over this group: the CPU for the host backends, the group's CUDA device
  // for NCCL, which moves nothing else.
  virtual Device scratch_device() const { return Device::cpu(); }

  // ---- collectives (see CollectiveCall for the exact semantics of each) ----
  std::shared_ptr<Work> broadcast(const Tensor& tensor, const BroadcastOptions& options = {});
  std::shared_ptr<Work> all_reduce(const Tensor& tensor, const AllReduceOptions& options = {});
  std::shared_ptr<Work> reduce(const Tensor& tensor, const ReduceOptions& options = {});
  std::shared_ptr<Work> all_gather(const Tensor& output, const Tensor& input, const AllGatherOptions& options = {});
  std::shared_ptr<Work> reduce_scatter(const Tensor& output, const Tensor& input,
                                       const ReduceScatterOptions& options = {});
  std::shared_ptr<Work> barrier(const BarrierOptions& options = {});
  // Point to point. dst / src are group ranks other than rank(); tensors must match in dtype and numel.
  std::shared_ptr<Work> send(const Tensor& tensor, int dst, const P2POptions& options = {});
  std::shared_ptr<Work> recv(const Tensor& tensor, int src, const P2POptions& options = {});

  // ---- sub-groups ----
  // MPI_Comm_split: a collective over this group. Ranks passing the same color >= 0 form one sub-group,
  // ordered by (key, parent rank); color < 0 yields nullptr (not a member of any). Blocks until done.
  absl::StatusOr<std::shared_ptr<ProcessGroup>> split(int color, int key, const SubGroupOptions& options = {});
  // A sub-group of exactly `ranks` (group ranks of this group, distinct; sub-group rank i = ranks[i]).
  // A collective over this group: every rank calls it with the same list; non-members get nullptr.
  absl::StatusOr<std::shared_ptr<ProcessGroup>> new_group(absl::Span<const int> ranks,
                                                          const SubGroupOptions& options = {});

  // ---- failure ----
  // Fails this rank's pending and later calls on this group (and tells the other ranks, whose pending
  // and later calls fail with `reason`, see Note [group failure]). Idempotent; the first reason wins.
  virtual void abort(const absl::Status& reason) = 0;

  // How many collectives (not point-to-point calls) this handle has issued: the sequence number its next one gets.
  // The same on every rank between the same two calls (THE CONTRACT), e.g. to name something made between calls.
  std::int64_t collectives_issued() const { return next_seq_; }

  // ---- counters (comm_counters.h) ----
  CommCounters counters() const;
  void reset_counters();

 protected:
  ProcessGroup(int rank, int size, std::string name, std::vector<int> global_ranks, absl::Duration default_timeout);

  // Executes a validated call (arguments checked locally, counters updated, timeout resolved). The
  // backend checks what only it can (device, agreement across ranks) and returns the Work.
  virtual std::shared_ptr<Work> run(CollectiveCall call) = 0;

  // Creates this rank's handle on a sub-group. `members` are the parent-group ranks of the sub-group in
  // sub-group rank order (this rank is among them); `key` is a string unique to this sub-group among
  // all sub-groups created from this parent, identical on every member (e.g. for a store prefix).
  // Called on every member, in the same order relative to other calls on the parent.
  virtual absl::StatusOr<std::shared_ptr<ProcessGroup>> make_subgroup(std::vector<int> members,
                                                                      const std::string& key,
                                                                      const std::string& name,
                                                                      absl::Duration default_timeout,
                                                                      absl::Time deadline) = 0;

 private:
  std::shared_ptr<Work> issue(CollectiveCall call, std::int64_t counted_bytes);

  int rank_;
  int size_;
  std::string name_;
  std::vector<int> global_ranks_;
  absl::Duration default_timeout_;
  std::int64_t next_seq_ = 0;
  std::int64_t next_split_ = 0;
  mutable std::mutex counters_mu_;
  CommCounters counters_;
};

}  // namespace shardkit::comm
