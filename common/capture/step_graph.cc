#include "common/capture/step_graph.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"

namespace shardkit::capture {

std::int64_t Slot::numel() const {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

std::string_view node_kind_name(NodeKind k) {
  switch (k) {
    case NodeKind::input: return "input";
    case NodeKind::op: return "op";
    case NodeKind::collective: return "collective";
    case NodeKind::placeholder: return "placeholder";
    case NodeKind::output: return "output";
  }
  return "?";
}

std::string describe(const Node& n) {
  std::string s = absl::StrCat(std::string(node_kind_name(n.kind)), " ", n.name);
  if (n.kind == NodeKind::collective) {
    if (n.collective == comm::CollectiveKind::all_reduce || n.collective == comm::CollectiveKind::reduce ||
        n.collective == comm::CollectiveKind::reduce_scatter) {
      absl::StrAppend(&s, "(", n.reduce_op.to_string(), ")");
    }
    absl::StrAppend(&s, " @", n.group);
  }
  return s;
}

SlotId StepGraph::add_slot(std::string name, DType dtype, Shape shape) {
  const SlotId id = static_cast<SlotId>(slots_.size());
  slots_.push_back(Slot{id, std::move(name), dtype, std::move(shape)});
  return id;
}

int StepGraph::add(Node node) {
  nodes_.push_back(std::move(node));
  return static_cast<int>(nodes_.size()) - 1;
}

int StepGraph::add_input(SlotId slot, std::string name) {
  return add(Node{.kind = NodeKind::input, .name = std::move(name), .reads = {}, .writes = {slot}});
}

int StepGraph::add_op(std::string name, std::vector<SlotId> reads, std::vector<SlotId> writes) {
  return add(Node{.kind = NodeKind::op, .name = std::move(name), .reads = std::move(reads), .writes = std::move(writes)});
}

int StepGraph::add_collective(comm::CollectiveKind kind, std::vector<SlotId> reads, std::vector<SlotId> writes,
                              std::string group, comm::ReduceOp op) {
  Node n{.kind = NodeKind::collective,
         .name = std::string(comm::collective_kind_name(kind)),
         .reads = std::move(reads),
         .writes = std::move(writes)};
  n.collective = kind;
  n.reduce_op = op;
  n.group = std::move(group);
  return add(std::move(n));
}

int StepGraph::add_placeholder(std::string name, std::vector<SlotId> reads, std::vector<SlotId> writes) {
  return add(Node{.kind = NodeKind::placeholder, .name = std::move(name), .reads = std::move(reads),
                  .writes = std::move(writes)});
}

int StepGraph::add_output(SlotId slot, std::string name) {
  return add(Node{.kind = NodeKind::output, .name = std::move(name), .reads = {slot}, .writes = {}});
}

absl::Status StepGraph::validate() const {
  std::set<SlotId> written;
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    const Node& n = nodes_[i];
    const std::string where = absl::StrCat("StepGraph node ", i, " (", describe(n), ")");
    for (const auto* list : {&n.reads, &n.writes}) {
      for (SlotId s : *list) {
        if (s < 0 || static_cast<std::size_t>(s) >= slots_.size()) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": expected slots in [0, ", slots_.size(), "), found ", s));
        }
      }
    }
    if (n.grad_fn_slot >= static_cast<SlotId>(slots_.size())) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": expected a grad_fn slot in [0, ", slots_.size(),
                                                     "), found ", n.grad_fn_slot));
    }
    if (n.grad_fn_slot >= 0 && !written.count(n.grad_fn_slot)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": runs the backward node of slot '",
                                                     slot(n.grad_fn_slot).name, "', which nothing wrote before"));
    }
    for (SlotId s : n.reads) {
      if (!written.count(s)) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": reads slot '", slot(s).name,
                                                       "' before any node writes it"));
      }
    }
    if (n.kind == NodeKind::collective) {
      const bool in_place = n.collective != comm::CollectiveKind::all_gather &&
                            n.collective != comm::CollectiveKind::reduce_scatter;
      const bool shape_ok =
          n.reads.size() == 1 && n.writes.size() == 1 &&
          (in_place ? n.reads[0] == n.writes[0]
                    : slot(n.reads[0]).dtype == slot(n.writes[0]).dtype &&
                          (n.collective == comm::CollectiveKind::all_gather
                               ? slot(n.writes[0]).numel() % std::max<std::int64_t>(slot(n.reads[0]).numel(), 1) == 0
                               : slot(n.reads[0]).numel() % std::max<std::int64_t>(slot(n.writes[0]).numel(), 1) == 0));
      if (!shape_ok) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, in_place ? ": expected one slot, read and written in place"
                            : ": expected one input and one output slot of one dtype, sizes in a group's ratio"));
      }
    }
    for (SlotId s : n.writes) written.insert(s);
  }
  return absl::OkStatus();
}

std::string StepGraph::to_text() const {
  std::string out;
  auto names = [this](const std::vector<SlotId>& ids) {
    std::vector<std::string> v;
    for (SlotId s : ids) v.push_back(slot(s).name);
    return absl::StrCat("[", absl::StrJoin(v, ", "), "]");
  };
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    const Node& n = nodes_[i];
    absl::StrAppend(&out, i, ": ", describe(n));
    if (!n.reads.empty()) absl::StrAppend(&out, " reads ", names(n.reads));
    if (!n.writes.empty()) absl::StrAppend(&out, " writes ", names(n.writes));
    out += "\n";
  }
  return out;
}

std::string StepGraph::to_dot() const {
  auto quote = [](const std::string& s) { return absl::StrCat("\"", absl::StrReplaceAll(s, {{"\"", "\\\""}}), "\""); };
  std::string out = "digraph step {\n  rankdir=TB;\n";
  for (const Slot& s : slots_) {
    absl::StrAppend(&out, "  s", s.id, " [shape=ellipse, label=", quote(s.name), "];\n");
  }
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    const Node& n = nodes_[i];
    absl::StrAppend(&out, "  n", i, " [shape=box", n.kind == NodeKind::collective ? ", style=bold" : "",
                    ", label=", quote(describe(n)), "];\n");
    for (SlotId s : n.reads) absl::StrAppend(&out, "  s", s, " -> n", i, ";\n");
    for (SlotId s : n.writes) absl::StrAppend(&out, "  n", i, " -> s", s, ";\n");
  }
  return out + "}\n";
}

std::map<std::string, int> StepGraph::counts() const {
  std::map<std::string, int> c;
  for (const Node& n : nodes_) {
    ++c[std::string(node_kind_name(n.kind))];
    if (n.kind == NodeKind::collective) ++c[absl::StrCat("collective/", n.name)];
  }
  return c;
}

}  // namespace shardkit::capture
