#include "common/comm/tcp_auth.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace shardkit::comm::tcp_auth {
namespace {

inline std::uint64_t rotl(std::uint64_t x, int b) { return (x << b) | (x >> (64 - b)); }

inline std::uint64_t load_le64(const unsigned char* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

struct SipState {
  std::uint64_t v0, v1, v2, v3;
  void round() {
    v0 += v1;
    v1 = rotl(v1, 13);
    v1 ^= v0;
    v0 = rotl(v0, 32);
    v2 += v3;
    v3 = rotl(v3, 16);
    v3 ^= v2;
    v0 += v3;
    v3 = rotl(v3, 21);
    v3 ^= v0;
    v2 += v1;
    v1 = rotl(v1, 17);
    v1 ^= v2;
    v2 = rotl(v2, 32);
  }
  void absorb(std::uint64_t m) {
    v3 ^= m;
    round();
    round();
    v0 ^= m;
  }
};

// The fixed public key that turns a token into a key (the first 16 bytes of "shardkit rank key", any fixed
// value would do).
constexpr Key kDerivationKey = {0x6b64726168730a01ULL, 0x79656b206b6e6172ULL};

}  // namespace

std::uint64_t siphash24(const Key& key, std::string_view message) {
  SipState s{0x736f6d6570736575ULL ^ key[0], 0x646f72616e646f6dULL ^ key[1], 0x6c7967656e657261ULL ^ key[0],
             0x7465646279746573ULL ^ key[1]};
  const auto* p = reinterpret_cast<const unsigned char*>(message.data());
  const std::size_t n = message.size();
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) s.absorb(load_le64(p + i));
  std::uint64_t last = static_cast<std::uint64_t>(n & 0xff) << 56;
  for (std::size_t j = 0; i + j < n; ++j) last |= static_cast<std::uint64_t>(p[i + j]) << (8 * j);
  s.absorb(last);
  s.v2 ^= 0xff;
  for (int r = 0; r < 4; ++r) s.round();
  return s.v0 ^ s.v1 ^ s.v2 ^ s.v3;
}

Key derive_key(std::string_view token) {
  const std::string t(token);
  return {siphash24(kDerivationKey, "shardkit token key 0\n" + t), siphash24(kDerivationKey, "shardkit token key 1\n" + t)};
}

Tag mac(const Key& key, std::string_view message) {
  Tag t{};
  std::string m(1, '\x01');
  m.append(message);
  const std::uint64_t a = siphash24(key, m);
  m[0] = '\x02';
  const std::uint64_t b = siphash24(key, m);
  for (int i = 0; i < 8; ++i) {
    t[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(a >> (8 * i));
    t[static_cast<std::size_t>(8 + i)] = static_cast<std::uint8_t>(b >> (8 * i));
  }
  return t;
}

bool tags_equal(const Tag& a, const Tag& b) {
  std::uint8_t diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) diff = static_cast<std::uint8_t>(diff | (a[i] ^ b[i]));
  return diff == 0;
}

absl::StatusOr<Nonce> random_nonce() {
  Nonce n{};
  std::size_t got = 0;
  while (got < n.size()) {
    const ssize_t k = ::getrandom(n.data() + got, n.size() - got, 0);
    if (k < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("getrandom failed: ", std::strerror(errno)));
    }
    got += static_cast<std::size_t>(k);
  }
  return n;
}

}  // namespace shardkit::comm::tcp_auth
