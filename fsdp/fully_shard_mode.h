// The fully-shard parallel mode of compile() (issue 16 item 3): ZeRO-3 / FSDP2 as a graph rewrite.
//
//   auto mode = std::make_shared<fsdp::FullyShardMode>(pg);
//   capture::CompiledStep step = capture::compile(step_fn, model, *opt, {.parallel_mode = mode});
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
// Limits (each an InvalidArgument / Unimplemented from expand(), never a wrong answer): bf16/f16 parameters with
// fp32 master weights are not sharded yet; a node that uses a full gradient between the backward and the update
// (clip_grad_norm) is refused, since the gradient is reduce-scattered by then; a parameter must be read in forward through ops or views the graph
// names ("reshape", "view"). Frozen parameters (no update) stay whole on every rank.
//
// Ownership: holds the group; refers to nothing else after expand() (it keeps the tensors it shards).
// Thread-safety: one mode per rank.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/capture/compile.h"
#include "common/comm/process_group.h"

namespace shardkit::fsdp {

class FullyShardMode final : public capture::ParallelMode {
 public:
  explicit FullyShardMode(std::shared_ptr<comm::ProcessGroup> group);

  std::string name() const override { return "fully_shard"; }
  std::map<std::string, std::shared_ptr<comm::ProcessGroup>> groups() const override;
  absl::Status before_capture() override { return unshard_parameters(); }
  absl::Status expand(capture::StepGraph& graph) override;

  // Writes the shards back into the module's parameters and the optimizer's state tensors (reallocating them), on
  // every rank. A collective. Nothing to do before the first expand().
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
  std::vector<Sharded> sharded_;  // parameters and optimizer state, while the graph holds their shards
};

}  // namespace shardkit::fsdp
