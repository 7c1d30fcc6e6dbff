// Full optimizer state for a FullyShardedModel: the state of an optimizer over the unit shards
// (FullyShardedModel::parameters()) translated to and from the layout of an optimizer over the module's own
// parameters, so a checkpoint written under FSDP loads into plain single-rank training, DDP, OSS, or FSDP at
// another world size, and back.
//
// Indices (Note [parameter indices] in common/optim/state_dict.h): a parameter's position in
// root.parameters(). Groups: group g of the full dict lists, in increasing index order, the parameters of the
// units whose shards are in the optimizer's group g, with that group's hyper-parameters (so one group over
// the shards becomes one group over root.parameters(), as a single-rank optimizer would have it).
// State tensors are shaped like the module parameters.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/nn/module.h"
#include "common/optim/optimizer.h"
#include "fsdp/fully_shard.h"

namespace shardkit::fsdp {

// Every rank gets the full state. Collective (one all_gather per unit and state tensor). InvalidArgument when
// `opt` steps a tensor that is not one of fs's shards.
absl::StatusOr<optim::OptimizerStateDict> full_optimizer_state(const FullyShardedModel& fs, const nn::Module& root,
                                                               const optim::Optimizer& opt);

// Loads a full state (every rank passes the same dict) into `opt`, each rank keeping its shard's part.
// Collective (one all_reduce: every rank loads, or none does). InvalidArgument, on every rank and with `opt`
// unchanged on every rank, when the dict does not fit: whatever any optimizer over the module's parameters
// would refuse (Note [state dict validation] in common/optim/state_dict_validation.h: names, group and
// parameter counts, negative or duplicate indices, state for an index no group lists, keys, shapes, dtypes,
// step counts, hyper-parameters), and what only FSDP asks: the parameters of one unit have state together,
// with one step count and one set of keys. A rank whose own dict was fine says which rank refused.
absl::Status load_full_optimizer_state(const FullyShardedModel& fs, const nn::Module& root, optim::Optimizer& opt,
                                       const optim::OptimizerStateDict& full);

}  // namespace shardkit::fsdp
