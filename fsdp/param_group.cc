#include "fsdp/param_group.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/nn/deferred_init.h"
#include "common/tensor/storage.h"

namespace shardkit::fsdp {
namespace {

Shape local_shape_of(const Shape& global, std::int64_t local_rows) {
  if (global.empty()) return local_rows == 1 ? Shape{} : Shape{0};
  Shape s = global;
  s[0] = local_rows;
  return s;
}

// Copies `rows` rows of `row_numel` f32 elements.
void copy_rows(float* dst, const float* src, std::int64_t rows, std::int64_t row_numel) {
  if (rows > 0 && row_numel > 0) std::memcpy(dst, src, static_cast<std::size_t>(rows * row_numel) * sizeof(float));
}

// Copies `rows` rows of `row_numel` elements of dtype `src_dtype` at `src` into f32 `dst`.
void copy_rows_to_f32(float* dst, const char* src, DType src_dtype, std::int64_t rows, std::int64_t row_numel) {
  if (src_dtype == DType::f32) return copy_rows(dst, reinterpret_cast<const float*>(src), rows, row_numel);
  if (rows > 0 && row_numel > 0) convert_elements(src, src_dtype, dst, DType::f32, rows * row_numel);
}

// acc += x (f32, same numel).
void add_into(const Tensor& acc, const Tensor& x) {
  float* a = acc.data<float>();
  const float* o = x.data<float>();
  for (std::int64_t k = 0; k < acc.numel(); ++k) a[k] += o[k];
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

ParamGroup::ParamGroup(std::string name, std::vector<FSDPParam> params, std::shared_ptr<comm::ProcessGroup> group,
                       std::shared_ptr<comm::ProcessGroup> replicate, std::optional<absl::Duration> timeout,
                       MixedPrecisionPolicy mp)
    : name_(std::move(name)),
      params_(std::move(params)),
      pg_(std::move(group)),
      replicate_(std::move(replicate)),
      timeout_(timeout),
      mp_(mp) {
  const int rank = pg_->rank(), world = pg_->size();
  std::int64_t s = 0;
  for (FSDPParam& p : params_) {
    p.split = split_rows(p.global_shape, rank, world);
    p.local_shape = local_shape_of(p.global_shape, p.split.local_rows);
    p.shard_offset = s;
    s += p.padded_numel();
  }
  const TensorOptions param_opts = TensorOptions{}.with_category(MemoryCategory::parameter);
  shard_ = Tensor::zeros({s}, param_opts);
  float* shard = shard_.data<float>();
  // The unsharded parameters are views of one buffer per unit (one allocation per unshard, released at rest).
  std::int64_t full_numel = 0;
  for (const FSDPParam& p : params_) full_numel += shape_numel(p.global_shape);
  full_ = Tensor::over(Storage::allocate_released(static_cast<std::size_t>(full_numel) * sizeof(float), Device::cpu(),
                                                  MemoryCategory::parameter),
                       0, {full_numel}, DType::f32);  // released: no bytes until the first unshard
  std::int64_t full_offset = 0;
  nn::DeferredInit* deferred = nn::current_deferred_init();
  for (FSDPParam& p : params_) {
    const Tensor& full = p.registrations.front().first->parameter(p.registrations.front().second);
    SK_CHECK(full.shape() == p.global_shape && full.dtype() == DType::f32) << "fsdp: " << full.describe();
    // Note [deferred init under fully_shard]: a parameter built without storage is materialised here, its rows
    // copied and its bytes released at once, so construction never holds more than the shards and one parameter.
    const bool was_deferred = deferred != nullptr && deferred->is_deferred(full);
    if (was_deferred) deferred->materialize(full);
    copy_rows(shard + p.shard_offset, full.data<float>() + p.split.row_offset * p.split.row_numel, p.split.local_rows,
              p.split.row_numel);
    if (was_deferred && full.nbytes() > 0) full.release_storage();
    p.sharded = shard_.view(p.shard_offset, p.local_shape);
    p.sharded.set_requires_grad(true);
    p.unsharded = full_.view(full_offset, p.global_shape);
    full_offset += p.unsharded.numel();
    p.unsharded.set_requires_grad(true);
    p.register_as(p.sharded);
  }
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
  kshard_ = Tensor::zeros({s}, TensorOptions{}.with_category(MemoryCategory::parameter));
  kshard_.release_storage();
  return absl::OkStatus();
}

void ParamGroup::reshard_to_group() {
  SK_CHECK(k_ > 0 && unsharded_) << "fsdp: reshard_to_group on " << name_;
  kshard_.reallocate_storage();
  float* out = kshard_.data<float>();
  const int i = kgroup_->rank();
  for (std::size_t j = 0; j < params_.size(); ++j) {
    const FSDPParam& p = params_[j];
    const RowSplit rs = split_rows(p.global_shape, i, k_);
    float* dst = out + k_offsets_[j];
    std::memset(dst, 0, static_cast<std::size_t>(rs.rows_per_rank * rs.row_numel) * sizeof(float));
    copy_rows(dst, p.unsharded.data<float>() + rs.row_offset * rs.row_numel, rs.local_rows, rs.row_numel);
  }
  for (FSDPParam& p : params_) p.register_as(p.sharded);
  k_exact_ = unsharded_exact();
  full_.release_storage();
  unsharded_ = false;
  k_resharded_ = true;
}

absl::StatusOr<ParamGroup::UnshardHandle> ParamGroup::unshard_async(bool exact) {
  UnshardHandle h;
  if (unsharded_) return h;
  h.group_ = this;
  if (k_resharded_) {  // Note [reshard to a k-group]: gather within the k-group
    h.gathered_ = Tensor::empty({kshard_.numel() * k_}, TensorOptions{}.with_category(MemoryCategory::communication_buffer));
    h.work_ = kgroup_->all_gather(h.gathered_, kshard_, {.timeout = timeout(), .tag = absl::StrCat("fsdp unshard (k-group) ", name_)});
    return h;
  }
  const DType dtype = exact ? DType::f32 : mp_.compute_dtype();
  h.gathered_ = Tensor::empty({shard_.numel() * pg_->size()},
                              TensorOptions{}.with_category(MemoryCategory::communication_buffer).with_dtype(dtype));
  // param_dtype: the shard cast for the all-gather (its Work holds the cast until the peers have read it).
  const Tensor send = dtype == DType::f32 ? shard_ : shard_.to(dtype, MemoryCategory::communication_buffer);
  h.work_ = pg_->all_gather(h.gathered_, send, {.timeout = timeout(), .tag = absl::StrCat("fsdp unshard ", name_)});
  return h;
}

absl::Status ParamGroup::UnshardHandle::wait() {
  if (group_ == nullptr) return absl::OkStatus();
  ParamGroup* g = group_;
  group_ = nullptr;
  absl::Status s = work_->wait();
  work_.reset();
  Tensor gathered = std::move(gathered_);
  if (!s.ok()) return s;
  return g->finish_unshard(gathered);
}

absl::Status ParamGroup::finish_unshard(const Tensor& gathered) {
  // From the k-group's k-shards (Note [reshard to a k-group]) or from every rank's shard.
  const bool from_k = k_resharded_;
  const std::int64_t s = from_k ? kshard_.numel() : shard_.numel();
  const int parts = from_k ? k_ : pg_->size();
  const char* in = static_cast<const char*>(gathered.raw_data());
  const DType in_dtype = gathered.dtype();
  const std::int64_t es = static_cast<std::int64_t>(dtype_size(in_dtype));
  const bool exact = from_k ? k_exact_ : in_dtype == DType::f32;
  full_.reallocate_storage();
  for (std::size_t j = 0; j < params_.size(); ++j) {
    FSDPParam& p = params_[j];
    p.unsharded.set_requires_grad(p.sharded.requires_grad());  // frozen after fully_shard: no gradient
    float* out = p.unsharded.data<float>();
    const std::int64_t offset = from_k ? k_offsets_[j] : p.shard_offset;
    for (int r = 0; r < parts; ++r) {
      const RowSplit rs = split_rows(p.global_shape, r, parts);
      copy_rows_to_f32(out + rs.row_offset * rs.row_numel, in + (r * s + offset) * es, in_dtype, rs.local_rows,
                       rs.row_numel);
    }
    p.unsharded_exact = exact;
    p.register_as(p.unsharded);
  }
  if (from_k) {
    kshard_.release_storage();
    k_resharded_ = false;
  }
  unsharded_ = true;
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
  if (!unsharded_) return;
  for (FSDPParam& p : params_) p.register_as(p.sharded);
  full_.release_storage();
  unsharded_ = false;
}

void ParamGroup::write_back() {
  if (!unsharded_ || !unsharded_exact()) return;
  for (FSDPParam& p : params_) {
    copy_rows(p.sharded.data<float>(), p.unsharded.data<float>() + p.split.row_offset * p.split.row_numel,
              p.split.local_rows, p.split.row_numel);
  }
}

bool ParamGroup::has_unsharded_grads() const {
  for (const FSDPParam& p : params_) {
    if (p.unsharded.grad().defined()) return true;
  }
  return false;
}

void ParamGroup::drop_unsharded_grads() {
  for (const FSDPParam& p : params_) p.unsharded.set_grad(Tensor());
  pending_reduce_.reset();  // its Work keeps the buffers until the peers are done
}

absl::Status ParamGroup::reduce_grads(std::optional<double> divide_factor) {
  if (absl::Status st = start_reduce_grads(divide_factor); !st.ok()) return st;
  return finish_reduce_grads();
}

absl::Status ParamGroup::start_reduce_grads(std::optional<double> divide_factor, bool all_reduce_replicas) {
  if (absl::Status st = finish_reduce_grads(); !st.ok()) return st;
  const std::int64_t s = shard_.numel();
  const int world = pg_->size();
  // Every element is written once: a gradient's rows (cast to reduce_dtype), or zeros (padding, parameters without
  // a gradient).
  const DType rd = mp_.reduce_in();
  const std::int64_t es = static_cast<std::int64_t>(dtype_size(rd));
  Tensor flat = Tensor::empty({s * world}, TensorOptions{}.with_category(MemoryCategory::communication_buffer).with_dtype(rd));
  char* in = static_cast<char*>(flat.raw_data());
  for (FSDPParam& p : params_) {
    const Tensor g = p.unsharded.grad();
    SK_CHECK(!g.defined() || (g.dtype() == DType::f32 && g.numel() == p.unsharded.numel())) << "fsdp: gradient " << g.describe();
    for (int r = 0; r < world; ++r) {
      const RowSplit rs = split_rows(p.global_shape, r, world);
      char* dst = in + (r * s + p.shard_offset) * es;
      const std::int64_t filled = g.defined() ? rs.local_rows * rs.row_numel : 0;
      if (filled > 0) convert_elements(g.data<float>() + rs.row_offset * rs.row_numel, DType::f32, dst, rd, filled);
      std::memset(dst + filled * es, 0, static_cast<std::size_t>((p.padded_numel() - filled) * es));  // +0 in every dtype
    }
    if (g.defined()) p.unsharded.set_grad(Tensor());  // the full gradient is released once it is in the buffer
  }
  PendingReduce pending;
  pending.out = Tensor::empty({s}, TensorOptions{}.with_category(MemoryCategory::gradient).with_dtype(rd));
  pending.divide_factor = divide_factor;
  pending.all_reduce_replicas = all_reduce_replicas;
  const comm::ReduceOp op = divide_factor ? comm::ReduceOp::sum() : comm::ReduceOp::avg();
  // The Work holds `flat` until the peers are done with it; this rank drops it here.
  pending.work = pg_->reduce_scatter(pending.out, flat,
                                     {.op = op, .timeout = timeout(), .tag = absl::StrCat("fsdp reduce_scatter ", name_)});
  pending_reduce_ = std::move(pending);
  return absl::OkStatus();
}

absl::Status ParamGroup::finish_reduce_grads() {
  if (!pending_reduce_) return absl::OkStatus();
  PendingReduce pending = std::move(*pending_reduce_);
  pending_reduce_.reset();
  if (absl::Status st = pending.work->wait(); !st.ok()) return st;
  // The reduced rows land f32 (Note [mixed precision on f32 ops]).
  const Tensor out = pending.out.dtype() == DType::f32 ? pending.out : pending.out.to(DType::f32, MemoryCategory::gradient);
  pending.out = Tensor();
  if (replicate_ != nullptr) {  // Note [hybrid sharding]
    if (!pending.all_reduce_replicas) {
      if (partial_.defined()) {
        add_into(partial_, out);
      } else {
        partial_ = out;
      }
      return absl::OkStatus();
    }
    if (partial_.defined()) {
      add_into(out, partial_);
      partial_ = Tensor();
    }
    const comm::ReduceOp op = pending.divide_factor ? comm::ReduceOp::sum() : comm::ReduceOp::avg();
    if (absl::Status st = replicate_->all_reduce(out, {.op = op, .timeout = timeout(),
                                                       .tag = absl::StrCat("fsdp all_reduce (replicas) ", name_)})
                              ->wait();
        !st.ok()) {
      return st;
    }
  }
  if (pending.divide_factor) {
    float* o = out.data<float>();
    const float inv = static_cast<float>(1.0 / *pending.divide_factor);
    for (std::int64_t k = 0; k < out.numel(); ++k) o[k] *= inv;
  }
  for (FSDPParam& p : params_) {
    if (!p.sharded.requires_grad()) continue;  // frozen: the optimizer must not step it
    const Tensor mine = out.view(p.shard_offset, p.local_shape);
    if (const Tensor acc = p.sharded.grad(); acc.defined()) {  // accumulation over several backwards
      add_into(acc, mine);
    } else {
      p.sharded.set_grad(mine);
    }
  }
  return absl::OkStatus();
}

}  // namespace shardkit::fsdp
