#include "sddp/replicate_mode.h"

#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/capture/graph_passes.h"
#include "common/capture/param_slots.h"
#include "common/kernels/elementwise.h"

namespace shardkit::sddp {

ReplicateMode::ReplicateMode(std::shared_ptr<comm::ProcessGroup> group, ReplicateModeOptions options)
    : group_(std::move(group)), options_(options) {}

std::map<std::string, std::shared_ptr<comm::ProcessGroup>> ReplicateMode::groups() const {
  return {{group_->name(), group_}};
}

absl::Status ReplicateMode::expand(capture::StepGraph& graph) {
  absl::StatusOr<std::vector<capture::ParamSlots>> params = capture::find_param_slots(graph);
  if (!params.ok()) return params.status();
  // DDP's average, bit for bit: each gradient times the float 1/N, then a sum (Note [replicate average]).
  const float scale = 1.0f / static_cast<float>(group_->size());
  std::map<int, std::vector<capture::Node>> after;
  for (const capture::ParamSlots& p : *params) {
    std::vector<capture::Node>& list = after[p.grad_done];
    if (group_->size() > 1) {
      list.push_back(capture::Node{.kind = capture::NodeKind::op,
                                   .name = "scale",
                                   .reads = {p.grad},
                                   .writes = {p.grad},
                                   .kernel = [scale](trace::KernelArgs& a) {
                                     kernels::scale(scale, a.writes[0], a.writes[0]);
                                   }});
    }
    list.push_back(capture::Node{.kind = capture::NodeKind::collective,
                                 .name = "all_reduce",
                                 .reads = {p.grad},
                                 .writes = {p.grad},
                                 .collective = comm::CollectiveKind::all_reduce,
                                 .reduce_op = comm::ReduceOp::sum(),
                                 .group = group_->name()});
  }
  std::vector<capture::Node> nodes;
  for (std::size_t i = 0; i < graph.nodes().size(); ++i) {
    nodes.push_back(graph.nodes()[i]);
    if (auto it = after.find(static_cast<int>(i)); it != after.end()) {
      nodes.insert(nodes.end(), it->second.begin(), it->second.end());
    }
  }
  graph.mutable_nodes() = std::move(nodes);
  capture::coalesce_collectives(graph, options_.bucket_cap_bytes);
  return graph.validate();
}

}  // namespace shardkit::sddp
