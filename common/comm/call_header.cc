#include "common/comm/call_header.h"

#include "absl/strings/str_cat.h"

namespace shardkit::comm {

CallHeader make_call_header(const CollectiveCall& call, std::int64_t seq, std::int64_t numel, CollectiveKind kind) {
  CallHeader h;
  h.kind = static_cast<std::uint8_t>(kind);
  h.dtype = static_cast<std::uint8_t>(call.input.defined() ? call.input.dtype() : DType::f32);
  h.op = static_cast<std::uint8_t>(call.op.kind);
  h.root = call.root;
  h.fingerprint = call.fingerprint;
  h.seq = seq;
  h.numel = numel;
  return h;
}

std::string describe_call_header(const CallHeader& h) {
  if (h.magic != CallHeader::kMagic) return absl::StrCat("bytes that are not a call header (magic ", h.magic, ")");
  return absl::StrCat(std::string(collective_kind_name(static_cast<CollectiveKind>(h.kind))),
                      h.kind == static_cast<int>(CollectiveKind::send) ? " (p2p #" : " (#", h.seq,
                      ", dtype ", std::string(dtype_name(static_cast<DType>(h.dtype))), ", numel ", h.numel, ", op ",
                      std::string(reduce_kind_name(static_cast<ReduceKind>(h.op))), ", root ", h.root,
                      h.fingerprint != 0 ? absl::StrCat(", fingerprint ", fingerprint_str(h.fingerprint)) : "", ")");
}

}  // namespace shardkit::comm
