#include "common/optim/lr_schedule.h"

#include <cmath>
#include <numbers>

namespace shardkit::optim {

double constant_lr_factor(std::int64_t) { return 1.0; }

double linear_warmup_factor(std::int64_t step, std::int64_t warmup_steps) {
  if (warmup_steps <= 0 || step >= warmup_steps) return 1.0;
  if (step < 0) step = 0;
  return static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
}

double warmup_cosine_factor(std::int64_t step, std::int64_t warmup_steps, std::int64_t total_steps,
                            double min_factor) {
  if (step < warmup_steps) return linear_warmup_factor(step, warmup_steps);
  if (step >= total_steps) return min_factor;
  const double progress =
      static_cast<double>(step - warmup_steps) / static_cast<double>(total_steps - warmup_steps);
  return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

LrFactor constant_lr() { return constant_lr_factor; }
LrFactor linear_warmup(std::int64_t warmup_steps) {
  return [warmup_steps](std::int64_t step) { return linear_warmup_factor(step, warmup_steps); };
}
LrFactor warmup_cosine(std::int64_t warmup_steps, std::int64_t total_steps, double min_factor) {
  return [=](std::int64_t step) { return warmup_cosine_factor(step, warmup_steps, total_steps, min_factor); };
}

LrScheduler::LrScheduler(Optimizer& optimizer, LrFactor factor) : optimizer_(&optimizer), factor_(std::move(factor)) {
  for (std::size_t g = 0; g < optimizer.num_param_groups(); ++g) base_lrs_.push_back(optimizer.param_group(g).hyper.lr);
}

void LrScheduler::apply(std::int64_t step) {
  SK_CHECK(optimizer_ != nullptr) << "LrScheduler::apply(step) without an optimizer";
  const double f = factor_(step);
  for (std::size_t g = 0; g < optimizer_->num_param_groups(); ++g) {
    if (g == base_lrs_.size()) base_lrs_.push_back(optimizer_->param_group(g).hyper.lr);
    optimizer_->mutable_hyper(g).lr = base_lrs_[g] * f;
  }
}

void LrScheduler::apply(std::int64_t step, absl::Span<ParamGroup> groups) {
  const double f = factor_(step);
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (g == base_lrs_.size()) base_lrs_.push_back(groups[g].hyper.lr);
    groups[g].hyper.lr = base_lrs_[g] * f;
  }
}

}  // namespace shardkit::optim
