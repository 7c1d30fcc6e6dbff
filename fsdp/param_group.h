// ParamGroup: one unit's parameters and its collectives (FSDP2's FSDPParamGroup).
//
// A unit is the set of parameters one fully_shard call manages. Per pass it costs one all_gather (unshard) and
// one reduce_scatter (gradients):
//
//   unshard   all_gather every rank's shard buffer (the parameters' rows and padding, contiguous: no copy-in)
//             into a gather buffer [N × S]; wait() copies each parameter's rows out of it into the parameter's
//             unsharded tensor (copy-out), frees the gather buffer, and swaps the module registrations to the
//             unsharded tensors. Large parameters without padding skip the buffer (Note [own collectives] in
//             param_group.cc).
//   reshard   swaps the registrations back to the shards and releases the unsharded tensors' bytes.
//   reduce    copies each unsharded gradient's rows, rank by rank, into a buffer [N × S] (zeros for padding and
//             for parameters without a gradient), reduce_scatters it into [S], and gives each shard its rows as
//             its gradient (added to a gradient already there: accumulation over steps); the unsharded
//             gradients are released. Large parameters without padding are reduce-scattered straight from their
//             gradients (Note [own collectives] in param_group.cc).
//
// Every buffer lives on the parameters' device, CPU or CUDA (Note [unit on a device] in param_group.cc), except
// the shard buffer and the sharded gradients under cpu offload, which live in host memory (Note [cpu offload]).
//
// Memory (ledger categories): the shard buffer and the unsharded tensors are `parameter`; the gather buffer and
// the reduce_scatter input `communication_buffer`; the sharded gradients `gradient`. S includes padding:
// Σ ceil(d0/N) · row elements over the unit's parameters.
//
// Thread-safety: one rank's thread. Collectives: every rank calls unshard / reduce in the same order.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/comm/process_group.h"
#include "fsdp/fsdp_param.h"
#include "fsdp/mixed_precision.h"

namespace shardkit::fsdp {

class ParamGroup {
 public:
  // Takes the parameters (their current values: every rank must pass the same ones, e.g. built from the same
  // seed) and shards them: each rank keeps its rows in the shard buffer, the registrations point at the shards.
  // Hashes each parameter while it is whole (take_value_hashes(); Note [same values on every rank] in
  // same_values.cc).
  // `params[i].registrations`, `names` and `global_shape` must be set; the rest is filled here.
  // `replicate` (HSDP, Note [hybrid sharding]): the group of the ranks holding the same shard as this one (one
  // per replica), or nullptr.
  // `mp`: the dtypes of the all-gather and the reduce-scatter (Note [mixed precision on f32 ops] in
  // mixed_precision.h).
  // `cpu_offload`: the shard buffer and the shards' gradients in host memory (Note [cpu offload] in the .cc).
  ParamGroup(std::string name, std::vector<FSDPParam> params, std::shared_ptr<comm::ProcessGroup> group,
             std::shared_ptr<comm::ProcessGroup> replicate, std::optional<absl::Duration> timeout,
             MixedPrecisionPolicy mp = {}, std::int64_t own_collective_min_numel = INT64_MAX,
             bool cpu_offload = false);
  ParamGroup(const ParamGroup&) = delete;
  ParamGroup& operator=(const ParamGroup&) = delete;

  // An all_gather in flight; wait() finishes the unshard (copy-out, swap). Waiting twice is a no-op.
  class UnshardHandle {
   public:
    UnshardHandle() = default;
    absl::Status wait();

   private:
    friend class ParamGroup;
    ParamGroup* group_ = nullptr;
    std::vector<std::shared_ptr<comm::Work>> works_;  // the shared all-gather first, then the own ones
    Tensor gathered_;  // f32, or param_dtype (the shard was cast for the all-gather); undefined when not needed
    bool own_ = false;  // own collectives gather into the unsharded buffer (Note [own collectives])
  };
  // Note [reshard to a k-group]
  // reshard_after_forward = k: after forward each rank keeps, besides its shard, its part of the parameters split
  // over the k ranks of its k-group (ranks [g·k, g·k + k)), the same dim-0 rule with k in place of N (the
  // "k-shard", MemoryCategory::parameter, about Ψ_unit/k); the unsharded tensors are released. The next unshard
  // (before backward) all-gathers the k-shards within the k-group only, not the whole group. A full reshard (after
  // backward) drops the k-shards.
  // Makes the unit able to reshard to k-groups: splits the group (a collective: every rank calls it, in the
  // same order). Requires 1 < k < N with k dividing N (fully_shard checks it).
  absl::Status enable_group_reshard(int k);
  // After forward, while unsharded: keep this rank's k-shard, release the unsharded tensors.
  void reshard_to_group();

  // Starts unsharding (a no-op handle when already unsharded with current values). Collective (over the k-group after
  // reshard_to_group(), else over the whole group).
  // exact: gather f32 whatever param_dtype is (summon_full_params: values to read, write and save).
  absl::StatusOr<UnshardHandle> unshard_async(bool exact = false);
  absl::Status unshard(bool exact = false);
  // Whether the unsharded values are the shards' own (FSDPParam::unsharded_exact); true when sharded.
  bool unsharded_exact() const { return !unsharded_ || params_.empty() || params_.front().unsharded_exact; }
  void reshard();
  // Unsharded with values still current: false once the shards got gradients since the unshard (Note [kept after
  // backward, stale after a step] in param_group.cc); the next unshard then gathers again.
  bool is_unsharded() const { return unsharded_ && !stale_; }
  // While unsharded with exact values: copies this rank's rows of the unsharded parameters into the shards (values
  // written to the full parameters, e.g. by load_state_dict, survive the next reshard()). A no-op otherwise.
  void write_back();

  // Reduces the unsharded gradients into the shards' gradients (see above). `divide_factor`: the sum is
  // divided by it (empty: by the world size, an average). Collective.
  absl::Status reduce_grads(std::optional<double> divide_factor);
  // The same in two halves (Note [reduce-scatter in flight] in state.cc): start copies the gradients into the
  // reduce_scatter input, releases the unsharded gradients and issues the collective; finish waits for it and
  // gives the shards their gradients. At most one reduce per unit is in flight (start finishes a pending one
  // first). finish is a no-op when nothing is in flight. Collective (start; finish under HSDP).
  // HSDP (Note [hybrid sharding]): finish then all-reduces the reduced rows across replicas, unless
  // `all_reduce_replicas` is false: the rows are then kept aside and added in at the next reduce that all-reduces.
  absl::Status start_reduce_grads(std::optional<double> divide_factor, bool all_reduce_replicas = true);
  absl::Status finish_reduce_grads();
  bool reduce_in_flight() const { return pending_reduce_.has_value(); }
  // N × S × 4: the unit's f32 all_gather output and reduce_scatter input, padding included.
  std::int64_t unsharded_bytes() const { return shard_.nbytes() * pg_->size(); }
  // Whether any unsharded gradient is defined (gradients not reduced yet).
  bool has_unsharded_grads() const;
  // Whether a reduce has anything to do: a parameter requires grad, or HSDP rows wait for their all-reduce. The same
  // on every rank (freezing is), unlike has_unsharded_grads (Note [frozen parameters are not reduced] in
  // param_group.cc).
  bool needs_reduce() const;
  // Drops the unsharded gradients and a reduce in flight, waited for first (a failed backward: Note [a backward
  // that threw] in state.cc).
  void drop_unsharded_grads();

  // Note [same values on every rank] in same_values.cc: per parameter, the hash of its whole values taken at
  // construction (empty over a group of one rank without a replicate group); handed over once, to fully_shard.
  std::vector<std::uint64_t> take_value_hashes() { return std::move(value_hashes_); }

  // Note [unit fingerprints] in param_group.cc: names the unit (the same name on every rank, another for every unit
  // of its group); its collectives then carry fingerprints of it. Before this, they carry none.
  void set_identity(std::string identity) { identity_ = std::move(identity); }

  const std::string& name() const { return name_; }
  const std::vector<FSDPParam>& params() const { return params_; }
  std::int64_t shard_numel() const { return shard_.numel(); }  // S, padding included
  comm::ProcessGroup& process_group() const { return *pg_; }

 private:
  absl::Status finish_unshard(const Tensor& gathered, bool own);
  // Whether `p` requires grad now: the flag of the tensor the module holds (Note [freezing while unsharded]).
  bool trains(const FSDPParam& p) const { return (unsharded_ ? p.unsharded : p.sharded).requires_grad(); }
  // Registers the shards as the module's parameters, carrying the flags set meanwhile on the unsharded tensors.
  void register_shards();
  // Whether this unshard / reduce uses own collectives (Note [own collectives]): f32 moved, whole group.
  bool own_unshard(DType gather_dtype) const { return own_numel_ > 0 && !k_resharded_ && gather_dtype == DType::f32; }
  bool own_reduce() const { return own_numel_ > 0 && mp_.reduce_in() == DType::f32; }
  absl::Duration timeout() const { return timeout_.value_or(pg_->default_timeout()); }
  // A buffer of this unit: on its parameters' device (Note [unit on a device] in param_group.cc).
  TensorOptions options(MemoryCategory category, DType dtype = DType::f32) const {
    return TensorOptions{}.with_category(category).with_dtype(dtype).with_device(device_);
  }
  // Where the shards and their gradients live: the host under cpu offload, else the parameters' device.
  Device shard_device() const { return offload_ ? Device::cpu() : device_; }
  // The shard buffer where the collectives read it: itself, or (cpu offload) a copy on the parameters' device.
  Tensor shard_on_device() const;

  // Note [unit fingerprints]: the fingerprint of this unit's collective for `purpose`, or 0 before set_identity.
  std::uint32_t fingerprint(std::string_view purpose) const;

  std::string name_;
  std::optional<std::string> identity_;  // Note [unit fingerprints]
  std::vector<FSDPParam> params_;
  std::vector<std::uint64_t> value_hashes_;  // Note [same values on every rank] in same_values.cc
  std::shared_ptr<comm::ProcessGroup> pg_;
  std::shared_ptr<comm::ProcessGroup> replicate_;  // HSDP, else nullptr
  Tensor partial_;  // HSDP: reduced rows not all-reduced yet (set_requires_all_reduce(false)), or undefined
  std::vector<std::int64_t> partial_offsets_;  // HSDP: partial_'s layout (ReduceLayout::offsets)
  std::vector<char> partial_used_;  // HSDP: with partial_, which parameters some rank of the shard group used
  std::optional<absl::Duration> timeout_;
  MixedPrecisionPolicy mp_;
  Device device_ = Device::cpu();  // the parameters' (Note [unit on a device])
  bool offload_ = false;           // Note [cpu offload]
  Tensor shard_;  // [S]: this rank's rows of every parameter, each followed by its padding
  // Note [own collectives]: the parameters sharing a collective come first in shard_ ([0, shared_numel_)), those
  // with their own after (own_numel_ elements).
  std::int64_t shared_numel_ = 0;
  std::int64_t own_numel_ = 0;
  Tensor full_;   // every unsharded parameter, back to back (released at rest); each one's `unsharded` views it
  bool unsharded_ = false;
  bool stale_ = false;  // Note [kept after backward, stale after a step]
  // Note [reshard to a k-group]
  int k_ = 0;                                  // 0: not enabled
  std::shared_ptr<comm::ProcessGroup> kgroup_;
  std::vector<std::int64_t> k_offsets_;        // each parameter's offset in the k-shard
  Tensor kshard_;                              // released unless k-resharded
  bool k_resharded_ = false;
  bool k_exact_ = true;  // the k-shards hold exact values (see unsharded_exact)
  // Where each parameter's rows go in a reduce (Note [frozen parameters are not reduced] in param_group.cc).
  struct ReduceLayout {
    std::vector<std::int64_t> offsets;  // per parameter, into the reduced rows; -1: frozen, not reduced
    std::int64_t shared = 0;            // rank stride of the shared reduce_scatter's input
    std::int64_t total = 0;             // the reduced rows of every reduced parameter, padding included
  };
  ReduceLayout reduce_layout(bool own) const;
  struct PendingReduce {
    std::vector<std::shared_ptr<comm::Work>> works;
    ReduceLayout layout;
    Tensor out;  // [layout.total], the reduced rows of every reduced parameter
    Tensor used;  // one flag per parameter: some rank of the group had its gradient (Note [parameters no rank used])
    std::optional<double> divide_factor;
    bool all_reduce_replicas = true;
  };
  std::optional<PendingReduce> pending_reduce_;
};

}  // namespace shardkit::fsdp
