// Rank authentication for the TCP mesh (issue 15 item 5): a keyed MAC over a fresh challenge proves that the
// process at the other end of a rank-to-rank connection knows the Store's token, without sending the token
// (the handshake that uses it: Note [rank authentication] in tcp_rendezvous.cc).
//
// The MAC is SipHash-2-4 (Aumasson and Bernstein, 2012), written here because shardkit has no cryptography
// library as a dependency: a keyed pseudo-random function with a 128-bit key, designed and analysed as a MAC
// for short messages (it is not a general-purpose hash like SHA-256). A tag is two SipHash-2-4 outputs of the
// message under domain bytes 1 and 2 (128 bits). The key is derived from the token by SipHash-2-4 under a fixed
// public key, so a token's strength counts up to 128 bits.
//
// What it protects against: a process that can reach a rank's port during the rendezvous but does not know the
// token cannot take a rank's place in the mesh, nor pose as the rank a connecting rank expects; a recorded
// handshake cannot be replayed (both sides contribute 16 fresh random bytes from getrandom(2)).
// What it does not protect against: anyone who can read or inject traffic on the network path after the
// handshake (the collectives' bytes are neither encrypted nor authenticated: use a private network or a
// tunnel); and a recorded handshake lets an attacker test guesses of the token offline, so the token must be
// random and long (e.g. 32 hex digits from `od -An -tx1 -N16 /dev/urandom`), not a password. An empty token
// authenticates nothing (every process knows it).
//
// Pure functions except random_nonce(); thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"

namespace shardkit::comm::tcp_auth {

using Key = std::array<std::uint64_t, 2>;  // k0, k1 (little-endian words of the 16 key bytes)
using Tag = std::array<std::uint8_t, 16>;
using Nonce = std::array<std::uint8_t, 16>;

// SipHash-2-4 of `message` under `key`.
std::uint64_t siphash24(const Key& key, std::string_view message);
// The key a token stands for.
Key derive_key(std::string_view token);
// The 128-bit tag of `message`.
Tag mac(const Key& key, std::string_view message);
// Compares in time independent of where the tags differ.
bool tags_equal(const Tag& a, const Tag& b);
// 16 random bytes from the kernel (getrandom(2)); Internal error if it fails.
absl::StatusOr<Nonce> random_nonce();

}  // namespace shardkit::comm::tcp_auth
