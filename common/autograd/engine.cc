#include "common/autograd/engine.h"

#include <deque>
#include <queue>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/autograd/accumulate_grad.h"
#include "common/autograd/autograd_meta.h"
#include "common/autograd/grad_accumulation.h"
#include "common/autograd/grad_mode.h"
#include "common/kernels/elementwise.h"
#include "common/tensor/trace_hook.h"

namespace shardkit::autograd {
namespace {

// Note [execution order]
// The engine first counts, for every node reachable from the roots, how many edges point at it
// (its dependencies). A node is ready once all of them delivered their gradient. Among ready nodes it
// runs AccumulateGrad nodes first, then the highest sequence number (the most recently created node).
// Because a parameter's AccumulateGrad becomes ready right after the last node that uses it ran, and
// nodes run latest-created first, parameters become "gradient ready" in reverse forward order, and a
// parameter used twice (tied embeddings) is accumulated once, after its last contribution. This is
// PyTorch's CPU engine order too, and what ShardedDDP's bucketing in ready order relies on.
struct ReadyItem {
  bool accumulate;
  std::uint64_t sequence_nr;
  Node* node;
};
struct ReadyOrder {
  bool operator()(const ReadyItem& a, const ReadyItem& b) const {
    if (a.accumulate != b.accumulate) return !a.accumulate;  // accumulate nodes on top
    return a.sequence_nr < b.sequence_nr;                    // then the newest node
  }
};

struct GraphTask {
  std::deque<std::function<void()>> callbacks;
};

// The backward running on this thread (rank), if any; nested backwards (from a hook or node) stack, or share
// the enclosing one's callback queue (BackwardOptions::callbacks_to_enclosing).
thread_local GraphTask* tl_task = nullptr;

class TaskScope {
 public:
  explicit TaskScope(GraphTask* task) : previous_(tl_task) { tl_task = task; }
  ~TaskScope() { tl_task = previous_; }
  TaskScope(const TaskScope&) = delete;
  TaskScope& operator=(const TaskScope&) = delete;

 private:
  GraphTask* previous_;
};

std::string FreedGraphMessage(const Node& n) {
  return absl::StrCat("backward: trying to run node ", n.name(), " (sequence ", n.sequence_nr(),
                      ") whose saved tensors were already freed by an earlier backward; pass "
                      "BackwardOptions{.retain_graph = true} to the earlier backward to run backward twice "
                      "through the same graph");
}

// Note [tracing backward]
// While a step is captured (common/tensor/trace_hook.h), every node the engine runs is reported as one op: its
// incoming gradients are the reads, the gradients it returns the writes. Its kernel runs, with the incoming
// gradients of the replay, the node that the replayed forward op created (trace::KernelArgs::backward_node) and
// then releases it, as a backward that does not retain the graph would. A leaf's accumulation is reported as
// "accumulate_grad" (set or add, as it happened), gradients the engine makes as "ones" / "zeros", and the sum of
// two contributions as "add". A node that is traced by parts (Node::traced_by_parts: nn::checkpoint's) is not
// recorded: it runs with the tracer visible, so what it runs is recorded op by op instead. Hooks are not replayed:
// a hook that runs during capture is reported as unsupported, naming it (a compiled step expresses what hooks do,
// collectives, in its parallel mode).

void trace_fill(const trace::OpTraceScope& scope, const char* name, const Tensor& t, double value) {
  scope.record(name, {}, {t}, [value, shape = t.shape(), dtype = t.dtype()](trace::KernelArgs& a) {
    a.writes[0] = detail::new_activation(shape, dtype);
    a.writes[0].fill_(value);
  });
}

Tensor traced_sum_gradients(Tensor a, Tensor b) {
  trace::OpTraceScope scope;
  if (!scope.tracing() || !a.defined()) return detail::sum_gradients(std::move(a), std::move(b));
  const Tensor ra = a, rb = b;
  Tensor sum = detail::sum_gradients(std::move(a), std::move(b));
  scope.record("add", {ra, rb}, {sum}, [](trace::KernelArgs& k) {
    // Reuses an addend's bytes when replay hands it over as the only reference (Note [gradient buffer reuse]);
    // IEEE addition commutes, so the bits do not depend on which.
    k.writes[0] = detail::sum_gradients(std::move(k.reads[0]), std::move(k.reads[1]));
  });
  return sum;
}

TensorList run_traced_node(Node* n, TensorList&& in) {
  if (n->traced_by_parts()) return n->apply(std::move(in));  // records what it runs itself (node.h)
  trace::OpTraceScope scope;
  if (!scope.tracing()) return n->apply(std::move(in));
  if (n->is_accumulate_grad()) {
    const Tensor& variable = static_cast<AccumulateGrad*>(n)->variable();
    AutogradMeta* meta = meta_of(variable);
    if (meta && ((meta->hooks && !meta->hooks->empty()) ||
                 (meta->post_accumulate_hooks && !meta->post_accumulate_hooks->empty()))) {
      scope.tracer()->on_unsupported(absl::StrCat("a hook on leaf ", variable.describe(), " (hooks are not replayed)"));
    }
    const Tensor grad = in[0];
    const Tensor before = variable.grad();
    TensorList out = n->apply(std::move(in));
    const bool accumulate = before.defined();
    scope.record("accumulate_grad", {grad, before}, {variable.grad()},
                 [accumulate, shape = variable.shape(), dtype = variable.dtype()](trace::KernelArgs& a) {
                   if (accumulate) {
                     detail::add_into(a.writes[0], a.reads[0]);
                   } else if (detail::is_exclusive(a.reads[0]) && a.reads[0].dtype() == dtype) {
                     // Note [gradient buffer reuse]: no copy; the bytes are a gradient from here on, as in eager
                     // (AccumulateGrad), so the replay's ledger charges them where eager's does.
                     a.reads[0].storage()->recategorize(MemoryCategory::gradient);
                     a.writes[0] = std::move(a.reads[0]);
                   } else {
                     // Shared with another path (an add's backward hands one gradient to both inputs): a copy, so
                     // whatever is done to this leaf's gradient later (a collective, in place) touches only it.
                     a.writes[0] = Tensor::empty(shape, TensorOptions{}.with_dtype(dtype).with_category(
                                                            MemoryCategory::gradient));
                     a.writes[0].copy_(a.reads[0]);
                   }
                 });
    return out;
  }
  const TensorList grads = in;
  TensorList out = n->apply(std::move(in));
  std::vector<bool> defined;
  for (const Tensor& o : out) defined.push_back(o.defined());
  scope.record(n->name(), grads, out,
               [defined](trace::KernelArgs& a) {
                 auto* node = static_cast<Node*>(a.backward_node);
                 SK_CHECK(node != nullptr) << "replay of a backward node without its node";
                 TensorList fresh = node->apply(std::move(a.reads));
                 node->release();
                 SK_CHECK_EQ(fresh.size(), defined.size()) << node->name() << ": replay returned a different count";
                 std::size_t next = 0;
                 for (std::size_t i = 0; i < fresh.size(); ++i) {
                   if (defined[i]) a.writes[next++] = std::move(fresh[i]);
                 }
               },
               n);
  return out;
}

}  // namespace

bool is_backward_running() { return tl_task != nullptr; }

void queue_callback(std::function<void()> fn) {
  if (tl_task == nullptr) {
    throw AutogradError("queue_callback: expected to be called while a backward runs on this thread, found none");
  }
  tl_task->callbacks.push_back(std::move(fn));
}

void backward(const Tensor& root, const Tensor& grad, const BackwardOptions& options) {
  backward(TensorList{root}, TensorList{grad}, options);
}

void backward(const TensorList& roots, const TensorList& grads, const BackwardOptions& options) {
  if (roots.size() != grads.size()) {
    throw AutogradError(absl::StrCat("backward: expected one gradient per root (", roots.size(), " roots), found ",
                                     grads.size()));
  }
  std::vector<Edge> root_edges;
  TensorList root_grads;
  for (std::size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    if (!r.defined() || !r.requires_grad()) {
      throw AutogradError(absl::StrCat("backward: expected a root that requires grad, found ",
                                       r.defined() ? r.describe() : std::string("an undefined tensor"),
                                       " that does not (was it computed under NoGradGuard, or from tensors "
                                       "without requires_grad?)"));
    }
    Tensor g = grads[i];
    if (!g.defined()) {
      if (r.numel() != 1) {
        throw AutogradError(absl::StrCat("backward: expected a one-element root when no gradient is given, found ",
                                         r.describe(), "; pass the gradient w.r.t. the root"));
      }
      trace::OpTraceScope scope;
      g = detail::new_activation(r.shape(), r.dtype(), r.device());
      if (g.device().is_cuda()) {
        SK_CHECK(g.dtype() == DType::f32) << "backward: a CUDA root of dtype " << dtype_name(g.dtype())
                                          << " needs an explicit gradient";
        kernels::fill(g, 1.f);
      } else {
        g.fill_(1.0);
      }
      if (scope.tracing()) trace_fill(scope, "ones", g, 1.0);
    } else if (g.shape() != r.shape()) {
      throw AutogradError(absl::StrCat("backward: expected a gradient of shape ", shape_str(r.shape()),
                                       " for the root, found ", g.describe()));
    } else if (g.device() != r.device() || g.dtype() != r.dtype()) {
      // The root's backward reads the gradient as the root's dtype on the root's device.
      throw AutogradError(absl::StrCat("backward: expected a gradient of dtype ", std::string(dtype_name(r.dtype())),
                                       " on ", r.device().str(), " for the root ", r.describe(), ", found ",
                                       g.describe()));
    }
    root_edges.push_back(gradient_edge(r));
    root_grads.push_back(std::move(g));
  }

  GraphTask task;
  // callbacks_to_enclosing: queue_callback() inside this backward feeds the enclosing one's queue (which runs
  // them after the enclosing backward); this backward's own queue then stays empty.
  TaskScope task_scope(options.callbacks_to_enclosing && tl_task != nullptr ? tl_task : &task);
  NoGradGuard no_grad;

  trace::Tracer* const tracer = trace::active_tracer();  // Note [tracing backward]

  // Dependencies: number of edges into each reachable node.
  absl::flat_hash_map<Node*, int> deps;
  absl::flat_hash_set<Node*> seen;
  std::vector<Node*> stack;
  for (const Edge& e : root_edges) {
    if (seen.insert(e.node.get()).second) stack.push_back(e.node.get());
  }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next_edges()) {
      if (!e.valid()) continue;
      ++deps[e.node.get()];
      if (seen.insert(e.node.get()).second) stack.push_back(e.node.get());
    }
  }

  absl::flat_hash_map<Node*, TensorList> buffers;
  std::priority_queue<ReadyItem, std::vector<ReadyItem>, ReadyOrder> ready;
  absl::flat_hash_set<Node*> queued_roots;
  for (std::size_t i = 0; i < root_edges.size(); ++i) {
    Node* n = root_edges[i].node.get();
    TensorList& buf = buffers[n];
    if (buf.empty()) buf.resize(static_cast<std::size_t>(n->num_outputs()));
    Tensor& slot = buf[static_cast<std::size_t>(root_edges[i].input_nr)];
    slot = traced_sum_gradients(std::move(slot), std::move(root_grads[i]));
  }
  for (const Edge& e : root_edges) {
    Node* n = e.node.get();
    if (!deps.contains(n) && queued_roots.insert(n).second) {
      ready.push({n->is_accumulate_grad(), n->sequence_nr(), n});
    }
  }

  while (!ready.empty()) {
    Node* n = ready.top().node;
    ready.pop();
    if (n->released()) throw AutogradError(FreedGraphMessage(*n));
    TensorList in;
    if (auto it = buffers.find(n); it != buffers.end()) {
      in = std::move(it->second);
      buffers.erase(it);
    }
    in.resize(static_cast<std::size_t>(n->num_outputs()));
    bool any_defined = false;
    for (int i = 0; i < n->num_outputs(); ++i) {
      Tensor& g = in[static_cast<std::size_t>(i)];
      if (g.defined() && n->output_hooks(i)) {
        if (tracer != nullptr && !n->output_hooks(i)->empty()) {
          tracer->on_unsupported(absl::StrCat("a tensor hook on an output of ", n->name(), " (hooks are not replayed)"));
        }
        g = detail::run_tensor_hooks(*n->output_hooks(i), std::move(g), n->output_shape(i));
      }
      any_defined = any_defined || g.defined();
    }
    TensorList out;
    if (any_defined) {
      for (int i = 0; i < n->num_outputs(); ++i) {
        Tensor& g = in[static_cast<std::size_t>(i)];
        if (!g.defined()) {
          g = detail::zeros_activation(n->output_shape(i), n->output_dtype(i),
                                       n->output_device(i));
          trace::OpTraceScope scope;
          if (scope.tracing()) trace_fill(scope, "zeros", g, 0.0);
        }
      }
      // A temporary, so the incoming gradients die as soon as apply returns (a gradient passed through
      // unchanged, e.g. by add or reshape, is then exclusive again: Note [gradient buffer reuse]).
      out = tracer != nullptr ? run_traced_node(n, TensorList(std::move(in)))
                              : n->apply(TensorList(std::move(in)));
      SK_CHECK(out.empty() || out.size() == n->next_edges().size())
          << n->name() << " returned " << out.size() << " gradients for " << n->next_edges().size() << " inputs";
    }
    if (!options.retain_graph) n->release();
    const auto& edges = n->next_edges();
    for (std::size_t i = 0; i < edges.size(); ++i) {
      const Edge& e = edges[i];
      if (!e.valid()) continue;
      Node* next = e.node.get();
      if (i < out.size() && out[i].defined()) {
        TensorList& buf = buffers[next];
        if (buf.empty()) buf.resize(static_cast<std::size_t>(next->num_outputs()));
        Tensor& slot = buf[static_cast<std::size_t>(e.input_nr)];
        slot = traced_sum_gradients(std::move(slot), std::move(out[i]));
      }
      if (--deps[next] == 0) ready.push({next->is_accumulate_grad(), next->sequence_nr(), next});
    }
  }

  // Final callbacks: after every node and hook; callbacks may queue more.
  while (!task.callbacks.empty()) {
    std::function<void()> cb = std::move(task.callbacks.front());
    task.callbacks.pop_front();
    cb();
  }
}

absl::Status try_backward(const Tensor& root, const Tensor& grad, const BackwardOptions& options) {
  try {
    backward(root, grad, options);
  } catch (const StatusError& e) {
    return e.status();
  } catch (const AutogradError& e) {
    return absl::FailedPreconditionError(e.what());
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("backward failed: ", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace shardkit::autograd
