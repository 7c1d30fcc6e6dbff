// Oss: optimizer state sharding, ZeRO stage 1 (DESIGN.md section 3).
//
// Wraps any optim::Optimizer (through its factory). The parameters of every param group are partitioned
// across the ranks of a ProcessGroup (partition.h): greedy whole tensors, or a flat even split where a
// tensor may straddle ranks. Each rank builds an inner optimizer over what it owns only, so it allocates
// optimizer state (and fp32 master weights) for its share only. step() steps the share, then brings every
// rank's parameters up to date: bucketed broadcasts from the owners (greedy) or one all_gather per bucket
// (flat). Gradients must be the same on every rank before step() (averaged by DDP, or reduced to their
// owners by ShardedDataParallel: only the owned part of each gradient is read).
//
// Training loop: the Oss is the object the loop zeroes and steps, with or without ShardedDataParallel
// (Note [training step contract] in common/optim/optimizer.h):
//
//   auto opt = oss::Oss::create({{model.parameters(), hyper}}, optim::AdamW::factory(), pg).value();
//   for (...) {
//     opt->zero_grad();
//     autograd::backward(model.loss(x, y));   // gradients averaged by DDP, or reduced by ShardedDDP
//     if (absl::Status s = opt->step(); !s.ok()) return s;
//   }
//
// Collective calls: the constructor (create), step(), clip_grad_norm(), consolidate_state_dict() and
// load_state_dict() are collectives over the group: every rank calls them, in the same order.
//
// Flat policy: the inner optimizer steps views of the parameters (views share the parameters' bytes, so
// the step writes the parameters in place); before each step the views' gradients are set to the
// matching views of the parameters' gradients.
//
// Frozen parameters (requires_grad false) keep their owner; they are not broadcast. The set of trainable
// parameters must be the same on every rank; it is re-read at each step (refresh_trainable() does it
// explicitly, e.g. right after freezing).
//
// Note [delivered gradient slices]
// With the flat policy a gradient may arrive as an owned slice only (set_piece_grad: ShardedDataParallel's
// reduce-scatter, or a hand-written reduction), with no full-size gradient behind it. The slice is handed
// over: from then on the Oss holds the only reference the library keeps (the reducer drops its own at
// delivery), so the memory is freed when the Oss lets go. It does so in step() (after stepping: a slice
// serves one step) and in zero_grad() (set_to_none or not: a slice is not an accumulator), and a slice
// delivered for one step is never read by a later one. With ShardedDataParallel's flat strategies, a rank's
// gradient bytes are therefore exactly its owned share after backward, and zero after step() or zero_grad().
//
// Errors (absl::Status): when the inner optimizer refuses the step (Note [training step contract]: a
// hyper-parameter set out of range, a released parameter), step() returns its Status before any collective
// and nothing changes (the gradients stay for a retry); hyper-parameters are the same on every rank, so a
// range error is refused by every rank alike. When a collective of step() fails (a rank died, a deadline passed), the group is
// aborted (common/comm/process_group.h) and step() returns its Status naming the rank and the operation. The
// model is then NOT consistent across ranks: owners have stepped their share and only some buckets have
// arrived. Recover from the last checkpoint (consolidate_state_dict / load_state_dict) on a new group.
// Thread-safety: none; one Oss belongs to one rank.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/comm/process_group.h"
#include "common/optim/optimizer.h"
#include "common/optim/state_dict.h"
#include "oss/partition.h"

namespace shardkit::oss {

enum class PartitionPolicy { greedy, flat };

// "greedy" / "flat" (for messages, benchmark and test names).
constexpr const char* partition_policy_name(PartitionPolicy p) { return p == PartitionPolicy::greedy ? "greedy" : "flat"; }

struct OssOptions {
  PartitionPolicy policy = PartitionPolicy::greedy;
  // Parameters are sent in buckets of at most this many bytes (greedy: parameters smaller than
  // pack_below_bytes of one owner are packed together; flat: all_gather output per bucket).
  std::int64_t bucket_bytes = 16 << 20;
  // Greedy: a parameter of at least this many bytes is broadcast alone and in place (no packing copies);
  // smaller ones share buckets, to save per-call latency. See Note [OSS parameter buckets].
  std::int64_t pack_below_bytes = 64 << 10;
  // Send parameters in this dtype (e.g. bf16 for f32 parameters). Every rank, the owner included, then
  // holds the parameter rounded to this dtype, so all ranks keep identical models. Empty: the parameter's.
  std::optional<DType> broadcast_dtype = std::nullopt;
  // Flat policy: keep each param group's parameters in one contiguous buffer laid out as the flat index
  // space (each chunk padded to world · its shard size), so parameters are all-gathered in place with no
  // copies. The parameters are re-bound (Tensor::rebind) into that buffer at construction: create the Oss
  // before anything takes views of them. While it is built, a group's parameters are held twice (old
  // storage and buffer). Used for groups whose parameters share one dtype, without broadcast_dtype; other
  // groups are all-gathered through a bucket. See Note [OSS parameter buckets].
  bool contiguous_flat = true;
  // Flat policy: each param group is cut into chunks of about this many elements, each split evenly over
  // the ranks (Note [flat chunks] in partition.h); <= 0: one chunk per group. With ShardedDataParallel's
  // reduce-scatter, a chunk is what one collective reduces during backward: keep it at most its
  // reduce_buffer_size (the same default) so gradients are reduced while backward goes on.
  std::int64_t flat_chunk_numel = std::int64_t{1} << 23;
  // Deadline of each collective; empty: the group's default.
  std::optional<absl::Duration> timeout = std::nullopt;
};

// Where one rank's share of a parameter lives: elements [offset, offset + length) of parameter `param` of
// group `group`, whose global index (Note [parameter indices] in common/optim/state_dict.h) is `index`.
struct OwnedPiece {
  int group = 0;
  int param = 0;
  std::int64_t index = 0;
  std::int64_t offset = 0;
  std::int64_t length = 0;
};

// One rank's part of the optimizer state, with what is needed to put shards back together.
struct ShardedStateDict {
  int rank = 0;
  int world = 1;
  PartitionPolicy policy = PartitionPolicy::greedy;
  // State of the owned pieces, keyed by global index; hyper-parameters of every group. For the flat policy
  // each state tensor holds only the owned elements (1-D).
  optim::OptimizerStateDict state;
  std::map<std::int64_t, OwnedPiece> pieces;  // global index -> owned piece
  std::vector<Shape> param_shapes;            // by global index
};

// Puts the shards of every rank (any order, one per rank) back into the full state dict. InvalidArgument
// when shards are missing, duplicated, or disagree (world, policy, shapes, step counts, uncovered elements).
absl::StatusOr<optim::OptimizerStateDict> merge_sharded_state_dicts(const std::vector<ShardedStateDict>& shards);

class Oss {
 public:
  // Partitions `groups` over `group`'s ranks and builds this rank's inner optimizer with `factory`.
  // InvalidArgument for an undefined, non-floating, non-CPU or repeated parameter, or a factory error.
  static absl::StatusOr<std::unique_ptr<Oss>> create(std::vector<optim::ParamGroup> groups,
                                                     optim::OptimizerFactory factory,
                                                     std::shared_ptr<comm::ProcessGroup> group,
                                                     OssOptions options = {});
  ~Oss();
  Oss(const Oss&) = delete;
  Oss& operator=(const Oss&) = delete;

  // Steps this rank's share, then updates every rank's parameters, and drops the delivered slices (Note
  // [delivered gradient slices]). Collective. See Note [training step contract].
  [[nodiscard]] absl::Status step();
  // Every parameter's gradient (all of them, owned or not) set to none or zero, and every delivered slice
  // dropped: the one zeroing call of a training loop, with or without ShardedDataParallel.
  void zero_grad(bool set_to_none = true);
  // The gradients the next step() reads: this rank's owned part of every gradient (greedy: the owned
  // parameters' .grad; flat: each owned piece's delivered slice, else the matching view of its parameter's
  // .grad), undefined ones left out. For a grad scaler or a norm. Views and slices alias what step() reads.
  std::vector<Tensor> step_gradients() const;
  // How many times step() (successfully) or zero_grad() ran: ShardedDataParallel tells by it a second
  // synchronised backward onto gradients nothing consumed yet (Note [one synchronised backward per step] in
  // sddp/data_parallel.cc).
  std::int64_t grad_generation() const { return grad_generation_; }
  // Appends a group (partitioned on its own: existing ownership does not move). Every rank must call it
  // with the same parameters. Not a collective.
  absl::Status add_param_group(optim::ParamGroup group);

  std::size_t num_param_groups() const { return groups_.size(); }
  const optim::ParamGroup& param_group(std::size_t g) const { return groups_.at(g); }
  // Changes reach the inner optimizer at the next step (lr schedules).
  optim::HyperParams& mutable_hyper(std::size_t g) { return groups_.at(g).hyper; }

  // ---- ownership (what ShardedDataParallel routes gradients with) ----
  PartitionPolicy policy() const { return options_.policy; }
  const OssOptions& options() const { return options_; }
  const comm::ProcessGroup& process_group() const { return *pg_; }
  // Greedy: the rank that owns parameter `param` of group `group`. Flat: InternalError (use flat_partition).
  int owner(int group, int param) const;
  const GreedyPartition& greedy_partition() const { return greedy_; }
  const FlatPartition& flat_partition() const { return flat_; }
  // This rank's pieces, in the inner optimizer's parameter order.
  const std::vector<OwnedPiece>& owned_pieces() const { return local_; }
  std::int64_t owned_numel() const;
  std::int64_t global_index(int group, int param) const;

  // Total gradient norm over the whole model (2 or inf) computed from each rank's owned part: local partial
  // norms in fp32/double, one all_reduce (sum; max for inf). Scales every gradient this rank holds by
  // min(1, max_norm / (norm + 1e-6)). Returns the norm before clipping, identical on every rank. Collective.
  // InvalidArgument (before any collective) for max_norm <= 0 or NaN.
  absl::StatusOr<double> clip_grad_norm(double max_norm, double norm_type = 2.0);

  // ---- state ----
  // Gathers the full optimizer state on `to_rank` (point to point, one rank's shard at a time: only
  // to_rank ever holds the full state). Collective.
  absl::Status consolidate_state_dict(int to_rank = 0);
  // Hands over the consolidated state (full, global indices) on the rank that received it, and drops this
  // rank's copy, so the full state is not kept alive between checkpoints. FailedPrecondition elsewhere,
  // before consolidate_state_dict(), or when it was already handed over.
  absl::StatusOr<optim::OptimizerStateDict> state_dict();
  // This rank's own part, with partition metadata. Not a collective.
  ShardedStateDict sharded_state_dict() const;
  // Loads a full state dict (from state_dict() or merge_sharded_state_dicts(), saved at any world size):
  // each rank keeps its part. Every rank passes the same dict. Collective: if any rank rejects it, every
  // rank returns InvalidArgument and keeps its previous state and hyper-parameters.
  absl::Status load_state_dict(const optim::OptimizerStateDict& full);

  // Re-reads which parameters are trainable (also done automatically at each step).
  void refresh_trainable();

  // Flat policy, for ShardedDataParallel's reduce-scatter: gives piece k (owned_pieces()[k]) its gradient
  // directly (`grad` has piece.length elements, any float dtype), so the parameter needs no full-size
  // gradient. It is used by the next step() instead of a view of the parameter's gradient; step() and
  // zero_grad() drop it, and the piece goes back to reading the parameter's gradient (Note [delivered
  // gradient slices]: the caller hands it over and keeps no reference if it wants the memory freed then).
  void set_piece_grad(std::size_t k, const Tensor& grad);

  // The inner optimizer over this rank's share.
  optim::Optimizer& shard_optimizer() { return *inner_; }

 private:
  Oss(std::vector<optim::ParamGroup> groups, std::shared_ptr<comm::ProcessGroup> group, OssOptions options);
  void partition();
  void make_flat_buffer(std::size_t g);
  std::vector<optim::ParamGroup> local_groups(std::size_t first_group) const;
  void attach_shard_grads();
  std::vector<bool> read_trainable() const;  // requires_grad of every parameter, by global index
  absl::Status sync_params();
  absl::Status wait_all(std::vector<std::shared_ptr<comm::Work>>& works);
  absl::Duration timeout() const;

  std::vector<optim::ParamGroup> groups_;
  std::shared_ptr<comm::ProcessGroup> pg_;
  OssOptions options_;
  GreedyPartition greedy_;
  FlatPartition flat_;
  std::vector<std::int64_t> first_index_;  // global index of each group's first parameter
  std::size_t partitioned_groups_ = 0;      // groups whose pieces are in local_
  std::vector<Tensor> flat_buffers_;        // per group (flat policy, contiguous_flat): undefined if not used
  // Per chunk of flat_: where its world · shard_size elements start in its group's flat buffer.
  std::vector<std::int64_t> chunk_buffer_offset_;
  std::vector<OwnedPiece> local_;
  std::vector<Tensor> shards_;  // parallel to local_: the tensors the inner optimizer steps
  std::unique_ptr<optim::Optimizer> inner_;
  std::vector<bool> trainable_;  // by global index, as last read
  std::vector<bool> external_grad_;  // parallel to local_: set_piece_grad() since the last step
  // Parallel to local_ (flat): the piece holds a zero gradient, as a parameter whose gradient zero_grad(false)
  // zeroed does (Note [zero gradients of flat pieces] in oss.cc).
  std::vector<bool> zero_grad_kept_;
  std::vector<bool> had_grad_;  // parallel to local_ (flat): the piece had a gradient at the last step()
  std::int64_t grad_generation_ = 0;
  std::optional<optim::OptimizerStateDict> consolidated_;
  std::optional<optim::OptimizerStateDict> backup_;  // during load_state_dict only
};

}  // namespace shardkit::oss
