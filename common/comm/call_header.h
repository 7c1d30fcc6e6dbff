// CallHeader: the 32 bytes a process backend sends ahead of every call on each connection the call uses (kind,
// dtype, op, root, fingerprint, sequence number, numel), so that ranks which disagree about a call fail with
// InvalidArgument naming both calls instead of exchanging garbage (process_group.h, THE CONTRACT).
// Sender and receiver run on the same host kind: the header is sent in the host's byte order.
#pragma once

#include <cstdint>
#include <string>

#include "common/comm/process_group.h"

namespace shardkit::comm {

struct CallHeader {
  static constexpr std::uint32_t kMagic = 0x5054534b;  // "KSTP"
  std::uint32_t magic = kMagic;
  std::uint8_t kind = 0;
  std::uint8_t dtype = 0;
  std::uint8_t op = 0;
  std::uint8_t pad = 0;
  std::int32_t root = 0;
  std::uint32_t fingerprint = 0;  // the call's options' fingerprint (process_group.h, THE CONTRACT)
  std::int64_t seq = 0;
  std::int64_t numel = 0;
};
static_assert(sizeof(CallHeader) == 32);

// The header of `call` (its fingerprint included) as rank-agreed values: `kind` (send for both ends of a
// point-to-point transfer), `seq` (the call's sequence number, or the pair's point-to-point count) and `numel` (of
// the buffer the plan runs on).
CallHeader make_call_header(const CollectiveCall& call, std::int64_t seq, std::int64_t numel, CollectiveKind kind);

// "all_reduce (#3, dtype f32, numel 10, op sum, root 0)" (", fingerprint 0x0000002a" before the parenthesis when
// not 0), or what the bytes are when they are not a header.
std::string describe_call_header(const CallHeader& h);

}  // namespace shardkit::comm
