// The fully-shard parallel mode of compile() (issue 16 item 3): ZeRO-3 / FSDP2 as a graph rewrite.
//
//   auto mode = std::make_shared<fsdp::FullyShardMode>(pg, fsdp::FullyShardModeOptions{.bucket_bytes = 4 << 20,
//                                                                                        .prefetch = 1});
//   capture::CompiledStep step = capture::compile(step_fn, model, *opt, {.parallel_mode = mode,
//                                                                        .coalesce_bytes = 128 << 10});
//   ...
//   mode->unshard_parameters();   // the module's parameters (and the optimizer's state) whole again, e.g. to save
//
// The step function is the single-rank one; each rank calls the compiled step on its own rows of the batch.
// expand() shards every parameter the optimizer updates, per parameter as FSDP2 does (each rank keeps rows
// [r * S, (r + 1) * S) of the flattened parameter, S = ceil(numel / N), zero-padded):
//   * forward: an all_gather of the shard before each op that reads the parameter, then a view of the gathered rows
//     as the parameter (a new leaf), and after the last forward use a "reshard" that frees the gathered bytes;
//   * backward: an all_gather again before each backward node whose forward read the parameter (those nodes
//     saved it), and a reshard after the last;
//   * the gradient: a reduce_scatter(avg) into this rank's rows right after the node that finishes it;
//   * the update: the optimizer's update node runs on the shards (parameter, gradient, moments).
// Then compile's dedup pass removes the all_gathers that repeat one with nothing written in between (a parameter
// read by several ops, a module called twice): one all_gather per parameter per pass, as FSDP2's unit.
// The module's parameter storage and the optimizer's full state are released when the graph is expanded (the
// shards are the truth); unshard_parameters() writes them back whole (a collective), and before_capture() does so
// before every recapture, so the step can run eagerly again.
//
// Every rank must build the same model (same seed, or load the same values) before the compiled step's first call,
// as for fully_shard: expand() hashes each parameter the step reads while it is still whole and compares the hashes
// across the group (one all_gather of 8 bytes per parameter, at every capture; a collective, as the step is), and
// when a rank's values differ the capture fails on every rank with an InvalidArgument naming the first differing
// parameter (in the order the step first reads them) and both ranks, e.g. "fsdp: parameter 'blocks.0.attn.qkv.weight'
// on rank 1 differs from rank 0's before sharding: ...", and nothing is sharded (Note [same values on every rank] in
// fsdp/same_values.cc). The optimizer's state tensors are sharded unchecked.
//
// Limits (each an InvalidArgument / Unimplemented from expand(), never a wrong answer): bf16/f16 parameters with
// fp32 master weights are not sharded yet; a node that uses a full gradient between the backward and the update
// (clip_grad_norm) is refused, since the gradient is reduce-scattered by then; a parameter must be read in forward through ops or views the graph
// names ("reshape", "view"). Frozen parameters (requires_grad false) are sharded and gathered too, never reduced;
// one that requires grad but is not the optimizer's stays whole (Note [frozen parameters in the fully-shard mode]).
//
// Ownership: holds the group; refers to nothing else after expand() (it keeps the tensors it shards).
// Thread-safety: one mode per rank.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/capture/compile.h"
#include "common/comm/process_group.h"

namespace shardkit::fsdp {

// Note [gather buckets]
// Each pass (forward, backward) gathers a parameter once, before its first use; those first gathers are placed in
// buckets, as FSDP gathers a unit's parameters together: in the order of first use, consecutive parameters up to
// bucket_bytes of unsharded bytes (a parameter larger than that is a bucket of its own) are gathered back to back,
// before the first use of the bucket's first parameter, so compile's coalesce pass (Note [coalesce collectives]) can
// merge them: with CompileOptions::coalesce_bytes >= bucket_bytes each bucket is one all_gather (at the price of a
// pack and an unpack copy of the whole bucket); with a smaller bound (train_bench: 128 KiB in 4 MiB buckets) the
// bucket's small parameters become one call and the large ones stay calls of their own, gathered straight into
// their buffers. With prefetch = p, bucket b is
// gathered p buckets ahead, at the first use of bucket b - p (FSDP's implicit prefetch with p = 1): the gather then
// runs during bucket b - p's compute, and the replay waits for it only at bucket b's first use (Note [collective
// overlap] in executor.h); the price is p more buckets of gathered parameters alive at once. The reduce-scatters
// stay one per gradient, right after it is done; coalescing merges those that follow each other into one call
// (waited at the update). Bucketing and prefetch move calls, never change values: the result is bitwise the same.
//
// Note [kept for backward]
// With reshard_last_bucket_after_forward false, the parameters the forward still uses once its last bucket has
// begun (its own parameters, and any used again at the end, as GPT's tied embedding in the head) keep their
// gathered values from forward to backward: no reshard after forward and no gather in backward, whose first nodes
// need them (FSDP2 keeps the root unit so). The price is their unsharded bytes through the turn of the step.
struct FullyShardModeOptions {
  std::int64_t bucket_bytes = 0;  // 0: a bucket per parameter
  int prefetch = 0;               // buckets gathered ahead
  bool reshard_last_bucket_after_forward = true;  // Note [kept for backward]
};

class FullyShardMode final : public capture::ParallelMode {
 public:
  explicit FullyShardMode(std::shared_ptr<comm::ProcessGroup> group, FullyShardModeOptions options = {});

  std::string name() const override { return "fully_shard"; }
  std::map<std::string, std::shared_ptr<comm::ProcessGroup>> groups() const override;
  absl::Status before_capture() override { return unshard_parameters(); }
  // After unshard_parameters(): the whole tensors are the truth (Note [whole again after unshard_parameters]).
  std::optional<std::string> recapture_reason() const override {
    if (!whole_ || sharded_.empty()) return std::nullopt;
    return "unshard_parameters() made the parameters whole (they may have been written): sharding them again";
  }
  absl::Status expand(capture::StepGraph& graph) override;

  // Writes the shards back into the module's parameters and the optimizer's state tensors (reallocating them), on
  // every rank. A collective. Nothing to do before the first expand(), nor a second time before the next capture:
  // the whole tensors are then the truth (read or write them, e.g. load_state_dict), and the next call of the
  // compiled step captures again and shards them anew (Note [whole again after unshard_parameters]).
  absl::Status unshard_parameters();

  // Bytes this rank holds in shards (parameters and optimizer state), for the memory figures.
  std::int64_t shard_bytes() const;

 private:
  struct Sharded {
    Tensor full;   // the module's parameter, or the optimizer's state tensor (released while sharded)
    Tensor shard;  // this rank's rows, [S]
  };
  Tensor make_shard(const Tensor& full) const;

  std::shared_ptr<comm::ProcessGroup> group_;
  FullyShardModeOptions options_;
  std::vector<Sharded> sharded_;  // parameters and optimizer state, while the graph holds their shards
  bool whole_ = true;  // the module's whole tensors are the truth (before expand, after unshard_parameters)
};

}  // namespace shardkit::fsdp
