// The optimizer state dict: PyTorch's layout, with parameters named by index.
//
// Note [parameter indices]
// A parameter is identified by its *index*: its position when the param groups' lists are concatenated
// in group order (group 0's params are 0..n0-1, group 1's follow, ...). `state` holds an entry for each
// parameter that has taken at least one step; `param_groups[g].params` lists the indices of group g.
//
// Optimizer::state_dict() always writes indices 0..N-1 in that order. load_state_dict() does what
// PyTorch does: it pairs the dict's groups with the optimizer's groups by position, and inside each group
// pairs the dict's i-th index with the optimizer's i-th parameter; the index *values* only have to be
// unique, >= 0, and to match the keys of `state`. Every loader checks a dict the same way
// (Note [state dict validation] in state_dict_validation.h). That is what lets a sharding layer (OSS):
//   (a) build an inner Optimizer over the subset of parameters a rank owns (same groups, same order,
//       possibly empty groups), and
//   (b) translate: its inner state dict uses local indices 0..n-1, which it maps to global indices with
//       its own local->global table to consolidate; to re-shard a full dict it builds, per rank, a dict
//       whose groups list the *global* indices that rank owns (in the inner optimizer's order) and whose
//       `state` holds those entries (tensors sliced to the owned range for a flat partition), and loads
//       it into the inner optimizer unchanged. remap_indices() below does the renaming.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/optim/param_group.h"

namespace shardkit::optim {

struct ParamGroupState {
  HyperParams hyper;
  std::vector<std::int64_t> params;  // parameter indices, see Note [parameter indices]
};

struct OptimizerStateDict {
  std::string optimizer;  // "SGD", "Adam", "AdamW": load_state_dict checks it
  std::map<std::int64_t, ParamState> state;
  std::vector<ParamGroupState> param_groups;

  // Total number of parameters the groups list.
  std::int64_t num_params() const;
  // A copy whose tensors are new tensors (charged to the calling thread's current category).
  OptimizerStateDict clone() const;
};

// Renames indices: index i becomes new_index[i] (in `state` and in every group). new_index must cover
// every index used; Status (InvalidArgument) otherwise. The result shares the tensors of `dict`.
absl::StatusOr<OptimizerStateDict> remap_indices(const OptimizerStateDict& dict,
                                                 absl::Span<const std::int64_t> new_index);

}  // namespace shardkit::optim
