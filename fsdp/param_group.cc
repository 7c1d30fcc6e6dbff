#include "fsdp/param_group.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/comm/any_flags.h"
#include "common/kernels/elementwise.h"
#include "common/nn/deferred_init.h"
#include "common/tensor/pinned_host_source.h"
#include "common/tensor/storage.h"
#include "fsdp/same_values.h"

namespace shardkit::fsdp {
namespace {

Shape local_shape_of(const Shape& global, std::int64_t local_rows) {
  if (global.empty()) return local_rows == 1 ? Shape{} : Shape{0};
  Shape s = global;
  s[0] = local_rows;
  return s;
}

// Note [unit on a device]
// A unit's buffers (the shard buffer, the unsharded buffer, the gather and reduce-scatter buffers, the reduced
// gradients) live on its parameters' device, and every row copy, dtype conversion, zero fill, sum and scale goes
// through the Tensor-level kernels (kernels::cast, Tensor::zero_, kernels::add / scale), which run where the tensors
// are: on the CPU the same loops as plain copies, on a CUDA device kernels on the calling thread's stream, ordered
// before the collectives (a collective on device tensors waits for the caller's stream). fully_shard requires the
// parameters of one call to share a device.

// Note [cpu offload]
// FSDP2's CPUOffloadPolicy (FullyShardOptions::offload_policy.cpu). The shard buffer, so the module's parameters
// at rest, and the shards' gradients live in host memory (MemoryLocation::host in the ledger); an optimizer built
// over model.parameters() finds them there and steps on the CPU with its CPU kernels, its state sized by the rows
// and on the host too. The parameters' device keeps everything of a pass: the gather and reduce-scatter buffers,
// the unsharded parameters and gradients, the k-shards. Per unshard this rank's shard is copied to the device
// (shard_on_device(), a communication buffer the all-gather's Work holds until the peers have read it); per reduce
// the reduced rows (after the HSDP all-reduce and the divide) are copied back to the host before they become or
// join the shards' gradients; write_back() copies unsharded rows into the host shards. The shard buffer is pinned
// (PinnedHostSource: page-locked when the program can pin memory), so its copy to the device runs by DMA; the
// reduced rows land in ordinary host memory (a new buffer each step, which pinned memory's costly free would slow
// down). The copies are synchronous, so they do not overlap the device's compute.
// On CPU parameters the policy changes where nothing lives (host and compute device are the same memory) but the
// copies still run: what the CPU tests exercise.

// Copies `rows` rows of `row_numel` elements of `src` starting at element `src_offset` into `dst` at element
// `dst_offset`, converting to dst's dtype; any devices.
void copy_rows(const Tensor& dst, std::int64_t dst_offset, const Tensor& src, std::int64_t src_offset,
               std::int64_t rows, std::int64_t row_numel) {
  const std::int64_t n = rows * row_numel;
  if (n > 0) kernels::cast(src.view(src_offset, {n}), dst.view(dst_offset, {n}));
}

// Zeros elements [offset, offset + n) of `t`.
void zero_range(const Tensor& t, std::int64_t offset, std::int64_t n) {
  if (n > 0) t.view(offset, {n}).zero_();
}

}  // namespace

// Note [hybrid sharding]
// HSDP on a 2-D mesh (replicate × shard): each parameter is sharded over the shard group (a row of the mesh) and
// replicated across the replicate group (a column: the ranks holding the same shard). Unshard all-gathers within
// the shard group only. A gradient is reduce-scattered within the shard group, then the reduced rows are
// all-reduced across the replicate group, both with the same operation (average, or sum before the divide
// factor), so each shard ends with the average over every rank of the mesh. set_requires_all_reduce(false) (HSDP
// gradient accumulation) keeps the reduce-scattered rows aside (`partial_`, MemoryCategory::gradient) instead of
// all-reducing them; the next reduce that all-reduces adds them in first, so one all-reduce carries every
// micro-batch. The all-reduce runs when the reduce-scatter is finished (not overlapped yet).

// Note [own collectives]
// A unit's all-gather lands rank-major ([rank 0: every parameter's rows | rank 1: ... ]) while each unsharded
// parameter is row-major on its own, so the shared gather buffer costs a copy-out of every byte, and the
// reduce-scatter a copy-in of every gradient byte; on CPU backends those copies cost as much as the collective
// itself. A parameter whose rows split evenly over the group (no padding) is already rank-major on its own: its
// unsharded tensor *is* the all-gather output of its shard, and its full gradient *is* a reduce-scatter input. So
// a parameter with at least FullyShardOptions::own_collective_min_numel elements and no padding gets collectives
// of its own: an all_gather from its shard rows straight into its view of the unit's unsharded buffer, and a
// reduce_scatter from its gradient straight into its rows of the unit's reduced gradients; the unit's other
// parameters (small ones, padded ones) still share one all_gather and one reduce_scatter through a buffer. Their
// rows come first in the shard buffer ([0, shared_numel_)), so the shared collective's input is contiguous.
// Every rank decides the same (the choice depends on shapes and the group size only) and issues the same
// collectives in the same order: the shared one, then the own ones in parameter order. The values are the same
// bits: the gather is a copy either way and a reduction is per element, in rank order.
// Own collectives are used when the gather moves f32 (no param_dtype cast, not a k-group gather) and, for the
// reduce, when reduce_dtype is f32; otherwise the whole unit goes through the buffers as before.
// Memory: while own gathers are in flight the unsharded buffer is charged as MemoryCategory::communication_buffer
// (it is the gather output), and becomes `parameter` when the unshard is waited for, so the ledger tells the same
// story as with a gather buffer (a prefetched unit's parameters are not charged before it runs); in flight are the
// unsharded buffer (N × S less padding) plus the shared parameters' gather buffer (the small ones), slightly more
// than the N × S of one gather buffer. A gradient handed to its own reduce_scatter is released by this rank at once
// and held by the collective until the peers are done (as the shared buffer is), charged as `gradient` meanwhile
// (the copy it replaces was a communication buffer).

ParamGroup::ParamGroup(std::string name, std::vector<FSDPParam> params, std::shared_ptr<comm::ProcessGroup> group,
                       std::shared_ptr<comm::ProcessGroup> replicate, std::optional<absl::Duration> timeout,
                       MixedPrecisionPolicy mp, std::int64_t own_collective_min_numel, bool cpu_offload)
    : name_(std::move(name)),
      params_(std::move(params)),
      pg_(std::move(group)),
      replicate_(std::move(replicate)),
      timeout_(timeout),
      mp_(mp),
      offload_(cpu_offload) {
  const int rank = pg_->rank(), world = pg_->size();
  for (FSDPParam& p : params_) {
    p.split = split_rows(p.global_shape, rank, world);
    p.local_shape = local_shape_of(p.global_shape, p.split.local_rows);
    const std::int64_t numel = shape_numel(p.global_shape);
    p.own_collective = numel > 0 && numel >= own_collective_min_numel && p.split.rows_per_rank * world == p.split.rows;
  }
  if (!params_.empty()) {
    const FSDPParam& first = params_.front();
    device_ = first.registrations.front().first->parameter(first.registrations.front().second).device();
  }
  std::int64_t s = 0;
  for (const bool own : {false, true}) {  // Note [own collectives]: the shared ones first
    for (FSDPParam& p : params_) {
      if (p.own_collective != own) continue;
      p.shard_offset = s;
      s += p.padded_numel();
      (own ? own_numel_ : shared_numel_) += p.padded_numel();
    }
  }
  {
    // Note [cpu offload]: the host shard is pinned, copied to the device at every unshard.
    std::optional<HostBlockSourceScope> pinned;
    if (offload_) pinned.emplace(std::make_shared<PinnedHostSource>());
    shard_ = Tensor::zeros({s}, options(MemoryCategory::parameter).with_device(shard_device()));
  }
  // The unsharded parameters are views of one buffer per unit (one allocation per unshard, released at rest).
  std::int64_t full_numel = 0;
  for (const FSDPParam& p : params_) full_numel += shape_numel(p.global_shape);
  full_ = Tensor::over(Storage::allocate_released(static_cast<std::size_t>(full_numel) * sizeof(float), device_,
                                                  MemoryCategory::parameter),
                       0, {full_numel}, DType::f32);  // released: no bytes until the first unshard
  std::int64_t full_offset = 0;
  nn::DeferredInit* deferred = nn::current_deferred_init();
  const bool compared = world > 1 || (replicate_ != nullptr && replicate_->size() > 1);
  for (FSDPParam& p : params_) {
    const Tensor& full = p.registrations.front().first->parameter(p.registrations.front().second);
    SK_CHECK(full.shape() == p.global_shape && full.dtype() == DType::f32) << "fsdp: " << full.describe();
    // Note [deferred init under fully_shard]: a parameter built without storage is materialised here, its rows
    // copied and its bytes released at once, so construction never holds more than the shards and one parameter.
    const bool was_deferred = deferred != nullptr && deferred->is_deferred(full);
    if (was_deferred) deferred->materialize(full);
    SK_CHECK(full.device() == device_) << "fsdp: " << full.describe() << " in a unit on " << device_.str();
    if (compared) value_hashes_.push_back(value_hash(full));  // Note [same values on every rank] in same_values.cc
    copy_rows(shard_, p.shard_offset, full, p.split.row_offset * p.split.row_numel, p.split.local_rows,
              p.split.row_numel);
    if (was_deferred && full.nbytes() > 0) full.release_storage();
    p.sharded = shard_.view(p.shard_offset, p.local_shape);
    p.sharded.set_requires_grad(full.requires_grad());  // a frozen parameter's shards are frozen (fsdp_param.h)
    p.unsharded = full_.view(full_offset, p.global_shape);
    p.full_offset = full_offset;
    full_offset += p.unsharded.numel();
    p.unsharded.set_requires_grad(true);  // (for the post-accumulate hooks; each unshard copies the shard's)
    p.register_as(p.sharded);
  }
}

Tensor ParamGroup::shard_on_device() const {
  return offload_ ? shard_.to(device_, MemoryCategory::communication_buffer) : shard_;
}

absl::Status ParamGroup::enable_group_reshard(int k) {
  SK_CHECK(k > 1 && k < pg_->size() && pg_->size() % k == 0) << "fsdp: reshard group " << k;  // (fully_shard checks)
  auto sub = pg_->split(pg_->rank() / k, pg_->rank(), {.name = absl::StrCat(pg_->name(), "/reshard", k)});
  if (!sub.ok()) return sub.status();
  k_ = k;
  kgroup_ = std::move(*sub);
  std::int64_t s = 0;
  for (const FSDPParam& p : params_) {
    k_offsets_.push_back(s);
    const RowSplit rs = split_rows(p.global_shape, 0, k);
    s += rs.rows_per_rank * rs.row_numel;
  }
  kshard_ = Tensor::zeros({s}, options(MemoryCategory::parameter));
  kshard_.release_storage();
  return absl::OkStatus();
}

void ParamGroup::reshard_to_group() {
  SK_CHECK(k_ > 0 && unsharded_) << "fsdp: reshard_to_group on " << name_;
  kshard_.reallocate_storage();
  const int i = kgroup_->rank();
  for (std::size_t j = 0; j < params_.size(); ++j) {
    const FSDPParam& p = params_[j];
    const RowSplit rs = split_rows(p.global_shape, i, k_);
    zero_range(kshard_, k_offsets_[j] + rs.local_rows * rs.row_numel, (rs.rows_per_rank - rs.local_rows) * rs.row_numel);
    copy_rows(kshard_, k_offsets_[j], p.unsharded, rs.row_offset * rs.row_numel, rs.local_rows, rs.row_numel);
  }
  register_shards();
  k_exact_ = unsharded_exact();
  full_.release_storage();
  unsharded_ = false;
  k_resharded_ = true;
}

// Note [freezing while unsharded]
// While a unit is unsharded the module's parameters are the unsharded tensors, so model.set_requires_grad() between
// steps with the unit kept unsharded (set_reshard_after_backward(false), reshard_after_forward false) sets the flag
// on those; the next unshard used to copy the shards' old flag back over it, and the freeze was lost (a helper's
// audit: a frozen block kept training, tests/fsdp/fsdp_combo7_frozen_test.cc). So whichever tensor the module holds
// has the flag that counts (trains()), and registering the shards again carries it over to them.
void ParamGroup::register_shards() {
  for (FSDPParam& p : params_) {
    if (unsharded_) p.sharded.set_requires_grad(p.unsharded.requires_grad());
    p.register_as(p.sharded);
  }
}

// Note [unit fingerprints]
// Collectives pair across ranks by kind, order and size only, so two units of one shard size pair silently when
// ranks run different units in one forward (a branch taken on some ranks): rank 1's unit got rank 0's rows of
// another, and no rank was told (tests/fsdp/fsdp_misuse_test.cc). So each collective of a unit carries a
// fingerprint (process_group.h, THE CONTRACT): a hash of the unit's identity and of the collective's purpose
// ("unshard", "reduce_scatter", ...), the same on every rank, different between units; the backends that compare
// it (in-process, TCP, shared memory, MPI) then fail such a call on every rank with InvalidArgument naming both
// fingerprints. The identity is where the unit's fully_shard call stood among its groups' collectives
// (ProcessGroup::collectives_issued() of the shard group, and of the replicate group under HSDP, when the call
// began): every rank makes the same fully_shard calls between the same collectives, and each call issues at least
// one (the values' comparison, Note [same values on every rank] in same_values.cc), so the identity is the same
// on every rank and another for each unit, across roots too (a first version named units by their path under
// their root, and every root was "": two independent models of one size run in another order on each rank paired
// silently; FsdpFingerprintTwoRoots in fsdp_same_values_combo_test.cc). It is set when the unit is made, so its
// collectives carry it from the first (FSDPModule::unshard before any forward included). NCCL does not compare
// fingerprints: there such a breach still pairs silently.
std::uint32_t ParamGroup::fingerprint(std::string_view purpose) const {
  if (!identity_) return 0;
  return comm::fingerprint_of(absl::StrCat("fsdp unit '", *identity_, "' ", std::string(purpose)));
}

// Note [kept after backward, stale after a step]
// set_reshard_after_backward(false) keeps a unit's unsharded parameters after its backward so that the next forward
// (an accumulation micro-batch) need not gather them again. But once the unit's gradients reach its shards (a
// synchronised backward), an optimizer step may change the shards, and the kept full values are then stale: a
// helper's audit found the next forward computing with the pre-step parameters, and summon_full_params' write-back
// copying those stale rows over the stepped shards, so reading the model reverted the step
// (tests/fsdp/fsdp_combo6_test.cc). So delivering gradients to the shards marks the kept values stale: they are no
// longer "unsharded" for unshard() (the next forward, backward or summon releases them and gathers again) and
// write_back() ignores them. Keeping pays off within accumulation (no reduce), as FSDP2's recipe uses it.
absl::StatusOr<ParamGroup::UnshardHandle> ParamGroup::unshard_async(bool exact) {
  UnshardHandle h;
  if (unsharded_ && !stale_) return h;
  if (stale_) reshard();
  h.group_ = this;
  if (k_resharded_) {  // Note [reshard to a k-group]: gather within the k-group
    h.gathered_ = Tensor::empty({kshard_.numel() * k_}, options(MemoryCategory::communication_buffer));
    h.works_.push_back(kgroup_->all_gather(h.gathered_, kshard_,
                                           {.timeout = timeout(), .tag = absl::StrCat("fsdp unshard (k-group) ", name_),
                                            .fingerprint = fingerprint("unshard (k-group)")}));
    return h;
  }
  const DType dtype = exact ? DType::f32 : mp_.compute_dtype();
  h.own_ = own_unshard(dtype);
  // Note [own collectives]: the shared parameters through the gather buffer, the others straight into full_.
  const std::int64_t shared = h.own_ ? shared_numel_ : shard_.numel();
  const Tensor shard = shard_on_device();  // the Works hold it until the peers have read it
  if (shared > 0) {
    h.gathered_ = Tensor::empty({shared * pg_->size()}, options(MemoryCategory::communication_buffer, dtype));
    // param_dtype: the shard cast for the all-gather (its Work holds the cast until the peers have read it).
    const Tensor mine = shared == shard.numel() ? shard : shard.view(0, {shared});
    const Tensor send = dtype == DType::f32 ? mine : mine.to(dtype, MemoryCategory::communication_buffer);
    h.works_.push_back(pg_->all_gather(h.gathered_, send,
                                       {.timeout = timeout(), .tag = absl::StrCat("fsdp unshard ", name_),
                                        .fingerprint = fingerprint("unshard")}));
  }
  if (!h.own_) return h;
  full_.storage()->recategorize(MemoryCategory::communication_buffer);  // until waited for
  full_.reallocate_storage();
  for (const FSDPParam& p : params_) {
    if (!p.own_collective) continue;
    h.works_.push_back(pg_->all_gather(full_.view(p.full_offset, {p.unsharded.numel()}),
                                       shard.view(p.shard_offset, {p.padded_numel()}),
                                       {.timeout = timeout(),
                                        .tag = absl::StrCat("fsdp unshard ", name_, " ", p.names.front()),
                                        .fingerprint = fingerprint(absl::StrCat("unshard ", p.names.front()))}));
  }
  return h;
}

absl::Status ParamGroup::UnshardHandle::wait() {
  if (group_ == nullptr) return absl::OkStatus();
  ParamGroup* g = group_;
  group_ = nullptr;
  absl::Status s;
  for (const std::shared_ptr<comm::Work>& w : works_) {  // every one: own gathers write into full_ until done
    if (absl::Status ws = w->wait(); s.ok()) s = ws;
  }
  works_.clear();
  Tensor gathered = std::move(gathered_);
  if (!s.ok()) {
    if (own_) {  // nothing writes full_ any more
      g->full_.release_storage();
      g->full_.storage()->recategorize(MemoryCategory::parameter);
    }
    return s;
  }
  return g->finish_unshard(gathered, own_);
}

absl::Status ParamGroup::finish_unshard(const Tensor& gathered, bool own) {
  // From the k-group's k-shards (Note [reshard to a k-group]) or from every rank's shard.
  const bool from_k = k_resharded_;
  // Rank stride of the gather buffer: the shared parameters only when the others gathered on their own.
  const std::int64_t s = from_k ? kshard_.numel() : own ? shared_numel_ : shard_.numel();
  const int parts = from_k ? k_ : pg_->size();
  const DType in_dtype = gathered.defined() ? gathered.dtype() : DType::f32;
  const bool exact = from_k ? k_exact_ : in_dtype == DType::f32;
  if (own) {
    full_.storage()->recategorize(MemoryCategory::parameter);  // the gather output becomes the parameters
  } else {
    full_.reallocate_storage();
  }
  for (std::size_t j = 0; j < params_.size(); ++j) {
    FSDPParam& p = params_[j];
    p.unsharded.set_requires_grad(p.sharded.requires_grad());  // frozen after fully_shard: no gradient
    p.unsharded_exact = exact;
    p.register_as(p.unsharded);
    if (own && p.own_collective) continue;  // gathered in place
    const std::int64_t offset = from_k ? k_offsets_[j] : p.shard_offset;
    for (int r = 0; r < parts; ++r) {
      const RowSplit rs = split_rows(p.global_shape, r, parts);
      copy_rows(p.unsharded, rs.row_offset * rs.row_numel, gathered, r * s + offset, rs.local_rows, rs.row_numel);
    }
  }
  if (from_k) {
    kshard_.release_storage();
    k_resharded_ = false;
  }
  unsharded_ = true;
  stale_ = false;
  return absl::OkStatus();
}

absl::Status ParamGroup::unshard(bool exact) {
  auto h = unshard_async(exact);
  if (!h.ok()) return h.status();
  return h->wait();
}

void ParamGroup::reshard() {
  if (k_resharded_) {  // a full reshard drops the k-shards
    kshard_.release_storage();
    k_resharded_ = false;
  }
  stale_ = false;
  if (!unsharded_) return;
  register_shards();
  full_.release_storage();
  unsharded_ = false;
}

void ParamGroup::write_back() {
  if (!unsharded_ || stale_ || !unsharded_exact()) return;
  for (FSDPParam& p : params_) {
    copy_rows(p.sharded, 0, p.unsharded, p.split.row_offset * p.split.row_numel, p.split.local_rows,
              p.split.row_numel);
  }
}

bool ParamGroup::has_unsharded_grads() const {
  for (const FSDPParam& p : params_) {
    if (p.unsharded.grad().defined()) return true;
  }
  return false;
}

// Note [frozen parameters are not reduced]
// fully_shard shards frozen parameters too (FSDP2; fine-tuning a frozen backbone keeps 1/N of it per rank), and a
// frozen parameter's shards are frozen: no gradient, no update, until the user unfreezes them. So a reduce moves
// the rows of the parameters that require grad only, as FSDP2 reduce-scatters only the gradients that exist: with
// a few trainable parameters in a large frozen unit (adapters), the reduce_scatter and its buffers are the size of
// the trainable ones. The layout is a function of requires_grad and the shapes, which are the same on every rank
// (freezing is), so every rank issues the same collectives; a unit whose parameters are all frozen reduces nothing
// at all (no reduce_scatter, no flags). The used-parameter flags still cover every parameter (small). A parameter
// frozen while its unsharded gradient waits (inside no_sync) loses that gradient at the next reduce, as frozen
// parameters get none. HSDP rows kept for a deferred all-reduce carry their layout; a reduce with another layout
// (requires_grad changed between the backwards of one accumulation) is refused.
ParamGroup::ReduceLayout ParamGroup::reduce_layout(bool own) const {
  ReduceLayout l;
  l.offsets.assign(params_.size(), -1);
  for (const bool own_pass : {false, true}) {  // the shard buffer's order (Note [own collectives])
    if (own_pass) l.shared = own ? l.total : 0;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const FSDPParam& p = params_[i];
      if (p.own_collective != own_pass || !trains(p)) continue;
      l.offsets[i] = l.total;
      l.total += p.padded_numel();
    }
  }
  if (!own) l.shared = l.total;
  return l;
}

bool ParamGroup::needs_reduce() const {
  return partial_.defined() ||
         std::any_of(params_.begin(), params_.end(), [this](const FSDPParam& p) { return trains(p); });
}

void ParamGroup::drop_unsharded_grads() {
  for (const FSDPParam& p : params_) p.unsharded.set_grad(Tensor());
  if (pending_reduce_) {  // Note [a backward that threw] in state.cc: nothing left in flight
    for (const std::shared_ptr<comm::Work>& w : pending_reduce_->works) (void)w->wait();
  }
  pending_reduce_.reset();
}

absl::Status ParamGroup::reduce_grads(std::optional<double> divide_factor) {
  if (absl::Status st = start_reduce_grads(divide_factor); !st.ok()) return st;
  return finish_reduce_grads();
}

absl::Status ParamGroup::start_reduce_grads(std::optional<double> divide_factor, bool all_reduce_replicas) {
  if (absl::Status st = finish_reduce_grads(); !st.ok()) return st;
  if (divide_factor && !(std::isfinite(*divide_factor) && *divide_factor > 0)) {  // before any collective
    return absl::InvalidArgumentError(absl::StrCat("fsdp: expected set_reduce_scatter_divide_factor's factor finite "
                                                   "and > 0, found ", *divide_factor, " (unit ", name_, ")"));
  }
  const int world = pg_->size();
  const bool own = own_reduce();  // Note [own collectives]
  PendingReduce pending;
  pending.layout = reduce_layout(own);  // Note [frozen parameters are not reduced]
  const ReduceLayout& l = pending.layout;
  // Every element of the reduce_scatter input is written once: a gradient's rows (cast to reduce_dtype), or zeros
  // (padding, parameters without a gradient on this rank).
  const DType rd = mp_.reduce_in();
  const Tensor flat =
      l.shared == 0 ? Tensor() : Tensor::empty({l.shared * world}, options(MemoryCategory::communication_buffer, rd));
  pending.out = Tensor::empty({l.total}, options(MemoryCategory::gradient, rd));
  pending.divide_factor = divide_factor;
  pending.all_reduce_replicas = all_reduce_replicas;
  const comm::ReduceOp op = divide_factor ? comm::ReduceOp::sum() : comm::ReduceOp::avg();
  // Which parameters had a gradient on this rank (Note [parameters no rank used], below).
  std::vector<char> had_grad;
  for (const FSDPParam& p : params_) had_grad.push_back(p.unsharded.grad().defined() ? 1 : 0);
  // Own reduce_scatters are issued in parameter order after the shared one (Note [own collectives]).
  std::vector<std::pair<const FSDPParam*, Tensor>> own_inputs;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    FSDPParam& p = params_[i];
    const Tensor g = p.unsharded.grad();
    SK_CHECK(!g.defined() || (g.dtype() == DType::f32 && g.numel() == p.unsharded.numel())) << "fsdp: gradient " << g.describe();
    if (g.defined()) p.unsharded.set_grad(Tensor());  // released once it is in the input (or the input itself)
    const std::int64_t offset = l.offsets[i];
    if (offset < 0) continue;  // frozen
    if (own && p.own_collective) {
      // Its gradient is the input as it is (zeros when it got none).
      own_inputs.emplace_back(&p, g.defined() ? g : Tensor::zeros({p.unsharded.numel()}, options(MemoryCategory::communication_buffer)));
      continue;
    }
    for (int r = 0; r < world; ++r) {
      const RowSplit rs = split_rows(p.global_shape, r, world);
      const std::int64_t at = r * l.shared + offset;
      const std::int64_t filled = g.defined() ? rs.local_rows * rs.row_numel : 0;
      if (filled > 0) copy_rows(flat, at, g, rs.row_offset * rs.row_numel, rs.local_rows, rs.row_numel);
      zero_range(flat, at + filled, p.padded_numel() - filled);
    }
  }
  // The Works hold `flat` and the gradients until the peers are done with them; this rank drops them here.
  if (l.shared > 0) {
    const Tensor out = l.shared == l.total ? pending.out : pending.out.view(0, {l.shared});
    pending.works.push_back(pg_->reduce_scatter(out, flat, {.op = op, .timeout = timeout(),
                                                            .tag = absl::StrCat("fsdp reduce_scatter ", name_),
                                                            .fingerprint = fingerprint("reduce_scatter")}));
  }
  for (const auto& [p, g] : own_inputs) {
    pending.works.push_back(pg_->reduce_scatter(
        pending.out.view(l.offsets[static_cast<std::size_t>(p - params_.data())], {p->padded_numel()}),
        g.view(0, {g.numel()}),
        {.op = op, .timeout = timeout(), .tag = absl::StrCat("fsdp reduce_scatter ", name_, " ", p->names.front()),
         .fingerprint = fingerprint(absl::StrCat("reduce_scatter ", p->names.front()))}));
  }
  pending.used = comm::flags_tensor(had_grad, device_, rd);
  if (world > 1) {
    const std::string tag = absl::StrCat("fsdp used parameters ", name_);
    pending.works.push_back(
        pg_->all_reduce(pending.used, {.op = comm::ReduceOp::max(), .timeout = timeout(), .tag = tag,
                                       .fingerprint = fingerprint("used parameters")}));
  }
  pending_reduce_ = std::move(pending);
  return absl::OkStatus();
}

// Note [parameters no rank used]
// A parameter that got no gradient on a rank goes into the reduce_scatter as zeros: another rank may have used it,
// and the average is then right. But when no rank used it, single-rank training leaves its gradient undefined and
// the optimizer skips it, where a zero gradient would still move it (weight decay, Adam's moments, momentum): a
// helper's audit found FSDP stepping such a parameter (tests/fsdp/fsdp_combo_test.cc, a head used in some steps
// only; sddp/reducer.cc has the same Note for DDP and ShardedDDP). FSDP2 reduces only the gradients that exist. So
// each reduction also all-reduces (max) one flag per parameter, "had a gradient here", over the shard group (and
// over the replicas under HSDP, accumulated with the rows when their all-reduce is deferred), issued after the
// reduce_scatters; a parameter whose shard has no gradient yet and that no rank used gets none. One where a
// gradient is accumulating keeps adding zeros, which changes nothing.

absl::Status ParamGroup::finish_reduce_grads() {
  if (!pending_reduce_) return absl::OkStatus();
  PendingReduce pending = std::move(*pending_reduce_);
  pending_reduce_.reset();
  absl::Status wst;
  for (const std::shared_ptr<comm::Work>& w : pending.works) {
    if (absl::Status st = w->wait(); wst.ok()) wst = st;
  }
  if (!wst.ok()) return wst;
  std::vector<char> used = comm::read_flags(pending.used);  // Note [parameters no rank used]
  // The reduced rows land f32 (Note [mixed precision on f32 ops]).
  Tensor out = pending.out.dtype() == DType::f32 ? pending.out : pending.out.to(DType::f32, MemoryCategory::gradient);
  pending.out = Tensor();
  if (replicate_ != nullptr) {  // Note [hybrid sharding]
    if (!partial_used_.empty()) {
      for (std::size_t i = 0; i < used.size(); ++i) used[i] = used[i] || partial_used_[i];
    }
    if (partial_.defined() && partial_offsets_ != pending.layout.offsets) {  // Note [frozen parameters are not reduced]
      partial_ = Tensor();
      partial_used_.clear();
      return absl::FailedPreconditionError(absl::StrCat(
          "fsdp: a parameter of ", name_, " was frozen or unfrozen between two backwards whose gradients wait for one "
          "all-reduce across the replicas (set_requires_all_reduce(false)); the gradients kept so far are dropped. "
          "Change requires_grad between steps"));
    }
    if (!pending.all_reduce_replicas) {
      if (partial_.defined()) {
        kernels::add(partial_, out, partial_);
      } else {
        partial_ = out;
        partial_offsets_ = pending.layout.offsets;
      }
      partial_used_ = std::move(used);
      return absl::OkStatus();
    }
    partial_used_.clear();
    if (partial_.defined()) {
      kernels::add(out, partial_, out);
      partial_ = Tensor();
    }
    if (replicate_->size() > 1) {  // the flags over the replicas too
      const Tensor flags = comm::flags_tensor(used, device_, DType::f32);
      const std::string tag = absl::StrCat("fsdp used parameters (replicas) ", name_);
      const comm::AllReduceOptions o{.op = comm::ReduceOp::max(), .timeout = timeout(), .tag = tag,
                                     .fingerprint = fingerprint("used parameters (replicas)")};
      if (absl::Status st = replicate_->all_reduce(flags, o)->wait(); !st.ok()) {
        return st;
      }
      used = comm::read_flags(flags);
    }
    const comm::ReduceOp op = pending.divide_factor ? comm::ReduceOp::sum() : comm::ReduceOp::avg();
    if (absl::Status st = replicate_->all_reduce(out, {.op = op, .timeout = timeout(),
                                                       .tag = absl::StrCat("fsdp all_reduce (replicas) ", name_),
                                                       .fingerprint = fingerprint("all_reduce (replicas)")})
                              ->wait();
        !st.ok()) {
      return st;
    }
  }
  if (pending.divide_factor) {
    kernels::scale(static_cast<float>(1.0 / *pending.divide_factor), out, out);
  }
  if (offload_) out = out.to(Device::cpu(), MemoryCategory::gradient);  // Note [cpu offload]
  for (std::size_t i = 0; i < params_.size(); ++i) {
    FSDPParam& p = params_[i];
    const std::int64_t offset = pending.layout.offsets[i];
    // Frozen when the reduce started: not reduced. Frozen since (between the backward and its wait): no gradient.
    if (offset < 0 || !trains(p)) continue;
    const Tensor mine = out.view(offset, p.local_shape);
    if (const Tensor acc = p.sharded.grad(); acc.defined()) {  // accumulation over several backwards
      kernels::add(acc, mine, acc);
    } else if (used[i]) {
      p.sharded.set_grad(mine);
    } else {
      continue;  // no rank used it: no gradient, as on one rank (Note [parameters no rank used])
    }
    stale_ = stale_ || unsharded_;  // Note [kept after backward, stale after a step]
  }
  return absl::OkStatus();
}

}  // namespace shardkit::fsdp
