// Oss::sync_params: after the local step, every rank's parameters are brought up to date from their
// owners.
//
// Note [OSS parameter buckets]
// Greedy: for each owner rank in turn, its trainable parameters (group order) smaller than
// pack_below_bytes are packed into buckets of at most bucket_bytes; a larger parameter is broadcast alone, in
// place when no dtype change is asked. Packing costs a copy in (owner) and out (receivers) of every byte:
// measured on gpt-10m at N = 2 (train_bench), packing every parameter into 16 MiB buckets made the OSS step
// about 5% slower than broadcasting the large parameters in place, so only small ones are packed, to save
// per-call latency. Every rank computes the same plan from the same partition and trainable flags, so the
// broadcasts match. At most kMaxInFlight buckets are outstanding, which bounds the communication buffers.
// Flat: with contiguous_flat (the default), each group's parameters live in one buffer laid out as the
// group's flat index space, so one all_gather per chunk (Note [flat chunks] in partition.h) runs in place:
// no buffer, no copies (this made the gpt-10m OSS step at N = 2 go from 1.07-1.11x the DDP step to 0.96x,
// train_bench). Otherwise each chunk's ranges are all-gathered through a buffer, a column of every rank's
// range at a time, so every call moves at most bucket_bytes in total.
#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/tensor/rank_context.h"
#include "oss/oss.h"

namespace shardkit::oss {
namespace {

constexpr std::size_t kMaxInFlight = 4;

struct Bucket {
  int owner = 0;
  DType wire = DType::f32;
  bool alone = false;  // one large parameter, not packed with others
  std::vector<Tensor> params;
  std::int64_t numel = 0;
  Tensor buffer;  // undefined when the single parameter is sent in place
};

// Copies [flat_begin, flat_begin + n) of a group's flat space between the parameters and `buf`
// (to_params: buf -> params).
void CopyFlat(const std::vector<Tensor>& params, std::int64_t flat_begin, std::int64_t n, const Tensor& buf,
              std::int64_t buf_offset, bool to_params) {
  std::int64_t start = 0;
  for (const Tensor& p : params) {
    const std::int64_t end = start + p.numel();
    const std::int64_t lo = std::max(start, flat_begin), hi = std::min(end, flat_begin + n);
    if (lo < hi) {
      const Tensor pv = p.view(lo - start, {hi - lo});
      const Tensor bv = buf.view(buf_offset + (lo - flat_begin), {hi - lo});
      if (to_params) {
        pv.copy_(bv);
      } else {
        bv.copy_(pv);
      }
    }
    if (end >= flat_begin + n) break;
    start = end;
  }
}

}  // namespace

absl::Status Oss::sync_params() {
  const int world = pg_->size(), rank = pg_->rank();
  if (world == 1) return absl::OkStatus();
  MemoryCategoryScope category(MemoryCategory::communication_buffer);
  std::vector<std::shared_ptr<comm::Work>> works;

  if (options_.policy == PartitionPolicy::greedy) {
    std::vector<Bucket> plan;
    for (int owner = 0; owner < world; ++owner) {
      for (std::size_t g = 0; g < groups_.size(); ++g) {
        for (int i : greedy_.owned(static_cast<int>(g), owner)) {
          const Tensor& p = groups_[g].params[static_cast<std::size_t>(i)];
          if (!trainable_[static_cast<std::size_t>(first_index_[g] + i)] || p.numel() == 0) continue;
          const DType wire = options_.broadcast_dtype.value_or(p.dtype());
          Bucket* last = plan.empty() ? nullptr : &plan.back();
          const bool alone = static_cast<std::int64_t>(dtype_size(wire)) * p.numel() >= options_.pack_below_bytes;
          if (alone || last == nullptr || last->alone || last->owner != owner || last->wire != wire ||
              static_cast<std::int64_t>(dtype_size(wire)) * (last->numel + p.numel()) > options_.bucket_bytes) {
            plan.push_back({owner, wire, alone, {}, 0, {}});
            last = &plan.back();
          }
          last->params.push_back(p);
          last->numel += p.numel();
        }
      }
    }
    // Unpacks finished buckets on receivers (and on the owner when the wire dtype rounds).
    auto finish = [&](Bucket& b) {
      if (!b.buffer.defined()) return;
      std::int64_t off = 0;
      for (const Tensor& p : b.params) {
        if (b.owner != rank || b.wire != p.dtype()) p.copy_(b.buffer.view(off, p.shape()));
        off += p.numel();
      }
      b.buffer = Tensor();
    };
    std::size_t done = 0;
    for (std::size_t k = 0; k < plan.size(); ++k) {
      Bucket& b = plan[k];
      const bool in_place = b.params.size() == 1 && b.wire == b.params[0].dtype();
      if (!in_place) {
        b.buffer = Tensor::empty({b.numel}, TensorOptions{}.with_dtype(b.wire).with_device(b.params[0].device()));
        if (b.owner == rank) {
          std::int64_t off = 0;
          for (const Tensor& p : b.params) {
            b.buffer.view(off, {p.numel()}).copy_(p);
            off += p.numel();
          }
        }
      }
      works.push_back(pg_->broadcast(in_place ? b.params[0] : b.buffer,
                                     {.root = b.owner, .timeout = options_.timeout,
                                      .tag = absl::StrCat("oss param bucket ", k)}));
      if (works.size() - done >= kMaxInFlight) {  // bound the buffers in flight
        if (absl::Status s = works[done]->wait(timeout()); !s.ok()) return s;
        finish(plan[done++]);
      }
    }
    for (; done < plan.size(); ++done) {
      if (absl::Status s = works[done]->wait(timeout()); !s.ok()) return s;
      finish(plan[done]);
    }
    return absl::OkStatus();
  }

  // Flat: per chunk (Note [flat chunks]), an all_gather of every rank's range.
  for (std::size_t c = 0; c < flat_.chunks.size(); ++c) {
    const FlatChunk& fc = flat_.chunks[c];
    const auto g = static_cast<std::size_t>(fc.group);
    const auto& params = groups_[g].params;
    if (fc.total == 0) continue;
    const std::string tag = absl::StrCat("oss flat group ", g, " chunk ", c);
    if (flat_buffers_[g].defined()) {  // parameters live in the flat buffer: one all_gather in place
      const Tensor out = flat_buffers_[g].view(chunk_buffer_offset_[c], {fc.shard_size * world});
      works.push_back(pg_->all_gather(out, out.view(rank * fc.shard_size, {fc.shard_size}),
                                      {.timeout = options_.timeout, .tag = tag}));
      continue;
    }
    DType wire = options_.broadcast_dtype.value_or(params.front().dtype());
    if (!options_.broadcast_dtype) {
      for (const Tensor& p : params) {
        if (p.dtype() != wire) wire = DType::f32;  // mixed dtypes: carry f32
      }
    }
    // Copies through a bucket of at most bucket_bytes: a column of every rank's range at a time.
    const std::int64_t column = std::max<std::int64_t>(
        1, options_.bucket_bytes / static_cast<std::int64_t>(dtype_size(wire)) / world);
    for (std::int64_t c0 = 0; c0 < fc.shard_size; c0 += column) {
      const std::int64_t len = std::min(column, fc.shard_size - c0);
      Tensor out = Tensor::empty({len * world}, TensorOptions{}.with_dtype(wire).with_device(params.front().device()));
      const Tensor in = out.view(rank * len, {len});
      const std::int64_t my_begin = fc.begin(rank) + c0;
      const std::int64_t my_n = std::clamp<std::int64_t>(fc.end(rank) - my_begin, 0, len);
      if (my_n > 0) CopyFlat(params, my_begin, my_n, in, 0, /*to_params=*/false);
      if (my_n < len) in.view(my_n, {len - my_n}).zero_();  // padding past the chunk's end
      auto work = pg_->all_gather(out, in, {.timeout = options_.timeout, .tag = tag});
      if (absl::Status s = work->wait(timeout()); !s.ok()) return s;
      for (int r = 0; r < world; ++r) {
        const std::int64_t begin = fc.begin(r) + c0;
        const std::int64_t n = std::clamp<std::int64_t>(fc.end(r) - begin, 0, len);
        if (n > 0 && (r != rank || wire != params.front().dtype() || options_.broadcast_dtype)) {
          CopyFlat(params, begin, n, out, static_cast<std::int64_t>(r) * len, /*to_params=*/true);
        }
      }
    }
  }
  return wait_all(works);
}

}  // namespace shardkit::oss
