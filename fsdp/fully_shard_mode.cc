#include "fsdp/fully_shard_mode.h"

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/capture/param_slots.h"
#include "fsdp/same_values.h"

namespace shardkit::fsdp {
namespace {

using capture::Node;
using capture::NodeKind;
using capture::SlotId;
using capture::StepGraph;

bool reads_any(const Node& n, const std::set<SlotId>& slots) {
  return std::any_of(n.reads.begin(), n.reads.end(), [&](SlotId s) { return slots.count(s) > 0; });
}

Node collective(comm::CollectiveKind kind, SlotId in, SlotId out, const std::string& group,
                comm::ReduceOp op = comm::ReduceOp::sum()) {
  return Node{.kind = NodeKind::collective,
              .name = std::string(comm::collective_kind_name(kind)),
              .reads = {in},
              .writes = {out},
              .collective = kind,
              .reduce_op = op,
              .group = group};
}

Node op(std::string name, std::vector<SlotId> reads, std::vector<SlotId> writes, trace::Kernel kernel) {
  return Node{.kind = NodeKind::op, .name = std::move(name), .reads = std::move(reads), .writes = std::move(writes),
              .kernel = std::move(kernel)};
}

// A parameter's first gather in a pass: placed by place_buckets.
struct FirstGather {
  std::size_t first_use;  // the node that first uses the parameter in the pass
  std::int64_t bytes;     // the gathered (unsharded) bytes
  Node gather;
};

// Note [gather buckets]. Buckets of consecutive first gathers (by first use) of at most options.bucket_bytes; bucket
// b's gathers go before the first use of bucket b - prefetch's first parameter: into `now` when that is bucket b's
// own first use (before the node's other inserted nodes), else into `ahead` (after them: the node's own gathers are
// waited first, then the next bucket's are issued).
// Sorts `gathers` by first use and cuts them into buckets of at most `bucket_bytes`: returns each one's first member.
std::vector<std::size_t> bucket_starts(std::vector<FirstGather>& gathers, std::int64_t bucket_bytes) {
  std::stable_sort(gathers.begin(), gathers.end(),
                   [](const FirstGather& a, const FirstGather& b) { return a.first_use < b.first_use; });
  std::vector<std::size_t> starts;
  std::int64_t bytes = 0;
  for (std::size_t k = 0; k < gathers.size(); ++k) {
    if (starts.empty() || bytes + gathers[k].bytes > bucket_bytes) {
      starts.push_back(k);
      bytes = 0;
    }
    bytes += gathers[k].bytes;
  }
  return starts;
}

// The first use of each bucket's first parameter.
std::vector<std::size_t> bucket_anchors(std::vector<FirstGather> gathers, std::int64_t bucket_bytes) {
  std::vector<std::size_t> anchors;
  for (std::size_t k : bucket_starts(gathers, bucket_bytes)) anchors.push_back(gathers[k].first_use);
  return anchors;
}

void place_buckets(std::vector<FirstGather>& gathers, const FullyShardModeOptions& options,
                   std::map<std::size_t, std::vector<Node>>& now, std::map<std::size_t, std::vector<Node>>& ahead) {
  const std::vector<std::size_t> starts = bucket_starts(gathers, options.bucket_bytes);
  std::vector<std::size_t> anchors;  // per bucket: its first parameter's first use
  std::vector<std::vector<const Node*>> buckets;
  for (std::size_t b = 0; b < starts.size(); ++b) {
    anchors.push_back(gathers[starts[b]].first_use);
    buckets.emplace_back();
    const std::size_t end = b + 1 < starts.size() ? starts[b + 1] : gathers.size();
    for (std::size_t k = starts[b]; k < end; ++k) buckets.back().push_back(&gathers[k].gather);
  }
  const std::size_t prefetch = static_cast<std::size_t>(std::max(options.prefetch, 0));
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    const std::size_t at = anchors[b >= prefetch ? b - prefetch : 0];
    std::vector<Node>& list = at == anchors[b] ? now[at] : ahead[at];
    for (const Node* n : buckets[b]) list.push_back(*n);
  }
}

}  // namespace

FullyShardMode::FullyShardMode(std::shared_ptr<comm::ProcessGroup> group, FullyShardModeOptions options)
    : group_(std::move(group)), options_(options) {}

std::map<std::string, std::shared_ptr<comm::ProcessGroup>> FullyShardMode::groups() const {
  return {{group_->name(), group_}};
}

Tensor FullyShardMode::make_shard(const Tensor& full) const {
  const std::int64_t n = full.numel();
  const std::int64_t world = group_->size();
  const std::int64_t rows = (n + world - 1) / world;
  const std::int64_t start = std::min(n, rows * group_->rank());
  const std::int64_t length = std::min(rows, n - start);
  Tensor shard = Tensor::zeros({rows}, TensorOptions{}.with_category(full.storage()->category()));
  if (length > 0) shard.view(0, {length}).copy_(full.view(start, {length}));
  return shard;
}

std::int64_t FullyShardMode::shard_bytes() const {
  std::int64_t bytes = 0;
  for (const Sharded& s : sharded_) bytes += static_cast<std::int64_t>(s.shard.nbytes());
  return bytes;
}

// Note [whole again after unshard_parameters]
// unshard_parameters() hands the module (and the optimizer) whole tensors that the user may then read or write
// (load_state_dict); the graph's shards are no longer the truth. Replaying would step the shards made at expand()
// and ignore what was written (a helper's audit found a loaded model ignored: tests/common/capture/
// compile_state_combo_test.cc). So from then on the mode asks for a recapture (recapture_reason), whose
// before_capture() leaves the whole tensors as they are, and expand() shards them again.
absl::Status FullyShardMode::unshard_parameters() {
  if (whole_) return absl::OkStatus();  // the whole tensors are the truth (and may have been written)
  whole_ = true;
  for (const Sharded& s : sharded_) {
    Tensor gathered = Tensor::empty({s.shard.numel() * group_->size()});
    if (absl::Status st = group_->all_gather(gathered, s.shard)->wait(group_->default_timeout()); !st.ok()) return st;
    if (s.full.storage_released()) s.full.reallocate_storage();
    s.full.copy_(gathered.view(0, s.full.shape()));
  }
  return absl::OkStatus();
}

absl::Status FullyShardMode::expand(StepGraph& graph) {
  absl::StatusOr<std::vector<capture::ParamSlots>> params = capture::find_param_slots(graph);
  if (!params.ok()) return params.status();
  const std::vector<Node> nodes = graph.nodes();
  const std::string& group = group_->name();
  const std::int64_t world = group_->size();

  // Backward starts at the root gradient ("ones") or the first node of the backward engine.
  std::size_t first_backward = nodes.size();
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i].grad_fn_slot >= 0 || (nodes[i].kind == NodeKind::op && nodes[i].name == "ones")) {
      first_backward = i;
      break;
    }
  }
  std::map<SlotId, std::size_t> first_writer;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    for (SlotId w : nodes[i].writes) first_writer.emplace(w, i);
  }

  std::map<std::size_t, std::vector<Node>> before, after;
  std::vector<FirstGather> forward_gathers, backward_gathers;
  std::map<std::size_t, Node> replaced;
  std::set<SlotId> no_longer_inputs;
  std::vector<Node> shard_inputs;
  std::vector<Sharded> sharded;
  // add_slot() may move the graph's slots: what is needed of a slot is copied out before adding one.
  auto shard_input = [&](SlotId full_slot) -> absl::StatusOr<SlotId> {
    const std::string name = graph.slot(full_slot).name;
    const Tensor full = graph.slot(full_slot).value;
    if (!full.defined() || full.dtype() != DType::f32) {
      return absl::InvalidArgumentError(absl::StrCat("fully_shard mode: expected '", name,
                                                     "' to be an f32 input of the step"));
    }
    const Tensor shard = make_shard(full);
    const SlotId id = graph.add_slot(absl::StrCat("shard.", name), DType::f32, shard.shape());
    graph.mutable_slot(id).value = shard;
    shard_inputs.push_back(Node{.kind = NodeKind::input, .name = graph.slot(id).name, .reads = {}, .writes = {id}});
    sharded.push_back({full, shard});
    no_longer_inputs.insert(full_slot);
    return id;
  };

  // Note [frozen parameters in the fully-shard mode]
  // What is sharded: every parameter the optimizer updates, and every frozen parameter (requires_grad false) the
  // step reads, as FSDP2 shards frozen parameters too. A frozen one is gathered for its uses like the others, viewed
  // without requires_grad, and has no gradient to reduce and no update. A parameter that requires grad but that the
  // optimizer does not hold stays whole (its gradient is the step's own).
  struct Target {
    SlotId param;
    const capture::ParamSlots* slots;  // nullptr: frozen
  };
  std::vector<Target> targets;
  {
    std::set<SlotId> updated;
    for (const capture::ParamSlots& p : *params) {
      targets.push_back({p.param, &p});
      updated.insert(p.param);
    }
    for (const Node& n : nodes) {
      if (n.kind != NodeKind::input || n.writes.size() != 1 || updated.count(n.writes[0]) != 0) continue;
      const capture::Slot& slot = graph.slot(n.writes[0]);
      if (absl::StartsWith(slot.name, "param.") && slot.value.defined() && !slot.value.requires_grad()) {
        targets.push_back({n.writes[0], nullptr});
      }
    }
  }

  // Note [same values on every rank] (fsdp/same_values.cc): before anything is sharded, every rank must hold the
  // same values of what it shards and of what it leaves whole. The parameters in the order the step first reads them.
  if (world > 1) {
    std::set<SlotId> is_target;
    for (const Target& t : targets) is_target.insert(t.param);
    std::vector<std::uint64_t> hashes;
    std::vector<std::pair<std::string, bool>> checked;  // (name, sharded)
    for (const Node& n : nodes) {
      if (n.kind != NodeKind::input || n.writes.size() != 1) continue;
      const capture::Slot& slot = graph.slot(n.writes[0]);
      if (!absl::StartsWith(slot.name, "param.") || !slot.value.defined() || slot.value.storage_released()) continue;
      hashes.push_back(value_hash(slot.value));
      checked.emplace_back(slot.name.substr(std::string_view("param.").size()), is_target.count(n.writes[0]) > 0);
    }
    absl::StatusOr<std::vector<ValueMismatch>> differ =
        compare_values(hashes, {}, *group_, nullptr, group_->default_timeout());
    if (!differ.ok()) return differ.status();
    if (!differ->empty()) {
      const ValueMismatch& m = differ->front();
      const auto& [name, is_sharded] = checked[m.param];
      return differing_value_error(
          "parameter", name, m.rank, m.reference,
          is_sharded ? "before sharding" : "(the fully-shard mode keeps it whole and never synchronises it)",
          "the fully-shard mode shards it (or load the same values into every rank's model before the compiled "
          "step's first call; Note [same values on every rank] in fsdp/same_values.cc)");
    }
  }

  // Where each parameter is used in each pass: the nodes that read it or a view of it the graph names ("view",
  // "reshape"), and the backward nodes whose forward op did (they saved it).
  struct Uses {
    std::vector<std::size_t> forward, backward;
  };
  std::vector<Uses> uses;
  std::vector<FirstGather> first_forward;  // for the forward's bucket anchors
  for (const Target& t : targets) {
    const int update_node = t.slots != nullptr ? t.slots->update : -1;
    std::set<SlotId> alias = {t.param};
    for (const Node& n : nodes) {
      if (n.kind == NodeKind::op && (n.name == "view" || n.name == "reshape") && reads_any(n, alias)) {
        alias.insert(n.writes.begin(), n.writes.end());
      }
    }
    Uses u;
    for (std::size_t j = 0; j < nodes.size(); ++j) {
      if (static_cast<int>(j) == update_node) continue;
      const Node& n = nodes[j];
      bool used = reads_any(n, alias);
      if (!used && n.grad_fn_slot >= 0) {
        auto w = first_writer.find(n.grad_fn_slot);
        used = w != first_writer.end() && reads_any(nodes[w->second], alias);
      }
      if (used) (j < first_backward ? u.forward : u.backward).push_back(j);
    }
    if (!u.forward.empty()) {
      const std::int64_t rows = (graph.slot(t.param).numel() + world - 1) / world;
      first_forward.push_back({u.forward.front(), rows * world * static_cast<std::int64_t>(sizeof(float)), Node{}});
    }
    uses.push_back(std::move(u));
  }
  const std::vector<std::size_t> forward_anchors = bucket_anchors(first_forward, options_.bucket_bytes);
  const std::size_t last_forward_anchor = forward_anchors.empty() ? 0 : forward_anchors.back();

  for (std::size_t param_index = 0; param_index < targets.size(); ++param_index) {
    const SlotId param_slot = targets[param_index].param;
    const bool trainable = targets[param_index].slots != nullptr;
    capture::ParamSlots p;
    if (trainable) {
      p = *targets[param_index].slots;
    } else {
      p.param = p.weights = param_slot;
    }
    // A copy: slots are added to the graph below, which may move its slots.
    const capture::Slot param = graph.slot(p.param);
    if (p.weights != p.param) {
      return absl::UnimplementedError(absl::StrCat("fully_shard mode: '", param.name,
                                                   "' has fp32 master weights (bf16/f16); not sharded yet"));
    }
    // The gradient is reduce-scattered when the backward is done with it (Note [gradient done]); a node that uses
    // the full gradient after that would see this rank's unreduced values.
    for (int j = p.grad_done + 1; j < p.update; ++j) {
      const Node& n = nodes[static_cast<std::size_t>(j)];
      const bool uses = std::find(n.reads.begin(), n.reads.end(), p.grad) != n.reads.end() ||
                        std::find(n.writes.begin(), n.writes.end(), p.grad) != n.writes.end();
      if (uses) {
        return absl::UnimplementedError(absl::StrCat(
            "fully_shard mode: node ", j, " (", capture::describe(n), ") uses the gradient of '", param.name,
            "' after the backward, where the mode reduce-scatters it; it would see this rank's unreduced gradient "
            "(clipping under the fully-shard mode is not supported yet: clip in eager fsdp with fsdp::clip_grad_norm)"));
      }
    }
    const std::int64_t numel = param.numel();
    const std::int64_t rows = (numel + world - 1) / world;
    const Shape shape = param.shape;
    absl::StatusOr<SlotId> shard = shard_input(p.param);
    if (!shard.ok()) return shard.status();
    const SlotId gathered = graph.add_slot(absl::StrCat("gathered.", param.name), DType::f32, {rows * world});

    const std::vector<std::size_t>& forward_uses = uses[param_index].forward;
    const std::vector<std::size_t>& backward_uses = uses[param_index].backward;
    // Note [kept for backward]: no reshard after forward and no gather in backward.
    const bool kept = !options_.reshard_last_bucket_after_forward && !forward_uses.empty() &&
                      !backward_uses.empty() && forward_uses.back() >= last_forward_anchor;
    auto reshard = op("reshard", {gathered}, {gathered}, [](trace::KernelArgs& a) { a.writes[0].release_storage(); });
    const Node gather = collective(comm::CollectiveKind::all_gather, *shard, gathered, group);
    const std::int64_t gathered_bytes = rows * world * static_cast<std::int64_t>(sizeof(float));
    // The first use's gather is placed with the parameter's bucket (Note [gather buckets]); every later use gets
    // its own, which dedup removes (nothing writes the shard or the gathered slot in between).
    for (std::size_t k = 0; k < forward_uses.size(); ++k) {
      const std::size_t j = forward_uses[k];
      if (k == 0) forward_gathers.push_back({j, gathered_bytes, gather});
      if (k > 0) before[j].push_back(gather);
      before[j].push_back(op("unshard_view", {gathered}, {p.param}, [shape, trainable](trace::KernelArgs& a) {
        Tensor v = Tensor::over(a.reads[0].storage(), a.reads[0].offset_bytes(), shape, DType::f32);
        v.set_requires_grad(trainable);
        a.writes[0] = std::move(v);
      }));
    }
    if (!forward_uses.empty() && !kept) after[forward_uses.back()].push_back(reshard);
    for (std::size_t k = 0; k < backward_uses.size(); ++k) {
      const std::size_t j = backward_uses[k];
      if (k == 0 && !kept) backward_gathers.push_back({j, gathered_bytes, gather});
      if (k > 0 && !kept) before[j].push_back(gather);
      // Backward nodes read the parameter through what they saved: this makes the replay wait for the gather.
      before[j].push_back(op("await_unshard", {gathered}, {}, [](trace::KernelArgs&) {}));
    }
    if (!backward_uses.empty()) after[backward_uses.back()].push_back(reshard);
    if (!trainable) continue;  // Note [frozen parameters in the fully-shard mode]

    // The gradient: padded to N * rows when needed, then reduce_scatter(avg) into this rank's rows.
    const SlotId grad_shard = graph.add_slot(absl::StrCat("grad_shard.", param.name), DType::f32, {rows});
    SlotId scatter_in = p.grad;
    std::vector<Node>& grad_nodes = after[static_cast<std::size_t>(p.grad_done)];
    if (rows * world != numel) {
      scatter_in = graph.add_slot(absl::StrCat("padded_grad.", param.name), DType::f32, {rows * world});
      grad_nodes.push_back(op("pad", {p.grad}, {scatter_in}, [numel, padded = rows * world](trace::KernelArgs& a) {
        Tensor t = Tensor::zeros({padded});
        t.view(0, {numel}).copy_(a.reads[0]);
        a.writes[0] = std::move(t);
      }));
    }
    grad_nodes.push_back(collective(comm::CollectiveKind::reduce_scatter, scatter_in, grad_shard, group,
                                    comm::ReduceOp::avg()));

    // The update on the shards: [param, grad, state...] -> [param, state...].
    Node update = nodes[static_cast<std::size_t>(p.update)];
    update.reads = {*shard, grad_shard};
    update.writes = {*shard};
    for (SlotId st : p.state) {
      absl::StatusOr<SlotId> st_shard = shard_input(st);
      if (!st_shard.ok()) return st_shard.status();
      update.reads.push_back(*st_shard);
      update.writes.push_back(*st_shard);
    }
    replaced[static_cast<std::size_t>(p.update)] = std::move(update);
  }

  // Note [gather buckets]: each pass's first gathers, by bucket, at their bucket's place.
  std::map<std::size_t, std::vector<Node>> gather_now, gather_ahead;
  for (std::vector<FirstGather>* pass : {&forward_gathers, &backward_gathers}) {
    place_buckets(*pass, options_, gather_now, gather_ahead);
  }
  std::vector<Node> out = std::move(shard_inputs);
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = nodes[i];
    if (n.kind == NodeKind::input && no_longer_inputs.count(n.writes[0])) continue;
    for (const auto* list : {&gather_now, &before, &gather_ahead}) {
      if (auto it = list->find(i); it != list->end()) out.insert(out.end(), it->second.begin(), it->second.end());
    }
    auto r = replaced.find(i);
    out.push_back(r != replaced.end() ? r->second : n);
    if (auto it = after.find(i); it != after.end()) out.insert(out.end(), it->second.begin(), it->second.end());
  }
  graph.mutable_nodes() = std::move(out);
  for (SlotId s : no_longer_inputs) graph.mutable_slot(s).value = Tensor();
  if (absl::Status s = graph.validate(); !s.ok()) return s;
  // The shards are the truth from here on: the full tensors give their bytes back.
  for (const Sharded& s : sharded) s.full.release_storage();
  sharded_ = std::move(sharded);
  whole_ = false;
  return absl::OkStatus();
}

}  // namespace shardkit::fsdp
