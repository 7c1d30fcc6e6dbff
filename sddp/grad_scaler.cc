#include "sddp/grad_scaler.h"

#include <algorithm>
#include <cmath>

#include "common/autograd/ops.h"

namespace shardkit::sddp {
namespace {

// g *= inv in place; returns true when any element (before scaling) is inf or nan.
bool unscale_one(const Tensor& g, float inv) {
  bool bad = false;
  if (g.dtype() == DType::f32) {
    float* p = g.data<float>();
    for (std::int64_t i = 0; i < g.numel(); ++i) {
      bad |= !std::isfinite(p[i]);
      p[i] *= inv;
    }
    return bad;
  }
  constexpr std::int64_t kChunk = 2048;
  float tmp[kChunk];
  auto* bytes = static_cast<char*>(g.raw_data());
  const auto es = static_cast<std::int64_t>(g.element_size());
  for (std::int64_t i = 0; i < g.numel(); i += kChunk) {
    const std::int64_t n = std::min(kChunk, g.numel() - i);
    convert_elements(bytes + i * es, g.dtype(), tmp, DType::f32, n);
    for (std::int64_t k = 0; k < n; ++k) {
      bad |= !std::isfinite(tmp[k]);
      tmp[k] *= inv;
    }
    convert_elements(tmp, DType::f32, bytes + i * es, g.dtype(), n);
  }
  return bad;
}

}  // namespace

ShardedGradScaler::ShardedGradScaler(std::shared_ptr<comm::ProcessGroup> group, GradScalerOptions options)
    : pg_(std::move(group)), options_(options), scale_(options.init_scale) {}

Tensor ShardedGradScaler::scale(const Tensor& loss) const { return autograd::scale(loss, static_cast<float>(scale_)); }

absl::StatusOr<bool> ShardedGradScaler::unscale(absl::Span<const Tensor> grads) {
  if (unscaled_) return found_inf_;
  const float inv = static_cast<float>(1.0 / scale_);
  bool bad = false;
  for (const Tensor& g : grads) {
    if (g.defined()) bad |= unscale_one(g, inv);
  }
  Tensor flag = Tensor::full({1}, bad ? 1.0 : 0.0, TensorOptions{}.with_category(MemoryCategory::other));
  if (absl::Status s = pg_->all_reduce(flag, {.op = comm::ReduceOp::max(), .tag = "found_inf"})->wait(); !s.ok()) {
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
