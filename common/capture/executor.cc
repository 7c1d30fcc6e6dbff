#include "common/capture/executor.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/autograd/autograd_meta.h"
#include "common/autograd/grad_mode.h"
#include "common/autograd/node.h"
#include "common/tensor/host_block_source.h"

namespace shardkit::capture {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Lifetime {
  SlotId slot = -1;
  int first = -1;  // first node that writes it
  int last = -1;   // last node that reads or writes it
};

std::vector<bool> persistent_slots(const StepGraph& g) {
  std::vector<bool> keep(g.slots().size(), false);
  for (const Node& n : g.nodes()) {
    if (n.kind == NodeKind::input) keep[static_cast<std::size_t>(n.writes[0])] = true;
    if (n.kind == NodeKind::output) keep[static_cast<std::size_t>(n.reads[0])] = true;
  }
  return keep;
}

std::int64_t slot_bytes(const Slot& s) { return s.nbytes(); }

}  // namespace

std::vector<OpTime> kernel_time_by_op(const StepGraph& graph, const ReplayStats& stats) {
  std::map<std::string, OpTime> by_name;
  for (std::size_t i = 0; i < graph.nodes().size() && i < stats.node_seconds.size(); ++i) {
    const Node& n = graph.nodes()[i];
    if (n.kind != NodeKind::op) continue;
    OpTime& t = by_name[n.name];
    t.op = n.name;
    t.seconds += stats.node_seconds[i];
    ++t.calls;
  }
  std::vector<OpTime> out;
  for (auto& [name, t] : by_name) out.push_back(std::move(t));
  std::stable_sort(out.begin(), out.end(), [](const OpTime& a, const OpTime& b) { return a.seconds > b.seconds; });
  return out;
}

MemoryPlan plan_memory(const StepGraph& graph) {
  MemoryPlan plan;
  plan.last_use.resize(graph.nodes().size());
  const std::vector<bool> keep = persistent_slots(graph);
  std::vector<Lifetime> life(graph.slots().size());
  for (std::size_t i = 0; i < graph.nodes().size(); ++i) {
    const Node& n = graph.nodes()[i];
    const int at = static_cast<int>(i);
    for (SlotId s : n.reads) life[static_cast<std::size_t>(s)].last = at;
    for (SlotId s : n.writes) {
      Lifetime& l = life[static_cast<std::size_t>(s)];
      if (l.first < 0) l.first = at;
      l.last = at;
    }
  }
  std::vector<Lifetime> temps;
  for (std::size_t s = 0; s < life.size(); ++s) {
    life[s].slot = static_cast<SlotId>(s);
    if (keep[s]) {
      ++plan.persistent_slots;
      continue;
    }
    if (life[s].first < 0) continue;  // never written: unused
    ++plan.temporary_slots;
    plan.last_use[static_cast<std::size_t>(life[s].last)].push_back(life[s].slot);
    temps.push_back(life[s]);
  }
  // Peak: bytes alive at each node, a value counting from its first write to its last use, inclusive.
  std::vector<std::int64_t> delta(graph.nodes().size() + 1, 0);
  for (const Lifetime& l : temps) {
    const std::int64_t bytes = slot_bytes(graph.slot(l.slot));
    delta[static_cast<std::size_t>(l.first)] += bytes;
    delta[static_cast<std::size_t>(l.last) + 1] -= bytes;
  }
  std::int64_t live = 0;
  for (std::int64_t d : delta) {
    live += d;
    plan.peak_bytes = std::max(plan.peak_bytes, live);
  }
  return plan;
}

Executor::Executor(StepGraph graph, ExecutorOptions options, MemoryPlan plan)
    : graph_(std::move(graph)),
      options_(std::move(options)),
      plan_(std::move(plan)),
      arena_(options_.arena ? std::make_shared<StepArena>() : nullptr) {
  // The inputs' tensors move from the graph into the replay's values (set_input rebinds them later).
  env_.resize(graph_.slots().size());
  for (const Node& n : graph_.nodes()) {
    if (n.kind != NodeKind::input) continue;
    env_[static_cast<std::size_t>(n.writes[0])] = std::move(graph_.mutable_slot(n.writes[0]).value);
    graph_.mutable_slot(n.writes[0]).value = Tensor();
  }
  // What every replay needs of the plan, per node (Note [replay schedule]).
  keep_ = persistent_slots(graph_);
  names_a_node_.assign(graph_.slots().size(), false);
  for (const Node& n : graph_.nodes()) {
    if (n.grad_fn_slot >= 0) names_a_node_[static_cast<std::size_t>(n.grad_fn_slot)] = true;
  }
  schedule_.resize(graph_.nodes().size());
  for (std::size_t i = 0; i < graph_.nodes().size(); ++i) {
    const Node& n = graph_.nodes()[i];
    NodeSchedule& sched = schedule_[i];
    for (SlotId s : plan_.last_use[i]) {
      if (!keep_[static_cast<std::size_t>(s)]) sched.forget_after.push_back(s);
    }
    if (n.kind == NodeKind::op) {
      for (SlotId s : n.reads) {
        const std::vector<SlotId>& after = sched.forget_after;
        const bool last = std::find(after.begin(), after.end(), s) != after.end();
        const bool written = std::find(n.writes.begin(), n.writes.end(), s) != n.writes.end();
        const bool listed = std::find(sched.hand_over.begin(), sched.hand_over.end(), s) != sched.hand_over.end();
        if (last && !written && !listed) sched.hand_over.push_back(s);
      }
    }
    if (n.kind == NodeKind::collective) {
      const auto it = options_.groups.find(n.group);
      sched.group = it != options_.groups.end() ? it->second.get() : nullptr;
    }
  }
  pending_.resize(graph_.slots().size());
  backward_nodes_.resize(graph_.slots().size());
}

absl::StatusOr<Executor> Executor::create(StepGraph graph, ExecutorOptions options) {
  if (absl::Status s = graph.validate(); !s.ok()) return s;
  for (std::size_t i = 0; i < graph.nodes().size(); ++i) {
    const Node& n = graph.nodes()[i];
    const std::string where = absl::StrCat("Executor: node ", i, " (", describe(n), ")");
    if (n.kind == NodeKind::input && !graph.slot(n.writes[0]).value.defined()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": expected the input's tensor, found none"));
    }
    if (n.kind == NodeKind::placeholder) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": a placeholder is left; expand it first"));
    }
    if (n.kind == NodeKind::collective && !options.groups.contains(n.group)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": no process group named '", n.group, "'"));
    }
    if (n.kind == NodeKind::op && !n.kernel) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": expected a kernel, found none"));
    }
  }
  MemoryPlan plan = plan_memory(graph);
  return Executor(std::move(graph), std::move(options), std::move(plan));
}

void Executor::set_input(SlotId slot, Tensor t) {
  const Slot& s = graph_.slot(slot);
  const bool input = std::any_of(graph_.nodes().begin(), graph_.nodes().end(), [&](const Node& n) {
    return n.kind == NodeKind::input && n.writes[0] == slot;
  });
  SK_CHECK(input) << "set_input: slot '" << s.name << "' is not an input";
  SK_CHECK(t.dtype() == s.dtype && t.shape() == s.shape)
      << "set_input: slot '" << s.name << "' expects " << dtype_name(s.dtype) << shape_str(s.shape) << ", found "
      << t.describe();
  env_[static_cast<std::size_t>(slot)] = std::move(t);
}

void Executor::record_failure(const absl::Status& s, int node) {
  if (s.ok() || !failed_.ok()) return;
  failed_ = absl::Status(s.code(), absl::StrCat("replay: node ", node, " (", describe(graph_.nodes()[node]), "): ",
                                                s.message()));
}

void Executor::finish(SlotId slot, const absl::Status& s) {
  Pending& p = pending_[static_cast<std::size_t>(slot)];
  const int node = p.node;
  // One collective may cover two slots (its input and output): finishing one finishes both.
  for (SlotId t : {slot, p.other}) {
    if (t < 0) continue;
    Pending& q = pending_[static_cast<std::size_t>(t)];
    if (q.work != p.work && t != slot) continue;
    if (q.forget) env_[static_cast<std::size_t>(t)] = Tensor();
    q = Pending{};
  }
  std::erase_if(active_, [&](SlotId t) { return !pending_[static_cast<std::size_t>(t)].work; });
  record_failure(s, node);
}

void Executor::wait(SlotId slot) {
  Pending& p = pending_[static_cast<std::size_t>(slot)];
  if (!p.work) return;
  const Clock::time_point t0 = Clock::now();
  const std::shared_ptr<comm::Work> work = p.work;
  const absl::Status s = work->wait(p.timeout);
  finish(slot, s);
  stats_.collective_seconds += seconds_since(t0);
}

void Executor::reap_completed() {
  // Values whose last use has passed are forgotten as soon as their collective is done, not when a later node
  // happens to wait for it: their bytes go back during the step (Note [memory plan]).
  for (std::size_t k = 0; k < active_.size();) {
    const SlotId s = active_[k];
    const Pending& p = pending_[static_cast<std::size_t>(s)];
    if (p.forget && p.work->is_completed()) {
      finish(s, p.work->wait(absl::ZeroDuration()));
      k = 0;  // finish() edited the list
    } else {
      ++k;
    }
  }
}

absl::Status Executor::run() {
  const Clock::time_point start = Clock::now();
  stats_.kernel_seconds = stats_.collective_seconds = stats_.total_seconds = 0;
  stats_.node_seconds.assign(graph_.nodes().size(), 0.0);  // sized by the first replay, reused after
  failed_ = absl::OkStatus();
  // Every allocation of the replay on this thread, up to and including the values dropped at its end, goes through
  // the arena (Note [step arena]).
  std::optional<HostBlockSourceScope> arena_scope;
  if (arena_) {
    arena_->begin_replay();
    arena_scope.emplace(arena_);
  }
  for (std::size_t i = 0; i < graph_.nodes().size() && failed_.ok(); ++i) {
    const Node& n = graph_.nodes()[i];
    const NodeSchedule& sched = schedule_[i];
    if (!active_.empty()) {
      for (const auto* list : {&n.reads, &n.writes}) {
        for (SlotId s : *list) wait(s);
      }
      if (!failed_.ok()) break;
    }
    if (n.kind == NodeKind::op) {
      reads_.clear();
      writes_.clear();
      for (SlotId s : n.reads) reads_.push_back(env_[static_cast<std::size_t>(s)]);
      for (SlotId s : n.writes) writes_.push_back(env_[static_cast<std::size_t>(s)]);
      // Values this node uses last are handed over: the kernel holds the only reference (Note [memory plan]).
      for (SlotId s : sched.hand_over) env_[static_cast<std::size_t>(s)] = Tensor();
      std::shared_ptr<autograd::Node> node;
      if (n.grad_fn_slot >= 0) {
        node = std::move(backward_nodes_[static_cast<std::size_t>(n.grad_fn_slot)]);
        if (!node) {
          failed_ = absl::InternalError(absl::StrCat("replay: node ", i, " (", describe(n),
                                                     "): the replayed forward made no backward node for it"));
          break;
        }
      }
      const Clock::time_point t0 = Clock::now();
      try {
        autograd::GradModeGuard grad_mode(n.grad_enabled);
        trace::KernelArgs args{reads_, writes_, node.get()};
        n.kernel(args);
      } catch (const std::exception& e) {
        failed_ = absl::InternalError(absl::StrCat("replay: node ", i, " (", describe(n), "): ", e.what()));
        break;
      }
      const double seconds = seconds_since(t0);
      stats_.kernel_seconds += seconds;
      stats_.node_seconds[i] = seconds;
      reads_.clear();  // the kernel's references to what it read go now, not at the next op
      for (std::size_t w = 0; w < n.writes.size(); ++w) {
        const SlotId s = n.writes[w];
        Tensor& value = env_[static_cast<std::size_t>(s)];
        value = std::move(writes_[w]);
        if (!names_a_node_[static_cast<std::size_t>(s)]) continue;
        if (const autograd::AutogradMeta* meta = autograd::meta_of(value); meta != nullptr && meta->grad_fn) {
          backward_nodes_[static_cast<std::size_t>(s)] = meta->grad_fn;
        }
      }
      writes_.clear();
    } else if (n.kind == NodeKind::collective) {
      const Clock::time_point t0 = Clock::now();
      comm::ProcessGroup& pg = *sched.group;
      const Tensor& in = env_[static_cast<std::size_t>(n.reads[0])];
      Tensor& out = env_[static_cast<std::size_t>(n.writes[0])];
      if (!out.defined()) {
        const Slot& slot = graph_.slot(n.writes[0]);
        out = Tensor::empty(slot.shape, TensorOptions{}.with_dtype(slot.dtype));
      } else if (out.storage_released()) {
        out.reallocate_storage();  // gathered again into the bytes a reshard gave back (what saved views point at)
      }
      std::shared_ptr<comm::Work> work;
      switch (n.collective) {
        case comm::CollectiveKind::all_reduce: work = pg.all_reduce(out, {.op = n.reduce_op}); break;
        case comm::CollectiveKind::all_gather: work = pg.all_gather(out, in); break;
        case comm::CollectiveKind::reduce_scatter: work = pg.reduce_scatter(out, in, {.op = n.reduce_op}); break;
        default:
          failed_ = absl::InvalidArgumentError(absl::StrCat("replay: node ", i, " (", describe(n),
                                                            "): this collective kind is not replayed"));
          break;
      }
      if (!work) break;
      const SlotId in_slot = n.reads[0], out_slot = n.writes[0];
      for (SlotId s : {in_slot, out_slot}) {
        pending_[static_cast<std::size_t>(s)] =
            Pending{work, pg.default_timeout(), static_cast<int>(i), s == in_slot ? out_slot : in_slot};
        if (std::find(active_.begin(), active_.end(), s) == active_.end()) active_.push_back(s);
      }
      stats_.collective_seconds += seconds_since(t0);
    }
    for (SlotId s : sched.forget_after) {
      Pending& p = pending_[static_cast<std::size_t>(s)];
      if (p.work) {
        p.forget = true;  // Note [collective overlap]: not waited here
      } else {
        env_[static_cast<std::size_t>(s)] = Tensor();
      }
    }
    if (!active_.empty()) reap_completed();
  }
  while (!active_.empty()) wait(active_.front());
  // A failed step leaves no value of its own behind (and no backward node holding saved activations).
  reads_.clear();
  writes_.clear();
  for (std::shared_ptr<autograd::Node>& node : backward_nodes_) node.reset();
  if (!failed_.ok()) {
    for (std::size_t s = 0; s < env_.size(); ++s) {
      if (!keep_[s]) env_[s] = Tensor();
    }
  }
  if (arena_) {
    arena_scope.reset();
    arena_->end_replay();
  }
  stats_.total_seconds = seconds_since(start);
  return failed_;
}

}  // namespace shardkit::capture
