// Full state dicts of a fully sharded model: the model's and its optimizer's state gathered to their
// unsharded shapes, so a checkpoint written under FSDP loads into single-rank training, DDP, OSS, or FSDP at
// another world size, and back (DESIGN.md section 5).
//
// Names: the module's own (no wrapper prefixes: fully_shard wraps nothing), every name of a shared parameter
// (GPT's "wte.weight" and "lm_head.weight"), as nn::Module::state_dict(). Optimizer state: indices are positions
// in root.parameters() (Note [parameter indices] in common/optim/state_dict.h), exactly what an optimizer built
// from the unsharded model's parameters() writes; state tensors have the parameters' global shapes.
//
// Every function is collective over the root unit's group except load_full_state_dict's copy (it all-gathers to
// check shapes as the module does; see there).
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/nn/module.h"
#include "common/optim/optimizer.h"

namespace shardkit::fsdp {

// Every rank gets the full model state (copies, MemoryCategory::other). Collective.
absl::StatusOr<nn::StateDict> full_state_dict(nn::Module& root);
// Loads a full model state (every rank passes the same dict): each rank keeps its rows. InvalidArgument (module
// unchanged) as nn::Module::load_state_dict. Collective.
absl::Status load_full_state_dict(nn::Module& root, const nn::StateDict& state, bool strict = true);

// The full state of `opt`, an optimizer over root's parameters (the shards and any whole parameters), on every
// rank. InvalidArgument when `opt` steps a tensor that is not one of root's parameters. Collective.
absl::StatusOr<optim::OptimizerStateDict> full_optimizer_state(nn::Module& root, const optim::Optimizer& opt);
// Loads a full optimizer state (every rank passes the same dict) into `opt`, each rank keeping its rows.
// InvalidArgument (and `opt` unchanged) when the dict does not fit the unsharded parameters (Note [state dict
// validation] in common/optim/state_dict_validation.h). Every rank decides the same way (the same dict, the same
// global shapes), so no rank loads while another refuses.
absl::Status load_full_optimizer_state(nn::Module& root, optim::Optimizer& opt, const optim::OptimizerStateDict& full);

}  // namespace shardkit::fsdp
