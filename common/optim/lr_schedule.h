// Learning-rate schedules: pure functions of the step, and a small scheduler that applies one to an
// optimizer's groups (or to any list of ParamGroups, e.g. OSS's global groups).
//
// A schedule is a *factor* of each group's base lr (PyTorch's LambdaLR shape), so groups with different
// lrs keep their ratio. `step` counts optimizer steps taken so far (0 before the first step).
//   constant_lr:     1
//   linear_warmup:   (step + 1) / warmup_steps while step < warmup_steps, then 1
//   warmup_cosine:   linear warm-up as above, then from step = warmup_steps to total_steps
//                    min_factor + (1 - min_factor) * (1 + cos(pi * (step - warmup) / (total - warmup))) / 2,
//                    and min_factor after total_steps.
// Thread-safety: the factor functions are pure; an LrScheduler belongs to the thread of its optimizer.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/types/span.h"
#include "common/optim/optimizer.h"

namespace shardkit::optim {

using LrFactor = std::function<double(std::int64_t step)>;

double constant_lr_factor(std::int64_t step);
double linear_warmup_factor(std::int64_t step, std::int64_t warmup_steps);
double warmup_cosine_factor(std::int64_t step, std::int64_t warmup_steps, std::int64_t total_steps,
                            double min_factor = 0.0);

LrFactor constant_lr();
LrFactor linear_warmup(std::int64_t warmup_steps);
LrFactor warmup_cosine(std::int64_t warmup_steps, std::int64_t total_steps, double min_factor = 0.0);

// Remembers each group's base lr the first time it sees the group (at construction for the groups that
// exist then; groups added later are picked up at their first apply), and sets lr = base * factor(step).
class LrScheduler {
 public:
  LrScheduler(Optimizer& optimizer, LrFactor factor);
  // No optimizer bound: use apply(step, groups).
  explicit LrScheduler(LrFactor factor) : factor_(std::move(factor)) {}

  // Sets the bound optimizer's group lrs for `step`.
  void apply(std::int64_t step);
  // Same for a list of groups (the scheduler must always be given the same list, in the same order).
  void apply(std::int64_t step, absl::Span<ParamGroup> groups);

  double factor(std::int64_t step) const { return factor_(step); }
  const std::vector<double>& base_lrs() const { return base_lrs_; }

 private:
  Optimizer* optimizer_ = nullptr;
  LrFactor factor_;
  std::vector<double> base_lrs_;
};

}  // namespace shardkit::optim
