// FSDPParam: one parameter sharded on dim 0 (DESIGN.md section 5; FSDP2's FSDPParam).
//
// Note [per-parameter dim-0 shards]
// A parameter of global shape [d0, d1, ...] is cut into rows: with N ranks each rank r owns rows
// [r·c, r·c + local_rows) where c = ceil(d0 / N) and local_rows = clamp(d0 − r·c, 0, c) (the last ranks may own
// fewer rows, or none). A 0-d parameter is one row of one element. At rest the module's parameter *is* the
// sharded tensor: a leaf of shape [local_rows, d1, ...] that requires grad (unless frozen), so an optimizer built from
// model.parameters() steps the shards with no FSDP code, and its state is sized by the rows a rank owns. Its
// bytes live in the unit's shard buffer (param_group.h) at `shard_offset`, followed by padding up to c rows,
// so every rank contributes the same number of elements to the unit's all_gather; the padding holds zeros and
// is never visible (not in the tensor's shape, not in a state dict).
//
// While the unit is unsharded, the module's parameter is the `unsharded` tensor instead: a leaf of the global
// shape that requires grad, a view of the unit's one unsharded buffer (param_group.h), whose Storage object lives
// as long as the unit, is created released (Storage::allocate_released: never charged at construction), and is
// released at rest and reallocated to unshard. Tensors autograd saved during forward are this tensor or views of its Storage, so they
// see the new bytes when backward unshards again: nothing is re-bound per pass. Backward accumulates the full
// gradient in unsharded.grad(); the unit's reduce_scatter turns it into sharded.grad() (the same rows).
//
// Freezing: the shards take the requires_grad the parameter had at fully_shard, and the unsharded tensor takes the
// shard's at each unshard, so a frozen parameter (frozen before fully_shard, or after it: model.set_requires_grad(
// false) at rest sets it on the shard) gets no gradient and no update, and trains again once unfrozen.
//
// Every registration of the parameter (a tensor registered under several names, e.g. a tied embedding used
// by two modules of one unit) is swapped together.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/nn/module.h"
#include "common/tensor/tensor.h"

namespace shardkit::fsdp {

// What a sharded parameter is, seen from outside (DTensor-like, kept small): this rank's rows, the global shape,
// and where the rows start.
struct ShardedTensor {
  Tensor local;             // [local_rows, d1, ...]
  Shape global_shape;       // [d0, d1, ...]
  std::int64_t row_offset;  // the first global row this rank holds
};

// Rows of a dim-0 shard: the layout rule of Note [per-parameter dim-0 shards], a pure function.
struct RowSplit {
  std::int64_t rows = 0;           // d0 (1 for a 0-d parameter)
  std::int64_t row_numel = 0;      // elements per row
  std::int64_t rows_per_rank = 0;  // c = ceil(d0 / N)
  std::int64_t row_offset = 0;     // r·c, clamped to d0
  std::int64_t local_rows = 0;     // rows this rank holds
};
RowSplit split_rows(const Shape& global_shape, int rank, int world);

struct FSDPParam {
  // Fully qualified names under the module fully_shard was called on (every name of a shared tensor).
  std::vector<std::string> names;
  // Where it is registered: swapped together between `sharded` and `unsharded`.
  std::vector<std::pair<nn::Module*, std::string>> registrations;
  Shape global_shape;
  Shape local_shape;
  RowSplit split;
  std::int64_t shard_offset = 0;  // elements into the unit's shard buffer
  std::int64_t full_offset = 0;   // elements into the unit's unsharded buffer
  // Gathered and reduced by a collective of its own (Note [own collectives] in param_group.cc).
  bool own_collective = false;
  Tensor sharded;                 // the module's parameter at rest (leaf; requires grad unless frozen)
  Tensor unsharded;               // the module's parameter while unsharded (leaf; requires grad as `sharded`)
  // Whether the unsharded values are the shards' own (an f32 gather) rather than their param_dtype roundings
  // (Note [mixed precision on f32 ops]): only exact values may be written back into the shards or saved.
  bool unsharded_exact = true;

  // c · row_numel: what this parameter occupies in every rank's shard buffer (padding included).
  std::int64_t padded_numel() const { return split.rows_per_rank * split.row_numel; }
  // Points every registration at `t`.
  void register_as(const Tensor& t) const;
  ShardedTensor view() const { return {sharded, global_shape, split.row_offset}; }
};

}  // namespace shardkit::fsdp
