#include "oss/sharded_grad_norm.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/comm/host_staged.h"
#include "common/optim/clip_grad.h"

namespace shardkit::oss {

absl::StatusOr<double> sharded_grad_norm(absl::Span<const Tensor> owned, comm::ProcessGroup& group,
                                         double norm_type, const ShardedNormOptions& options) {
  const bool inf = std::isinf(norm_type) && norm_type > 0;
  if (!inf && norm_type != 2.0) {
    return absl::InvalidArgumentError(absl::StrCat("clip_grad_norm: expected norm_type 2 or inf, found ", norm_type));
  }
  const double partial = optim::grad_norm_partial(owned, norm_type);
  // The partial travels in f32 (relative error ~1e-7 in the norm).
  Tensor t = Tensor::full({1}, partial, TensorOptions{}.with_category(MemoryCategory::communication_buffer));
  if (absl::Status s = comm::all_reduce_host(group, t, {.op = inf ? comm::ReduceOp::max() : comm::ReduceOp::sum(),
                                                        .timeout = options.timeout, .tag = options.tag});
      !s.ok()) {
    return s;
  }
  return optim::grad_norm_from_partial(t.item(), norm_type);
}

}  // namespace shardkit::oss
