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
// values alive at once by that rule (counting each value once, saved activations through the slot that made them).
// Where the values' bytes live is the StepArena's business (step_arena.h, Note [step arena]): one block per rank,
// placed from the lifetimes of the allocations the first replay made, which also covers what backward nodes saved.
//
// Note [replay schedule]
// A replay does no search and no lookup per node: create() computes, per node, the values it uses last (its slots
// in the plan's last-use list that are not the step's inputs or outputs), which of those an op hands to its kernel,
// and a collective's group; the collectives in flight, the backward nodes and the kernels' argument lists live in
// vectors by slot that the executor keeps between replays. After every node, a collective that is done and whose
// slot's last use has passed gives its value back at once (is_completed(), never blocking), so a gradient sent by a
// reduce_scatter is freed when the call is done rather than when a later node waits for the call's result.
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

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/capture/step_arena.h"
#include "common/capture/step_graph.h"
#include "common/comm/process_group.h"

namespace shardkit::autograd {
class Node;
}  // namespace shardkit::autograd

namespace shardkit::capture {

struct MemoryPlan {
  // Per node: the slots whose last use it is (handed over to it, then forgotten).
  std::vector<std::vector<SlotId>> last_use;
  std::int64_t peak_bytes = 0;  // most bytes of step values alive at once
  int persistent_slots = 0;
  int temporary_slots = 0;
};

// Note [memory plan].
MemoryPlan plan_memory(const StepGraph& graph);

struct ExecutorOptions {
  // The groups collective nodes name (Node::group), by name.
  std::map<std::string, std::shared_ptr<comm::ProcessGroup>> groups;
  // Carve the replay's values out of one StepArena (Note [step arena]); false: every value from the heap.
  bool arena = true;
};

// Per replay, what the step spent outside kernels and collectives is the host overhead (train_bench reports it).
struct ReplayStats {
  double kernel_seconds = 0;      // inside op kernels
  double collective_seconds = 0;  // issuing collectives and waiting for them
  double total_seconds = 0;
  std::vector<double> node_seconds;  // per node of the graph: its kernel's time (0 for other nodes)
};

// The replay's kernel time by op name (Node::name), most first: where a replayed step spends its time.
struct OpTime {
  std::string op;
  double seconds = 0;
  int calls = 0;
};
std::vector<OpTime> kernel_time_by_op(const StepGraph& graph, const ReplayStats& stats);

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
  // The arena's size and where the last replay's allocations came from (zeros without an arena).
  StepArena::Stats arena_stats() const { return arena_ ? arena_->stats() : StepArena::Stats{}; }
  const ReplayStats& last_stats() const { return stats_; }

 private:
  Executor(StepGraph graph, ExecutorOptions options, MemoryPlan plan);

  // Note [replay schedule]: what run() needs per node, computed once by the constructor from the graph and the plan.
  struct NodeSchedule {
    std::vector<SlotId> forget_after;  // the node's last uses, persistent slots excluded
    std::vector<SlotId> hand_over;     // of those, the op's reads it does not write: handed to its kernel
    comm::ProcessGroup* group = nullptr;  // a collective's group
  };
  // A collective in flight, per slot it covers (its input and its output).
  struct Pending {
    std::shared_ptr<comm::Work> work;
    absl::Duration timeout;
    int node = -1;
    SlotId other = -1;    // the call's other slot
    bool forget = false;  // the call was the slot's last use: forget the value once it completed
  };
  void wait(SlotId slot);
  void finish(SlotId slot, const absl::Status& s);
  void reap_completed();
  void record_failure(const absl::Status& s, int node);

  StepGraph graph_;
  ExecutorOptions options_;
  MemoryPlan plan_;
  ReplayStats stats_;
  std::shared_ptr<StepArena> arena_;  // nullptr: options.arena is false
  std::vector<Tensor> env_;  // one value per slot
  std::vector<bool> keep_;   // persistent slots
  std::vector<bool> names_a_node_;  // slots some backward node is found through (Node::grad_fn_slot)
  std::vector<NodeSchedule> schedule_;
  // Per replay (members so that a replay allocates nothing of its own for them).
  std::vector<Pending> pending_;                                  // by slot
  std::vector<SlotId> active_;                                    // slots with a collective in flight
  std::vector<std::shared_ptr<autograd::Node>> backward_nodes_;  // by the slot its forward op wrote
  std::vector<Tensor> reads_, writes_;                            // the op's arguments
  absl::Status failed_;
};

}  // namespace shardkit::capture
