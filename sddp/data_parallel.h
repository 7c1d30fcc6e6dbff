// Data-parallel wrappers (DESIGN.md section 4): DistributedDataParallel (the unsharded baseline: every
// gradient all-reduced) and ShardedDataParallel (ZeRO-2: gradients reduced to the OSS rank that owns them,
// reduce_scatter into owned slices with OSS's flat policy). Both are one DataParallel (this file) with a
// different Reducer strategy (reducer.h).
//
//   auto oss = oss::Oss::create({{model.parameters(), hyper}}, optim::AdamW::factory(), pg).value();
//   auto sddp = ShardedDataParallel::create(model, {oss.get()}, pg).value();
//   for (...) {
//     oss->zero_grad();
//     autograd::backward(model.loss(x, y));   // reductions run during backward; done when it returns
//     if (absl::Status s = oss->step(); !s.ok()) return s;
//   }
//
// The loop zeroes and steps the optimizer only, never the wrapper (Note [training step contract] in
// common/optim/optimizer.h): with DistributedDataParallel the plain optimizer (or an Oss) over the module's
// parameters, with ShardedDataParallel its Oss objects. The wrapper holds no gradient between steps: the
// owned slices it delivers (flat) belong to the Oss from then on (Note [delivered gradient slices] in
// oss/oss.h), whose zero_grad() and step() release them.
//
// Construction (a collective): verifies that every rank has the same parameter and buffer names, shapes
// and dtypes (InvalidArgument naming the first difference, model_sync.h), broadcasts parameters and
// buffers from rank 0 (sync_models_at_startup), registers one post-accumulate-grad hook per trainable
// parameter and a forward pre-hook on the module.
//
// Forward: call the module as usual (module(x), or a method that calls it, like GPT::loss); with
// mixed_precision.param_dtype it runs on rounded copies of the parameters (see DataParallelOptions). The pre-hook
// re-reads the trainable set when auto_refresh_trainable (a change rebuilds the buckets, with a warning when
// warn_on_trainable_params_changed) and broadcasts buffers from rank 0 when broadcast_buffers and training.
// Its errors (a refused trainable set, see refresh_trainable(); a failed broadcast) throw ReducerError from
// the forward; e.status() is the Status.
//
// Backward: see reducer.h. When backward returns, gradients are averaged over the ranks: all of them
// (DDP), the owned ones (ShardedDDP greedy: the others are released), or the owned slices handed to OSS via
// set_piece_grad (flat: every full-size gradient is released). Errors in backward (a failed collective)
// throw ReducerError from autograd::backward; autograd::try_backward returns them as a Status.
//
// Every rank must run the same sequence of forward / backward / no_sync / reduce / sync_buffers calls.
// Ownership: the wrapper refers to the module and the Oss objects (it does not own them); they must outlive
// it. Destroying the wrapper removes its hooks. Thread-safety: none; one wrapper belongs to one rank.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/comm/process_group.h"
#include "common/nn/mixed_precision.h"
#include "common/nn/module.h"
#include "oss/oss.h"
#include "sddp/reducer.h"

namespace shardkit::sddp {

// fairscale ShardedDataParallel's options (those that apply to DDP too).
struct DataParallelOptions {
  // Broadcast buffers from rank 0 before each training-mode forward.
  bool broadcast_buffers = true;
  // Broadcast parameters and buffers from rank 0 at construction.
  bool sync_models_at_startup = true;
  // Bucket capacity in elements; 0 = no buckets (each parameter reduced alone; flat reduce-scatter: one
  // reduce_scatter per OSS chunk).
  std::int64_t reduce_buffer_size = std::int64_t{1} << 23;
  // Re-read requires_grad before each forward and rebuild the reducer when it changed.
  bool auto_refresh_trainable = true;
  // Mixed precision (Note [mixed precision on f32 ops] in common/nn/mixed_precision.h), PyTorch DDP's
  // _MixedPrecision choices in FSDP2's policy. param_dtype: every forward (and so its backward) computes with the
  // parameters' values rounded to it (nn::MixedPrecisionHooks on the module: rounded copies swapped in for the
  // call, Note [rounded parameters in forward]); the parameters stay f32, the master the optimizer steps, and
  // their gradients land f32. reduce_dtype (empty: param_dtype, or each gradient's own dtype): gradients are
  // reduced in it (half the bytes for bf16 / f16). cast_forward_inputs rounds the module's floating inputs to
  // param_dtype, output_dtype its floating outputs. A dtype that is not floating is InvalidArgument at create().
  // With Oss, keep OssOptions::broadcast_dtype empty for an f32 master on every rank (broadcast_dtype rounds the
  // owner's parameters too).
  nn::MixedPrecisionPolicy mixed_precision = {};
  // Log a warning when the trainable set changed (auto_refresh_trainable).
  bool warn_on_trainable_params_changed = true;
  // Launched buckets that keep their buffers before the oldest is waited for.
  int max_buckets_in_flight = 4;
  // Deadline of each collective; empty: the group's default.
  std::optional<absl::Duration> timeout = std::nullopt;
  // OSS flat policy only. true: each chunk of OSS's flat partition (Note [flat chunks]) is reduce-scattered
  // straight into the owned slices (padding-free columns of at most reduce_buffer_size elements, Note
  // [column buckets]); a chunk's columns fill together, so keep OssOptions::flat_chunk_numel at most
  // reduce_buffer_size (a larger chunk is reduced only when all of it is ready, and held meanwhile: logged
  // at construction). false: ready-order buckets of owner-aligned pieces reduced to their owner (DeepSpeed
  // stage-2 style: the same bytes, any chunk size).
  bool flat_reduce_scatter = true;
};

class DataParallel {
 public:
  virtual ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  nn::Module& module() { return module_; }
  Tensor operator()(const Tensor& x) { return module_(x); }

  // RAII: while alive, backward does not reduce and gradients accumulate locally (fairscale / DDP no_sync).
  class [[nodiscard]] NoSync {
   public:
    explicit NoSync(DataParallel& dp) : dp_(&dp), previous_(dp.reducer_->sync()) { dp.reducer_->set_sync(false); }
    ~NoSync() {
      if (dp_) dp_->reducer_->set_sync(previous_);
    }
    NoSync(NoSync&& o) noexcept : dp_(std::exchange(o.dp_, nullptr)), previous_(o.previous_) {}
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;

   private:
    DataParallel* dp_;
    bool previous_;
  };
  NoSync no_sync() { return NoSync(*this); }

  // Reduces the current gradients by hand (e.g. after backwards run inside no_sync()). Collective.
  absl::Status reduce();
  // Broadcasts buffers from rank 0; blocking = false returns at once and the next forward (or
  // wait_for_buffers()) waits. Collective.
  absl::Status sync_buffers(bool blocking = true);
  absl::Status wait_for_buffers();
  // Re-reads requires_grad; rebuilds the reducer and refreshes the Oss objects. Every rank must call it at
  // the same point. Automatic before forward when auto_refresh_trainable (an error is then thrown from the
  // forward as a ReducerError carrying this Status). FailedPrecondition, and nothing changes, when a trainable
  // parameter is in none of the Oss optimizers (e.g. it was frozen and left out of their param groups, then
  // unfrozen): add it to a param group (Oss::add_param_group) on every rank and refresh again.
  absl::Status refresh_trainable();

  // ---- statistics (train_bench) ----
  // The last synchronised backward (or reduce()): buckets issued, gradient bytes, overlapped bytes,
  // overlap_frac(), final wait.
  const ReductionStats& last_backward_stats() const { return reducer_->last_stats(); }
  std::size_t num_buckets() const { return reducer_->num_buckets(); }
  std::vector<std::int64_t> bucket_numels() const { return reducer_->bucket_numels(); }
  // Gradients this rank holds after reduction, for a grad scaler or a norm: every trainable parameter's
  // .grad (DDP); the Oss objects' step_gradients() (ShardedDDP: owned .grads, or the delivered slices).
  std::vector<Tensor> held_gradients() const;
  // Elements of the trainable parameters (what every backward reduces).
  std::int64_t trainable_numel() const;
  const Reducer& reducer() const { return *reducer_; }
  Reducer& mutable_reducer() { return *reducer_; }
  const DataParallelOptions& options() const { return options_; }

 protected:
  DataParallel(nn::Module& module, std::shared_ptr<comm::ProcessGroup> group, DataParallelOptions options,
               ReduceStrategy strategy, std::vector<oss::Oss*> optimizers);
  // Verifies the model across ranks, broadcasts, builds the reducer and the forward hook.
  absl::Status init();

 private:
  // `refreshing`: after construction (a trainable parameter no Oss holds is then FailedPrecondition, not
  // InvalidArgument).
  absl::StatusOr<std::unique_ptr<Reducer>> make_reducer(bool refreshing) const;
  std::vector<bool> trainable_flags() const;
  void before_forward();

  nn::Module& module_;
  std::shared_ptr<comm::ProcessGroup> pg_;
  DataParallelOptions options_;
  ReduceStrategy strategy_;
  std::vector<oss::Oss*> optimizers_;
  std::unique_ptr<Reducer> reducer_;
  std::vector<bool> trainable_;
  std::vector<std::shared_ptr<comm::Work>> buffer_works_;
  autograd::HookHandle forward_hook_;
  // Registered after forward_hook_, so the trainable set is read from the f32 masters.
  std::unique_ptr<nn::MixedPrecisionHooks> mixed_precision_;
};

// The unsharded baseline: every gradient all-reduced (averaged) in buckets during backward.
class DistributedDataParallel : public DataParallel {
 public:
  static absl::StatusOr<std::unique_ptr<DistributedDataParallel>> create(nn::Module& module,
                                                                          std::shared_ptr<comm::ProcessGroup> group,
                                                                          DataParallelOptions options = {});

 private:
  using DataParallel::DataParallel;
};

// ZeRO-2: each gradient goes to the rank whose Oss owns it. Every trainable parameter of the module must be
// in exactly one of `optimizers` (all on `group`, all with the same partition policy). Greedy: buckets of
// one owner, reduced to it; flat: each OSS chunk's column buckets reduce-scattered into the owned slices
// (Note [column buckets] in bucketing.h), delivered with Oss::set_piece_grad (a flat param group must have
// one dtype).
class ShardedDataParallel : public DataParallel {
 public:
  static absl::StatusOr<std::unique_ptr<ShardedDataParallel>> create(nn::Module& module,
                                                                      std::vector<oss::Oss*> optimizers,
                                                                      std::shared_ptr<comm::ProcessGroup> group,
                                                                      DataParallelOptions options = {});

 private:
  using DataParallel::DataParallel;
};

}  // namespace shardkit::sddp
