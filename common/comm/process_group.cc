#include "common/comm/process_group.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/comm/completion_work.h"

namespace shardkit::comm {
namespace {

class DoneWork : public Work {
 public:
  explicit DoneWork(absl::Status status) : status_(std::move(status)) {}
  absl::Status wait(absl::Duration) override { return status_; }
  bool is_completed() const override { return true; }

 private:
  absl::Status status_;
};

std::string tensor_str(const Tensor& t) { return t.defined() ? t.describe() : std::string("undefined tensor"); }

// Byte range [begin, end) of a tensor inside its storage.
struct ByteRange {
  const void* storage;
  std::size_t begin, end;
};
ByteRange range_of(const Tensor& t) { return {t.storage().get(), t.offset_bytes(), t.offset_bytes() + t.nbytes()}; }
bool overlaps(const ByteRange& a, const ByteRange& b) {
  return a.storage == b.storage && a.begin < b.end && b.begin < a.end;
}

}  // namespace

std::string fingerprint_str(std::uint32_t fingerprint) {
  return absl::StrCat("0x", absl::Hex(fingerprint, absl::kZeroPad8));
}

std::uint32_t fingerprint_of(std::string_view text) {
  std::uint32_t h = 2166136261u;
  for (const char c : text) {
    h ^= static_cast<std::uint8_t>(c);
    h *= 16777619u;
  }
  return h == 0 ? 1 : h;
}

std::shared_ptr<Work> make_completed_work(absl::Status status) { return std::make_shared<DoneWork>(std::move(status)); }

std::string_view reduce_kind_name(ReduceKind k) {
  switch (k) {
    case ReduceKind::sum: return "sum";
    case ReduceKind::avg: return "avg";
    case ReduceKind::min: return "min";
    case ReduceKind::max: return "max";
    case ReduceKind::premul_sum: return "premul_sum";
  }
  return "?";
}

std::string ReduceOp::to_string() const {
  if (kind == ReduceKind::premul_sum) return absl::StrCat("premul_sum(", factor, ")");
  return std::string(reduce_kind_name(kind));
}

std::string CollectiveCall::describe() const {
  std::string s = std::string(collective_kind_name(kind));
  if (kind != CollectiveKind::send && kind != CollectiveKind::recv) absl::StrAppend(&s, " #", seq);
  if (!tag.empty()) absl::StrAppend(&s, " '", tag, "'");
  std::string detail;  // what goes between the parentheses
  switch (kind) {
    case CollectiveKind::barrier: break;
    case CollectiveKind::all_gather:
    case CollectiveKind::reduce_scatter:
      absl::StrAppend(&detail, "in ", tensor_str(input), ", out ", tensor_str(output));
      if (kind == CollectiveKind::reduce_scatter) absl::StrAppend(&detail, ", ", op.to_string());
      break;
    case CollectiveKind::all_reduce: absl::StrAppend(&detail, tensor_str(input), ", ", op.to_string()); break;
    case CollectiveKind::reduce:
      absl::StrAppend(&detail, tensor_str(input), ", ", op.to_string(), ", root ", root);
      break;
    case CollectiveKind::broadcast: absl::StrAppend(&detail, tensor_str(input), ", root ", root); break;
    case CollectiveKind::send: absl::StrAppend(&detail, tensor_str(input), " to rank ", peer); break;
    case CollectiveKind::recv: absl::StrAppend(&detail, tensor_str(input), " from rank ", peer); break;
  }
  if (fingerprint != 0) {
    absl::StrAppend(&detail, detail.empty() ? "" : ", ", "fingerprint ", fingerprint_str(fingerprint));
  }
  if (!detail.empty()) absl::StrAppend(&s, " (", detail, ")");
  return s;
}

ProcessGroup::ProcessGroup(int rank, int size, std::string name, std::vector<int> global_ranks,
                           absl::Duration default_timeout)
    : rank_(rank),
      size_(size),
      name_(std::move(name)),
      global_ranks_(std::move(global_ranks)),
      default_timeout_(default_timeout) {
  SK_CHECK_GT(size_, 0);
  SK_CHECK(rank_ >= 0 && rank_ < size_) << "rank " << rank_ << " of " << size_;
  if (global_ranks_.empty()) {
    for (int r = 0; r < size_; ++r) global_ranks_.push_back(r);
  }
  SK_CHECK_EQ(static_cast<int>(global_ranks_.size()), size_);
}

std::string ProcessGroup::describe_rank(int group_rank) const {
  if (group_rank < 0 || group_rank >= size_) return absl::StrCat("rank ", group_rank);
  const int g = global_ranks_[group_rank];
  if (g == group_rank) return absl::StrCat("rank ", group_rank);
  return absl::StrCat("rank ", group_rank, " (global rank ", g, ")");
}

CommCounters ProcessGroup::counters() const {
  std::lock_guard<std::mutex> lock(counters_mu_);
  return counters_;
}

void ProcessGroup::reset_counters() {
  std::lock_guard<std::mutex> lock(counters_mu_);
  counters_ = CommCounters{};
}

namespace {

absl::Status check_tensor(const Tensor& t, const char* what) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat("expected a defined ", what, " tensor, found undefined"));
  if (t.storage_released())
    return absl::InvalidArgumentError(absl::StrCat("expected ", what, " tensor with storage, found released storage (",
                                                   t.describe(), ")"));
  return absl::OkStatus();
}

absl::Status check_op(const ReduceOp& op, DType dtype) {
  if (op.kind == ReduceKind::premul_sum) {
    if (!std::isfinite(op.factor))
      return absl::InvalidArgumentError(absl::StrCat("expected a finite premul_sum factor, found ", op.factor));
    if (dtype == DType::i64 && op.factor != std::trunc(op.factor))
      return absl::InvalidArgumentError(
          absl::StrCat("expected an integral premul_sum factor for an i64 tensor, found ", op.factor));
  }
  return absl::OkStatus();
}

}  // namespace

std::shared_ptr<Work> ProcessGroup::issue(CollectiveCall call, std::int64_t counted_bytes) {
  call.deadline = absl::Now() + call.timeout;
  if (call.kind != CollectiveKind::send && call.kind != CollectiveKind::recv) call.seq = next_seq_++;

  absl::Status st;
  const auto fail = [&](absl::Status s) {
    st = absl::Status(s.code(), absl::StrCat(call.describe(), " on group '", name_, "', ", describe_rank(rank_),
                                             ": ", s.message()));
  };
  switch (call.kind) {
    case CollectiveKind::barrier: break;
    case CollectiveKind::broadcast:
    case CollectiveKind::reduce:
      if (call.root < 0 || call.root >= size_) {
        fail(absl::InvalidArgumentError(absl::StrCat("expected root in [0, ", size_, "), found ", call.root)));
      }
      [[fallthrough]];
    case CollectiveKind::all_reduce:
      if (st.ok()) {
        if (absl::Status s = check_tensor(call.input, "in/out"); !s.ok()) fail(s);
      }
      if (st.ok() && call.kind != CollectiveKind::broadcast) {
        if (absl::Status s = check_op(call.op, call.input.dtype()); !s.ok()) fail(s);
      }
      break;
    case CollectiveKind::all_gather:
    case CollectiveKind::reduce_scatter: {
      if (absl::Status s = check_tensor(call.input, "input"); !s.ok()) {
        fail(s);
        break;
      }
      if (absl::Status s = check_tensor(call.output, "output"); !s.ok()) {
        fail(s);
        break;
      }
      if (call.input.dtype() != call.output.dtype()) {
        fail(absl::InvalidArgumentError(absl::StrCat("expected input and output of one dtype, found ",
                                                     call.input.describe(), " and ", call.output.describe())));
        break;
      }
      const bool gather = call.kind == CollectiveKind::all_gather;
      const Tensor& big = gather ? call.output : call.input;
      const Tensor& small = gather ? call.input : call.output;
      if (big.numel() != small.numel() * size_) {
        fail(absl::InvalidArgumentError(absl::StrCat("expected ", gather ? "output" : "input", " numel = ", size_,
                                                     " x ", small.numel(), " = ", small.numel() * size_,
                                                     ", found ", big.numel())));
        break;
      }
      if (overlaps(range_of(big), range_of(small))) {
        const ByteRange b = range_of(big), s = range_of(small);
        const std::size_t slice_begin = b.begin + static_cast<std::size_t>(rank_) * small.nbytes();
        if (!(s.begin == slice_begin && s.end == slice_begin + small.nbytes())) {
          fail(absl::InvalidArgumentError(absl::StrCat(
              "expected ", gather ? "input" : "output", " to be disjoint from ", gather ? "output" : "input",
              " or to alias exactly its slice ", rank_, ", found another overlap")));
          break;
        }
      }
      if (!gather) {
        if (absl::Status s = check_op(call.op, call.input.dtype()); !s.ok()) fail(s);
      }
      break;
    }
    case CollectiveKind::send:
    case CollectiveKind::recv:
      if (call.peer < 0 || call.peer >= size_ || call.peer == rank_) {
        fail(absl::InvalidArgumentError(absl::StrCat("expected a peer rank in [0, ", size_, ") other than ", rank_,
                                                     ", found ", call.peer)));
        break;
      }
      if (absl::Status s = check_tensor(call.input, "p2p"); !s.ok()) fail(s);
      break;
  }
  if (!st.ok()) {
    abort(st);
    return make_completed_work(st);
  }
  if (counted_bytes < 0) {
    counted_bytes = 0;
    switch (call.kind) {
      case CollectiveKind::all_gather: counted_bytes = static_cast<std::int64_t>(call.input.nbytes()); break;
      case CollectiveKind::reduce_scatter: counted_bytes = static_cast<std::int64_t>(call.output.nbytes()); break;
      case CollectiveKind::barrier: break;
      default: counted_bytes = static_cast<std::int64_t>(call.input.nbytes()); break;
    }
    const Volume v = collective_volume(call.kind, counted_bytes, size_, rank_, call.root);
    std::lock_guard<std::mutex> lock(counters_mu_);
    KindCounters& k = counters_.of(call.kind);
    ++k.calls;
    k.bytes_sent += v.sent;
    k.bytes_received += v.received;
  }
  return run(std::move(call));
}

std::shared_ptr<Work> ProcessGroup::broadcast(const Tensor& tensor, const BroadcastOptions& options) {
  CollectiveCall c;
  c.kind = CollectiveKind::broadcast;
  c.input = c.output = tensor;
  c.root = options.root;
  c.timeout = options.timeout.value_or(default_timeout_);
  c.tag = options.tag;
  c.fingerprint = options.fingerprint;
  return issue(std::move(c), -1);
}

std::shared_ptr<Work> ProcessGroup::all_reduce(const Tensor& tensor, const AllReduceOptions& options) {
  CollectiveCall c;
  c.kind = CollectiveKind::all_reduce;
  c.input = c.output = tensor;
  c.op = options.op;
  c.timeout = options.timeout.value_or(default_timeout_);
  c.tag = options.tag;
  c.fingerprint = options.fingerprint;
  return issue(std::move(c), -1);
}

std::shared_ptr<Work> ProcessGroup::reduce(const Tensor& tensor, const ReduceOptions& options) {
  CollectiveCall c;
  c.kind = CollectiveKind::reduce;
  c.input = c.output = tensor;
  c.root = options.root;
  c.op = options.op;
  c.timeout = options.timeout.value_or(default_timeout_);
  c.tag = options.tag;
  c.fingerprint = options.fingerprint;
  return issue(std::move(c), -1);
}

std::shared_ptr<Work> ProcessGroup::all_gather(const Tensor& output, const Tensor& input,
                                               const AllGatherOptions& options) {
  CollectiveCall c;
  c.kind = CollectiveKind::all_gather;
  c.input = input;
  c.output = output;
  c.timeout = options.timeout.value_or(default_timeout_);
  c.tag = options.tag;
  c.fingerprint = options.fingerprint;
  return issue(std::move(c), -1);
}

std::shared_ptr<Work> ProcessGroup::reduce_scatter(const Tensor& output, const Tensor& input,
                                                   const ReduceScatterOptions& options) {
  CollectiveCall c;
  c.kind = CollectiveKind::reduce_scatter;
  c.input = input;
  c.output = output;
  c.op = options.op;
  c.timeout = options.timeout.value_or(default_timeout_);
  c.tag = options.tag;
  c.fingerprint = options.fingerprint;
  return issue(std::move(c), -1);
}

std::shared_ptr<Work> ProcessGroup::barrier(const BarrierOptions& options) {
  CollectiveCall c;
  c.kind = CollectiveKind::barrier;
  c.timeout = options.timeout.value_or(default_timeout_);
  c.tag = options.tag;
  c.fingerprint = options.fingerprint;
  return issue(std::move(c), -1);
}

std::shared_ptr<Work> ProcessGroup::send(const Tensor& tensor, int dst, const P2POptions& options) {
  CollectiveCall c;
  c.kind = CollectiveKind::send;
  c.input = c.output = tensor;
  c.peer = dst;
  c.timeout = options.timeout.value_or(default_timeout_);
  c.tag = options.tag;
  c.fingerprint = options.fingerprint;
  return issue(std::move(c), -1);
}

std::shared_ptr<Work> ProcessGroup::recv(const Tensor& tensor, int src, const P2POptions& options) {
  CollectiveCall c;
  c.kind = CollectiveKind::recv;
  c.input = c.output = tensor;
  c.peer = src;
  c.timeout = options.timeout.value_or(default_timeout_);
  c.tag = options.tag;
  c.fingerprint = options.fingerprint;
  return issue(std::move(c), -1);
}

absl::StatusOr<std::shared_ptr<ProcessGroup>> ProcessGroup::split(int color, int key, const SubGroupOptions& options) {
  const std::int64_t split_index = next_split_++;
  // Exchange (color, key) with an all_gather that is not counted (it is bookkeeping, not payload).
  Tensor mine = Tensor::from_int64({color, key}, {2}, TensorOptions{}.with_dtype(DType::i64));
  Tensor all = Tensor::empty({2 * static_cast<std::int64_t>(size_)}, TensorOptions{}.with_dtype(DType::i64));
  CollectiveCall c;
  c.kind = CollectiveKind::all_gather;
  c.input = mine;
  c.output = all;
  c.timeout = options.timeout.value_or(default_timeout_);
  c.tag = "split";
  c.deadline = absl::Now() + c.timeout;
  c.seq = next_seq_++;
  const absl::Time deadline = c.deadline;
  if (absl::Status s = run(std::move(c))->wait(); !s.ok()) return s;
  if (color < 0) return std::shared_ptr<ProcessGroup>();

  std::vector<std::pair<std::int64_t, int>> order;  // (key, parent rank) of my color
  int color_index = 0;  // index of my color among the distinct colors, for a stable name
  std::vector<std::int64_t> colors;
  for (int r = 0; r < size_; ++r) {
    const std::int64_t cr = all.data<std::int64_t>()[2 * r];
    if (cr >= 0 && std::find(colors.begin(), colors.end(), cr) == colors.end()) colors.push_back(cr);
    if (cr == color) order.emplace_back(all.data<std::int64_t>()[2 * r + 1], r);
  }
  std::sort(colors.begin(), colors.end());
  color_index = static_cast<int>(std::find(colors.begin(), colors.end(), color) - colors.begin());
  std::sort(order.begin(), order.end());
  std::vector<int> members;
  for (const auto& [k, r] : order) members.push_back(r);
  const std::string sub_key = absl::StrCat("split", split_index, ".", color);
  const std::string sub_name = options.name.empty() ? absl::StrCat(name_, "/", split_index, ".", color_index)
                                                    : options.name;
  return make_subgroup(std::move(members), sub_key, sub_name, options.default_timeout.value_or(default_timeout_),
                       deadline);
}

absl::StatusOr<std::shared_ptr<ProcessGroup>> ProcessGroup::new_group(absl::Span<const int> ranks,
                                                                      const SubGroupOptions& options) {
  std::vector<int> seen;
  for (int r : ranks) {
    if (r < 0 || r >= size_ || std::find(seen.begin(), seen.end(), r) != seen.end()) {
      absl::Status st = absl::InvalidArgumentError(
          absl::StrCat("new_group on group '", name_, "': expected distinct ranks in [0, ", size_, "), found [",
                       absl::StrJoin(ranks, ", "), "]"));
      abort(st);
      return st;
    }
    seen.push_back(r);
  }
  const auto it = std::find(ranks.begin(), ranks.end(), rank_);
  const bool member = it != ranks.end();
  return split(member ? 0 : -1, member ? static_cast<int>(it - ranks.begin()) : 0, options);
}

}  // namespace shardkit::comm
