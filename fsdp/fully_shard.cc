#include "fsdp/fully_shard.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/autograd/engine.h"
#include "common/autograd/grad_mode.h"
#include "common/autograd/hooks.h"
#include "common/base/check.h"
#include "common/optim/clip_grad.h"
#include "oss/sharded_grad_norm.h"

namespace shardkit::fsdp {

using nn::TensorList;

struct FullyShardedModel::Unit {
  std::string name;
  nn::Module* module = nullptr;
  bool is_root = false;
  std::vector<Tensor> params;          // trainable parameters, each a view of `full`
  std::vector<std::int64_t> offsets;   // where each starts in `full`
  std::int64_t numel = 0;              // parameter elements (unpadded)
  std::int64_t shard_size = 0;         // S
  Tensor full;                         // world · S elements; released at rest
  Tensor shard;                        // this rank's S elements: the leaf the optimizer steps
  bool unsharded() const { return !full.storage_released(); }
  // per backward
  bool reduced = false;
  std::vector<autograd::HookHandle> hooks;           // forward hooks and post-accumulate-grad hooks
  struct BackwardHook {
    std::int64_t forward = 0;  // the root forward that registered it
    autograd::HookHandle handle;
  };
  // Pre-backward hooks on outputs and post-backward hooks on inputs (Note [pending pre-backward hooks]).
  std::vector<BackwardHook> backward_hooks;
};

// Note [post-backward on a unit's inputs]
// When is a unit's backward over? Not "when all its parameters have gradients": whether a parameter gets
// one can depend on the data (a branch taken on some ranks only), and ranks would then issue the unit's
// reduce_scatter at different points of the backward (a hang). Instead a hook on each input of the unit
// that requires grad fires when the gradient of that input is complete, which is after every node of the
// unit ran; the engine runs a ready AccumulateGrad before any other node (Note [execution order] in
// engine.cc), so by then every parameter used inside the unit has its gradient. That point depends only on
// the graph, the same on every rank. The unit is reduced there, with zeros for parameters that got no
// gradient. Reduction is linear, so a unit reduced several times in one backward (two forwards before one
// backward: the second forward's input fires first, while parameters used by both still wait for the
// first forward's part) accumulates the right sum in its shard's gradient. Units without such an input (the
// root, whose input is token ids) are reduced by the final callback, in unit order. A parameter must be
// used only inside its unit's forward (a shared parameter belongs to the common ancestor), else a gradient
// arriving after its unit's post-backward is reduced by the final callback.
// When a unit's input is the previous unit's output (consecutive blocks), its post-backward runs inside
// the previous unit's pre-backward hook, before that unit is unsharded, so backward holds one unit's full
// parameters at a time (besides the root's) rather than two.

// Note [pending pre-backward hooks]
// Each training forward registers a hook on every unit's outputs that unshards the unit before its
// backward. Several forwards may precede their backwards (micro-batches summed into one loss, or one
// backward per forward afterwards), so a backward must not drop the hooks of forwards whose backward has
// not run yet. Hooks are dropped by age instead: those registered more than kPendingForwards root forwards
// ago (a forward whose backward never ran, e.g. a loss computed with grad mode on and discarded).
constexpr std::int64_t kPendingForwards = 8;

// Note [fsdp units and flat shards]
// A unit's trainable parameters live in one flat buffer (as OSS's contiguous flat policy, Note [flat
// chunks] in oss/partition.h: one chunk per unit), so unsharding is one all_gather straight into the
// parameters' bytes and the gradient reduction is one reduce_scatter whose output is exactly the shard's
// gradient. The flat buffer's Storage is released at rest and reallocated to unshard: every view (the
// module's parameters, and the tensors autograd saved for backward) sees the new bytes, so nothing is
// re-bound per pass. The shard is a separate tensor, so the optimizer's state is sized by the shard.

std::vector<nn::Module*> modules_of_type(nn::Module& root, const std::string& type) {
  std::vector<nn::Module*> out;
  for (const auto& [name, m] : root.named_modules()) {
    if (m != &root && m->type_name() == type) out.push_back(m);
  }
  return out;
}

FullyShardedModel::FullyShardedModel(std::shared_ptr<comm::ProcessGroup> group, FullyShardOptions options)
    : pg_(std::move(group)), options_(std::move(options)) {}

FullyShardedModel::~FullyShardedModel() = default;

absl::Duration FullyShardedModel::timeout() const { return options_.timeout.value_or(pg_->default_timeout()); }

absl::StatusOr<std::unique_ptr<FullyShardedModel>> FullyShardedModel::create(nn::Module& root,
                                                                          std::shared_ptr<comm::ProcessGroup> group,
                                                                          FullyShardOptions options) {
  std::unique_ptr<FullyShardedModel> m(new FullyShardedModel(std::move(group), std::move(options)));
  const int world = m->pg_->size(), rank = m->pg_->rank();
  std::map<const nn::Module*, std::string> module_names;
  for (const auto& [name, mod] : root.named_modules()) module_names[mod] = name;

  // Assign parameters: listed units first (in order), then the root. A shared parameter goes to the first.
  std::set<const TensorImpl*> claimed;
  std::vector<nn::Module*> order = m->options_.units;
  order.push_back(&root);
  for (nn::Module* mod : order) {
    auto it = module_names.find(mod);
    if (mod == nullptr || it == module_names.end() || (mod != &root && it->second.empty())) {
      return absl::InvalidArgumentError("fully_shard: expected every unit to be a submodule of the root");
    }
    auto u = std::make_unique<Unit>();
    u->name = it->second;
    u->module = mod;
    u->is_root = mod == &root;
    for (const auto& [pname, p] : mod->named_parameters()) {
      if (claimed.count(p.id()) != 0) continue;
      if (!p.requires_grad()) {
        if (u->is_root) m->frozen_.push_back(p);  // (frozen parameters of units are seen again by the root)
        continue;
      }
      if (p.dtype() != DType::f32) {
        return absl::InvalidArgumentError(absl::StrCat("fully_shard: expected f32 parameters, found ",
                                                       std::string(dtype_name(p.dtype())), " for '",
                                                       u->name.empty() ? pname : absl::StrCat(u->name, ".", pname), "'"));
      }
      claimed.insert(p.id());
      u->offsets.push_back(u->numel);
      u->params.push_back(p);
      u->numel += p.numel();
    }
    if (u->numel == 0) continue;
    u->shard_size = (u->numel + world - 1) / world;
    const TensorOptions param_opts = TensorOptions{}.with_category(MemoryCategory::parameter);
    u->full = Tensor::zeros({u->shard_size * world}, param_opts);
    for (std::size_t i = 0; i < u->params.size(); ++i) {
      const Tensor home = u->full.view(u->offsets[i], u->params[i].shape());
      home.copy_(u->params[i]);
      u->params[i].rebind(home);  // the module's parameter now reads and writes the flat buffer
    }
    if (m->options_.sync_module_states && world > 1) {
      if (absl::Status s = m->pg_->broadcast(u->full, {.root = 0, .timeout = m->timeout(), .tag = "fsdp sync"})->wait();
          !s.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("fully_shard: startup broadcast failed: ", s.message()));
      }
    }
    u->shard = Tensor::empty({u->shard_size}, param_opts);
    u->shard.copy_(u->full.view(rank * u->shard_size, {u->shard_size}));
    u->shard.set_requires_grad(true);
    m->units_.push_back(std::move(u));
  }

  // Hooks (Note [fsdp units and flat shards]).
  FullyShardedModel* self = m.get();
  for (auto& owned : m->units_) {
    Unit* u = owned.get();
    u->hooks.push_back(u->module->register_forward_pre_hook(
        [self, u](nn::Module&, const TensorList& inputs) -> std::optional<TensorList> {
          if (u->is_root) {
            self->unit_outputs_.clear();
            if (absl::Status s = self->check_trainable(); !s.ok()) throw FsdpError(std::move(s));
            // A backward that ended without its final callback (a hook threw): start clean.
            if (self->in_backward_ && !autograd::is_backward_running()) self->reset_backward_state();
            ++self->forwards_;
            for (auto& unit : self->units_) {
              std::erase_if(unit->backward_hooks, [&](const Unit::BackwardHook& h) {
                return h.forward <= self->forwards_ - kPendingForwards;
              });
            }
          }
          if (absl::Status s = self->unshard_unit(*u); !s.ok()) throw FsdpError(std::move(s));
          if (!u->is_root && autograd::is_grad_enabled()) {  // Note [post-backward on a unit's inputs]
            for (const Tensor& t : inputs) {
              if (!t.defined() || !t.requires_grad()) continue;
              if (auto it = self->unit_outputs_.find(t.id()); it != self->unit_outputs_.end()) {
                it->second.reduce_first->push_back(u);  // the previous unit's pre-backward hook reduces u first
                continue;
              }
              u->backward_hooks.push_back(
                  {self->forwards_, autograd::register_hook(t, [self, u](const Tensor&) -> std::optional<Tensor> {
                     self->in_hook([&] {
                       self->ensure_final_callback();
                       self->reduce_unit(*u);
                     });
                     return std::nullopt;
                   })});
            }
          }
          return std::nullopt;
        }));
    u->hooks.push_back(u->module->register_forward_hook(
        [self, u](nn::Module&, const TensorList&, const TensorList& outputs) -> std::optional<TensorList> {
          const bool grad_follows = std::any_of(outputs.begin(), outputs.end(),
                                                [](const Tensor& t) { return t.defined() && t.requires_grad(); });
          if (!grad_follows || (!u->is_root && self->options_.reshard_after_forward)) {
            self->reshard_unit(*u);  // (no gradient follows: no backward will need these parameters)
          }
          if (u->is_root) self->unit_outputs_.clear();  // the forward is over
          if (!grad_follows) return std::nullopt;
          for (const Tensor& t : outputs) {
            if (!t.defined() || !t.requires_grad()) continue;
            auto reduce_first = std::make_shared<std::vector<Unit*>>();
            if (!u->is_root) self->unit_outputs_[t.id()] = {t, reduce_first};
            u->backward_hooks.push_back(
                {self->forwards_,
                 autograd::register_hook(t, [self, u, reduce_first](const Tensor&) -> std::optional<Tensor> {
                   self->in_hook([&] {
                     self->ensure_final_callback();
                     for (Unit* next : *reduce_first) self->reduce_unit(*next);  // their post-backward
                     if (absl::Status s = self->unshard_unit(*u); !s.ok()) throw FsdpError(std::move(s));
                   });
                   return std::nullopt;
                 })});
          }
          return std::nullopt;
        }));
    for (const Tensor& p : u->params) {
      // Only to make sure the final callback is queued (a loss that does not pass through the root's output).
      u->hooks.push_back(autograd::register_post_accumulate_grad_hook(
          p, [self](const Tensor&) { self->in_hook([&] { self->ensure_final_callback(); }); }));
    }
    m->reshard_unit(*u);  // at rest: shards only
  }
  return m;
}

std::vector<Tensor> FullyShardedModel::parameters() const {
  std::vector<Tensor> out;
  for (const auto& u : units_) out.push_back(u->shard);
  return out;
}

absl::StatusOr<double> FullyShardedModel::clip_grad_norm(double max_norm, double norm_type) {
  const std::vector<Tensor> shards = parameters();
  absl::StatusOr<double> total =
      oss::sharded_grad_norm(shards, *pg_, norm_type, {.timeout = options_.timeout, .tag = "fsdp clip_grad_norm"});
  if (!total.ok()) return total.status();
  const double coef = optim::clip_coefficient(*total, max_norm);
  if (!(coef >= 1.0)) optim::scale_grads(shards, coef);  // NaN scales too, as PyTorch
  return *total;
}

std::size_t FullyShardedModel::num_units() const { return units_.size(); }
std::string FullyShardedModel::unit_name(std::size_t u) const { return units_.at(u)->name; }
std::int64_t FullyShardedModel::unit_numel(std::size_t u) const { return units_.at(u)->numel; }

FullyShardedModel::UnitLayout FullyShardedModel::unit_layout(std::size_t u) const {
  const Unit& unit = *units_.at(u);
  return {unit.params, unit.offsets, unit.shard_size, unit.shard};
}

std::int64_t FullyShardedModel::shard_numel() const {
  std::int64_t n = 0;
  for (const auto& u : units_) n += u->shard_size;
  return n;
}

absl::Status FullyShardedModel::unshard_unit(Unit& u) {
  if (u.unsharded()) return absl::OkStatus();
  u.full.reallocate_storage();
  absl::Status s =
      pg_->all_gather(u.full, u.shard, {.timeout = timeout(), .tag = absl::StrCat("fsdp unshard ", u.name)})->wait();
  if (!s.ok()) u.full.release_storage();  // its bytes are not the parameters
  return s;
}

void FullyShardedModel::reshard_unit(Unit& u) {
  if (!u.unsharded() || pinned_) return;
  u.full.release_storage();
}

absl::Status FullyShardedModel::unshard() {
  for (auto& u : units_) {
    if (absl::Status s = unshard_unit(*u); !s.ok()) return s;
  }
  pinned_ = true;
  return absl::OkStatus();
}

void FullyShardedModel::reshard() {
  pinned_ = false;
  const int rank = pg_->rank();
  for (auto& u : units_) {
    if (!u->unsharded()) continue;
    u->shard.copy_(u->full.view(rank * u->shard_size, {u->shard_size}));  // keeps changes made meanwhile
    reshard_unit(*u);
  }
}

absl::Status FullyShardedModel::check_trainable() const {
  for (const auto& u : units_) {
    for (std::size_t i = 0; i < u->params.size(); ++i) {
      if (!u->params[i].requires_grad()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "fully_shard: parameter ", i, " of unit '", u->name,
            "' was frozen after fully_shard; expected the trainable set fixed at construction (freeze before "
            "fully_shard: frozen parameters stay unsharded)"));
      }
    }
  }
  for (const Tensor& p : frozen_) {
    if (p.requires_grad()) {
      return absl::FailedPreconditionError(
          "fully_shard: a parameter frozen at construction (left unsharded) was unfrozen; expected the trainable "
          "set fixed at construction");
    }
  }
  return absl::OkStatus();
}

// A hook that throws ends the backward without its final callback (the engine drops its queue): forget
// this backward's state, so the next one starts clean. Units stay as they are; the next forward unshards
// what it needs.
void FullyShardedModel::in_hook(const std::function<void()>& body) {
  try {
    body();
  } catch (...) {
    reset_backward_state();
    throw;
  }
}

void FullyShardedModel::reset_backward_state() {
  in_backward_ = false;
  for (auto& u : units_) {
    for (const Tensor& p : u->params) p.set_grad(Tensor());  // partial full gradients of the failed backward
    u->reduced = false;
  }
}

void FullyShardedModel::ensure_final_callback() {
  if (in_backward_) return;
  in_backward_ = true;
  for (auto& u : units_) u->reduced = false;
  autograd::queue_callback([this] { in_hook([this] { finalize_backward(); }); });
}

void FullyShardedModel::reduce_unit(Unit& u) {
  u.reduced = true;
  if (!sync_) {  // accumulation: the full gradients stay on the parameters until a synchronised backward
    reshard_unit(u);
    return;
  }
  const int world = pg_->size();
  Tensor flat = Tensor::empty({u.shard_size * world}, TensorOptions{}.with_category(MemoryCategory::communication_buffer));
  for (std::size_t i = 0; i < u.params.size(); ++i) {
    const Tensor g = u.params[i].grad();
    const Tensor slot = flat.view(u.offsets[i], {u.params[i].numel()});
    if (!g.defined()) {
      slot.zero_();  // no gradient: zeros
      continue;
    }
    slot.copy_(g.reshape({g.numel()}));
    u.params[i].set_grad(Tensor());  // the full gradient is released once it is in the bucket
  }
  if (u.numel < flat.numel()) flat.view(u.numel, {flat.numel() - u.numel}).zero_();  // padding
  Tensor out = Tensor::empty({u.shard_size}, TensorOptions{}.with_category(MemoryCategory::gradient));
  if (absl::Status s = pg_->reduce_scatter(out, flat, {.op = comm::ReduceOp::avg(), .timeout = timeout(),
                                                       .tag = absl::StrCat("fsdp grads ", u.name)})
                           ->wait();
      !s.ok()) {
    throw FsdpError(std::move(s));
  }
  if (const Tensor acc = u.shard.grad(); acc.defined()) {  // accumulation over several backwards
    float* a = acc.data<float>();
    const float* o = out.data<float>();
    for (std::int64_t k = 0; k < u.shard_size; ++k) a[k] += o[k];
  } else {
    u.shard.set_grad(out);
  }
  reshard_unit(u);
}

void FullyShardedModel::finalize_backward() {
  // Units with no post-backward in this backward (Note [post-backward on a unit's inputs]), and units whose
  // gradients arrived after it: every rank reduces them, in unit order.
  for (auto& u : units_) {
    const bool late = sync_ && std::any_of(u->params.begin(), u->params.end(),
                                           [](const Tensor& p) { return p.grad().defined(); });
    if (!u->reduced || late) reduce_unit(*u);
  }
  for (auto& u : units_) reshard_unit(*u);  // (pending hooks stay: Note [pending pre-backward hooks])
  in_backward_ = false;
}

}  // namespace shardkit::fsdp
