// TcpStore wire protocol: length-prefixed frames with bounded sizes, and pure encode / decode helpers
// shared by the client (tcp_store.h), the server (tcp_store_server.h) and the fault tests.
//
// Frame:   u32 payload_length (little endian) | payload (payload_length bytes)
// Payload: u8 message type | fields.  Fields: str = u32 length | bytes;  i64 = 8 bytes LE;  u32 = 4 bytes LE.
//
//   client -> server                                    server -> client
//   kHello   u32 magic, u32 version, str token          kOk
//   kSet     str key, str value                         kValue   str value
//   kGet     str key, i64 timeout_ms                    kInt     i64 value
//   kAdd     str key, i64 delta                         kBool    u8 (0/1)
//   kCheck   u32 n, n x str key                         kTimeout str what was still missing
//   kDelete  str key                                    kError   str message (server closes after it)
//   kWait    u32 n, n x str key, i64 timeout_ms
//
// The first frame of every connection must be kHello; the server answers kOk or kError and closes. Until the
// hello is accepted a frame may announce at most kMaxHelloPayloadBytes (the server allocates nothing larger for
// a client that has not authenticated). A server over one of its connection limits answers a kError starting
// with kConnectionLimitPrefix and closes without reading the hello.
// Every field is bounds-checked against the payload; a payload with bytes left over is malformed.
// Pure functions, thread-compatible.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace shardkit::comm::tcp_store_protocol {

inline constexpr std::uint32_t kMagic = 0x314b5353;  // "SSK1"
inline constexpr std::uint32_t kVersion = 1;
inline constexpr std::size_t kHeaderBytes = 4;
inline constexpr std::size_t kDefaultMaxFrameBytes = 16u << 20;  // 16 MiB
inline constexpr std::size_t kMaxKeyBytes = 4096;
// The largest hello payload: u8 type, u32 magic, u32 version, str token (at most kMaxKeyBytes).
inline constexpr std::size_t kMaxHelloPayloadBytes = 1 + 4 + 4 + 4 + kMaxKeyBytes;
inline constexpr char kConnectionLimitPrefix[] = "store connection limit reached: ";
inline constexpr std::uint32_t kMaxKeysPerRequest = 65536;
// The longest get / wait timeout on the wire: 2^40 ms, about 35 years. The client clamps longer (and
// infinite) timeouts to it, and the server clamps what it receives to [0, kMaxTimeoutMs] before turning it
// into a timer, so no hostile or infinite value can overflow the nanosecond clock arithmetic (2^40 ms is
// 1.1e18 ns, below the 9.2e18 an int64 holds).
inline constexpr std::int64_t kMaxTimeoutMs = std::int64_t{1} << 40;
// timeout_ms clamped to [0, kMaxTimeoutMs].
constexpr std::int64_t clamp_timeout_ms(std::int64_t timeout_ms) {
  return timeout_ms < 0 ? 0 : (timeout_ms > kMaxTimeoutMs ? kMaxTimeoutMs : timeout_ms);
}

enum class MessageType : std::uint8_t {
  kHello = 1,
  kSet = 2,
  kGet = 3,
  kAdd = 4,
  kCheck = 5,
  kDelete = 6,
  kWait = 7,
  kOk = 100,
  kValue = 101,
  kInt = 102,
  kBool = 103,
  kTimeout = 104,
  kError = 105,
};

// A decoded message (either direction). Only the fields its type uses are meaningful.
struct Message {
  MessageType type = MessageType::kOk;
  std::vector<std::string> keys;  // key(s) of requests
  std::string value;              // kSet value, kValue, kTimeout / kError text, kHello token
  std::int64_t number = 0;        // kGet / kWait timeout_ms, kAdd delta, kInt value, kBool value
  std::uint32_t magic = 0;        // kHello
  std::uint32_t version = 0;      // kHello
};

// Appends one complete frame (header + payload) for `m` to `out`.
void encode_frame(const Message& m, std::string& out);
std::string encode_frame(const Message& m);

// Reads the header's payload length.
std::uint32_t decode_header(const unsigned char* header);

// Decodes a payload (without header). InvalidArgument "malformed store frame: expected ..., found ..." when
// the type is unknown, a field runs past the end, a key exceeds kMaxKeyBytes, or bytes are left over.
absl::StatusOr<Message> decode_payload(std::string_view payload);

// Constant-time equality (time depends only on the lengths, never on where the bytes differ).
bool constant_time_equal(std::string_view a, std::string_view b);

}  // namespace shardkit::comm::tcp_store_protocol
