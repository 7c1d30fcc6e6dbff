// libFuzzer target: the TcpStore frame decoder (common/comm/tcp_store_protocol.h), as the server meets bytes from
// an unauthenticated peer. The input is a byte stream cut into frames the way the server cuts it (u32 length,
// payload). Properties, beyond "no crash, no sanitizer report": a frame announcing more than the server would
// accept is never decoded; a payload that decodes re-encodes to a frame that decodes to the same message.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/comm/tcp_store_protocol.h"

namespace p = shardkit::comm::tcp_store_protocol;

namespace {

bool same(const p::Message& a, const p::Message& b) {
  return a.type == b.type && a.keys == b.keys && a.value == b.value && a.number == b.number && a.magic == b.magic &&
         a.version == b.version;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::size_t at = 0;
  bool authenticated = false;
  while (size - at >= p::kHeaderBytes) {
    const std::uint32_t length = p::decode_header(data + at);
    at += p::kHeaderBytes;
    const std::size_t limit = authenticated ? p::kDefaultMaxFrameBytes : p::kMaxHelloPayloadBytes;
    if (length > limit || length > size - at) return 0;  // the server refuses (or waits for) such a frame
    const std::string_view payload(reinterpret_cast<const char*>(data + at), length);
    at += length;
    auto m = p::decode_payload(payload);
    if (!m.ok()) return 0;  // the server answers kError and closes
    const std::string again = p::encode_frame(*m);
    if (again.size() < p::kHeaderBytes) std::abort();
    auto round = p::decode_payload(std::string_view(again).substr(p::kHeaderBytes));
    if (!round.ok() || !same(*m, *round)) std::abort();  // encode and decode disagree
    authenticated = authenticated || m->type == p::MessageType::kHello;
  }
  return 0;
}
