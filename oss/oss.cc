#include "oss/oss.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/base/logging.h"
#include "common/optim/clip_grad.h"
#include "oss/sharded_grad_norm.h"
#include "common/tensor/rank_context.h"

namespace shardkit::oss {

Oss::Oss(std::vector<optim::ParamGroup> groups, std::shared_ptr<comm::ProcessGroup> group, OssOptions options)
    : groups_(std::move(groups)), pg_(std::move(group)), options_(options) {}

Oss::~Oss() = default;

namespace {
// `device`: where every parameter must be (one CPU or CUDA device: the flat buffers and broadcast buckets hold
// parameters side by side); empty = the first parameter's.
absl::Status CheckParams(const std::vector<optim::ParamGroup>& groups, std::set<const TensorImpl*>& seen,
                         std::size_t first_group, std::optional<Device> device = std::nullopt) {
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (std::size_t i = 0; i < groups[g].params.size(); ++i) {
      const Tensor& p = groups[g].params[i];
      const std::string where = absl::StrCat("param group ", first_group + g, ", parameter ", i);
      if (!p.defined()) return absl::InvalidArgumentError(absl::StrCat(where, ": expected a tensor, found undefined"));
      if (!is_floating(p.dtype())) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": expected a floating-point tensor, found ", p.describe()));
      }
      if (!device) device = p.device();
      if (p.device() != *device) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": expected every parameter on one device, ",
                                                       device->str(), ", found ", p.describe()));
      }
      if (!seen.insert(p.id()).second) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": expected each parameter once, found a repeat"));
      }
    }
  }
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<std::unique_ptr<Oss>> Oss::create(std::vector<optim::ParamGroup> groups,
                                                 optim::OptimizerFactory factory,
                                                 std::shared_ptr<comm::ProcessGroup> group, OssOptions options) {
  if (group == nullptr) return absl::InvalidArgumentError("Oss: expected a process group, found null");
  if (options.bucket_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("Oss: expected bucket_bytes > 0, found ", options.bucket_bytes));
  }
  std::set<const TensorImpl*> seen;
  if (absl::Status s = CheckParams(groups, seen, 0); !s.ok()) return s;
  std::unique_ptr<Oss> oss(new Oss(std::move(groups), std::move(group), options));
  oss->partition();
  MemoryCategoryScope category(MemoryCategory::optimizer_state);
  absl::StatusOr<std::unique_ptr<optim::Optimizer>> inner = factory(oss->local_groups(0));
  if (!inner.ok()) return inner.status();
  oss->inner_ = std::move(*inner);
  oss->refresh_trainable();
  return oss;
}

// Computes the partition of every group, this rank's pieces and the tensors the inner optimizer steps.
// Groups already partitioned keep their pieces (add_param_group appends).
void Oss::partition() {
  GroupSizes sizes;
  for (const auto& g : groups_) {
    std::vector<std::int64_t> s;
    for (const Tensor& p : g.params) s.push_back(p.numel());
    sizes.push_back(std::move(s));
  }
  const int world = pg_->size(), rank = pg_->rank();
  first_index_.clear();
  std::int64_t next = 0;
  for (const auto& s : sizes) {
    first_index_.push_back(next);
    next += static_cast<std::int64_t>(s.size());
  }
  // Earlier groups keep their owners: greedy visits groups in order, and flat splits each group alone.
  const std::size_t done_groups = partitioned_groups_;
  std::vector<OwnedPiece> pieces;
  if (options_.policy == PartitionPolicy::greedy) {
    greedy_ = partition_greedy(sizes, world);
    for (std::size_t g = 0; g < sizes.size(); ++g) {
      for (int i : greedy_.owned(static_cast<int>(g), rank)) {
        pieces.push_back({static_cast<int>(g), i, first_index_[g] + i, 0, sizes[g][static_cast<std::size_t>(i)]});
      }
    }
  } else {
    flat_ = partition_flat(sizes, world, options_.flat_chunk_numel);
    for (const Slice& s : flat_.slices[static_cast<std::size_t>(rank)]) {
      pieces.push_back({s.group, s.param, first_index_[static_cast<std::size_t>(s.group)] + s.param, s.offset, s.length});
    }
  }
  if (options_.policy == PartitionPolicy::flat) {
    flat_buffers_.resize(sizes.size());
    for (std::size_t g = done_groups; g < sizes.size(); ++g) make_flat_buffer(g);
  }
  partitioned_groups_ = sizes.size();
  // Keep the existing pieces (and their shard tensors, which the inner optimizer holds) as they are.
  std::size_t keep = 0;
  while (keep < pieces.size() && static_cast<std::size_t>(pieces[keep].group) < done_groups) ++keep;
  SK_CHECK_EQ(keep, local_.size()) << "re-partitioning moved existing ownership";
  for (std::size_t k = keep; k < pieces.size(); ++k) {
    const OwnedPiece& piece = pieces[k];
    const Tensor& p = groups_[static_cast<std::size_t>(piece.group)].params[static_cast<std::size_t>(piece.param)];
    local_.push_back(piece);
    external_grad_.push_back(false);
    zero_grad_kept_.push_back(false);
    had_grad_.push_back(false);
    shards_.push_back(options_.policy == PartitionPolicy::greedy ? p : p.view(piece.offset, {piece.length}));
  }
}

// Moves group g's parameters into one buffer laid out as the group's flat index space, each chunk padded with
// zeros up to world · its shard size, when they share a dtype and no broadcast dtype is asked.
void Oss::make_flat_buffer(std::size_t g) {
  const auto& params = groups_[g].params;
  const int world = pg_->size();
  chunk_buffer_offset_.resize(flat_.chunks.size(), 0);
  std::int64_t padded = 0;
  for (std::size_t c = 0; c < flat_.chunks.size(); ++c) {
    if (static_cast<std::size_t>(flat_.chunks[c].group) != g) continue;
    chunk_buffer_offset_[c] = padded;
    padded += flat_.chunks[c].shard_size * world;
  }
  if (!options_.contiguous_flat || options_.broadcast_dtype || params.empty() || padded == 0) return;
  for (const Tensor& p : params) {
    if (p.dtype() != params.front().dtype()) return;
  }
  const MemoryCategory category = params.front().storage()->category();
  Tensor flat = Tensor::zeros(
      {padded},
      TensorOptions{}.with_dtype(params.front().dtype()).with_device(params.front().device()).with_category(category));
  std::int64_t flat_offset = 0;
  for (const Tensor& p : params) {
    const auto c = static_cast<std::size_t>(flat_.chunk_of(static_cast<int>(g), flat_offset));  // whole in it
    const Tensor home = flat.view(chunk_buffer_offset_[c] + flat_offset - flat_.chunks[c].base, p.shape());
    home.copy_(p);
    p.rebind(home);  // every handle of p now reads and writes the flat buffer
    flat_offset += p.numel();
  }
  flat_buffers_[g] = flat;
}

std::vector<optim::ParamGroup> Oss::local_groups(std::size_t first_group) const {
  std::vector<optim::ParamGroup> out;
  for (std::size_t g = first_group; g < groups_.size(); ++g) out.push_back({{}, groups_[g].hyper});
  for (std::size_t k = 0; k < local_.size(); ++k) {
    const auto g = static_cast<std::size_t>(local_[k].group);
    if (g >= first_group) out[g - first_group].params.push_back(shards_[k]);
  }
  return out;
}

absl::Status Oss::add_param_group(optim::ParamGroup group) {
  std::set<const TensorImpl*> seen;
  if (absl::Status s = CheckParams(groups_, seen, 0); !s.ok()) return s;
  std::optional<Device> device;
  for (const optim::ParamGroup& g : groups_) {
    if (!g.params.empty()) device = g.params.front().device();
  }
  if (absl::Status s = CheckParams({group}, seen, groups_.size(), device); !s.ok()) return s;
  const std::size_t g = groups_.size();
  groups_.push_back(std::move(group));
  partition();
  MemoryCategoryScope category(MemoryCategory::optimizer_state);
  absl::Status s = inner_->add_param_group(std::move(local_groups(g).front()));
  SK_CHECK(s.ok()) << "inner optimizer refused a checked group: " << s;
  refresh_trainable();
  return absl::OkStatus();
}

int Oss::owner(int group, int param) const {
  SK_CHECK(options_.policy == PartitionPolicy::greedy) << "owner() is for the greedy policy";
  return greedy_.owner.at(static_cast<std::size_t>(group)).at(static_cast<std::size_t>(param));
}

std::int64_t Oss::owned_numel() const {
  std::int64_t n = 0;
  for (const OwnedPiece& p : local_) n += p.length;
  return n;
}

std::int64_t Oss::global_index(int group, int param) const {
  return first_index_.at(static_cast<std::size_t>(group)) + param;
}

std::vector<bool> Oss::read_trainable() const {
  std::vector<bool> flags;
  for (const auto& g : groups_) {
    for (const Tensor& p : g.params) flags.push_back(p.requires_grad());
  }
  return flags;
}

void Oss::refresh_trainable() {
  trainable_ = read_trainable();
  if (options_.policy == PartitionPolicy::flat) {
    for (std::size_t k = 0; k < local_.size(); ++k) {
      shards_[k].set_requires_grad(trainable_[static_cast<std::size_t>(local_[k].index)]);
    }
  }
}

void Oss::zero_grad(bool set_to_none) {
  for (const auto& g : groups_) {
    for (const Tensor& p : g.params) {
      Tensor grad = p.grad();
      if (!grad.defined()) continue;
      if (set_to_none) {
        p.set_grad(Tensor());
      } else {
        grad.zero_();
      }
    }
  }
  if (options_.policy == PartitionPolicy::flat) {
    // Also the delivered slices, whatever set_to_none says (Note [delivered gradient slices]); a piece that held
    // a gradient keeps a zero one under set_to_none = false (Note [zero gradients of flat pieces]).
    for (std::size_t k = 0; k < local_.size(); ++k) {
      const bool holds = shards_[k].grad().defined() || external_grad_[k] || had_grad_[k];
      zero_grad_kept_[k] = !set_to_none && (zero_grad_kept_[k] || holds);
      had_grad_[k] = false;
      shards_[k].set_grad(Tensor());
    }
    external_grad_.assign(local_.size(), false);
  }
  ++grad_generation_;
}

std::vector<Tensor> Oss::step_gradients() const {
  std::vector<Tensor> out;
  for (std::size_t k = 0; k < local_.size(); ++k) {
    const OwnedPiece& piece = local_[k];
    if (options_.policy == PartitionPolicy::flat && external_grad_[k]) {
      out.push_back(shards_[k].grad());
      continue;
    }
    const Tensor grad =
        groups_[static_cast<std::size_t>(piece.group)].params[static_cast<std::size_t>(piece.param)].grad();
    if (!grad.defined()) continue;
    out.push_back(options_.policy == PartitionPolicy::greedy ? grad : grad.view(piece.offset, {piece.length}));
  }
  return out;
}

void Oss::set_piece_grad(std::size_t k, const Tensor& grad) {
  SK_CHECK(options_.policy == PartitionPolicy::flat) << "set_piece_grad is for the flat policy";
  SK_CHECK_LT(k, local_.size());
  SK_CHECK_EQ(grad.numel(), local_[k].length) << "gradient for owned piece " << k;
  shards_[k].set_grad(grad.reshape({local_[k].length}));
  external_grad_[k] = true;
}

// Note [zero gradients of flat pieces]
// zero_grad(set_to_none = false) keeps every gradient tensor and zeroes it, so on one rank a parameter that takes no
// part in the next backward still has a (zero) gradient and the optimizer still steps it (weight decay, moments).
// A flat piece's gradient is a delivered slice (dropped by zero_grad whatever set_to_none says, Note [delivered
// gradient slices]) or a view of its parameter's gradient, which ShardedDataParallel's flat strategies release
// after every backward: either way nothing would be left. So zero_grad(false) remembers each piece that held a
// gradient (zero_grad_kept_), and a step that finds such a piece with no gradient gives it zeros, as one rank
// would step them; zero_grad(true) forgets. A helper's audit found the difference (tests/sddp/sddp_combo2_test.cc).
void Oss::attach_shard_grads() {
  if (options_.policy != PartitionPolicy::flat) return;  // greedy shards are the parameters themselves
  for (std::size_t k = 0; k < local_.size(); ++k) {
    if (external_grad_[k]) continue;
    const OwnedPiece& piece = local_[k];
    const Tensor& p = groups_[static_cast<std::size_t>(piece.group)].params[static_cast<std::size_t>(piece.param)];
    const Tensor grad = p.grad();
    if (grad.defined()) {
      shards_[k].set_grad(grad.view(piece.offset, {piece.length}));
    } else if (zero_grad_kept_[k] && shards_[k].requires_grad()) {
      shards_[k].set_grad(Tensor::zeros({piece.length}, TensorOptions{}
                                                            .with_dtype(shards_[k].dtype())
                                                            .with_device(shards_[k].device())
                                                            .with_category(MemoryCategory::gradient)));
    } else {
      shards_[k].set_grad(Tensor());
    }
  }
}

absl::Status Oss::step() {
  if (read_trainable() != trainable_) {
    SK_LOG(kInfo, "Oss: the set of trainable parameters changed; refreshing");
    refresh_trainable();
  }
  for (std::size_t g = 0; g < groups_.size(); ++g) inner_->mutable_hyper(g) = groups_[g].hyper;
  attach_shard_grads();
  {
    MemoryCategoryScope category(MemoryCategory::optimizer_state);
    // A refused step (a hyper-parameter out of range, a released parameter) updates nothing and issues no
    // collective; the gradients stay for a retry.
    if (absl::Status s = inner_->step(); !s.ok()) return s;
  }
  external_grad_.assign(local_.size(), false);
  ++grad_generation_;
  if (options_.policy == PartitionPolicy::flat) {
    // The pieces' gradients are views of (or were handed in for) this step only: drop them, so they do not
    // keep last step's gradient buffers alive through the next backward. A delivered slice has no other
    // owner, so this frees it (Note [delivered gradient slices]).
    for (std::size_t k = 0; k < local_.size(); ++k) {
      had_grad_[k] = shards_[k].grad().defined();  // Note [zero gradients of flat pieces]
      shards_[k].set_grad(Tensor());
    }
  }
  return sync_params();
}

absl::StatusOr<double> Oss::clip_grad_norm(double max_norm, double norm_type) {
  if (!(max_norm > 0)) {  // zero, negative or NaN would zero, negate or NaN every gradient (as fsdp::clip_grad_norm)
    return absl::InvalidArgumentError(absl::StrCat("Oss::clip_grad_norm: expected max_norm > 0, found ", max_norm));
  }
  // The gradients the next step() uses: the shards' (views of the parameters' gradients, or the slices
  // handed over with set_piece_grad by ShardedDataParallel, whose full gradients are released).
  attach_shard_grads();
  absl::StatusOr<double> total =
      sharded_grad_norm(shards_, *pg_, norm_type, {.timeout = options_.timeout, .tag = "oss clip_grad_norm"});
  if (!total.ok()) return total.status();
  const double coef = optim::clip_coefficient(*total, max_norm);
  if (coef < 1.0 || std::isnan(coef)) {
    // Every gradient this rank holds: the parameters' (which the flat shards' views alias), and the slices
    // handed over with set_piece_grad, which alias nothing.
    std::vector<Tensor> all;
    for (const auto& g : groups_) all.insert(all.end(), g.params.begin(), g.params.end());
    for (std::size_t k = 0; k < local_.size(); ++k) {
      if (options_.policy == PartitionPolicy::flat && external_grad_[k]) all.push_back(shards_[k]);
    }
    optim::scale_grads(all, coef);
  }
  return *total;
}

absl::Duration Oss::timeout() const { return options_.timeout.value_or(pg_->default_timeout()); }

absl::Status Oss::wait_all(std::vector<std::shared_ptr<comm::Work>>& works) {
  absl::Status first;
  for (auto& w : works) {
    absl::Status s = w->wait(timeout());
    if (first.ok() && !s.ok()) first = s;
  }
  works.clear();
  return first;
}

}  // namespace shardkit::oss
