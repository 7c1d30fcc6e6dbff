// ShardedGradScaler: dynamic loss scaling for f16 training when each rank holds only part of the gradients
// (ShardedDataParallel / OSS; works for DDP too). Shape of PyTorch's GradScaler and fairscale's
// ShardedGradScaler.
//
//   oss->zero_grad();
//   Tensor loss = scaler.scale(model.loss(x, y));
//   autograd::backward(loss);
//   auto stepped = scaler.step(oss->step_gradients(), [&] { return oss->step(); });  // or sddp->held_gradients()
//   scaler.update();
//
// Note [agreed found_inf] (fairscale #179): each rank checks only the gradients it holds, so ranks may see
// different overflow; a rank that skips the step while another steps leaves the collectives of the step
// mismatched and the ranks hang. unscale() therefore agrees on found_inf with ONE all_reduce(max) before
// anyone steps; every rank then skips, or every rank steps. The per-rank check is common/optim/finite.h's
// scale_and_find_non_finite (Note [finite checks]).
//
// Which group: one over which every gradient element is seen by some rank: the world group, or (ShardedDDP, OSS,
// fully_shard) the group the gradients are sharded over. Under HSDP (fsdp::fully_shard on a 2-D mesh) the world
// group or the shard group both work (the all-reduce across replicas carries an overflow to every replica); the
// replicate group does NOT: a column of ranks whose rows did not overflow would step while the others skip, and the
// replicas drift apart with no error (tests/fsdp/fsdp_scaler_combo6_test.cc).
//
// Not inside a compiled step (capture::compile): the capture fails naming it.
//
// Thread-safety: none; one scaler belongs to one rank. unscale()/step() are collectives over the group.
#pragma once

#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/comm/process_group.h"
#include "common/tensor/tensor.h"

namespace shardkit::sddp {

struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  // Steps without inf/nan before the scale grows.
  int growth_interval = 2000;
};

class ShardedGradScaler {
 public:
  explicit ShardedGradScaler(std::shared_ptr<comm::ProcessGroup> group, GradScalerOptions options = {});

  // loss * scale (differentiable).
  Tensor scale(const Tensor& loss) const;

  // Multiplies `grads` (the gradients this rank holds, any float dtype) by 1/scale in place and returns
  // whether ANY rank found an inf or nan (agreed with one all_reduce). Once per step: a second call before
  // update() returns the agreed flag without touching the gradients. Collective.
  absl::StatusOr<bool> unscale(absl::Span<const Tensor> grads);

  // unscale() if not done yet, then runs `step` unless a rank found inf/nan. Returns whether it stepped.
  absl::StatusOr<bool> step(absl::Span<const Tensor> grads, const std::function<absl::Status()>& step);

  // Adjusts the scale after a step: backoff when inf/nan was found, growth after growth_interval clean steps.
  void update();

  double get_scale() const { return scale_; }

 private:
  std::shared_ptr<comm::ProcessGroup> pg_;
  GradScalerOptions options_;
  double scale_;
  int clean_steps_ = 0;
  bool unscaled_ = false;
  bool found_inf_ = false;
};

}  // namespace shardkit::sddp
