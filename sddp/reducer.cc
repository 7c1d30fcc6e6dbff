#include "sddp/reducer.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/autograd/engine.h"
#include "common/autograd/hooks.h"
#include "common/base/logging.h"
#include "common/comm/any_flags.h"
#include "common/comm/host_staged.h"
#include "common/kernels/elementwise.h"
#include "common/tensor/rank_context.h"

namespace shardkit::sddp {
namespace {

// dst = scale * src, converting dtypes (f32 / bf16 / f16). The 1/world scale fused into the bucket copy.
void scaled_copy(const Tensor& src, const Tensor& dst, float scale) {
  if (scale == 1.0f) {
    dst.copy_(src);
    return;
  }
  if (src.dtype() == DType::f32 && dst.dtype() == DType::f32) {
    kernels::scale(scale, src, dst);  // any device
    return;
  }
  if (dst.device().is_cuda()) {  // convert, then scale in fp32 on the device
    if (dst.dtype() == DType::f32) {
      dst.copy_(src);
      kernels::scale(scale, dst, dst);
    } else {
      const Tensor tmp = Tensor::empty(src.shape(), TensorOptions{}.with_device(dst.device()));
      tmp.copy_(src);
      kernels::scale(scale, tmp, tmp);
      dst.copy_(tmp);
    }
    return;
  }
  constexpr std::int64_t kChunk = 2048;
  float tmp[kChunk];
  const auto* s = static_cast<const char*>(src.raw_data());
  auto* d = static_cast<char*>(dst.raw_data());
  for (std::int64_t i = 0; i < src.numel(); i += kChunk) {
    const std::int64_t n = std::min(kChunk, src.numel() - i);
    convert_elements(s + i * static_cast<std::int64_t>(src.element_size()), src.dtype(), tmp, DType::f32, n);
    for (std::int64_t k = 0; k < n; ++k) tmp[k] *= scale;
    convert_elements(tmp, DType::f32, d + i * static_cast<std::int64_t>(dst.element_size()), dst.dtype(), n);
  }
}

Tensor flat_view(const Tensor& t, std::int64_t offset, std::int64_t length) { return t.view(offset, {length}); }

}  // namespace

// Note [reducer lifecycle]
// Per synchronised backward: the first mark_ready() resets the per-backward state (pending counts, ready
// flags) and queues finalize() as the backward's final callback. Hooks copy gradients in and launch buckets
// in order; finalize() treats parameters that got no gradient as ready (every rank must issue every
// bucket), launches the rest, waits for everything, delivers owned slices and, the first time, rebuilds
// the buckets in the observed ready order (agreed with rank 0). If anything throws, the per-backward state
// is reset so the next backward starts clean (the failed backward's callback does not run: the engine drops
// its queue).
//
// Owned slices (flat strategies): each backward allocates them afresh (finish() at a bucket's first output
// for the piece), fills every element (the columns / owner buckets cover each trainable piece, and a
// parameter that got no gradient contributes zeros), and deliver_pieces() hands them over and forgets them
// (Note [delivered gradient slices] in oss/oss.h). So between backwards the reducer holds no gradient, and
// nothing delivered in one backward can be delivered again in a later one.

Reducer::Reducer(ReduceStrategy strategy, std::vector<ReducerParam> params, std::vector<oss::FlatChunk> spaces,
                 std::vector<FlatPiece> pieces, std::shared_ptr<comm::ProcessGroup> group, ReducerOptions options)
    : strategy_(strategy),
      params_(std::move(params)),
      spaces_(std::move(spaces)),
      pieces_(std::move(pieces)),
      pg_(std::move(group)),
      options_(options) {
  rank_ = pg_->rank();
  world_ = pg_->size();
  if (!params_.empty()) device_ = params_[0].param.device();
  for (const ReducerParam& p : params_) {
    SK_CHECK(p.param.device() == device_) << "the reducer's parameters are on different devices: " << p.name << " is "
                                          << p.param.describe() << ", " << params_[0].name << " is on "
                                          << device_.str();
  }
  piece_grads_.resize(pieces_.size());
  for (const FlatPiece& fp : pieces_) {
    int owner = -1;
    for (std::size_t i = 0; i < params_.size() && owner < 0; ++i) {
      const ReducerParam& rp = params_[i];
      if (rp.space == fp.space && rp.flat_offset <= fp.flat_offset &&
          fp.flat_offset + fp.length <= rp.flat_offset + rp.param.numel()) {
        owner = static_cast<int>(i);
      }
    }
    SK_CHECK_GE(owner, 0) << "a flat piece at " << fp.flat_offset << " of space " << fp.space
                          << " is not a slice of one parameter";
    piece_param_.push_back(owner);
  }
  std::vector<int> order(params_.size());
  std::iota(order.begin(), order.end(), 0);
  std::reverse(order.begin(), order.end());  // expected ready order before anything is observed
  build_buckets(order);
  for (std::size_t i = 0; i < params_.size(); ++i) {
    SK_CHECK(params_[i].param.requires_grad()) << params_[i].name << " is not trainable";
    hooks_.push_back(autograd::register_post_accumulate_grad_hook(
        params_[i].param, [this, i](const Tensor&) { mark_ready(static_cast<int>(i)); }));
  }
}

Reducer::~Reducer() = default;

absl::Duration Reducer::timeout() const { return options_.timeout.value_or(pg_->default_timeout()); }

void Reducer::build_buckets(const std::vector<int>& order) {
  const std::size_t n = params_.size();
  buckets_.clear();
  slots_.assign(n, ParamSlot{});
  std::vector<int> position(n, 0);
  for (std::size_t i = 0; i < order.size(); ++i) position[static_cast<std::size_t>(order[i])] = static_cast<int>(i);
  auto wire_dtype = [&](DType d) { return options_.reduce_dtype.value_or(d); };

  if (strategy_ == ReduceStrategy::flat_reduce_to_owner) {
    build_flat_owner_buckets(position);
    return;
  }
  if (strategy_ != ReduceStrategy::reduce_scatter) {
    std::vector<std::int64_t> numel(n);
    std::vector<int> key(n);
    for (std::size_t i = 0; i < n; ++i) {
      numel[i] = params_[i].param.numel();
      const int owner = strategy_ == ReduceStrategy::reduce_to_owner ? params_[i].owner : 0;
      key[i] = owner * 8 + static_cast<int>(params_[i].param.dtype());
      slots_[i].owned = strategy_ == ReduceStrategy::all_reduce || owner == rank_;
    }
    for (const auto& members : assign_buckets(order, numel, key, options_.bucket_numel)) {
      Bucket b;
      const Tensor& first = params_[static_cast<std::size_t>(members[0])].param;
      b.dtype = wire_dtype(first.dtype());
      b.root = strategy_ == ReduceStrategy::reduce_to_owner ? params_[static_cast<std::size_t>(members[0])].owner : 0;
      b.in_place = members.size() == 1 && b.dtype == first.dtype() && first.dtype() == DType::f32;
      for (int p : members) {
        const std::int64_t len = params_[static_cast<std::size_t>(p)].param.numel();
        slots_[static_cast<std::size_t>(p)].entries.emplace_back(static_cast<int>(buckets_.size()),
                                                                 static_cast<int>(b.entries.size()));
        b.entries.push_back({p, 0, b.numel, len});
        b.numel += len;
      }
      b.expected = static_cast<int>(b.entries.size());
      buckets_.push_back(std::move(b));
    }
    return;
  }

  // reduce_scatter: column buckets over every flat space.
  // ceil: a chunk of bucket_numel elements (the recommended OssOptions::flat_chunk_numel) is one column.
  const std::int64_t width = options_.bucket_numel <= 0 ? 0 : (options_.bucket_numel + world_ - 1) / world_;
  std::vector<Column> columns;
  for (std::size_t s = 0; s < spaces_.size(); ++s) {
    std::vector<FlatMember> members;
    for (std::size_t i = 0; i < n; ++i) {
      if (params_[i].space == static_cast<int>(s)) {
        members.push_back({static_cast<int>(i), params_[i].flat_offset, params_[i].param.numel()});
      }
    }
    std::sort(members.begin(), members.end(),
              [](const FlatMember& a, const FlatMember& b) { return a.flat_offset < b.flat_offset; });
    for (Column& c : assign_columns(static_cast<int>(s), spaces_[s], members, world_, width)) {
      if (!c.pieces.empty()) columns.push_back(std::move(c));
    }
  }
  std::vector<std::vector<int>> col_params;
  for (const Column& c : columns) {
    std::vector<int> ps;
    for (const ColumnPiece& p : c.pieces) ps.push_back(p.param);
    col_params.push_back(std::move(ps));
  }
  for (std::size_t i = 0; i < n; ++i) slots_[i].owned = false;
  for (const int ci : launch_order(col_params, position)) {
    const Column& c = columns[static_cast<std::size_t>(ci)];
    Bucket b;
    b.width = c.width;
    b.numel = c.width * world_;
    b.dtype = wire_dtype(params_[static_cast<std::size_t>(c.pieces[0].param)].param.dtype());
    std::int64_t covered = 0;
    for (const ColumnPiece& p : c.pieces) {
      slots_[static_cast<std::size_t>(p.param)].entries.emplace_back(static_cast<int>(buckets_.size()),
                                                                     static_cast<int>(b.entries.size()));
      b.entries.push_back({p.param, p.param_offset, p.rank * c.width + p.segment_offset, p.length});
      covered += p.length;
    }
    b.has_gaps = covered != b.numel;
    b.expected = static_cast<int>(b.entries.size());
    // Where this rank's output lands in its owned pieces.
    const oss::FlatChunk& g = spaces_[static_cast<std::size_t>(c.space)];
    const std::int64_t lo = g.begin(rank_) + c.offset;
    add_outs(b, c.space, lo, std::min(lo + c.width, g.end(rank_)), 0);
    buckets_.push_back(std::move(b));
  }
}

// Output elements [out_base, out_base + hi - lo) of bucket b hold flat elements [lo, hi) of `space`: record
// where they go in this rank's owned pieces.
void Reducer::add_outs(Bucket& b, int space, std::int64_t lo, std::int64_t hi, std::int64_t out_base) const {
  for (std::size_t k = 0; k < pieces_.size(); ++k) {
    const FlatPiece& fp = pieces_[k];
    if (fp.space != space) continue;
    const std::int64_t a = std::max(lo, fp.flat_offset), z = std::min(hi, fp.flat_offset + fp.length);
    if (a < z) b.outs.push_back({static_cast<int>(k), a - fp.flat_offset, out_base + a - lo, z - a});
  }
}

// flat_reduce_to_owner: every parameter is cut at the rank boundaries of its flat space into units with one
// owner each; units are bucketed like whole parameters (ready order, one owner per bucket) and each bucket is
// reduced to its owner, which copies the result into its owned pieces.
void Reducer::build_flat_owner_buckets(const std::vector<int>& position) {
  struct Unit {
    int param;
    std::int64_t offset, length;
    int owner;
  };
  std::vector<Unit> units;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const ReducerParam& rp = params_[i];
    const oss::FlatChunk& g = spaces_.at(static_cast<std::size_t>(rp.space));
    const std::int64_t fo = rp.flat_offset, fe = fo + rp.param.numel();
    for (int r = 0; r < world_; ++r) {
      const std::int64_t a = std::max(fo, g.begin(r)), z = std::min(fe, g.end(r));
      if (a < z) units.push_back({static_cast<int>(i), a - fo, z - a, r});
    }
    slots_[i].owned = false;
  }
  std::vector<int> order(units.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return position[static_cast<std::size_t>(units[static_cast<std::size_t>(a)].param)] <
           position[static_cast<std::size_t>(units[static_cast<std::size_t>(b)].param)];
  });
  std::vector<std::int64_t> numel;
  std::vector<int> key;
  for (const Unit& u : units) {
    numel.push_back(u.length);
    key.push_back(u.owner * 8 + static_cast<int>(params_[static_cast<std::size_t>(u.param)].param.dtype()));
  }
  for (const auto& members : assign_buckets(order, numel, key, options_.bucket_numel)) {
    Bucket b;
    const Unit& first = units[static_cast<std::size_t>(members[0])];
    b.root = first.owner;
    b.dtype = options_.reduce_dtype.value_or(params_[static_cast<std::size_t>(first.param)].param.dtype());
    for (int ui : members) {
      const Unit& u = units[static_cast<std::size_t>(ui)];
      const ReducerParam& rp = params_[static_cast<std::size_t>(u.param)];
      slots_[static_cast<std::size_t>(u.param)].entries.emplace_back(static_cast<int>(buckets_.size()),
                                                                     static_cast<int>(b.entries.size()));
      b.entries.push_back({u.param, u.offset, b.numel, u.length});
      if (b.root == rank_) add_outs(b, rp.space, rp.flat_offset + u.offset, rp.flat_offset + u.offset + u.length, b.numel);
      b.numel += u.length;
    }
    b.expected = static_cast<int>(b.entries.size());
    buckets_.push_back(std::move(b));
  }
}

std::vector<std::int64_t> Reducer::bucket_numels() const {
  std::vector<std::int64_t> out;
  for (const Bucket& b : buckets_) out.push_back(b.numel);
  return out;
}

std::vector<int> Reducer::bucket_params(std::size_t b) const {
  std::vector<int> out;
  for (const Entry& e : buckets_.at(b).entries) out.push_back(e.param);
  return out;
}

void Reducer::begin_backward() {
  if (options_.consumed_generation && reduced_at_generation_ == options_.consumed_generation()) {
    throw ReducerError(absl::FailedPreconditionError(
        "ShardedDataParallel: a second synchronised backward (or reduce()) before the optimizer's step() or "
        "zero_grad(): each rank keeps only its own share of the gradients it reduced, so a second reduction cannot "
        "add to them; accumulate over several backwards inside no_sync() for all but the last one"));
  }
  in_backward_ = true;
  ready_.assign(params_.size(), 0);
  had_grad_.assign(params_.size(), 0);
  observed_order_.clear();
  next_launch_ = 0;
  in_flight_.clear();
  launched_at_hook_.assign(buckets_.size(), -1);
  current_ = ReductionStats{};
  for (Tensor& t : piece_grads_) t = Tensor();  // what a failed backward left half filled
  for (Bucket& b : buckets_) {
    b.pending = b.expected;
    b.grad_bytes = 0;
  }
}

void Reducer::mark_ready(int index) {
  if (!sync_) return;
  try {
    if (!in_backward_) {
      begin_backward();
      autograd::queue_callback([this] {
        try {
          finalize();
        } catch (...) {
          in_backward_ = false;
          throw;
        }
      });
    }
    const auto i = static_cast<std::size_t>(index);
    SK_CHECK_LT(i, params_.size());
    if (ready_[i]) {
      throw ReducerError(absl::FailedPreconditionError(absl::StrCat(
          "gradient of parameter '", params_[i].name,
          "' marked ready twice in one backward: expected each gradient once per backward (a parameter reached "
          "through two backward passes before the reduction finished?)")));
    }
    ready_[i] = 1;
    ++current_.hooks;
    observed_order_.push_back(index);
    copy_in(index);
    launch_ready();
  } catch (...) {
    in_backward_ = false;
    throw;
  }
}

void Reducer::copy_in(int index) {
  const ReducerParam& rp = params_[static_cast<std::size_t>(index)];
  Tensor g = rp.param.grad();
  had_grad_[static_cast<std::size_t>(index)] = g.defined() ? 1 : 0;
  if (!g.defined()) {
    g = Tensor::zeros(rp.param.shape(), TensorOptions{}
                                            .with_dtype(rp.param.dtype())
                                            .with_device(device_)
                                            .with_category(MemoryCategory::gradient));
    rp.param.set_grad(g);
  }
  const float scale = 1.0f / static_cast<float>(world_);
  bool in_place = false;
  for (const auto& [bi, ei] : slots_[static_cast<std::size_t>(index)].entries) {
    Bucket& b = buckets_[static_cast<std::size_t>(bi)];
    const Entry& e = b.entries[static_cast<std::size_t>(ei)];
    if (b.in_place) {
      in_place = true;
      if (world_ > 1) kernels::scale(scale, g, g);
    } else {
      if (!b.buffer.defined()) {
        const TensorOptions o =
            TensorOptions{}.with_dtype(b.dtype).with_device(device_).with_category(MemoryCategory::communication_buffer);
        b.buffer = b.has_gaps ? Tensor::zeros({b.numel}, o) : Tensor::empty({b.numel}, o);
      }
      scaled_copy(flat_view(g, e.param_offset, e.length), flat_view(b.buffer, e.bucket_offset, e.length), scale);
    }
    b.grad_bytes += e.length * static_cast<std::int64_t>(g.element_size());
    SK_CHECK_GT(b.pending, 0);
    --b.pending;
  }
  // A gradient this rank does not keep is released as soon as its bucket holds it.
  if (!slots_[static_cast<std::size_t>(index)].owned && !in_place) rp.param.set_grad(Tensor());
}

void Reducer::launch_ready() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    launch(static_cast<int>(next_launch_++));
  }
}

void Reducer::launch(int bi) {
  Bucket& b = buckets_[static_cast<std::size_t>(bi)];
  const std::string tag = absl::StrCat("grad bucket ", bi);
  const Tensor t = b.in_place ? params_[static_cast<std::size_t>(b.entries[0].param)].param.grad() : b.buffer;
  switch (strategy_) {
    case ReduceStrategy::all_reduce:
      b.work = pg_->all_reduce(t, {.timeout = timeout(), .tag = tag});
      break;
    case ReduceStrategy::reduce_to_owner:
    case ReduceStrategy::flat_reduce_to_owner:
      b.work = pg_->reduce(t, {.root = b.root, .timeout = timeout(), .tag = tag});
      break;
    case ReduceStrategy::reduce_scatter:
      b.output = Tensor::empty({b.width}, TensorOptions{}.with_dtype(b.dtype).with_device(device_).with_category(
                                              MemoryCategory::communication_buffer));
      b.work = pg_->reduce_scatter(b.output, b.buffer, {.timeout = timeout(), .tag = tag});
      break;
  }
  launched_at_hook_[static_cast<std::size_t>(bi)] = current_.hooks;
  ++current_.buckets;
  current_.grad_bytes += b.grad_bytes;
  in_flight_.push_back(bi);
  while (static_cast<int>(in_flight_.size()) > std::max(1, options_.max_buckets_in_flight)) finish_oldest();
}

void Reducer::finish_oldest() {
  const int bi = in_flight_.front();
  in_flight_.erase(in_flight_.begin());
  finish(bi);
}

void Reducer::finish(int bi) {
  Bucket& b = buckets_[static_cast<std::size_t>(bi)];
  if (absl::Status s = b.work->wait(); !s.ok()) throw ReducerError(std::move(s));
  b.work.reset();
  const bool keep = strategy_ == ReduceStrategy::all_reduce ||
                    (strategy_ == ReduceStrategy::reduce_to_owner && b.root == rank_);
  if (is_flat(strategy_)) {
    const Tensor& src = strategy_ == ReduceStrategy::reduce_scatter ? b.output : b.buffer;
    for (const OutEntry& o : b.outs) {
      Tensor& pg = piece_grads_[static_cast<std::size_t>(o.piece)];
      if (!pg.defined()) {
        const FlatPiece& fp = pieces_[static_cast<std::size_t>(o.piece)];
        const DType d = params_[static_cast<std::size_t>(b.entries[0].param)].param.dtype();
        pg = Tensor::empty({fp.length},
                           TensorOptions{}.with_dtype(d).with_device(device_).with_category(MemoryCategory::gradient));
      }
      flat_view(pg, o.piece_offset, o.length).copy_(flat_view(src, o.out_offset, o.length));
    }
  } else if (keep) {
    if (!b.in_place) {
      for (const Entry& e : b.entries) {
        flat_view(params_[static_cast<std::size_t>(e.param)].param.grad(), e.param_offset, e.length)
            .copy_(flat_view(b.buffer, e.bucket_offset, e.length));
      }
    }
  } else if (b.in_place) {
    params_[static_cast<std::size_t>(b.entries[0].param)].param.set_grad(Tensor());
  }
  b.buffer = Tensor();
  b.output = Tensor();
}

void Reducer::finalize() {
  const std::int64_t hooks = current_.hooks;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!ready_[i]) {
      ready_[i] = 1;
      observed_order_.push_back(static_cast<int>(i));
      copy_in(static_cast<int>(i));
    }
  }
  current_.hooks = hooks + 1;  // launches from here on are not overlapped (see below)
  launch_ready();
  SK_CHECK_EQ(next_launch_, buckets_.size()) << "buckets left unlaunched";
  const absl::Time t0 = absl::Now();
  const std::vector<char> used = used_anywhere();  // issued after every bucket, waited for after them
  current_.final_wait = absl::Now() - t0;
  current_.hooks = hooks;
  // Overlapped: issued from a hook that was not the last one of the backward.
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    if (launched_at_hook_[b] >= 0 && launched_at_hook_[b] < hooks) current_.overlapped_bytes += buckets_[b].grad_bytes;
  }
  if (!is_flat(strategy_)) {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!used[i]) params_[i].param.set_grad(Tensor());  // the zeros it went in as (Note [parameters no rank used])
    }
  }
  deliver_pieces(used);
  if (options_.rebuild_buckets && !rebuilt_ && autograd::is_backward_running()) rebuild_from_observed();
  stats_ = current_;
  if (options_.consumed_generation) reduced_at_generation_ = options_.consumed_generation();
  in_backward_ = false;
}

// Note [parameters no rank used]
// Every rank issues every bucket, so a parameter that got no gradient on a rank goes in as zeros (copy_in): the
// others may have used it, and the average over ranks is then right. But when no rank used it, single-rank
// training leaves its gradient undefined and the optimizer skips it, where a zero gradient would still move it
// (weight decay, Adam's moments, momentum): a helper's audit found DDP, OSS + DDP and ShardedDDP stepping such a
// parameter (tests/sddp/sddp_combo_test.cc, a head used in some steps only). So after the last bucket each backward
// all-reduces (max) one flag per parameter, "had a gradient here" (accumulated over no_sync backwards too), and a
// parameter no rank used ends the backward without a gradient: the zeros it was given are dropped, and its flat
// pieces are not delivered. PyTorch's DDP does the same with find_unused_parameters (a globally unused parameter's
// grad is left untouched). The flags are one small collective per backward (a flag per parameter, in the reduce
// dtype, so mixed precision still halves every byte sent), issued after every bucket, so every rank issues the
// collectives in the same order; they travel on the parameters' device (NCCL moves only device tensors) and are read
// back on the host once the buckets are done.
std::vector<char> Reducer::used_anywhere() {
  std::shared_ptr<comm::Work> work;
  Tensor flags;
  if (world_ > 1 && !params_.empty()) {
    flags = comm::flags_tensor(had_grad_, device_, options_.reduce_dtype.value_or(DType::f32));
    work = pg_->all_reduce(flags, {.op = comm::ReduceOp::max(), .timeout = timeout(), .tag = "used parameters"});
  }
  while (!in_flight_.empty()) finish_oldest();
  if (work == nullptr) return had_grad_;
  if (absl::Status s = work->wait(); !s.ok()) throw ReducerError(std::move(s));
  return comm::read_flags(flags);
}

void Reducer::deliver_pieces(const std::vector<char>& used) {
  for (std::size_t k = 0; k < pieces_.size(); ++k) {
    Tensor grad = std::exchange(piece_grads_[k], Tensor());  // handed over: the receiver owns it
    if (!used[static_cast<std::size_t>(piece_param_[k])]) continue;  // Note [parameters no rank used]
    if (grad.defined() && pieces_[k].deliver) pieces_[k].deliver(grad);
  }
}

void Reducer::rebuild_from_observed() {
  rebuilt_ = true;
  const auto n = static_cast<std::int64_t>(params_.size());
  std::vector<std::int64_t> mine(observed_order_.begin(), observed_order_.end());
  Tensor t = Tensor::from_int64(mine, {n}, TensorOptions{}.with_category(MemoryCategory::other));
  if (absl::Status s = comm::broadcast_host(*pg_, t, {.root = 0, .timeout = timeout(), .tag = "ready order"}); !s.ok()) {
    throw ReducerError(std::move(s));
  }
  std::vector<int> order(static_cast<std::size_t>(n));
  bool same = true;
  for (std::int64_t i = 0; i < n; ++i) {
    order[static_cast<std::size_t>(i)] = static_cast<int>(t.data<std::int64_t>()[i]);
    same = same && order[static_cast<std::size_t>(i)] == observed_order_[static_cast<std::size_t>(i)];
  }
  if (!same) {
    SK_LOG(kWarning, "sddp reducer on rank ", rank_,
           ": gradient-ready order differs from rank 0's; buckets follow rank 0's order");
  }
  build_buckets(order);
}

absl::Status Reducer::reduce_now() {
  if (in_backward_ || autograd::is_backward_running()) {
    return absl::FailedPreconditionError("reduce(): expected no backward running, found one");
  }
  try {
    begin_backward();
    finalize();
  } catch (const ReducerError& e) {
    in_backward_ = false;
    return e.status();
  }
  return absl::OkStatus();
}

}  // namespace shardkit::sddp
