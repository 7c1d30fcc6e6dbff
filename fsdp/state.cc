#include "fsdp/state.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/autograd/grad_mode.h"
#include "fsdp/same_values.h"

namespace shardkit::fsdp {
namespace {

// The root whose forward runs on this thread (one rank), to tell a unit outside it (Note [roots]).
thread_local RootContext* t_forward_root = nullptr;

}  // namespace

// Note [post-backward on a unit's inputs]
// When is a unit's backward over? Not "when all its parameters have gradients": whether a parameter gets
// one can depend on the data (a branch taken on some ranks only), and ranks would then issue the unit's
// reduce_scatter at different points of the backward (a hang). Instead a hook on each input of the unit
// that requires grad fires when the gradient of that input is complete, which is after every node of the
// unit ran; the engine runs a ready AccumulateGrad before any other node (Note [execution order] in
// engine.cc), so by then every parameter used inside the unit has its gradient. That point depends only on
// the graph, the same on every rank. The unit is reduced there, with zeros for parameters that got no
// gradient. Reduction is linear, so a unit reduced several times in one backward (two forwards before one
// backward) accumulates the right sum in its shards' gradients. Units without such an input (the root, whose
// input is token ids) are reduced by the final callback, in module order. A parameter must be used only inside
// its unit's forward (a shared parameter belongs to the common ancestor), else a gradient arriving after its
// unit's post-backward is reduced by the final callback.
// When a unit's input is the previous unit's output (consecutive blocks), its post-backward runs inside the
// previous unit's pre-backward hook, before that unit is unsharded, so backward holds one unit's full
// parameters at a time (besides the root's) rather than two.

// Note [pending pre-backward hooks]
// Each training forward registers a hook on every unit's outputs that unshards the unit before its backward.
// Several forwards may precede their backwards (micro-batches summed into one loss, or one backward per
// forward afterwards), so a backward must not drop the hooks of forwards whose backward has not run yet. Hooks
// are dropped by age instead: those registered more than kPendingForwards root forwards ago (a forward whose
// backward never ran, e.g. a loss computed with grad mode on and discarded).
constexpr std::int64_t kPendingForwards = 8;

// Note [prefetch]
// A unit's all-gather is issued before the unit needs it, so it runs while the rank computes (every backend
// completes collectives in the background). The root's first forward records two orders of its units with
// parameters: pre-forward order and post-forward order (RootContext). Afterwards:
//   forward:  when unit X's forward starts, X issues its own all-gather (unless a prefetch did), then the next
//             unit's in pre-forward order, then waits for its own;
//   backward: when X's pre-backward hook runs, the same with the unit before X in post-forward order (the next
//             one backward reaches).
// An explicit list on X (FSDPModule::set_modules_to_forward_prefetch / set_modules_to_backward_prefetch)
// replaces the implicit successor. Every rank issues the same all-gathers in the same order because the orders
// come from the same forward; a model whose units run in a data-dependent order must turn implicit_prefetch
// off (as with FSDP2, its first forward is not representative).
// Bound: a prefetch is issued only while fewer than the root's max_prefetched_units units are ahead (prefetched
// and not yet reached by their forward or pre-backward hook); a prefetch beyond it is skipped. So besides the
// units running (a unit, whose own gather may still be in flight while it issues its prefetches, and the units
// it is nested in) and the root, at most that many units hold a gather buffer; a prefetched unit's parameters are
// copied out of its gather buffer only when it runs, so the parameter peak is that without prefetch (parameters
// gathered in place by their own collectives count as communication buffer until then: Note [own collectives] in
// param_group.cc). The
// communication-buffer peak of a forward is at most (1 + max_prefetched_units) gather buffers of the largest
// units (fsdp_prefetch_test asserts it). A prefetched unit not reached (not run in this forward or backward) is
// resharded by the root's post-forward and by the final callback.

// Note [reduce-scatter in flight]
// A unit's post-backward copies its gradients into the reduce-scatter input and issues the collective; the next
// unit's post-backward (or the final callback) finishes it: waits, divides, hands the shards their gradients.
// One reduce-scatter per root is in flight, overlapping the next unit's backward; the communication buffers hold
// at most two units' [N × S] inputs (the one in flight, the one being filled). The final callback finishes every
// one before backward returns, so the optimizer sees every sharded gradient.

const char* training_state_name(TrainingState s) {
  switch (s) {
    case TrainingState::idle: return "idle";
    case TrainingState::forward: return "forward";
    case TrainingState::pre_backward: return "pre_backward";
    case TrainingState::post_backward: return "post_backward";
    case TrainingState::summoned: return "summoned (unshard() until reshard())";
  }
  return "?";
}

FSDPState* state_attached(const nn::Module& module) {
  return dynamic_cast<FSDPState*>(module.attachment(kFsdpAttachment));
}

FSDPState::FSDPState(nn::Module& module, std::shared_ptr<comm::ProcessGroup> group, FullyShardOptions options,
                     std::unique_ptr<ParamGroup> params)
    : module_(&module), pg_(std::move(group)), options_(std::move(options)), params_(std::move(params)) {
  // Mixed precision (Note [mixed precision on f32 ops] in mixed_precision.h): a unit's floating inputs, and the
  // root's floating outputs, rounded after the hooks registered theirs on the originals.
  module_hooks_.push_back(module_->register_forward_pre_hook(
      [this](nn::Module&, const TensorList& inputs) -> std::optional<TensorList> {
        pre_forward(inputs);
        const MixedPrecisionPolicy& mp = options_.mp_policy;
        if (!mp.cast_forward_inputs || !mp.param_dtype || state_ == TrainingState::summoned) return std::nullopt;
        return round_floating(inputs, *mp.param_dtype);
      }));
  module_hooks_.push_back(module_->register_forward_hook(
      [this](nn::Module&, const TensorList& inputs, const TensorList& outputs) -> std::optional<TensorList> {
        post_forward(inputs, outputs);
        const MixedPrecisionPolicy& mp = options_.mp_policy;
        if (!mp.output_dtype || !is_root() || state_ == TrainingState::summoned) return std::nullopt;
        return round_floating(outputs, *mp.output_dtype);
      }));
  if (params_ != nullptr) {
    for (const FSDPParam& p : params_->params()) {
      // Only to make sure the final callback is queued (a loss that does not pass through the root's output).
      module_hooks_.push_back(autograd::register_post_accumulate_grad_hook(
          p.unsharded, [this](const Tensor&) { in_hook([this] { ensure_final_callback(); }); }));
    }
  }
}

FSDPState::~FSDPState() {
  if (ctx_ != nullptr) std::erase(ctx_->states, this);
}

void FSDPState::forget_value_mismatches(const std::set<const TensorImpl*>& written) {
  std::erase_if(value_mismatches_, [&](const ValueMismatch& m) {
    if (m.ignored.defined()) return written.count(m.ignored.id()) != 0;
    const FSDPParam& p = params_->params()[m.param];
    return written.count(p.sharded.id()) != 0 || written.count(p.unsharded.id()) != 0;
  });
}

std::vector<FSDPState*> FSDPState::subtree_states() const {
  std::vector<FSDPState*> out;
  for (const auto& [name, m] : module_->named_modules()) {
    if (FSDPState* s = state_attached(*m)) out.push_back(s);
  }
  return out;
}

bool FSDPState::reshard_after_forward() const {
  if (!options_.reshard_after_forward) return !is_root();
  const auto& v = *options_.reshard_after_forward;
  return std::holds_alternative<bool>(v) ? std::get<bool>(v) : false;
}

int FSDPState::reshard_after_forward_group() const {
  const auto& v = options_.reshard_after_forward;
  return v && std::holds_alternative<int>(*v) ? std::get<int>(*v) : 0;
}

// Note [roots]: the first state whose forward runs outside any other root's forward becomes a root and adopts
// every state below it. A state reached first by another path (its module's forward called on its own earlier)
// is refused, as FSDP2 does: the root must run first.
void FSDPState::lazy_init() {
  if (t_forward_root != nullptr) {
    throw FsdpError(absl::FailedPreconditionError(absl::StrCat(
        "fully_shard: a ", module_->type_name(), " sharded by fully_shard runs inside the forward of the root ",
        t_forward_root->root->module().type_name(),
        " but is not one of its submodules; expected every sharded module under the root")));
  }
  ctx_ = std::make_shared<RootContext>();
  ctx_->root = this;
  for (FSDPState* s : subtree_states()) {
    if (s == this) continue;
    if (s->ctx_ != nullptr) {
      throw FsdpError(absl::FailedPreconditionError(absl::StrCat(
          "fully_shard: the ", s->module().type_name(), " under root ", module_->type_name(),
          " already ran as a root of its own (its forward was called before the root's); expected the first "
          "forward to go through the root")));
    }
    s->ctx_ = ctx_;
    ctx_->states.push_back(s);
  }
  ctx_->states.push_back(this);
  ctx_->is_last_backward = pending_is_last_backward_;
}

void FSDPState::require_state(TrainingState wanted, const char* call) const {
  if (state_ == wanted) return;
  throw FsdpError(absl::FailedPreconditionError(absl::StrCat("fsdp: ", call, " on a ", module_->type_name(),
                                                             " in training state ", training_state_name(state_),
                                                             "; expected ", training_state_name(wanted))));
}

absl::Status FSDPState::unshard_unit(bool exact) {
  if (params_ == nullptr || state_ == TrainingState::summoned) return absl::OkStatus();
  if (absl::Status s = issue_unshard(exact); !s.ok()) return s;
  return wait_unshard();
}

absl::Status FSDPState::issue_unshard(bool exact) {
  if (params_ == nullptr || pending_unshard_ || params_->is_unsharded()) return absl::OkStatus();
  auto h = params_->unshard_async(exact);
  if (!h.ok()) return h.status();
  pending_unshard_ = std::move(*h);
  if (ctx_ != nullptr) ctx_->overlap.bytes += params_->unsharded_bytes();
  return absl::OkStatus();
}

absl::Status FSDPState::wait_unshard() {
  if (ctx_ != nullptr) std::erase(ctx_->prefetched, this);
  if (!pending_unshard_) return absl::OkStatus();
  absl::Status s = pending_unshard_->wait();
  pending_unshard_.reset();
  return s;
}

FSDPState* FSDPState::neighbour_in(const std::vector<FSDPState*>& order, int step) const {
  const auto it = std::find(order.begin(), order.end(), this);
  if (it == order.end()) return nullptr;
  const std::ptrdiff_t i = (it - order.begin()) + step;
  return i >= 0 && i < static_cast<std::ptrdiff_t>(order.size()) ? order[static_cast<std::size_t>(i)] : nullptr;
}

void FSDPState::record_order(std::vector<FSDPState*>& order) {
  if (params_ != nullptr && std::find(order.begin(), order.end(), this) == order.end()) order.push_back(this);
}

void FSDPState::prefetch(const std::optional<std::vector<FSDPState*>>& explicit_list, FSDPState* implicit_next) {
  std::vector<FSDPState*> targets;
  if (explicit_list) {
    targets = *explicit_list;
  } else if (options_.implicit_prefetch && ctx_->order_recorded && implicit_next != nullptr) {
    targets.push_back(implicit_next);
  }
  const int limit = ctx_->root->options_.max_prefetched_units;
  for (FSDPState* t : targets) {
    if (t->ctx_ != ctx_) {
      throw FsdpError(absl::InvalidArgumentError(absl::StrCat(
          "fsdp: the prefetch list of a ", module_->type_name(), " names a ", t->module_->type_name(),
          " that is not under the same root (", ctx_->root->module_->type_name(),
          "); expected units of the model being run")));
    }
    if (t == this || t->params_ == nullptr || t->state_ != TrainingState::idle || t->pending_unshard_ ||
        t->params_->is_unsharded()) {
      continue;
    }
    if (static_cast<int>(ctx_->prefetched.size()) >= limit) return;
    if (absl::Status s = t->issue_unshard(); !s.ok()) throw FsdpError(std::move(s));
    ctx_->overlap.overlapped_bytes += t->params_->unsharded_bytes();
    ctx_->prefetched.push_back(t);
  }
}

void FSDPState::finish_reduces(std::size_t keep) {
  while (ctx_->reducing.size() > keep) {
    const RootContext::Reducing r = ctx_->reducing.front();
    ctx_->reducing.erase(ctx_->reducing.begin());
    if (r.hook != ctx_->hooks) ctx_->overlap.overlapped_bytes += r.state->params_->unsharded_bytes();
    if (absl::Status s = r.state->params_->finish_reduce_grads(); !s.ok()) throw FsdpError(std::move(s));
  }
}

absl::Status FSDPState::start_unshard() {
  if (state_ != TrainingState::idle) {
    return absl::FailedPreconditionError(absl::StrCat("fsdp: unshard() on a ", module_->type_name(), " in training state ",
                                                      training_state_name(state_), "; expected idle"));
  }
  // Note [same values on every rank] in same_values.cc
  if (absl::Status s = values_differ(*module_, {this}); !s.ok()) return s;
  return issue_unshard();
}

void FSDPState::reshard_unit() {
  if (params_ == nullptr || state_ == TrainingState::summoned) return;
  if (pending_unshard_) (void)wait_unshard();  // (its bytes are released right after)
  params_->reshard();
}

// Note [forward inside backward]
// An activation-checkpoint recompute (nn::checkpoint) runs a unit's forward, hooks included, while a backward
// runs, right before that unit's own backward. Such a forward gathers the unit as any other, but prefetches
// nothing in forward order (the next unit's backward already ran), records no order, and keeps the unit
// unsharded afterwards (no reshard_after_forward) and out of RootContext::unit_outputs: its pre-backward hook, on
// the recomputed outputs, comes next and finds it gathered, so checkpointing costs no extra all-gather.

void FSDPState::pre_forward(const TensorList& inputs) {
  if (ctx_ == nullptr) lazy_init();
  if (state_ == TrainingState::summoned) return;  // gathers and releases nothing until reshard()
  const bool recompute = autograd::is_backward_running();  // Note [forward inside backward]
  if (is_root() && !recompute) {
    // A backward that ended without its final callback (a hook threw): start clean.
    if (ctx_->in_backward && !autograd::is_backward_running()) reset_backward_state();
    if (state_ == TrainingState::forward) reset_forward_state();  // Note [a forward that threw]
    ++ctx_->forwards;
    for (FSDPState* s : ctx_->states) {
      std::erase_if(s->backward_hooks_, [&](const BackwardHook& h) { return h.forward <= ctx_->forwards - kPendingForwards; });
    }
    ctx_->unit_outputs.clear();
    t_forward_root = ctx_.get();
  }
  require_state(TrainingState::idle, "forward");
  state_ = TrainingState::forward;
  ++ctx_->hooks;
  if (!ctx_->order_recorded && !recompute) record_order(ctx_->forward_order);
  // Note [prefetch]: own all-gather first, then the next unit's, then wait for our own.
  if (absl::Status s = issue_unshard(); !s.ok()) throw FsdpError(std::move(s));
  std::erase(ctx_->prefetched, this);  // running now, no longer ahead
  if (!recompute) prefetch(forward_prefetch_, neighbour_in(ctx_->forward_order, +1));
  if (absl::Status s = unshard_unit(); !s.ok()) throw FsdpError(std::move(s));
  if (is_root() && !recompute && !ctx_->values_verified) {  // Note [same values on every rank] in same_values.cc
    if (absl::Status s = values_differ(*module_, ctx_->states); !s.ok()) {
      reset_forward_state();  // refused before anything ran: at rest, as before the forward (a load may follow)
      throw FsdpError(std::move(s));
    }
    ctx_->values_verified = true;
  }
  if (is_root() || !autograd::is_grad_enabled()) return;
  for (const Tensor& t : inputs) {  // Note [post-backward on a unit's inputs]
    if (!t.defined() || !t.requires_grad()) continue;
    if (auto it = ctx_->unit_outputs.find(t.id()); it != ctx_->unit_outputs.end()) {
      it->second.reduce_first->push_back(this);  // the previous unit's pre-backward hook reduces this unit first
      continue;
    }
    backward_hooks_.push_back({ctx_->forwards, autograd::register_hook(t, [this](const Tensor&) -> std::optional<Tensor> {
                                 post_backward();
                                 return std::nullopt;
                               })});
  }
}

void FSDPState::post_forward(const TensorList&, const TensorList& outputs) {
  if (state_ == TrainingState::summoned) return;
  const bool grad_follows =
      std::any_of(outputs.begin(), outputs.end(), [](const Tensor& t) { return t.defined() && t.requires_grad(); });
  const bool recompute = autograd::is_backward_running();  // Note [forward inside backward]
  if (recompute && grad_follows) {
    // Kept unsharded for the pre-backward hook that follows.
  } else if (!grad_follows || reshard_after_forward()) {
    reshard_unit();  // (no gradient follows: no backward needs them)
  } else if (reshard_after_forward_group() > 0 && params_ != nullptr && params_->is_unsharded()) {
    params_->reshard_to_group();  // Note [reshard to a k-group] in param_group.h
  }
  state_ = TrainingState::idle;
  if (!ctx_->order_recorded && !recompute) record_order(ctx_->post_forward_order);
  if (is_root() && !recompute) {
    ctx_->unit_outputs.clear();  // the forward is over
    t_forward_root = nullptr;
    ctx_->order_recorded = true;
    // Units prefetched and not run in this forward (Note [prefetch]).
    for (FSDPState* s : std::vector<FSDPState*>(ctx_->prefetched)) {
      if (s->state_ == TrainingState::idle) s->reshard_unit();
    }
    ctx_->prefetched.clear();
  }
  if (!grad_follows) return;
  for (const Tensor& t : outputs) {
    if (!t.defined() || !t.requires_grad()) continue;
    auto reduce_first = std::make_shared<std::vector<FSDPState*>>();
    if (!is_root() && !recompute) ctx_->unit_outputs[t.id()] = {t, reduce_first};
    backward_hooks_.push_back(
        {ctx_->forwards, autograd::register_hook(t, [this, reduce_first](const Tensor&) -> std::optional<Tensor> {
           pre_backward(reduce_first);
           return std::nullopt;
         })});
  }
}

void FSDPState::pre_backward(const std::shared_ptr<std::vector<FSDPState*>>& reduce_first) {
  in_hook([&] {
    ensure_final_callback();
    ++ctx_->hooks;
    for (FSDPState* next : *reduce_first) next->reduce_unit();  // their post-backward
    if (state_ == TrainingState::summoned) return;
    if (absl::Status s = issue_unshard(); !s.ok()) throw FsdpError(std::move(s));
    std::erase(ctx_->prefetched, this);  // running now, no longer ahead
    prefetch(backward_prefetch_, neighbour_in(ctx_->post_forward_order, -1));  // Note [prefetch]
    if (absl::Status s = unshard_unit(); !s.ok()) throw FsdpError(std::move(s));
    state_ = TrainingState::pre_backward;
  });
}

void FSDPState::post_backward() {
  in_hook([&] {
    ensure_final_callback();
    ++ctx_->hooks;
    reduce_unit();
  });
}

void FSDPState::reduce_unit() {
  if (state_ == TrainingState::summoned) return;
  reduced_ = true;
  state_ = TrainingState::post_backward;
  // Sync off (accumulation): the full gradients stay on the unsharded parameters until a synchronised backward.
  // Note [reduce-scatter in flight]; Note [frozen parameters are not reduced] in param_group.cc.
  if (params_ != nullptr && requires_gradient_sync_ && params_->needs_reduce()) {
    finish_reduces(0);
    if (absl::Status s = params_->start_reduce_grads(divide_factor_, requires_all_reduce_); !s.ok()) throw FsdpError(std::move(s));
    ctx_->reducing.push_back({this, ctx_->hooks});
    ctx_->overlap.bytes += params_->unsharded_bytes();
  }
  if (reshard_after_backward_) reshard_unit();
  state_ = TrainingState::idle;
}

void FSDPState::ensure_final_callback() {
  if (ctx_->in_backward) return;
  ctx_->in_backward = true;
  for (FSDPState* s : ctx_->states) s->reduced_ = false;
  FSDPState* root = ctx_->root;
  autograd::queue_callback([root] { root->in_hook([root] { root->finalize_backward(); }); });
}

void FSDPState::finalize_backward() {
  ++ctx_->hooks;
  // Units with no post-backward in this backward, and units whose gradients arrived after it: every rank reduces
  // them, in module order (Note [post-backward on a unit's inputs]).
  for (FSDPState* s : ctx_->states) {
    if (s->state_ == TrainingState::summoned) continue;
    const bool late = s->requires_gradient_sync_ && s->params_ != nullptr && s->params_->has_unsharded_grads();
    if (!s->reduced_ || late) s->reduce_unit();
  }
  finish_reduces(0);
  for (FSDPState* s : std::vector<FSDPState*>(ctx_->prefetched)) {  // prefetched, not reached (Note [prefetch])
    if (absl::Status st = s->wait_unshard(); !st.ok()) throw FsdpError(std::move(st));
  }
  for (FSDPState* s : ctx_->states) {
    if (s->state_ == TrainingState::summoned) continue;
    if (s->reshard_after_backward_ && ctx_->is_last_backward) s->reshard_unit();
    s->state_ = TrainingState::idle;
  }
  ctx_->in_backward = false;  // (pending hooks stay: Note [pending pre-backward hooks])
}

// Note [a forward that threw]
// A forward that ends by an exception (a module's forward or a hook threw) skips the post-forward hooks of the
// units it was inside: they stay in training state forward, possibly gathered, and every later forward was refused
// ("expected idle"; a helper's audit, tests/fsdp/fsdp_misuse_test.cc). The root's next forward finds itself in state
// forward, which only such an end leaves, and puts every unit back to idle and resharded (the next forward gathers
// what it needs; a backward through the failed forward's outputs is not possible, they were never returned).
void FSDPState::reset_forward_state() {
  for (FSDPState* s : ctx_->states) {
    if (s->state_ != TrainingState::forward) continue;
    s->state_ = TrainingState::idle;
    s->reshard_unit();
  }
  for (FSDPState* s : std::vector<FSDPState*>(ctx_->prefetched)) {
    if (s->state_ == TrainingState::idle) s->reshard_unit();
  }
  ctx_->prefetched.clear();
  ctx_->unit_outputs.clear();
  t_forward_root = nullptr;
}

// Note [a backward that threw]
// A backward that ends by an exception (a hook threw: a refused divide factor, a failed collective) may leave
// collectives in flight: all-gathers prefetched for units the backward never reached, reduce-scatters of units it
// did. They were left for the next forward to wait for, so a rank that stopped after the error destroyed its group
// with a call still queued (an error of its own, "the group handle was destroyed with 1 call queued", in about one
// run of twenty of FsdpMisuse.DivideFactorZeroNegativeOrNanIsRefused) and held the gathered parameters meanwhile.
// Every rank issued the same calls up to the failure (the same hooks run in the same order), so each is waited for
// here, its status dropped (the backward's own error is the one to report; a call a peer never joins ends at its
// deadline, as every FSDP collective does), and the units are resharded as a backward that ends well leaves them:
// the failed backward ends with nothing in flight and every unit at rest
// (FsdpMisuse.AFailedBackwardLeavesNoPrefetchInFlight).
void FSDPState::reset_backward_state() {
  if (ctx_ == nullptr) return;
  ctx_->in_backward = false;
  ctx_->reducing.clear();  // dropped below with the partial gradients
  for (FSDPState* s : std::vector<FSDPState*>(ctx_->prefetched)) {
    (void)s->wait_unshard();  // the backward's error is the one reported
    if (s->state_ == TrainingState::idle) s->reshard_unit();
  }
  ctx_->prefetched.clear();
  for (FSDPState* s : ctx_->states) {
    if (s->params_ != nullptr) s->params_->drop_unsharded_grads();  // partial gradients of the failed backward
    s->reduced_ = false;
    if (s->state_ == TrainingState::summoned) continue;
    s->state_ = TrainingState::idle;
    if (s->reshard_after_backward_) s->reshard_unit();  // as a backward that ends well leaves it
  }
}

// A hook that throws ends the backward without its final callback (the engine drops its queue): forget this
// backward's state, so the next one starts clean. Units stay as they are; the next forward unshards what it needs.
void FSDPState::in_hook(const std::function<void()>& body) {
  try {
    body();
  } catch (...) {
    reset_backward_state();
    throw;
  }
}

void FSDPState::set_is_last_backward(bool last) {
  if (ctx_ != nullptr) ctx_->is_last_backward = last;
  pending_is_last_backward_ = last;
}

absl::Status FSDPState::summon() {
  const std::vector<FSDPState*> targets = subtree_states();
  for (FSDPState* s : targets) {
    if (s->state_ != TrainingState::idle && s->state_ != TrainingState::summoned) {
      return absl::FailedPreconditionError(absl::StrCat("fsdp: unshard() on a ", s->module_->type_name(),
                                                        " in training state ", training_state_name(s->state_),
                                                        "; expected idle (between steps)"));
    }
  }
  // Note [same values on every rank] in same_values.cc: before any rank sees the full values.
  if (absl::Status st = values_differ(*module_, targets); !st.ok()) return st;
  for (FSDPState* s : targets) {
    if (s->state_ == TrainingState::summoned) continue;
    // Summoned values are read, written back and saved: exact f32, not param_dtype's (mixed_precision.h).
    if (absl::Status st = s->wait_unshard(); !st.ok()) return st;
    if (s->params_ != nullptr && !s->params_->unsharded_exact()) s->reshard_unit();
    if (absl::Status st = s->unshard_unit(/*exact=*/true); !st.ok()) return st;
    s->state_ = TrainingState::summoned;
  }
  return absl::OkStatus();
}

absl::Status FSDPState::reshard(bool recurse) {
  std::vector<FSDPState*> targets = recurse ? subtree_states() : std::vector<FSDPState*>{this};
  for (FSDPState* s : targets) {
    if (s->state_ != TrainingState::idle && s->state_ != TrainingState::summoned) {
      return absl::FailedPreconditionError(absl::StrCat("fsdp: reshard() on a ", s->module_->type_name(),
                                                        " in training state ", training_state_name(s->state_),
                                                        "; expected idle or summoned (between steps)"));
    }
  }
  for (FSDPState* s : targets) {
    if (s->state_ == TrainingState::summoned) {
      s->state_ = TrainingState::idle;
      if (s->params_ != nullptr) s->params_->write_back();  // values written meanwhile (load_state_dict) are kept
    }
    s->reshard_unit();
  }
  return absl::OkStatus();
}

}  // namespace shardkit::fsdp
