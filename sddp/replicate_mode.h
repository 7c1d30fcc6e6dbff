// The replicate parallel mode of compile() (issue 16 item 3): DistributedDataParallel as a graph rewrite.
//
//   auto mode = std::make_shared<sddp::ReplicateMode>(pg);
//   capture::CompiledStep step = capture::compile(step_fn, model, *opt, {.parallel_mode = mode});
//
// The step function is the single-rank one; each rank calls the compiled step on its own rows of the batch.
// expand() puts, right after the node that finishes each parameter's gradient (its last write before the
// optimizer's update reads it), a "scale" op and an all_reduce(sum) of that gradient. Then consecutive all_reduces
// are coalesced into buckets of at most bucket_cap_bytes (coalesce_collectives), in the order the gradients became
// ready, as DDP's buckets.
//
// Note [replicate average]
// DDP averages by multiplying each gradient by the float 1/N and summing: so does this mode, as two nodes, so the
// result is DDP's bit for bit at any N. premul_sum(1/N) would be one node, but the reduction kernels may fuse its
// multiply into the add (an FMA rounds once), which differs from DDP's in the last bit when 1/N is not a power of two.
//
// Parameters must start equal on every rank (the same seed, or a broadcast before the first call): the mode does
// not broadcast them. Ownership: holds the group; thread-safety: one mode per rank.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "common/capture/compile.h"
#include "common/comm/process_group.h"

namespace shardkit::sddp {

struct ReplicateModeOptions {
  std::int64_t bucket_cap_bytes = 25 << 20;  // DDP's default bucket cap
};

class ReplicateMode final : public capture::ParallelMode {
 public:
  explicit ReplicateMode(std::shared_ptr<comm::ProcessGroup> group, ReplicateModeOptions options = {});

  std::string name() const override { return "replicate"; }
  std::map<std::string, std::shared_ptr<comm::ProcessGroup>> groups() const override;
  // InvalidArgument when an optimizer update reads no gradient the backward accumulated.
  absl::Status expand(capture::StepGraph& graph) override;

 private:
  std::shared_ptr<comm::ProcessGroup> group_;
  ReplicateModeOptions options_;
};

}  // namespace shardkit::sddp
