// Where a captured step keeps each parameter: what the parallel modes (sddp/replicate_mode, fsdp/fully_shard_mode)
// need to find in a recorded graph before they insert their collectives. Pure functions of the graph.
//
// A parameter is found through its optimizer update node ("<optimizer>.update", Note [tracing the update] in
// common/optim/optimizer.cc), which reads [weights, param (bf16/f16 only), grad, state...] and writes [weights,
// param, state...]. The gradient is the read that an "accumulate_grad" node (Note [tracing backward] in
// common/autograd/engine.cc) wrote.
//
// Note [gradient done]
// A gradient is done when the backward's last "accumulate_grad" into it has run: that is where a mode reduces it.
// Nodes of the step between that and the update that read or write it (clip_grad_norm) then see the reduced
// gradient, as they do after an eager DDP backward. (Placing the reduction after the last write instead would
// clip each rank's local gradient: a silent wrong result.)
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/capture/step_graph.h"

namespace shardkit::capture {

struct ParamSlots {
  SlotId param = -1;        // the parameter as the model reads it (an input slot, "param.<name>")
  SlotId weights = -1;      // what the update writes: the parameter, or its fp32 master for bf16/f16
  SlotId grad = -1;         // the gradient the update reads
  std::vector<SlotId> state;  // the optimizer's state the update reads and writes, in its order (master excluded)
  int grad_done = -1;       // the backward's last accumulation into `grad` (Note [gradient done])
  int update = -1;          // the update node
};

// One entry per update node, in graph order. InvalidArgument naming the node when an update reads no gradient
// that an accumulate_grad node wrote.
absl::StatusOr<std::vector<ParamSlots>> find_param_slots(const StepGraph& graph);

}  // namespace shardkit::capture
