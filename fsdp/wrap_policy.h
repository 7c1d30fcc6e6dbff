// Wrap policies and fsdp::auto_shard: which modules become units, chosen by a pure function of the model
// (DESIGN.md section 5; FSDP1's auto_wrap_policy, seed 000's shared-parameter assignment).
//
//   nn::GPT model(config, seed);
//   auto root = fsdp::auto_shard(model, fsdp::by_module_type({"TransformerBlock"}), pg).value();
//   // the same as fully_shard on every block, then on the model, with shared parameters placed as below
//
// A WrapPolicy takes the root and returns the modules to make units: modules under the root (never the root
// itself), each once, children before parents (the order of modules_bottom_up). It only reads the model, so it
// can be called and tested without ranks. auto_shard calls fully_shard on each chosen module bottom-up, then on
// the root. A unit gathers its parameters around its own forward only, so a policy must not choose a module whose
// parameters another module's forward reads directly (GPT's forward reads wpe.weight without calling wpe: wpe
// cannot be a unit, and by_parameter_count with a threshold at or below wpe's size would choose it).
//
// Shared parameters (seed 000's _get_fully_sharded_module_to_states): a tensor registered in several modules
// (GPT's tied embedding: wte.weight is lm_head.weight) belongs to the unit of the lowest common ancestor of its
// registrations among the units auto_shard creates (the root when no smaller one encloses them all). A unit's
// forward gathers only its own parameters, and the ancestor's forward encloses every use, so every use sees the
// parameter unsharded; the lower units leave it to the ancestor (FullyShardOptions::leave_to_ancestor).
//
// Ignored parameters (FullyShardOptions::ignored_params, and every parameter of AutoShardOptions::ignored_modules'
// subtrees) stay whole and replicated on every rank: no unit shards, gathers or reduces them, so after backward
// their gradient is this rank's own (from this rank's inputs), not the average over ranks; a training loop that
// wants them averaged all_reduces them itself. A module a policy chooses inside an ignored module is not made a
// unit. Frozen parameters are sharded like the others (fully_shard.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/comm/process_group.h"
#include "common/nn/module.h"
#include "fsdp/fully_shard.h"
#include "fsdp/fully_shard_options.h"

namespace shardkit::fsdp {

// The modules to make units, given the root: modules under the root, children before parents, each once.
using WrapPolicy = std::function<std::vector<nn::Module*>(nn::Module& root)>;

// Every module under `root` with its fully qualified name, children before parents (post-order: a module's
// children in registration order, then the module), `root` last with name "". A module registered twice is
// listed once, where it is first reached.
std::vector<std::pair<std::string, nn::Module*>> modules_bottom_up(nn::Module& root);

// The modules whose type_name() is one of `types` ("TransformerBlock").
WrapPolicy by_module_type(std::set<std::string> types);

// FSDP1's size_based_auto_wrap_policy, children first: walking bottom-up, a module is chosen when the
// parameters under it (itself included) that no module chosen below it already took reach `min_num_params`
// elements. Each distinct tensor counts once (a tied weight is one tensor), frozen or not (a unit shards both).
// Containers without a forward of their own (ModuleList) are never chosen:
// their parameters count toward the module that calls them, as FSDP1's exclude_wrap_modules. A module with
// nothing left to take is never chosen.
WrapPolicy by_parameter_count(std::int64_t min_num_params);

// The modules for which `pred(fqn, module)` is true; `fqn` is the module's name under the root
// ("blocks.0.mlp"). Called once per module under the root, bottom-up.
WrapPolicy by_predicate(std::function<bool(const std::string& fqn, const nn::Module& module)> pred);

// The union of the policies' choices, bottom-up. Each policy decides alone: unlike FSDP1's _or_policy, a module
// another policy chose still counts toward by_parameter_count's totals above it.
WrapPolicy any_of(std::vector<WrapPolicy> policies);

struct AutoShardOptions {
  // Modules under the root whose whole subtree FSDP leaves alone (FSDP1's ignored_modules): their parameters
  // are ignored as FullyShardOptions::ignored_params (see above), and no module inside them becomes a unit.
  std::vector<const nn::Module*> ignored_modules = {};
};

// What auto_shard will do, computed without sharding anything (a pure function of the model).
struct ShardPlan {
  struct Unit {
    nn::Module* module = nullptr;
    std::string fqn;  // under the root; "" for the root
    // The parameters this unit will manage, each by its first name under the root (named_parameters order).
    std::vector<std::string> params;
    // Tensors registered in this unit's subtree that belong to an ancestor unit (shared parameters).
    std::vector<Tensor> leave_to_ancestor;
  };
  std::vector<Unit> units;      // bottom-up, the root last
  std::vector<Tensor> ignored;  // ignored_params plus every parameter of the ignored modules
};

// The plan for `root` under `policy`. InvalidArgument: an empty policy; a policy that returns a null module, a
// module not under the root, the root itself, or a container without a forward of its own; an ignored module
// not under the root.
absl::StatusOr<ShardPlan> plan_auto_shard(nn::Module& root, const WrapPolicy& policy,
                                          const AutoShardOptions& auto_options = {},
                                          absl::Span<const Tensor> ignored_params = {});

// fully_shard on every module `policy` chooses, bottom-up, then on `root`; returns the root's FSDPModule. Every
// unit gets `options` (with its ignored_params extended by the ignored modules' parameters and its
// leave_to_ancestor set from the plan), except that the root's reshard_after_forward is left to the heuristic
// (false: FSDP2 keeps the root's parameters from forward to backward). The plan is checked before anything is
// sharded: on its errors (above), or FailedPrecondition when a module under the root is already sharded, or
// InvalidArgument when options.leave_to_ancestor is not empty (auto_shard sets it), the model is unchanged.
// Collective (each fully_shard call).
absl::StatusOr<FSDPModule> auto_shard(nn::Module& root, const WrapPolicy& policy,
                                      std::shared_ptr<comm::ProcessGroup> group, FullyShardOptions options = {},
                                      AutoShardOptions auto_options = {});

}  // namespace shardkit::fsdp
