#include "fsdp/fsdp_param.h"

#include <algorithm>

#include "common/base/check.h"

namespace shardkit::fsdp {

RowSplit split_rows(const Shape& global_shape, int rank, int world) {
  SK_CHECK(world >= 1 && rank >= 0 && rank < world) << "split_rows: rank " << rank << " of " << world;
  RowSplit s;
  const std::int64_t numel = shape_numel(global_shape);
  s.rows = global_shape.empty() ? 1 : global_shape[0];
  s.row_numel = s.rows == 0 ? 0 : numel / s.rows;
  s.rows_per_rank = (s.rows + world - 1) / world;
  s.row_offset = std::min(s.rows, rank * s.rows_per_rank);
  s.local_rows = std::clamp<std::int64_t>(s.rows - s.row_offset, 0, s.rows_per_rank);
  return s;
}

void FSDPParam::register_as(const Tensor& t) const {
  for (const auto& [module, name] : registrations) module->replace_parameter(name, t);
}

}  // namespace shardkit::fsdp
