// Oss state: sharded state dicts, merging them, consolidation on one rank, and loading a full state at any
// world size.
//
// Note [OSS consolidation protocol]
// consolidate_state_dict(to) moves each other rank's ShardedStateDict to `to` point to point, one rank
// after the other, so `to` holds at most its own shard, one incoming shard and the result. A shard travels
// as three messages: an i64 header {number of i64 metadata words, number of f32 payload elements}, the i64
// metadata (per entry: global index, step, piece offset, piece length, number of tensors, then per tensor
// its key as length + characters), and one f32 payload with every state tensor's elements in order (not
// sent when empty).
#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/comm/host_staged.h"
#include "common/optim/state_dict_validation.h"
#include "common/tensor/rank_context.h"
#include "oss/oss.h"

namespace shardkit::oss {

ShardedStateDict Oss::sharded_state_dict() const {
  ShardedStateDict out;
  out.rank = pg_->rank();
  out.world = pg_->size();
  out.policy = options_.policy;
  for (const auto& g : groups_) {
    for (const Tensor& p : g.params) out.param_shapes.push_back(p.shape());
  }
  const optim::OptimizerStateDict local = inner_->state_dict();
  out.state.optimizer = local.optimizer;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    optim::ParamGroupState gs;
    gs.hyper = groups_[g].hyper;
    for (std::size_t i = 0; i < groups_[g].params.size(); ++i) gs.params.push_back(first_index_[g] + static_cast<std::int64_t>(i));
    out.state.param_groups.push_back(std::move(gs));
  }
  for (const auto& [local_index, st] : local.state) {
    const OwnedPiece& piece = local_.at(static_cast<std::size_t>(local_index));
    out.state.state[piece.index] = st;
  }
  for (const OwnedPiece& piece : local_) out.pieces[piece.index] = piece;
  return out;
}

absl::StatusOr<optim::OptimizerStateDict> merge_sharded_state_dicts(const std::vector<ShardedStateDict>& shards) {
  if (shards.empty()) return absl::InvalidArgumentError("merge: expected at least one shard, found none");
  const ShardedStateDict& first = shards.front();
  const int world = first.world;
  if (static_cast<int>(shards.size()) != world) {
    return absl::InvalidArgumentError(absl::StrCat("merge: expected ", world, " shards, found ", shards.size()));
  }
  std::vector<bool> seen(static_cast<std::size_t>(world), false);
  optim::OptimizerStateDict full;
  full.optimizer = first.state.optimizer;
  full.param_groups = first.state.param_groups;
  // Flat pieces: per global index, elements covered so far (checked against the parameter's numel).
  std::map<std::int64_t, std::int64_t> covered;
  for (const ShardedStateDict& sh : shards) {
    if (sh.world != world || sh.policy != first.policy || sh.param_shapes != first.param_shapes ||
        sh.state.optimizer != first.state.optimizer) {
      return absl::InvalidArgumentError(absl::StrCat("merge: shard of rank ", sh.rank,
                                                     " disagrees with rank ", first.rank,
                                                     " on world size, policy, optimizer or parameter shapes"));
    }
    if (sh.rank < 0 || sh.rank >= world || seen[static_cast<std::size_t>(sh.rank)]) {
      return absl::InvalidArgumentError(absl::StrCat("merge: expected one shard per rank 0..", world - 1,
                                                     ", found rank ", sh.rank, " twice or out of range"));
    }
    seen[static_cast<std::size_t>(sh.rank)] = true;
    for (const auto& [index, st] : sh.state.state) {
      if (index < 0 || index >= static_cast<std::int64_t>(first.param_shapes.size()) || !sh.pieces.count(index)) {
        return absl::InvalidArgumentError(absl::StrCat("merge: rank ", sh.rank, " has state for parameter ", index,
                                                       " that it does not own"));
      }
      const Shape& shape = first.param_shapes[static_cast<std::size_t>(index)];
      if (first.policy == PartitionPolicy::greedy) {
        if (full.state.count(index)) {
          return absl::InvalidArgumentError(absl::StrCat("merge: parameter ", index, " has state on two ranks"));
        }
        full.state[index] = st;
        continue;
      }
      const OwnedPiece& piece = sh.pieces.at(index);
      auto [it, inserted] = full.state.try_emplace(index);
      optim::ParamState& dst = it->second;
      if (inserted) {
        dst.step = st.step;
        for (const auto& [key, t] : st.tensors) dst.tensors[key] = Tensor::zeros(shape);
      } else if (dst.step != st.step || dst.tensors.size() != st.tensors.size()) {
        return absl::InvalidArgumentError(absl::StrCat("merge: parameter ", index,
                                                       " has pieces that disagree on step count or state keys"));
      }
      for (const auto& [key, t] : st.tensors) {
        auto d = dst.tensors.find(key);
        if (d == dst.tensors.end() || t.numel() != piece.length) {
          return absl::InvalidArgumentError(absl::StrCat("merge: parameter ", index, " state '", key,
                                                         "': expected a piece of ", piece.length,
                                                         " elements, found ", t.numel()));
        }
        d->second.view(piece.offset, {piece.length}).copy_(t);
      }
      covered[index] += piece.length;
    }
  }
  for (const auto& [index, n] : covered) {
    const std::int64_t want = shape_numel(first.param_shapes[static_cast<std::size_t>(index)]);
    if (n != want) {
      return absl::InvalidArgumentError(absl::StrCat("merge: parameter ", index, ": expected state for ", want,
                                                     " elements, found ", n));
    }
  }
  return full;
}

namespace {

// Flattens a shard into (metadata, payload) for the wire; see Note [OSS consolidation protocol].
void Encode(const ShardedStateDict& sh, std::vector<std::int64_t>& meta, std::vector<float>& payload) {
  for (const auto& [index, st] : sh.state.state) {
    const OwnedPiece& piece = sh.pieces.at(index);
    meta.insert(meta.end(), {index, st.step, piece.offset, piece.length, static_cast<std::int64_t>(st.tensors.size())});
    for (const auto& [key, t] : st.tensors) {
      meta.push_back(static_cast<std::int64_t>(key.size()));
      for (char c : key) meta.push_back(static_cast<unsigned char>(c));
      const std::vector<float> v = t.device().is_cpu() ? t.to_vector() : t.to(Device::cpu()).to_vector();
      payload.insert(payload.end(), v.begin(), v.end());
    }
  }
}

absl::StatusOr<ShardedStateDict> Decode(const ShardedStateDict& like, int rank, const std::vector<std::int64_t>& meta,
                                        const std::vector<float>& payload) {
  ShardedStateDict sh;
  sh.rank = rank;
  sh.world = like.world;
  sh.policy = like.policy;
  sh.param_shapes = like.param_shapes;
  sh.state.optimizer = like.state.optimizer;
  sh.state.param_groups = like.state.param_groups;
  std::size_t m = 0, f = 0;
  auto need = [&](std::size_t k) { return m + k <= meta.size(); };
  while (m < meta.size()) {
    if (!need(5)) return absl::DataLossError("consolidate: truncated metadata");
    OwnedPiece piece;
    piece.index = meta[m];
    optim::ParamState st;
    st.step = meta[m + 1];
    piece.offset = meta[m + 2];
    piece.length = meta[m + 3];
    const std::int64_t ntensors = meta[m + 4];
    m += 5;
    if (piece.index < 0 || piece.index >= static_cast<std::int64_t>(like.param_shapes.size())) {
      return absl::DataLossError("consolidate: parameter index out of range");
    }
    const Shape& shape = like.param_shapes[static_cast<std::size_t>(piece.index)];
    const Shape tshape = like.policy == PartitionPolicy::greedy ? shape : Shape{piece.length};
    const auto n = static_cast<std::size_t>(shape_numel(tshape));
    for (std::int64_t t = 0; t < ntensors; ++t) {
      if (!need(1) || !need(1 + static_cast<std::size_t>(meta[m]))) return absl::DataLossError("consolidate: truncated key");
      std::string key;
      for (std::int64_t c = 0; c < meta[m]; ++c) key.push_back(static_cast<char>(meta[m + 1 + static_cast<std::size_t>(c)]));
      m += 1 + static_cast<std::size_t>(meta[m]);
      if (f + n > payload.size()) return absl::DataLossError("consolidate: truncated payload");
      st.tensors[key] = Tensor::from_vector(std::vector<float>(payload.begin() + static_cast<std::ptrdiff_t>(f),
                                                               payload.begin() + static_cast<std::ptrdiff_t>(f + n)),
                                            tshape);
      f += n;
    }
    sh.pieces[piece.index] = piece;
    sh.state.state[piece.index] = std::move(st);
  }
  return sh;
}

}  // namespace

absl::Status Oss::consolidate_state_dict(int to_rank) {
  const int world = pg_->size(), rank = pg_->rank();
  if (to_rank < 0 || to_rank >= world) {
    return absl::InvalidArgumentError(absl::StrCat("consolidate_state_dict: expected a rank in [0, ", world,
                                                    "), found ", to_rank));
  }
  consolidated_.reset();
  ShardedStateDict mine = sharded_state_dict();
  const comm::P2POptions opts{.timeout = options_.timeout, .tag = "oss consolidate"};
  if (rank != to_rank) {
    std::vector<std::int64_t> meta;
    std::vector<float> payload;
    Encode(mine, meta, payload);
    // On the host, staged through the group's device when it moves only device tensors (NCCL): Note [host
    // tensors over device-only groups]. Each message is waited for before the next; `to` receives in this order.
    const Tensor header = Tensor::from_int64({static_cast<std::int64_t>(meta.size()),
                                              static_cast<std::int64_t>(payload.size())}, {2});
    if (absl::Status s = comm::send_host(*pg_, header, to_rank, opts, timeout()); !s.ok()) return s;
    if (!meta.empty()) {
      const Tensor meta_t = Tensor::from_int64(meta, {static_cast<std::int64_t>(meta.size())});
      if (absl::Status s = comm::send_host(*pg_, meta_t, to_rank, opts, timeout()); !s.ok()) return s;
    }
    if (!payload.empty()) {
      const Tensor payload_t = Tensor::from_vector(payload, {static_cast<std::int64_t>(payload.size())});
      if (absl::Status s = comm::send_host(*pg_, payload_t, to_rank, opts, timeout()); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  std::vector<ShardedStateDict> shards;
  for (int r = 0; r < world; ++r) {
    if (r == rank) {
      shards.push_back(mine);
      continue;
    }
    Tensor header = Tensor::zeros({2}, TensorOptions{}.with_dtype(DType::i64));
    if (absl::Status s = comm::recv_host(*pg_, header, r, opts, timeout()); !s.ok()) return s;
    const auto nmeta = static_cast<std::int64_t>(header.item_at(0));
    const auto npayload = static_cast<std::int64_t>(header.item_at(1));
    std::vector<std::int64_t> meta;
    std::vector<float> payload;
    if (nmeta > 0) {
      Tensor t = Tensor::zeros({nmeta}, TensorOptions{}.with_dtype(DType::i64));
      if (absl::Status s = comm::recv_host(*pg_, t, r, opts, timeout()); !s.ok()) return s;
      meta.assign(t.data<std::int64_t>(), t.data<std::int64_t>() + nmeta);
    }
    if (npayload > 0) {
      Tensor t = Tensor::zeros({npayload});
      if (absl::Status s = comm::recv_host(*pg_, t, r, opts, timeout()); !s.ok()) return s;
      payload = t.to_vector();
    }
    absl::StatusOr<ShardedStateDict> sh = Decode(mine, r, meta, payload);
    if (!sh.ok()) return sh.status();
    shards.push_back(std::move(*sh));
  }
  absl::StatusOr<optim::OptimizerStateDict> full = merge_sharded_state_dicts(shards);
  if (!full.ok()) return full.status();
  consolidated_ = std::move(*full);
  return absl::OkStatus();
}

absl::StatusOr<optim::OptimizerStateDict> Oss::state_dict() {
  if (!consolidated_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Oss::state_dict on rank ", pg_->rank(),
        ": expected a consolidated state on this rank, found none (call consolidate_state_dict(to_rank) on "
        "every rank first, and read it on to_rank)"));
  }
  optim::OptimizerStateDict out = std::move(*consolidated_);
  consolidated_.reset();
  return out;
}

absl::Status Oss::load_state_dict(const optim::OptimizerStateDict& full) {
  // 1. The checks every rank makes alike on the whole dict, before anything is re-sharded: the same as any
  //    optimizer over the global parameters would make (Note [state dict validation]).
  absl::Status local = [&]() -> absl::Status {
    if (absl::Status s = optim::validate_state_dict(full, *inner_, optim::param_layout(groups_)); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("load_state_dict: ", s.message()));
    }
    // 2. This rank's part, with local indices, loaded into the inner optimizer (which checks it again, over
    //    the shard's tensors, and is unchanged on error).
    optim::OptimizerStateDict mine;
    mine.optimizer = full.optimizer;
    std::int64_t next_local = 0;
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      optim::ParamGroupState gs;
      gs.hyper = full.param_groups[g].hyper;
      for (std::size_t k = 0; k < local_.size(); ++k) {
        if (static_cast<std::size_t>(local_[k].group) != g) continue;
        const OwnedPiece& piece = local_[k];
        const std::int64_t dict_index = full.param_groups[g].params[static_cast<std::size_t>(piece.param)];
        gs.params.push_back(next_local);
        auto st = full.state.find(dict_index);
        if (st != full.state.end()) {
          optim::ParamState ps;
          ps.step = st->second.step;
          for (const auto& [key, t] : st->second.tensors) {
            ps.tensors[key] = options_.policy == PartitionPolicy::greedy ? t : t.view(piece.offset, {piece.length});
          }
          mine.state[next_local] = std::move(ps);
        }
        ++next_local;
      }
      mine.param_groups.push_back(std::move(gs));
    }
    optim::OptimizerStateDict backup = inner_->state_dict();
    absl::Status s;
    {
      MemoryCategoryScope category(MemoryCategory::optimizer_state);
      s = inner_->load_state_dict(mine);
    }
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("load_state_dict: rank ", pg_->rank(), " rejected the state dict: ",
                                                 s.message(), " (parameter numbers are this rank's shard's)"));
    }
    backup_ = std::move(backup);
    return absl::OkStatus();
  }();
  // 3. Agree: the lowest rank that rejected the dict, or `world` when none did.
  const int world = pg_->size();
  Tensor verdict = Tensor::from_int64({local.ok() ? world : pg_->rank()}, {1});
  absl::Status agreed = comm::all_reduce_host(
      *pg_, verdict, {.op = comm::ReduceOp::min(), .timeout = options_.timeout, .tag = "oss load_state_dict"}, timeout());
  const int rejected_by = agreed.ok() ? static_cast<int>(verdict.item()) : -1;
  if (agreed.ok() && rejected_by == world) {
    for (std::size_t g = 0; g < groups_.size(); ++g) groups_[g].hyper = full.param_groups[g].hyper;
    backup_.reset();
    return absl::OkStatus();
  }
  if (local.ok() && backup_) {  // this rank loaded; put its previous state back
    MemoryCategoryScope category(MemoryCategory::optimizer_state);
    absl::Status restored = inner_->load_state_dict(*backup_);
    SK_CHECK(restored.ok()) << "restoring the previous optimizer state failed: " << restored;
  }
  backup_.reset();
  if (!local.ok()) return local;
  if (!agreed.ok()) return agreed;
  return absl::InvalidArgumentError(
      absl::StrCat("load_state_dict: rank ", rejected_by, " rejected the state dict (its error says why)"));
}

}  // namespace shardkit::oss
