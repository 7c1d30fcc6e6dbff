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

namespace {

bool coalescable(comm::CollectiveKind k) {
  return k == comm::CollectiveKind::all_reduce || k == comm::CollectiveKind::all_gather ||
         k == comm::CollectiveKind::reduce_scatter;
}

// A call's size for the bound: its larger slot (the unsharded size of an all_gather / reduce_scatter).
std::int64_t call_bytes(const StepGraph& g, const Node& n) {
  return std::max(g.slot(n.reads[0]).nbytes(), g.slot(n.writes[0]).nbytes());
}

bool touches_call(const Node& n, const Node& call) {
  return touches(n, call.reads[0], true, true) || touches(n, call.writes[0], true, true);
}

Tensor fresh_or_reallocated(Tensor t, const Shape& shape, DType dtype) {
  if (!t.defined()) return Tensor::empty(shape, TensorOptions{}.with_dtype(dtype));
  if (t.storage_released()) t.reallocate_storage();  // the bytes a reshard gave back (what saved views point at)
  return t;
}

// pack, the merged call and unpack for `members` (Note [coalesce collectives]). Rows of member m: the length of its
// smaller slot; with R = the sum over members and k = the group's ratio, an all_gather's packed input is
// [m1 | m2 | ...] (R) and its output k blocks of R, block r holding every member's rows from rank r; a
// reduce_scatter's packed input is those k blocks, its output R.
std::vector<Node> merged(StepGraph& graph, const std::vector<Node>& members, int g) {
  const Node& like = members.front();
  const DType dtype = graph.slot(like.reads[0]).dtype;
  std::vector<SlotId> ins, outs;
  std::vector<std::int64_t> rows;
  std::vector<std::pair<Shape, DType>> out_types;
  std::int64_t total = 0;
  for (const Node& m : members) {
    ins.push_back(m.reads[0]);
    outs.push_back(m.writes[0]);
    rows.push_back(std::min(graph.slot(m.reads[0]).numel(), graph.slot(m.writes[0]).numel()));
    out_types.emplace_back(graph.slot(m.writes[0]).shape, graph.slot(m.writes[0]).dtype);
    total += rows.back();
  }
  if (like.collective == comm::CollectiveKind::all_reduce) {
    const SlotId packed = graph.add_slot(absl::StrCat("coalesced.", g), dtype, {total});
    Node collective = like;
    collective.reads = {packed};
    collective.writes = {packed};
    return {
        Node{.kind = NodeKind::op, .name = "pack", .reads = ins, .writes = {packed},
             .kernel = [total, dtype](trace::KernelArgs& a) {
               Tensor flat = Tensor::empty({total}, TensorOptions{}.with_dtype(dtype));
               std::int64_t at = 0;
               for (const Tensor& t : a.reads) {
                 flat.view(at, t.shape()).copy_(t);
                 at += t.numel();
               }
               a.writes[0] = std::move(flat);
             }},
        collective,
        Node{.kind = NodeKind::op, .name = "unpack", .reads = {packed}, .writes = outs,
             .kernel = [](trace::KernelArgs& a) {
               std::int64_t at = 0;
               for (Tensor& t : a.writes) {
                 t.copy_(a.reads[0].view(at, t.shape()));
                 at += t.numel();
               }
             }},
    };
  }
  const bool gather = like.collective == comm::CollectiveKind::all_gather;
  const std::int64_t k = std::max(graph.slot(like.reads[0]).numel(), graph.slot(like.writes[0]).numel()) / rows[0];
  const SlotId packed_in = graph.add_slot(absl::StrCat("coalesced.", g), dtype, {gather ? total : k * total});
  const SlotId packed_out = graph.add_slot(absl::StrCat("coalesced.", g, ".out"), dtype, {gather ? k * total : total});
  Node collective = like;
  collective.reads = {packed_in};
  collective.writes = {packed_out};
  // Copies member m's rows of block r of the blocked side to or from block r of the packed tensor.
  auto copy_blocks = [rows, total](const Tensor& packed, const std::vector<Tensor>& members, std::int64_t nblocks,
                                   bool into_packed) {
    for (std::int64_t r = 0; r < nblocks; ++r) {
      std::int64_t at = r * total;
      for (std::size_t m = 0; m < members.size(); ++m) {
        const Tensor member = members[m].view(r * rows[m], {rows[m]});
        const Tensor block = packed.view(at, {rows[m]});
        (into_packed ? block : member).copy_(into_packed ? member : block);
        at += rows[m];
      }
    }
  };
  const std::int64_t in_blocks = gather ? 1 : k, out_blocks = gather ? k : 1;
  const std::int64_t in_numel = gather ? total : k * total;
  return {
      Node{.kind = NodeKind::op, .name = "pack", .reads = ins, .writes = {packed_in},
           .kernel = [copy_blocks, in_numel, in_blocks, dtype](trace::KernelArgs& a) {
             Tensor flat = Tensor::empty({in_numel}, TensorOptions{}.with_dtype(dtype));
             copy_blocks(flat, a.reads, in_blocks, /*into_packed=*/true);
             a.writes[0] = std::move(flat);
           }},
      collective,
      Node{.kind = NodeKind::op, .name = "unpack", .reads = {packed_out}, .writes = outs,
           .kernel = [copy_blocks, out_blocks, out_types](trace::KernelArgs& a) {
             for (std::size_t m = 0; m < a.writes.size(); ++m) {
               a.writes[m] = fresh_or_reallocated(a.writes[m], out_types[m].first, out_types[m].second);
             }
             copy_blocks(a.reads[0], a.writes, out_blocks, /*into_packed=*/false);
           }},
  };
}

}  // namespace

PassReport coalesce_collectives(StepGraph& graph, std::int64_t max_bytes) {
  const std::vector<Node> nodes = graph.nodes();
  auto candidate = [&](const Node& n) {
    return n.kind == NodeKind::collective && coalescable(n.collective) && call_bytes(graph, n) <= max_bytes;
  };
  // Groups of node indices, each to be merged at its last member.
  std::vector<std::vector<std::size_t>> groups;
  std::vector<std::size_t> open;
  std::int64_t open_bytes = 0;
  auto close = [&] {
    if (open.size() >= 2) groups.push_back(open);
    open.clear();
    open_bytes = 0;
  };
  for (std::size_t j = 0; j < nodes.size(); ++j) {
    const Node& n = nodes[j];
    // A node that reads or writes an open member's slots ends the group before it (that member cannot be delayed
    // past it); so does a call that shares a slot with one.
    bool blocks = false;
    for (std::size_t m : open) blocks = blocks || touches_call(n, nodes[m]);
    const bool joins = !blocks && candidate(n) && !open.empty() && same_call(nodes[open.front()], n) &&
                       graph.slot(n.reads[0]).dtype == graph.slot(nodes[open.front()].reads[0]).dtype &&
                       open_bytes + call_bytes(graph, n) <= max_bytes;
    if (!joins && (blocks || candidate(n))) close();
    if (candidate(n)) {
      open.push_back(j);
      open_bytes += call_bytes(graph, n);
    }
  }
  close();
  PassReport report;
  if (groups.empty()) return report;
  // Each group: pack and the call where its last member was; then unpack: right after an all_reduce, and for an
  // all_gather / reduce_scatter before the first later node that touches a member's output, or at the end.
  std::map<std::size_t, std::vector<Node>> at;  // insert before node index (nodes.size(): at the end)
  std::set<std::size_t> dropped;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    std::vector<Node> members;
    for (std::size_t m : groups[g]) {
      members.push_back(nodes[m]);
      dropped.insert(m);
    }
    std::vector<Node> three = merged(graph, members, static_cast<int>(g));
    const std::size_t last = groups[g].back();
    std::size_t use = last + 1;
    const bool in_place = members.front().collective == comm::CollectiveKind::all_reduce;
    for (; !in_place && use < nodes.size(); ++use) {
      const Node& n = nodes[use];
      if (std::any_of(members.begin(), members.end(),
                      [&](const Node& m) { return touches(n, m.writes[0], true, true); })) {
        break;
      }
    }
    at[last + 1].insert(at[last + 1].end(), three.begin(), three.begin() + 2);
    at[use].push_back(three[2]);
    report.removed += static_cast<int>(members.size()) - 1;
  }
  std::vector<Node> out;
  for (std::size_t j = 0; j <= nodes.size(); ++j) {
    if (auto it = at.find(j); it != at.end()) out.insert(out.end(), it->second.begin(), it->second.end());
    if (j < nodes.size() && !dropped.count(j)) out.push_back(nodes[j]);
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
