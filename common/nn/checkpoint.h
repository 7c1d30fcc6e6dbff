// Activation checkpointing (issue 13 item 5): a module whose activations are dropped in forward and
// recomputed in backward, trading one more forward of the module for the memory of its activations.
//
//   nn::GPT model(config, seed);
//   if (absl::Status s = nn::checkpoint_blocks(model); !s.ok()) ...   // every TransformerBlock
//   // or nn::checkpoint(module) for any module with a forward
//   autograd::backward(model.loss(x, y));   // each block's forward runs again inside backward
//
// What a call of a checkpointed module does (the reentrant form of PyTorch's torch.utils.checkpoint, with its
// preserve_rng_state):
//   forward   the call (forward pre-hooks, forward, forward hooks) runs with grad mode off: nothing inside the
//             module records a graph or keeps an activation. One node (CheckpointBackward) is recorded instead,
//             from the call's inputs (kept, as bytes-only handles) to its outputs. The rank's Generator is
//             copied first.
//   backward  the node runs the call again with grad mode on, on bytes-only copies of the inputs, with the
//             Generator as it was at the forward (dropout draws the same masks; afterwards the Generator is
//             put back as backward found it) and the module's buffers as they were before (BatchNorm's running
//             statistics are updated once, not twice); then it runs a backward from the recomputed outputs
//             (a nested autograd::backward) and hands the gradients of the inputs on to the outer backward.
// So gradients and parameters after a step are bitwise those of the same model without checkpointing: the
// recompute is the same computation on the same bytes. The recompute's tensors are charged to the ledger like
// the forward's (MemoryCategory::activation, unless the forward ran under another MemoryCategoryScope); they
// live only while the node runs, so the activation peak holds the kept inputs of every checkpointed call plus
// one module's activations at a time (tests/common/nn/checkpoint_test.cc measures it on a GPT).
//
// Note [checkpoint and the sharding layers]
// The parameters of a checkpointed module get their gradients in the nested backward, at the point of the outer
// backward where the node runs: their AccumulateGrad nodes and post-accumulate-grad hooks run there, in the same
// order as without checkpointing (reverse forward order), and final callbacks queued in there run after the
// whole outer backward (BackwardOptions::callbacks_to_enclosing). That is what DDP, OSS and ShardedDDP see.
// FSDP (fsdp::fully_shard): a checkpointed module inside a unit is recomputed after the unit's pre-backward
// hook gathered the unit's parameters (the hook sits on the unit's outputs, which the node's gradients come
// from), so the recompute reads full parameters. A checkpointed unit runs its FSDP hooks inside the checkpoint
// (Module::set_call_wrapper: whatever the order fully_shard and checkpoint were applied in): in forward without
// grad (gather, forward, release; no backward hooks), and again in the recompute (gather, forward, release; the
// hooks it registers there reduce-scatter and release during the nested backward). fsdp/ tells a recompute from a
// forward (Note [forward inside backward] in fsdp/state.cc): the recompute keeps the unit gathered for its
// pre-backward hook and prefetches nothing, so a checkpointed unit is gathered once per pass, as without
// checkpointing (CheckpointFsdp.ACheckpointedUnitIsGatheredOncePerPassAsWithout in
// tests/integration/activation_checkpoint_test.cc). Checkpointing the modules inside a unit costs no all-gather.
//
// Captured steps (capture::compile): a checkpointed call is recorded as the ops it runs, its forward with grad mode
// off, and its recompute and nested backward where the outer backward reaches its node, so the replay equals the
// eager checkpointed step bit for bit and holds what it holds (Note [capturing activation checkpointing] in
// checkpoint.cc). While captured the recompute does not copy and put back the module's buffers (the capture already
// refuses batch_norm's in-place statistics, the only traced write of a buffer).
//
// Limits (as PyTorch's reentrant checkpoint):
//   * a parameter of a checkpointed module must not also be used outside it, nor by two checkpointed calls,
//     in one forward: it would be accumulated, and its post-accumulate-grad hooks run, once per backward it is
//     reached in (ShardedDDP then refuses it: "marked ready twice");
//   * the recompute must compute what the forward computed: a module whose forward depends on state that
//     changes between forward and backward (the training flag, inputs written in place) gets gradients of
//     what it computes in the recompute; a recompute that returns other outputs (number or shapes) throws
//     autograd::AutogradError from backward;
//   * a call records the node when grad mode is on and an input requires grad or the module has a trainable
//     parameter; otherwise (inference, a frozen module on inputs without gradient) it is a plain call.
//
// Thread-safety: a module belongs to one rank; the Generator and the engine state used are the calling thread's.
// The module must outlive every backward through its checkpointed calls.
#pragma once

#include "absl/status/status.h"
#include "common/nn/module.h"

namespace shardkit::nn {

class GPT;

struct CheckpointOptions {
  // Recompute with the rank's Generator as it was at the forward (PyTorch's preserve_rng_state), so
  // dropout draws the same masks. false: the recompute draws from the Generator as backward finds it, and
  // leaves it advanced (results then differ from the same model without checkpointing when it draws).
  bool preserve_rng_state = true;
};

// Makes every later call of `module` (module(x), module.call(...), also from its parent's forward) a
// checkpointed call (see above). Nothing is wrapped: names, parameters and state dicts do not change. Calling it
// again replaces the options. InvalidArgument when the module has no forward of its own (a container such as
// ModuleList, which is never called: checkpoint the modules it holds); FailedPrecondition when the module already
// has a call wrapper of another API (Module::set_call_wrapper).
absl::Status checkpoint(Module& module, const CheckpointOptions& options = {});

// Calls of `module` run without checkpointing again (graphs recorded earlier keep their nodes). No-op when the
// module is not checkpointed.
void remove_checkpoint(Module& module);

bool is_checkpointed(const Module& module);

// checkpoint() on every TransformerBlock of `gpt` (each block keeps its input; everything inside a block is
// recomputed), and its inverse.
absl::Status checkpoint_blocks(GPT& gpt, const CheckpointOptions& options = {});
void remove_checkpoint_blocks(GPT& gpt);

}  // namespace shardkit::nn
