#include "fsdp/clip_grad.h"

#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/optim/clip_grad.h"
#include "fsdp/fully_shard.h"
#include "oss/sharded_grad_norm.h"

namespace shardkit::fsdp {

absl::StatusOr<double> clip_grad_norm(nn::Module& root, double max_norm, double norm_type) {
  auto unit = state_of(root);
  if (!unit.ok()) return unit.status();
  if (!(max_norm > 0)) {  // zero, negative or NaN would zero, negate or NaN every gradient
    return absl::InvalidArgumentError(absl::StrCat("fsdp::clip_grad_norm: expected max_norm > 0, found ", max_norm));
  }
  std::vector<Tensor> shards, whole;
  std::set<const TensorImpl*> sharded_ids;
  for (const ShardedTensor& t : sharded_parameters(root)) shards.push_back(t.local), sharded_ids.insert(t.local.id());
  for (const Tensor& p : root.parameters()) {
    if (sharded_ids.count(p.id()) == 0) whole.push_back(p);
  }
  absl::StatusOr<double> sharded_norm = oss::sharded_grad_norm(
      shards, unit->state().process_group(), norm_type, {.timeout = unit->state().options().timeout, .tag = "fsdp clip_grad_norm"});
  if (!sharded_norm.ok()) return sharded_norm.status();
  const double whole_norm = optim::grad_norm_from_partial(optim::grad_norm_partial(whole, norm_type), norm_type);
  const double total = std::isinf(norm_type) ? std::max(*sharded_norm, whole_norm)
                                             : std::sqrt(*sharded_norm * *sharded_norm + whole_norm * whole_norm);
  const double coef = optim::clip_coefficient(total, max_norm);
  if (!(coef >= 1.0)) {  // NaN scales too, as PyTorch
    optim::scale_grads(shards, coef);
    optim::scale_grads(whole, coef);
  }
  return total;
}

}  // namespace shardkit::fsdp
