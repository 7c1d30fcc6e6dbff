#include "common/comm/tcp_store_protocol.h"

#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace shardkit::comm::tcp_store_protocol {
namespace {

void put_u32(std::string& out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void put_i64(std::string& out, std::int64_t v) {
  const auto u = static_cast<std::uint64_t>(v);
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
}
void put_str(std::string& out, const std::string& s) {
  put_u32(out, static_cast<std::uint32_t>(s.size()));
  out.append(s);
}

bool is_known(std::uint8_t t) {
  return (t >= 1 && t <= 7) || (t >= 100 && t <= 105);
}

// Bounds-checked reader over a payload.
class Reader {
 public:
  explicit Reader(std::string_view p) : p_(p) {}
  absl::Status u8(std::uint8_t& v) {
    if (auto s = need(1, "a 1-byte field"); !s.ok()) return s;
    v = static_cast<std::uint8_t>(p_[pos_++]);
    return absl::OkStatus();
  }
  absl::Status u32(std::uint32_t& v) {
    if (auto s = need(4, "a 4-byte field"); !s.ok()) return s;
    v = decode_header(reinterpret_cast<const unsigned char*>(p_.data() + pos_));
    pos_ += 4;
    return absl::OkStatus();
  }
  absl::Status i64(std::int64_t& v) {
    if (auto s = need(8, "an 8-byte field"); !s.ok()) return s;
    std::uint64_t u = 0;
    for (int i = 0; i < 8; ++i) u |= static_cast<std::uint64_t>(static_cast<unsigned char>(p_[pos_ + i])) << (8 * i);
    pos_ += 8;
    v = static_cast<std::int64_t>(u);
    return absl::OkStatus();
  }
  absl::Status str(std::string& v, std::size_t limit, const char* what) {
    std::uint32_t n = 0;
    if (auto s = u32(n); !s.ok()) return s;
    if (n > limit) {
      return absl::InvalidArgumentError(absl::StrCat("malformed store frame: expected a ", what, " of at most ", limit,
                                                     " bytes, found ", n, " bytes"));
    }
    if (auto s = need(n, what); !s.ok()) return s;
    v.assign(p_.data() + pos_, n);
    pos_ += n;
    return absl::OkStatus();
  }
  absl::Status finish() const {
    if (pos_ != p_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("malformed store frame: expected ", pos_,
                                                     " payload bytes, found ", p_.size()));
    }
    return absl::OkStatus();
  }

 private:
  absl::Status need(std::size_t n, const char* what) const {
    if (p_.size() - pos_ < n) {
      return absl::InvalidArgumentError(absl::StrCat("malformed store frame: expected ", what, " of ", n,
                                                     " bytes at offset ", pos_, ", found ", p_.size() - pos_,
                                                     " bytes left"));
    }
    return absl::OkStatus();
  }
  std::string_view p_;
  std::size_t pos_ = 0;
};

#define SK_RETURN_IF_ERROR_(expr)   \
  do {                              \
    absl::Status s_ = (expr);       \
    if (!s_.ok()) return s_;        \
  } while (0)

}  // namespace

std::uint32_t decode_header(const unsigned char* h) {
  return static_cast<std::uint32_t>(h[0]) | (static_cast<std::uint32_t>(h[1]) << 8) |
         (static_cast<std::uint32_t>(h[2]) << 16) | (static_cast<std::uint32_t>(h[3]) << 24);
}

void encode_frame(const Message& m, std::string& out) {
  const std::size_t start = out.size();
  put_u32(out, 0);  // patched below
  out.push_back(static_cast<char>(m.type));
  switch (m.type) {
    case MessageType::kHello:
      put_u32(out, m.magic);
      put_u32(out, m.version);
      put_str(out, m.value);
      break;
    case MessageType::kSet:
      put_str(out, m.keys.at(0));
      put_str(out, m.value);
      break;
    case MessageType::kGet:
    case MessageType::kAdd:
      put_str(out, m.keys.at(0));
      put_i64(out, m.number);
      break;
    case MessageType::kDelete:
      put_str(out, m.keys.at(0));
      break;
    case MessageType::kCheck:
    case MessageType::kWait:
      put_u32(out, static_cast<std::uint32_t>(m.keys.size()));
      for (const auto& k : m.keys) put_str(out, k);
      if (m.type == MessageType::kWait) put_i64(out, m.number);
      break;
    case MessageType::kOk:
      break;
    case MessageType::kValue:
    case MessageType::kTimeout:
    case MessageType::kError:
      put_str(out, m.value);
      break;
    case MessageType::kInt:
      put_i64(out, m.number);
      break;
    case MessageType::kBool:
      out.push_back(m.number != 0 ? 1 : 0);
      break;
  }
  const auto len = static_cast<std::uint32_t>(out.size() - start - kHeaderBytes);
  for (int i = 0; i < 4; ++i) out[start + i] = static_cast<char>((len >> (8 * i)) & 0xff);
}

std::string encode_frame(const Message& m) {
  std::string out;
  encode_frame(m, out);
  return out;
}

absl::StatusOr<Message> decode_payload(std::string_view payload) {
  Reader r(payload);
  std::uint8_t t = 0;
  SK_RETURN_IF_ERROR_(r.u8(t));
  if (!is_known(t)) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed store frame: expected a known message type, found ", static_cast<int>(t)));
  }
  Message m;
  m.type = static_cast<MessageType>(t);
  constexpr std::size_t kNoLimit = ~std::size_t{0};
  std::string key;
  switch (m.type) {
    case MessageType::kHello:
      SK_RETURN_IF_ERROR_(r.u32(m.magic));
      SK_RETURN_IF_ERROR_(r.u32(m.version));
      SK_RETURN_IF_ERROR_(r.str(m.value, kMaxKeyBytes, "token"));
      break;
    case MessageType::kSet:
      SK_RETURN_IF_ERROR_(r.str(key, kMaxKeyBytes, "key"));
      m.keys.push_back(std::move(key));
      SK_RETURN_IF_ERROR_(r.str(m.value, kNoLimit, "value"));
      break;
    case MessageType::kGet:
    case MessageType::kAdd:
      SK_RETURN_IF_ERROR_(r.str(key, kMaxKeyBytes, "key"));
      m.keys.push_back(std::move(key));
      SK_RETURN_IF_ERROR_(r.i64(m.number));
      break;
    case MessageType::kDelete:
      SK_RETURN_IF_ERROR_(r.str(key, kMaxKeyBytes, "key"));
      m.keys.push_back(std::move(key));
      break;
    case MessageType::kCheck:
    case MessageType::kWait: {
      std::uint32_t n = 0;
      SK_RETURN_IF_ERROR_(r.u32(n));
      if (n > kMaxKeysPerRequest) {
        return absl::InvalidArgumentError(absl::StrCat("malformed store frame: expected at most ", kMaxKeysPerRequest,
                                                       " keys, found ", n));
      }
      for (std::uint32_t i = 0; i < n; ++i) {
        SK_RETURN_IF_ERROR_(r.str(key, kMaxKeyBytes, "key"));
        m.keys.push_back(std::move(key));
      }
      if (m.type == MessageType::kWait) SK_RETURN_IF_ERROR_(r.i64(m.number));
      break;
    }
    case MessageType::kOk:
      break;
    case MessageType::kValue:
    case MessageType::kTimeout:
    case MessageType::kError:
      SK_RETURN_IF_ERROR_(r.str(m.value, kNoLimit, "value"));
      break;
    case MessageType::kInt:
      SK_RETURN_IF_ERROR_(r.i64(m.number));
      break;
    case MessageType::kBool: {
      std::uint8_t b = 0;
      SK_RETURN_IF_ERROR_(r.u8(b));
      // Only the two values the encoder writes: a frame decodes to exactly one message and re-encodes to itself.
      if (b > 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("malformed store frame: expected a bool byte of 0 or 1, found ", static_cast<int>(b)));
      }
      m.number = b;
      break;
    }
  }
  SK_RETURN_IF_ERROR_(r.finish());
  return m;
}

bool constant_time_equal(std::string_view a, std::string_view b) {
  // Walks the longer length every time; differences accumulate without branching.
  const std::size_t n = a.size() > b.size() ? a.size() : b.size();
  unsigned diff = static_cast<unsigned>(a.size() ^ b.size());
  for (std::size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned>(x ^ y);
  }
  return diff == 0;
}

}  // namespace shardkit::comm::tcp_store_protocol
