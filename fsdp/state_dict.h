// State dicts of a fully sharded model (DESIGN.md section 5), in two forms:
//
//   full     the model's and its optimizer's state gathered to their unsharded shapes, so a checkpoint written
//            under FSDP loads into single-rank training, DDP, OSS, or FSDP at another world size, and back.
//            Collective.
//   sharded  each rank's own rows, with the global shape and row offset of each tensor (ShardedStateDict,
//            ShardedOptimizerState). Written without communication; loaded from every rank's piece of a checkpoint
//            written at any world size (Note [loading sharded pieces]), again without communication.
//
// Names: the module's own (no wrapper prefixes: fully_shard wraps nothing), every name of a shared parameter
// (GPT's "wte.weight" and "lm_head.weight"), as nn::Module::state_dict(). Optimizer state: the full form uses
// indices = positions in root.parameters() (Note [parameter indices] in common/optim/state_dict.h), exactly what
// an optimizer built from the unsharded model's parameters() writes, with state tensors of the parameters' global
// shapes; to_named / from_named convert it to and from NamedOptimizerState, keyed by parameter name. The sharded
// form is keyed by parameter name. A parameter's name in optimizer state is its first name in
// root.named_parameters() (GPT's tied embedding: "wte.weight").
//
// `root` is the module fully_shard was called on last (NotFound otherwise).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/nn/module.h"
#include "common/optim/optimizer.h"
#include "common/tensor/tensor.h"

namespace shardkit::fsdp {

// Every rank gets the full model state (copies, MemoryCategory::other). Collective.
absl::StatusOr<nn::StateDict> full_state_dict(nn::Module& root);
// Loads a full model state (every rank passes the same dict): each rank keeps its rows. InvalidArgument (module
// unchanged) as nn::Module::load_state_dict. Collective. The loaded parameters no longer count as differing across
// ranks (Note [same values on every rank] in same_values.cc), so a model built from other seeds may load here.
absl::Status load_full_state_dict(nn::Module& root, const nn::StateDict& state, bool strict = true);

// The full state of `opt`, an optimizer over root's parameters (the shards and any whole parameters), on every
// rank. InvalidArgument when `opt` steps a tensor that is not one of root's parameters. Collective.
absl::StatusOr<optim::OptimizerStateDict> full_optimizer_state(nn::Module& root, const optim::Optimizer& opt);
// Loads a full optimizer state (every rank passes the same dict) into `opt`, each rank keeping its rows.
// InvalidArgument (and `opt` unchanged) when the dict does not fit the unsharded parameters (Note [state dict
// validation] in common/optim/state_dict_validation.h). Every rank decides the same way (the same dict, the same
// global shapes), so no rank loads while another refuses.
absl::Status load_full_optimizer_state(nn::Module& root, optim::Optimizer& opt, const optim::OptimizerStateDict& full);

// ---- name-keyed full optimizer state ------------------------------------------------------------------------

// A parameter group of a name-keyed optimizer state: its hyper-parameters and its parameters by name, in the
// optimizer's order.
struct NamedParamGroup {
  optim::HyperParams hyper;
  std::vector<std::string> params;
};

// optim::OptimizerStateDict with parameters named by name instead of index: a checkpoint that survives a change
// of parameter order, and reads like PyTorch FSDP's optim_state_dict.
struct NamedOptimizerState {
  std::string optimizer;                          // "SGD", "Adam", "AdamW"
  std::map<std::string, optim::ParamState> state;  // parameters that have stepped
  std::vector<NamedParamGroup> param_groups;
};

// Index-keyed (positions in root.parameters(): full_optimizer_state, or an unsharded model's optimizer built
// from model.parameters()) to name-keyed, and back. Tensors are shared, not copied. Work on any module, sharded
// or not (the names and positions are the same). InvalidArgument for an index that is not a position in
// root.parameters(), or (from_named) a name that is not one of root's parameters' first names, or a name listed
// twice. Local.
absl::StatusOr<NamedOptimizerState> to_named(const nn::Module& root, const optim::OptimizerStateDict& full);
absl::StatusOr<optim::OptimizerStateDict> from_named(const nn::Module& root, const NamedOptimizerState& named);

// ---- sharded state dicts ---------------------------------------------------------------------------------------
//
// Note [loading sharded pieces]
// A sharded state dict is one piece per rank; each of its tensors holds rows [row_offset, row_offset + rows) of
// a tensor of shape global_shape (rows on dim 0, Note [per-parameter dim-0 shards]; a 0-d tensor is one row).
// Parameters FSDP does not shard (FullyShardOptions::ignored_params) and buffers are whole in every rank's piece:
// row_offset 0, local shape == global shape (replicas).
//
// The loaders take every piece of a checkpoint (all ranks' pieces, written at any world size, e.g. read back from
// per-rank files) and each rank assembles its own rows from the pieces that cover them: rows are contiguous
// ranges, so this is interval overlap; it copies only from those pieces. Before anything is copied, every rank
// checks the pieces' metadata (names, shapes, offsets; not their values), the same on every rank, so all ranks
// load or all refuse, and a refusal (InvalidArgument naming the entry and the piece) changes nothing:
//   * every piece of a name has the global shape the module has (or the optimizer's parameter);
//   * each piece's local shape is [rows, d1, ...] with the global d1, ... and rows inside [0, d0);
//   * the non-empty pieces of a name are either all whole (replicas: the first is read) or ranges that together
//     cover [0, d0), each range either disjoint from the others or held identically by several pieces (the
//     replicas of HSDP, Note [hybrid sharding] in param_group.cc: the first is read) ("pieces overlap",
//     "missing rows");
//   * strict: every name in the pieces is one of the module's ("unknown name"), and every name of the module is
//     in some piece.
// Values are converted to the target's dtype as nn::Module::load_state_dict does.
//
//   // writing, on each rank (e.g. to a file of its own): no communication
//   fsdp::ShardedStateDict piece = fsdp::sharded_state_dict(model).value();
//   fsdp::ShardedOptimizerState opt_piece = fsdp::sharded_optimizer_state(model, *opt).value();
//   // reading, at any world size, after fully_shard and building the optimizer: every piece written
//   fsdp::load_sharded_state_dict(model, pieces);                 // std::vector<ShardedStateDict>
//   fsdp::load_sharded_optimizer_state(model, *opt, opt_pieces);  // std::vector<ShardedOptimizerState>

// One tensor of one rank's piece: rows [row_offset, row_offset + local.shape()[0]) of a tensor of `global_shape`.
struct ShardedEntry {
  std::string name;
  Tensor local;
  Shape global_shape;
  std::int64_t row_offset = 0;
};

// One rank's piece of the model state: every name of root.state_dict(), in that order.
struct ShardedStateDict {
  std::vector<ShardedEntry> entries;
};

// This rank's piece: for each name of root.state_dict(), a copy (MemoryCategory::other) of the rows it holds
// (a sharded parameter's shard; whole for the others). A unit unsharded at the time (summoned, or kept unsharded
// after a forward) gives its rows of the unsharded values. Local: no communication, no change to the module.
// InvalidArgument when the ranks sharded other values (Note [same values on every rank] in same_values.cc).
absl::StatusOr<ShardedStateDict> sharded_state_dict(nn::Module& root);
// Loads this rank's rows from `pieces` (every rank's piece, any world size; Note [loading sharded pieces]). The
// module is resharded first (FSDPModule::reshard(true): local), so it ends at rest. InvalidArgument (module
// unchanged) as described there; FailedPrecondition inside a forward or backward. strict = false skips unknown
// names and leaves names no piece holds as they are. Local. The loaded parameters no longer count as differing
// across ranks (Note [same values on every rank] in same_values.cc).
absl::Status load_sharded_state_dict(nn::Module& root, const std::vector<ShardedStateDict>& pieces,
                                     bool strict = true);

// The optimizer state of one parameter in one rank's piece: each state tensor holds the same rows of a tensor of
// the parameter's global shape.
struct ShardedParamState {
  std::string name;  // the parameter's first name
  std::int64_t step = 0;
  std::map<std::string, Tensor> tensors;  // "exp_avg", ...: this rank's rows
  Shape global_shape;
  std::int64_t row_offset = 0;
};

// One rank's piece of an optimizer's state, keyed by parameter name. param_groups and step counts are the same in
// every rank's piece.
struct ShardedOptimizerState {
  std::string optimizer;                     // "SGD", "Adam", "AdamW"
  std::vector<NamedParamGroup> param_groups;  // hyper-parameters, parameter names in the optimizer's order
  std::vector<ShardedParamState> state;      // parameters that have stepped here, in the optimizer's order
};

// This rank's piece of `opt`'s state (`opt` steps root's parameters: the shards and any whole parameters; copies).
// InvalidArgument when `opt` steps a tensor that is not one of root's parameters. Local.
absl::StatusOr<ShardedOptimizerState> sharded_optimizer_state(nn::Module& root, const optim::Optimizer& opt);
// Loads this rank's rows of every parameter's state from `pieces` (every rank's piece, any world size) into
// `opt`, an optimizer over root's parameters built as the one that wrote them (same groups, by name; the same
// kind). InvalidArgument (and `opt` unchanged): the checks of Note [loading sharded pieces] per state tensor, the
// pieces disagree (groups, hyper-parameters, a parameter's step count or state keys), state or a group member
// naming an unknown parameter, a group that lists other parameters than `opt`'s, and the checks of
// optim::Optimizer::load_state_dict. Local.
absl::Status load_sharded_optimizer_state(nn::Module& root, optim::Optimizer& opt,
                                          const std::vector<ShardedOptimizerState>& pieces);

}  // namespace shardkit::fsdp
