// Executor: replays an executable StepGraph (issue 16 item 2): the recorded kernels in program order, with no
// autograd and no hooks, collectives on their ProcessGroups, and memory freed by a plan computed from lifetimes.
//
// Note [memory plan]
// Replay keeps one value per slot. The slots of the step's inputs (parameters, optimizer state, the batch) hold
// their tensors for good, and the step's outputs (the loss) stay until the next replay. Every other value lives from
// the node that writes it to the last node that reads or writes it: there the executor hands it to that node's
// kernel as the only reference it keeps (so the kernel may reuse its bytes, as the backward engine reuses a
// gradient nobody else holds) and forgets it. What a backward node saved in forward is kept by that node, as in
// eager, and freed when the node has run. So a replay holds no value longer than the eager step did.
// plan_memory() is a pure function of the graph: it gives each node the slots it uses last, the peak bytes of
// values alive at once by that rule (counting each value once, saved activations through the slot that made them),
// and the size one arena would need for them with first-fit placement by lifetime (arena_bytes >= peak_bytes; the
// gap is fragmentation). Values are allocated through the rank's ledger, not carved out of one arena: the
// placement is computed and reported, not used yet.
//
// Note [collective overlap]
// A collective is issued when the executor reaches its node (a parallel mode places it right after the node that
// produces its input), and waited only before the first later node that touches one of its buffers, or at the end
// of the step: computation between the two runs while the collective is in flight.
//
// Thread-safety: an Executor belongs to one rank thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/capture/step_graph.h"
#include "common/comm/process_group.h"

namespace shardkit::capture {

struct MemoryPlan {
  // Per node: the slots whose last use it is (handed over to it, then forgotten).
  std::vector<std::vector<SlotId>> last_use;
  std::int64_t peak_bytes = 0;   // most bytes of step values alive at once
  std::int64_t arena_bytes = 0;  // one arena holding them, placed first-fit by lifetime
  int persistent_slots = 0;
  int temporary_slots = 0;
};

// Note [memory plan].
MemoryPlan plan_memory(const StepGraph& graph);

struct ExecutorOptions {
  // The groups collective nodes name (Node::group), by name.
  std::map<std::string, std::shared_ptr<comm::ProcessGroup>> groups;
};

// Per replay, what the step spent outside kernels and collectives is the host overhead (train_bench reports it).
struct ReplayStats {
  double kernel_seconds = 0;      // inside op kernels
  double collective_seconds = 0;  // issuing collectives and waiting for them
  double total_seconds = 0;
};

class Executor {
 public:
  // InvalidArgument when the graph does not validate, an input slot has no value, an op node has no kernel, a
  // placeholder is left, or a collective names a group the options do not have.
  static absl::StatusOr<Executor> create(StepGraph graph, ExecutorOptions options = {});

  // One replay. A failed collective's status (naming the node) is returned after every issued collective was
  // waited; a kernel's exception becomes Internal naming the node.
  absl::Status run();

  const StepGraph& graph() const { return graph_; }
  // Binds an input slot to `t` (same dtype and shape as the captured input) for the next replays: how a compiled
  // step hands each call's batch over without copying it. A broken invariant (InternalError) otherwise.
  void set_input(SlotId slot, Tensor t);
  // The value of `slot` after the last replay (the inputs' tensors; the outputs'); undefined for values the plan
  // forgot.
  const Tensor& value(SlotId slot) const { return env_[static_cast<std::size_t>(slot)]; }
  const MemoryPlan& plan() const { return plan_; }
  const ReplayStats& last_stats() const { return stats_; }

 private:
  Executor(StepGraph graph, ExecutorOptions options, MemoryPlan plan);

  StepGraph graph_;
  ExecutorOptions options_;
  MemoryPlan plan_;
  ReplayStats stats_;
  std::vector<Tensor> env_;  // one value per slot
};

}  // namespace shardkit::capture
