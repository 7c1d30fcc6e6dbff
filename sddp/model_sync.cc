#include "sddp/model_sync.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/comm/host_staged.h"

namespace shardkit::sddp {
namespace {

std::string describe_tensor(const std::string& kind, const std::string& name, const Tensor& t) {
  return absl::StrCat(kind, " ", name, " ", std::string(dtype_name(t.dtype())), shape_str(t.shape()));
}

std::int64_t fnv1a(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return static_cast<std::int64_t>(h >> 1);
}

std::string joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& l : lines) absl::StrAppend(&out, l, "\n");
  return out;
}

}  // namespace

std::vector<std::string> describe_model(const nn::Module& module) {
  std::vector<std::string> out;
  for (const auto& [name, t] : module.named_parameters()) out.push_back(describe_tensor("param", name, t));
  for (const auto& [name, t] : module.named_buffers()) out.push_back(describe_tensor("buffer", name, t));
  return out;
}

absl::Status verify_same_model(const nn::Module& module, comm::ProcessGroup& group,
                               std::optional<absl::Duration> timeout) {
  const int n = group.size();
  if (n == 1) return absl::OkStatus();
  const absl::Duration to = timeout.value_or(group.default_timeout());
  const std::string text = joined(describe_model(module));
  const TensorOptions i64 = TensorOptions{}.with_dtype(DType::i64).with_category(MemoryCategory::other);
  Tensor mine = Tensor::from_int64({fnv1a(text), static_cast<std::int64_t>(text.size())}, {2}, i64);
  Tensor all = Tensor::empty({2 * n}, i64);
  if (absl::Status s = comm::all_gather_host(group, all, mine, {.timeout = to, .tag = "model hash"}); !s.ok()) return s;
  const auto* a = all.data<std::int64_t>();
  std::int64_t longest = 0;
  bool same = true;
  for (int r = 0; r < n; ++r) {
    same = same && a[2 * r] == a[0] && a[2 * r + 1] == a[1];
    longest = std::max(longest, a[2 * r + 1]);
  }
  if (same) return absl::OkStatus();
  // Details: everyone's description, one character per i64 (only on this error path).
  Tensor chars = Tensor::zeros({longest}, i64);
  for (std::size_t i = 0; i < text.size(); ++i) chars.data<std::int64_t>()[i] = static_cast<unsigned char>(text[i]);
  Tensor every = Tensor::empty({longest * n}, i64);
  if (absl::Status s = comm::all_gather_host(group, every, chars, {.timeout = to, .tag = "model description"}); !s.ok()) {
    return s;
  }
  auto text_of = [&](int r) {
    std::string s(static_cast<std::size_t>(a[2 * r + 1]), '\0');
    for (std::size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(every.data<std::int64_t>()[r * longest + static_cast<std::int64_t>(i)]);
    return std::vector<std::string>(absl::StrSplit(s, '\n', absl::SkipEmpty()));
  };
  const std::vector<std::string> ref = text_of(0);
  for (int r = 1; r < n; ++r) {
    const std::vector<std::string> other = text_of(r);
    for (std::size_t i = 0; i < std::max(ref.size(), other.size()); ++i) {
      const std::string want = i < ref.size() ? ref[i] : "(nothing)";
      const std::string got = i < other.size() ? other[i] : "(nothing)";
      if (want != got) {
        return absl::InvalidArgumentError(absl::StrCat("model on rank ", r, " differs from rank 0 at entry ", i,
                                                       ": expected '", want, "', found '", got, "'"));
      }
    }
  }
  return absl::InvalidArgumentError("models differ across ranks (hash mismatch with identical descriptions)");
}

absl::Status broadcast_module_state(const nn::Module& module, comm::ProcessGroup& group, bool parameters, bool buffers,
                                    std::optional<absl::Duration> timeout) {
  if (group.size() == 1) return absl::OkStatus();
  const absl::Duration to = timeout.value_or(group.default_timeout());
  std::vector<std::shared_ptr<comm::Work>> works;
  if (parameters) {
    for (const auto& [name, t] : module.named_parameters()) {
      works.push_back(group.broadcast(t, {.root = 0, .timeout = to, .tag = name}));
    }
  }
  if (buffers) {
    for (const auto& [name, t] : module.named_buffers()) {
      works.push_back(group.broadcast(t, {.root = 0, .timeout = to, .tag = name}));
    }
  }
  absl::Status first = absl::OkStatus();
  for (auto& w : works) first.Update(w->wait());
  return first;
}

}  // namespace shardkit::sddp
