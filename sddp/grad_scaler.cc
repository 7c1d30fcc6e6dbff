#include "sddp/grad_scaler.h"

#include "common/autograd/ops.h"
#include "common/comm/host_staged.h"
#include "common/optim/finite.h"
#include "common/tensor/trace_hook.h"

namespace shardkit::sddp {

ShardedGradScaler::ShardedGradScaler(std::shared_ptr<comm::ProcessGroup> group, GradScalerOptions options)
    : pg_(std::move(group)), options_(options), scale_(options.init_scale) {}

Tensor ShardedGradScaler::scale(const Tensor& loss) const { return autograd::scale(loss, static_cast<float>(scale_)); }

absl::StatusOr<bool> ShardedGradScaler::unscale(absl::Span<const Tensor> grads) {
  if (unscaled_) return found_inf_;
  // Not capturable: the unscale writes the gradients through raw pointers, and the skip-or-step choice is the
  // host's; a compiled step (capture::compile) would replay neither and silently step scaled gradients (a
  // helper's audit, tests/common/capture/compile_combo2_test.cc). The capture fails naming it.
  if (trace::Tracer* t = trace::active_tracer()) {
    t->on_unsupported("sddp::ShardedGradScaler (unscales gradients in place and chooses to skip the step on the host)");
  }
  const float inv = static_cast<float>(1.0 / scale_);
  bool bad = false;
  for (const Tensor& g : grads) {
    if (g.defined()) bad |= optim::scale_and_find_non_finite(g, inv);  // one pass: check, then scale
  }
  Tensor flag = Tensor::full({1}, bad ? 1.0 : 0.0, TensorOptions{}.with_category(MemoryCategory::other));
  if (absl::Status s = comm::all_reduce_host(*pg_, flag, {.op = comm::ReduceOp::max(), .tag = "found_inf"}); !s.ok()) {
    return s;
  }
  found_inf_ = flag.item() != 0.0;
  unscaled_ = true;
  return found_inf_;
}

absl::StatusOr<bool> ShardedGradScaler::step(absl::Span<const Tensor> grads, const std::function<absl::Status()>& step) {
  auto found = unscale(grads);
  if (!found.ok()) return found.status();
  if (*found) return false;
  if (absl::Status s = step(); !s.ok()) return s;
  return true;
}

void ShardedGradScaler::update() {
  if (found_inf_) {
    scale_ *= options_.backoff_factor;
    clean_steps_ = 0;
  } else if (unscaled_ && ++clean_steps_ >= options_.growth_interval) {
    scale_ *= options_.growth_factor;
    clean_steps_ = 0;
  }
  unscaled_ = false;
  found_inf_ = false;
}

}  // namespace shardkit::sddp
