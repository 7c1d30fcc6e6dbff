// Tensor and parameter hooks (DESIGN.md section 2, the hook table).
//
//   register_hook(t, fn)                        fn(grad) -> optional<Tensor>
//     Runs when the gradient w.r.t. `t` has been computed (all contributions summed), before it flows
//     further (into t's grad_fn, or into a leaf's .grad). Returning a tensor (same shape) replaces the
//     gradient; std::nullopt keeps it. FSDP uses it on a unit's outputs to unshard before backward.
//
//   register_post_accumulate_grad_hook(p, fn)   fn(const Tensor& p)
//     Leaves only. Runs after p.grad() has been accumulated and is final for this backward: exactly
//     once per backward per leaf that received a gradient, also for a parameter used several times in
//     the forward (its uses are summed first). ShardedDDP / FSDP: "gradient ready" -> bucket / reduce.
//     A leaf whose incoming gradient is undefined (no gradient reached it) is not accumulated and its
//     hooks do not run (use a final callback for such parameters).
//
// Several hooks per tensor; they run in registration order. Hooks run on the backward's thread with
// grad mode off and may call queue_callback() (engine.h). The returned handle removes the hook.
#pragma once

#include "common/autograd/autograd_meta.h"
#include "common/autograd/hook_handle.h"

namespace shardkit::autograd {

// `t` must require grad.
HookHandle register_hook(const Tensor& t, TensorHook fn);

// `param` must be a leaf that requires grad.
HookHandle register_post_accumulate_grad_hook(const Tensor& param, PostAccumulateGradHook fn);

}  // namespace shardkit::autograd
