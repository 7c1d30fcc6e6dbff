// StepGraph: one training step as a list of nodes over value slots (issue 16 item 1; seed 002, PyTorch _spmd's
// traced step, is the shape). This file is the graph only: its nodes, checks and printing. Capture (recording a
// step while it runs eagerly) and the executor come next; the passes over the graph are in graph_passes.h.
//
// Note [slots, not SSA]
// A value is a slot: a tensor of fixed dtype and shape that nodes read and write. Training steps update state in
// place (the optimizer writes the parameters and its moments; an all_reduce writes its input), so slots may be
// written by several nodes; the order of the node list is the program order. A graph is well formed when every
// slot a node reads is a graph input or was written by an earlier node (validate()). Passes reason about
// "no write in between" on this order.
//
// Node kinds:
//   input        writes one slot from outside (a parameter, a buffer, optimizer state, the batch)
//   op           a computation: reads `reads`, writes `writes` (name: "matmul", "adamw_update", ...)
//   collective   a ProcessGroup call on group `group`: all_reduce / broadcast / reduce read and write one slot;
//                all_gather and reduce_scatter read `reads[0]` and write `writes[0]`
//   placeholder  stands for a part that was not traced (an Override): expand_placeholder() replaces it
//   output       reads one slot that leaves the step (the loss, the updated parameters)
//
// Executable graphs: a graph the recorder built (recorder.h) also carries, per op node, its kernel (trace_hook.h),
// whether grad mode was on when it ran, and for a node of the backward engine the slot whose value's grad_fn is
// that node (an output of the forward op that created it: replay runs the node the replayed forward created).
// Slots of the step's inputs carry their tensor (`value`); every other value is made by the replay. Hand-built
// graphs (pass tests) leave these empty.
//
// Thread-safety: a value type; no shared state.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/comm/comm_counters.h"
#include "common/comm/process_group.h"
#include "common/tensor/dtype.h"
#include "common/tensor/tensor.h"
#include "common/tensor/trace_hook.h"

namespace shardkit::capture {

using SlotId = int;

struct Slot {
  SlotId id = -1;
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  Tensor value = {};  // recorded graphs, input slots: the tensor (a parameter, optimizer state, a batch tensor)

  std::int64_t numel() const;
  std::int64_t nbytes() const { return numel() * static_cast<std::int64_t>(dtype_size(dtype)); }
};

enum class NodeKind { input, op, collective, placeholder, output };
std::string_view node_kind_name(NodeKind k);

struct Node {
  NodeKind kind = NodeKind::op;
  std::string name = {};          // op name, collective kind name, placeholder name, input / output label
  std::vector<SlotId> reads = {};
  std::vector<SlotId> writes = {};
  // Collectives only.
  comm::CollectiveKind collective = comm::CollectiveKind::all_reduce;
  comm::ReduceOp reduce_op = {};
  std::string group = {};         // the ProcessGroup's name, e.g. "world"
  // Executable graphs, op nodes: recomputes `writes` from `reads`.
  trace::Kernel kernel = {};
  bool grad_enabled = false;
  // Executable graphs, backward nodes: a slot written by the forward op that created the node.
  SlotId grad_fn_slot = -1;
};

class StepGraph {
 public:
  // A new slot; its id is its index.
  SlotId add_slot(std::string name, DType dtype, Shape shape);
  // Appends a node; returns its index.
  int add(Node node);
  int add_input(SlotId slot, std::string name);
  int add_op(std::string name, std::vector<SlotId> reads, std::vector<SlotId> writes);
  int add_collective(comm::CollectiveKind kind, std::vector<SlotId> reads, std::vector<SlotId> writes,
                     std::string group, comm::ReduceOp op = comm::ReduceOp::sum());
  int add_placeholder(std::string name, std::vector<SlotId> reads, std::vector<SlotId> writes);
  int add_output(SlotId slot, std::string name);

  const std::vector<Slot>& slots() const { return slots_; }
  const std::vector<Node>& nodes() const { return nodes_; }
  std::vector<Node>& mutable_nodes() { return nodes_; }
  const Slot& slot(SlotId id) const { return slots_[static_cast<std::size_t>(id)]; }
  Slot& mutable_slot(SlotId id) { return slots_[static_cast<std::size_t>(id)]; }

  // InvalidArgument naming the node and slot when a node reads a slot nothing wrote before it, refers to a slot
  // that does not exist, or a collective's slots do not fit its kind (in-place kinds: one slot read and written;
  // all_gather / reduce_scatter: one each, the sizes in the ratio of a group of size >= 1).
  absl::Status validate() const;

  // One line per node: "3: collective all_reduce(sum) @world reads [grad.w] writes [grad.w]".
  std::string to_text() const;
  // Graphviz: slots as ellipses, nodes as boxes (collectives in bold), edges node -> slot (write) and
  // slot -> node (read); a slot written twice appears once.
  std::string to_dot() const;
  // Node counts by kind and, for collectives, by collective kind: {"op": 12, "collective/all_gather": 3, ...}.
  std::map<std::string, int> counts() const;

 private:
  std::vector<Slot> slots_;
  std::vector<Node> nodes_;
};

// "collective all_reduce(sum) @world" / "op matmul" / "placeholder attn" (the node without its slots).
std::string describe(const Node& node);

}  // namespace shardkit::capture
