// Reducer: the one gradient reducer behind DistributedDataParallel and ShardedDataParallel (DESIGN.md
// section 4; the shape of PyTorch DDP's reducer.cpp). Hooks, buckets, pending counts, in-order launch and a
// final callback live here once; what a bucket's collective is comes from the strategy:
//
//   all_reduce       every rank ends with the averaged gradient of every parameter      (DDP)
//   reduce_to_owner  each bucket holds gradients of one owner rank and is reduced to it;  (ShardedDDP, OSS
//                    the other ranks release those gradients                              greedy)
//   reduce_scatter   column buckets of each flat chunk (Note [column buckets], Note [flat   (ShardedDDP, OSS
//                    chunks]) are reduce-scattered straight into each rank's owned slices;  flat; ZeRO-2)
//                    full-size gradients are released on every rank and the owned slices
//                    are delivered through FlatPiece::deliver
//   flat_reduce_to_owner  flat split too, but ready-order buckets of parameter pieces cut at  (ShardedDDP, OSS
//                    rank boundaries, each bucket reduced to its owner and delivered into     flat, DeepSpeed
//                    the owned slices: the same bytes, buffers bounded whatever the chunk     stage-2 style)
//                    size
//
// Backward, per synchronised backward (Note [reducer lifecycle] in reducer.cc):
//   * a post-accumulate-grad hook per trainable parameter calls mark_ready(i): its gradient is copied into
//     its bucket(s) scaled by 1/world (the scale is fused into the copy; a parameter alone in its bucket is
//     scaled and reduced in place in its .grad); a bucket whose pending count reaches zero is launched if
//     every earlier bucket has been launched (so every rank issues the same collectives in the same order);
//   * the first hook of a backward queues a final callback (autograd::queue_callback) which treats
//     parameters that got no gradient as ready (with their current .grad or zeros), launches what is left,
//     and WAITS for every reduction (fairscale #241) before backward returns;
//   * at most max_buckets_in_flight launched buckets keep their buffers; the oldest is waited for and
//     finished when the limit is reached (this bounds communication-buffer memory during backward).
//
// Bucket order: the first synchronised backward uses reverse parameter order; its observed ready order is
// recorded, rank 0's is broadcast (every rank must agree; a rank whose order differs logs a warning and
// follows rank 0), and the buckets are rebuilt once in that order (Note [ready-order buckets]).
//
// Accumulation: while sync is off (no_sync), hooks do nothing and .grad accumulates locally; the next
// synchronised backward reduces the accumulated gradients. Between two synchronised backwards the caller
// must zero gradients (reduced gradients are not accumulated again).
//
// Errors: a failed collective, or a gradient marked ready twice in one backward, throws ReducerError from
// the hook / callback, which propagates out of autograd::backward (autograd::try_backward returns it as a
// Status). Thread-safety: none; a Reducer belongs to one rank's thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/autograd/engine.h"
#include "common/autograd/hook_handle.h"
#include "common/comm/process_group.h"
#include "common/tensor/tensor.h"
#include "oss/partition.h"
#include "sddp/bucketing.h"

namespace shardkit::sddp {

enum class ReduceStrategy { all_reduce, reduce_to_owner, reduce_scatter, flat_reduce_to_owner };

// True for the strategies that deliver owned flat slices (FlatPiece) instead of whole gradients.
inline bool is_flat(ReduceStrategy s) {
  return s == ReduceStrategy::reduce_scatter || s == ReduceStrategy::flat_reduce_to_owner;
}

// An autograd::StatusError, so autograd::try_backward returns the reducer's own Status.
class ReducerError : public autograd::StatusError {
 public:
  using autograd::StatusError::StatusError;
};

// One trainable parameter handed to the reducer.
struct ReducerParam {
  std::string name;
  Tensor param;
  int owner = -1;                // reduce_to_owner: the rank that keeps the reduced gradient
  int space = -1;                // flat strategies: index of its flat space (a chunk of an OSS flat partition)
  std::int64_t flat_offset = 0;  // flat strategies: where it starts in that chunk's group's index space
};

// reduce_scatter: one of this rank's owned slices of a flat space, [flat_offset, flat_offset + length).
// After every synchronised backward, deliver(grad) receives its reduced gradient: a new tensor of `length`
// elements, every one written by this backward (a parameter that got no gradient contributes zeros). The
// reducer keeps no reference to it: the receiver (the Oss) is its only owner (Note [delivered gradient
// slices] in oss/oss.h).
struct FlatPiece {
  int space = 0;
  std::int64_t flat_offset = 0;
  std::int64_t length = 0;
  std::function<void(const Tensor&)> deliver;
};

struct ReducerOptions {
  // Elements per bucket (per column for all ranks together in reduce_scatter); 0 = every parameter alone
  // (reduce_scatter: one column per flat space).
  std::int64_t bucket_numel = std::int64_t{1} << 22;
  // The dtype gradients are reduced in (converted on the way into the bucket, scaled by 1/world in the same
  // pass, and back into the gradient's dtype after the reduction); empty: each gradient's own dtype.
  std::optional<DType> reduce_dtype = std::nullopt;
  int max_buckets_in_flight = 4;
  // Rebuild buckets from the ready order observed in the first synchronised backward.
  bool rebuild_buckets = true;
  std::optional<absl::Duration> timeout = std::nullopt;
  // When set, a count the gradients' consumer advances each time it consumes or clears them (ShardedDataParallel:
  // its Oss objects' grad_generation()); a synchronised backward (or reduce()) that finds it where the previous
  // reduction left it throws FailedPrecondition (Note [one synchronised backward per step] in data_parallel.cc).
  std::function<std::int64_t()> consumed_generation = nullptr;
};

// Statistics of the last synchronised backward (or reduce()).
struct ReductionStats {
  std::int64_t buckets = 0;          // collectives issued for gradients
  std::int64_t grad_bytes = 0;       // gradient bytes put into reductions (gradient dtype)
  // Bytes whose reduction was issued from a hook that was not the backward's last one, i.e. while the
  // backward still had gradients to compute (train_bench's overlap_frac).
  std::int64_t overlapped_bytes = 0;
  std::int64_t hooks = 0;            // gradient-ready hooks that ran
  absl::Duration final_wait = absl::ZeroDuration();  // time the final callback spent waiting
  double overlap_frac() const {
    return grad_bytes == 0 ? 0.0 : static_cast<double>(overlapped_bytes) / static_cast<double>(grad_bytes);
  }
};

class Reducer {
 public:
  // `spaces` (flat strategies): the split of each flat space; `pieces`: this rank's owned slices.
  // Registers one post-accumulate-grad hook per parameter (removed with the Reducer).
  Reducer(ReduceStrategy strategy, std::vector<ReducerParam> params, std::vector<oss::FlatChunk> spaces,
          std::vector<FlatPiece> pieces, std::shared_ptr<comm::ProcessGroup> group, ReducerOptions options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Off: hooks do nothing (no_sync).
  void set_sync(bool sync) { sync_ = sync; }
  bool sync() const { return sync_; }

  // The hook body: parameter `index`'s gradient is final for this backward. Public for custom setups.
  void mark_ready(int index);

  // Outside backward: reduces every parameter's current gradient now (missing ones count as zero) and
  // waits. Collective.
  absl::Status reduce_now();


  const std::vector<ReducerParam>& params() const { return params_; }
  std::size_t num_buckets() const { return buckets_.size(); }
  // Input elements of each bucket, in launch order.
  std::vector<std::int64_t> bucket_numels() const;
  // Parameter indices of bucket b (in copy order).
  std::vector<int> bucket_params(std::size_t b) const;
  bool buckets_rebuilt() const { return rebuilt_; }
  const ReductionStats& last_stats() const { return stats_; }

 private:
  struct Entry {
    int param = 0;
    std::int64_t param_offset = 0;
    std::int64_t bucket_offset = 0;
    std::int64_t length = 0;
  };
  struct OutEntry {  // reduce_scatter: output [out_offset, +length) -> piece `piece` at piece_offset
    int piece = 0;
    std::int64_t piece_offset = 0;
    std::int64_t out_offset = 0;
    std::int64_t length = 0;
  };
  struct Bucket {
    std::vector<Entry> entries;
    std::int64_t numel = 0;   // input elements
    std::int64_t width = 0;   // reduce_scatter output elements
    int root = 0;
    DType dtype = DType::f32;     // bucket (wire) dtype
    bool in_place = false;        // one whole parameter reduced in its .grad
    bool has_gaps = false;        // some elements get no entry (frozen members): zero the buffer
    std::vector<OutEntry> outs;
    int expected = 0;             // entries to fill
    // per backward
    int pending = 0;
    Tensor buffer, output;
    std::shared_ptr<comm::Work> work;
    std::int64_t grad_bytes = 0;
  };
  struct ParamSlot {
    std::vector<std::pair<int, int>> entries;  // (bucket, entry)
    bool owned = true;                          // keeps its full .grad after reduction
  };

  void build_buckets(const std::vector<int>& order);
  void build_flat_owner_buckets(const std::vector<int>& position);
  void add_outs(Bucket& b, int space, std::int64_t lo, std::int64_t hi, std::int64_t out_base) const;
  void begin_backward();
  void copy_in(int index);
  void launch_ready();
  void launch(int b);
  void finish_oldest();
  void finish(int b);
  void finalize();
  // Note [parameters no rank used] in reducer.cc: which parameters some rank had a gradient for in this backward.
  std::vector<char> used_anywhere();
  void deliver_pieces(const std::vector<char>& used);
  void rebuild_from_observed();
  absl::Duration timeout() const;

  ReduceStrategy strategy_;
  std::vector<ReducerParam> params_;
  std::vector<oss::FlatChunk> spaces_;
  std::vector<FlatPiece> pieces_;
  std::vector<Tensor> piece_grads_;  // flat strategies, during a backward only: filled, then handed over
  std::vector<int> piece_param_;     // the parameter each piece is a slice of (a piece never spans two)
  std::shared_ptr<comm::ProcessGroup> pg_;
  ReducerOptions options_;
  int rank_ = 0, world_ = 1;
  Device device_;  // where every parameter, gradient and bucket lives

  std::vector<Bucket> buckets_;
  std::vector<ParamSlot> slots_;
  std::vector<autograd::HookHandle> hooks_;
  bool sync_ = true;
  bool rebuilt_ = false;

  // per backward
  bool in_backward_ = false;
  std::vector<char> ready_;
  std::optional<std::int64_t> reduced_at_generation_;  // consumed_generation() when the last reduction ended
  std::vector<char> had_grad_;  // had a gradient when it went into its bucket (Note [parameters no rank used])
  std::vector<int> observed_order_;
  std::size_t next_launch_ = 0;
  std::vector<int> in_flight_;  // launched, not yet finished, in launch order
  std::vector<std::int64_t> launched_at_hook_;  // per bucket: hook count at launch (-1: from the callback)
  ReductionStats stats_;
  ReductionStats current_;
};

}  // namespace shardkit::sddp
