#include "common/capture/graph_passes.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"

namespace shardkit::capture {
namespace {

bool touches(const Node& n, SlotId s, bool reads, bool writes) {
  return (reads && std::find(n.reads.begin(), n.reads.end(), s) != n.reads.end()) ||
         (writes && std::find(n.writes.begin(), n.writes.end(), s) != n.writes.end());
}

bool same_call(const Node& a, const Node& b) {
  return a.kind == NodeKind::collective && b.kind == NodeKind::collective && a.collective == b.collective &&
         a.reduce_op.kind == b.reduce_op.kind && a.reduce_op.factor == b.reduce_op.factor && a.group == b.group;
}

// Nodes that write `s`, anywhere in the graph.
int writers_of(const std::vector<Node>& nodes, SlotId s) {
  int k = 0;
  for (const Node& n : nodes) k += touches(n, s, false, true) ? 1 : 0;
  return k;
}

}  // namespace

PassReport dedup_collectives(StepGraph& graph) {
  std::vector<Node>& nodes = graph.mutable_nodes();
  std::vector<bool> removed(nodes.size(), false);
  std::map<std::size_t, std::pair<SlotId, SlotId>> renames;  // from node index on: read slot a as b
  PassReport report;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const Node& first = nodes[i];
    if (removed[i] || first.kind != NodeKind::collective) continue;
    if (first.collective != comm::CollectiveKind::all_gather && first.collective != comm::CollectiveKind::reduce_scatter) {
      continue;
    }
    const SlotId in = first.reads[0], out = first.writes[0];
    for (std::size_t j = i + 1; j < nodes.size(); ++j) {
      const Node& n = nodes[j];
      if (!removed[j] && same_call(first, n) && n.reads[0] == in && n.writes[0] == out) {
        removed[j] = true;  // the same call into the same slot, nothing written in between: nothing to redo
        ++report.removed;
        continue;
      }
      if (!removed[j] && same_call(first, n) && n.reads[0] == in && n.writes[0] != out &&
          writers_of(nodes, n.writes[0]) == 1) {
        removed[j] = true;
        renames[j + 1] = {n.writes[0], out};
        ++report.removed;
        continue;
      }
      // Between the two, neither the input nor the first's output may change.
      if (touches(n, in, false, true) || touches(n, out, false, true)) break;
    }
  }
  // Later reads of a removed collective's output read the first one's output.
  std::vector<std::pair<SlotId, SlotId>> active;
  std::vector<Node> kept;
  for (std::size_t j = 0; j < nodes.size(); ++j) {
    if (auto it = renames.find(j); it != renames.end()) active.push_back(it->second);
    if (removed[j]) continue;
    Node n = nodes[j];
    for (SlotId& s : n.reads) {
      for (const auto& [from, to] : active) {
        if (s == from) s = to;
      }
    }
    kept.push_back(std::move(n));
  }
  nodes = std::move(kept);
  return report;
}

PassReport coalesce_collectives(StepGraph& graph, std::int64_t max_bytes) {
  const std::vector<Node> nodes = graph.nodes();
  auto candidate = [&](const Node& n) {
    return n.kind == NodeKind::collective && n.collective == comm::CollectiveKind::all_reduce &&
           graph.slot(n.reads[0]).nbytes() <= max_bytes;
  };
  // Groups of node indices, each to be merged at its last member.
  std::vector<std::vector<std::size_t>> groups;
  std::vector<std::size_t> open;
  auto close = [&] {
    if (open.size() >= 2) groups.push_back(open);
    open.clear();
  };
  for (std::size_t j = 0; j < nodes.size(); ++j) {
    const Node& n = nodes[j];
    std::int64_t open_bytes = 0;
    for (std::size_t m : open) open_bytes += graph.slot(nodes[m].reads[0]).nbytes();
    const bool joins = candidate(n) && !open.empty() && same_call(nodes[open.front()], n) &&
                       graph.slot(n.reads[0]).dtype == graph.slot(nodes[open.front()].reads[0]).dtype &&
                       open_bytes + graph.slot(n.reads[0]).nbytes() <= max_bytes;
    if (joins) {
      open.push_back(j);
      continue;
    }
    // A node that reads or writes an open member's slot ends the group before it (that member cannot be
    // delayed past it).
    bool blocks = false;
    for (std::size_t m : open) blocks = blocks || touches(n, nodes[m].reads[0], true, true);
    if (blocks || candidate(n)) close();
    if (candidate(n)) open.push_back(j);
  }
  close();
  PassReport report;
  if (groups.empty()) return report;
  std::map<std::size_t, std::vector<Node>> replace_at;  // last member -> pack, collective, unpack
  std::set<std::size_t> dropped;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const std::vector<std::size_t>& members = groups[g];
    std::vector<SlotId> slots;
    std::int64_t numel = 0;
    for (std::size_t m : members) {
      slots.push_back(nodes[m].reads[0]);
      numel += graph.slot(nodes[m].reads[0]).numel();
      dropped.insert(m);
    }
    const Node& like = nodes[members.front()];
    const SlotId packed = graph.add_slot(absl::StrCat("coalesced.", g), graph.slot(slots[0]).dtype, {numel});
    Node collective = like;
    collective.reads = {packed};
    collective.writes = {packed};
    const DType dtype = graph.slot(slots[0]).dtype;
    replace_at[members.back()] = {
        Node{.kind = NodeKind::op, .name = "pack", .reads = slots, .writes = {packed},
             .kernel = [numel, dtype](trace::KernelArgs& a) {
               Tensor flat = Tensor::empty({numel}, TensorOptions{}.with_dtype(dtype));
               std::int64_t at = 0;
               for (const Tensor& t : a.reads) {
                 flat.view(at, t.shape()).copy_(t);
                 at += t.numel();
               }
               a.writes[0] = std::move(flat);
             }},
        collective,
        Node{.kind = NodeKind::op, .name = "unpack", .reads = {packed}, .writes = slots,
             .kernel = [](trace::KernelArgs& a) {
               std::int64_t at = 0;
               for (Tensor& t : a.writes) {
                 t.copy_(a.reads[0].view(at, t.shape()));
                 at += t.numel();
               }
             }},
    };
    report.removed += static_cast<int>(members.size()) - 1;
  }
  std::vector<Node> out;
  for (std::size_t j = 0; j < nodes.size(); ++j) {
    if (auto it = replace_at.find(j); it != replace_at.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
    } else if (!dropped.count(j)) {
      out.push_back(nodes[j]);
    }
  }
  graph.mutable_nodes() = std::move(out);
  return report;
}

absl::Status expand_placeholder(StepGraph& graph, const std::string& name, std::vector<Node> replacement) {
  std::vector<Node>& nodes = graph.mutable_nodes();
  auto it = std::find_if(nodes.begin(), nodes.end(),
                         [&](const Node& n) { return n.kind == NodeKind::placeholder && n.name == name; });
  if (it == nodes.end()) {
    return absl::NotFoundError(absl::StrCat("expand_placeholder: expected a placeholder named '", name,
                                            "' in the graph, found none"));
  }
  const std::vector<Node> before = nodes;
  const auto at = it - nodes.begin();
  nodes.erase(it);
  nodes.insert(nodes.begin() + at, replacement.begin(), replacement.end());
  if (absl::Status s = graph.validate(); !s.ok()) {
    graph.mutable_nodes() = before;
    return absl::InvalidArgumentError(absl::StrCat("expand_placeholder '", name, "': ", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace shardkit::capture
