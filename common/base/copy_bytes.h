// copy_bytes: memcpy that stays fast whatever the source's and destination's addresses are.
//
// Use it for bulk copies whose addresses the caller does not control (a tensor narrowed at any element, a ring
// position): collectives, tensor copies, shard packing. Same contract as std::memcpy: the ranges must not
// overlap (use std::memmove where they may).
#pragma once

#include <cstddef>
#include <string>

namespace shardkit {

// Copies n bytes from src to dst (non-overlapping): copy_bytes_line_aligned on the CPUs where copy_path_for says
// so, std::memcpy elsewhere. Note [copy alignment] in copy_bytes.cc says why.
void copy_bytes(void* dst, const void* src, std::size_t n);

// The copy that aligns the destination to 64-byte lines and copies with vector loads and aligned stores when the
// two addresses differ modulo 64 and n is at least 2 KiB; std::memcpy otherwise. Exposed so that tests run it on
// every CPU.
void copy_bytes_line_aligned(void* dst, const void* src, std::size_t n);

// Which copy copy_bytes uses on a CPU: a pure function of its identity (Note [copy alignment]).
enum class CopyPath { memcpy, line_aligned };
struct CpuIdentity {
  std::string vendor;   // CPUID leaf 0's vendor string, e.g. "AuthenticAMD", "GenuineIntel"; empty if unknown
  unsigned family = 0;  // the displayed family (base + extended), e.g. 25 for Zen 3 / Zen 4, 26 for Zen 5
};
CopyPath copy_path_for(const CpuIdentity& cpu);
// This machine's identity (CPUID on x86; empty elsewhere).
CpuIdentity this_cpu();

}  // namespace shardkit
