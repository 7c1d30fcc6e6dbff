#include "common/capture/param_slots.h"

#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace shardkit::capture {

absl::StatusOr<std::vector<ParamSlots>> find_param_slots(const StepGraph& graph) {
  std::vector<ParamSlots> out;
  std::set<SlotId> accumulated;
  for (std::size_t i = 0; i < graph.nodes().size(); ++i) {
    const Node& n = graph.nodes()[i];
    if (n.kind == NodeKind::op && n.name == "accumulate_grad") accumulated.insert(n.writes.begin(), n.writes.end());
    if (n.kind != NodeKind::op || !absl::EndsWith(n.name, ".update")) continue;
    ParamSlots p;
    p.update = static_cast<int>(i);
    p.weights = n.reads.at(0);
    std::size_t grad_at = 1;
    if (n.reads.size() > 1 && !accumulated.count(n.reads[1])) grad_at = 2;  // [master, param, grad, ...]
    if (n.reads.size() <= grad_at || !accumulated.count(n.reads[grad_at])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "node ", i, " (", describe(n), "): expected it to read a gradient the backward accumulated; a parallel mode "
          "reduces only gradients this step's backward made, and this one got none (a frozen or unused parameter "
          "holding a zero gradient that zero_grad(set_to_none = false) kept: drop gradients with zero_grad() instead)"));
    }
    p.param = grad_at == 2 ? n.reads[1] : n.reads[0];
    p.grad = n.reads[grad_at];
    p.state.assign(n.reads.begin() + static_cast<std::ptrdiff_t>(grad_at) + 1, n.reads.end());
    // Note [gradient done]: the backward's last accumulation, not the last write (a clip writes it after).
    for (std::size_t j = i; j-- > 0;) {
      const Node& w = graph.nodes()[j];
      if (w.name == "accumulate_grad" && std::find(w.writes.begin(), w.writes.end(), p.grad) != w.writes.end()) {
        p.grad_done = static_cast<int>(j);
        break;
      }
    }
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace shardkit::capture
