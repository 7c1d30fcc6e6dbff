#include "common/base/copy_bytes.h"

#include <cstdint>
#include <cstring>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace shardkit {

// Note [copy alignment]
// glibc (2.36, Debian 12) copies blocks from 2,112 bytes up to 1 MiB with `rep movsb` on x86-64, and on AMD Zen 4
// that instruction is 2.5-6x slower when the destination sits 4-28 bytes past the source within a cache line
// ((dst - src) mod 64 in [4, 28]): 3.4 GB/s at 4-12 bytes and 8 GB/s at 16-28 bytes, against 19-22 GB/s at the
// other offsets (bench/copy_bench.cc: a 32 MiB source copied in 16 or 128 KiB pieces into a cached 1 MiB buffer).
// Outside that size range glibc uses vector loops and every offset runs at full speed. The relative offset is not
// the caller's to choose: it follows from where a tensor was narrowed, or where a shared-memory ring's stream
// stands after the previous calls' headers (a barrier moves it by 40 bytes), so the same collective ran at full
// speed or far slower depending on what ran before it: comm_bench's shm all_gather and reduce_scatter at 64 MiB,
// N = 2, had repetitions of 17-35 ms against 8 ms, with glibc's memmove the hottest function in them.
// So when the two addresses differ modulo 64 and the block is large enough for rep movsb, copy_bytes aligns the
// destination to 64 bytes with a short memcpy and copies the rest with 64-byte vector loads and aligned stores
// (GCC's generic vectors: AVX-512, AVX2 or SSE2, whatever the build targets; no intrinsics). copy_bench: 0.93-1.0
// of aligned memcpy's speed at every offset on Zen 4 (memcpy itself 0.20 at 4-8 bytes, 0.42 at 16-24). An
// SSE2-only build of the same loop ran at 16-19 GB/s there. Equal offsets keep std::memcpy, at its best there.
// Zen 5 (family 26) has no such penalty: there `rep movsb` runs 36-42 GB/s at every offset while the vector loop
// tops out at 29-32 GB/s whatever it does (32-byte or 64-byte vectors, prefetching, aligned loads instead of
// stores; at offset 0 too), so copy_bytes there would be a quarter slower than std::memcpy (copy_bench on Zen 5:
// frac_of_limit 0.69-0.77 with the loop, 0.88-0.93 for memcpy). The loop is therefore chosen per CPU
// (copy_path_for): AMD family 25 (Zen 3 and Zen 4; only Zen 4 was measured, Zen 3 shares the family's `rep movsb`
// and is unmeasured), std::memcpy everywhere else (Zen 5 measured; Intel unmeasured, so it keeps glibc's choice).
// Not every slow repetition of those collectives was this: some remain after it (1 of 72 in one alternated run,
// against 5 of 72 before; more in other runs). They were not traced to the library; measured apart, this VM has
// phases in which a cache line takes 6x longer to travel between its two vCPUs (a round trip of 340-355 ns for a
// second or so, 50-60 ns otherwise), which a ring of cache-to-cache transfers would feel most.
namespace {

constexpr std::size_t kLine = 64;
constexpr std::size_t kVectorMinBytes = 2048;  // below this glibc does not use rep movsb

using Block = char __attribute__((vector_size(kLine), aligned(kLine)));
using UnalignedBlock = char __attribute__((vector_size(kLine), aligned(1)));

}  // namespace

CopyPath copy_path_for(const CpuIdentity& cpu) {
  constexpr unsigned kZen3AndZen4Family = 0x19;
  return cpu.vendor == "AuthenticAMD" && cpu.family == kZen3AndZen4Family ? CopyPath::line_aligned
                                                                           : CopyPath::memcpy;
}

CpuIdentity this_cpu() {
  CpuIdentity cpu;
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return cpu;
  char vendor[12];
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  cpu.vendor.assign(vendor, sizeof vendor);
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return cpu;
  // The displayed family: the base family, plus the extended family when the base is 15 (Intel SDM, AMD APM).
  const unsigned base_family = (eax >> 8) & 0xF;
  cpu.family = base_family == 0xF ? base_family + ((eax >> 20) & 0xFF) : base_family;
#endif
  return cpu;
}

void copy_bytes_line_aligned(void* dst, const void* src, std::size_t n) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  const auto da = reinterpret_cast<std::uintptr_t>(d);
  const auto sa = reinterpret_cast<std::uintptr_t>(s);
  if (n < kVectorMinBytes || (da - sa) % kLine == 0) {
    if (n > 0) std::memcpy(d, s, n);
    return;
  }
  const std::size_t head = (kLine - da % kLine) % kLine;
  std::memcpy(d, s, head);
  std::size_t i = head;
  for (; i + 4 * kLine <= n; i += 4 * kLine) {
    const Block a = *reinterpret_cast<const UnalignedBlock*>(s + i);
    const Block b = *reinterpret_cast<const UnalignedBlock*>(s + i + kLine);
    const Block c = *reinterpret_cast<const UnalignedBlock*>(s + i + 2 * kLine);
    const Block e = *reinterpret_cast<const UnalignedBlock*>(s + i + 3 * kLine);
    *reinterpret_cast<Block*>(d + i) = a;
    *reinterpret_cast<Block*>(d + i + kLine) = b;
    *reinterpret_cast<Block*>(d + i + 2 * kLine) = c;
    *reinterpret_cast<Block*>(d + i + 3 * kLine) = e;
  }
  std::memcpy(d + i, s + i, n - i);
}

void copy_bytes(void* dst, const void* src, std::size_t n) {
  // Decided once per process from an immutable fact (the CPU); never changes afterwards.
  static const CopyPath path = copy_path_for(this_cpu());
  if (path == CopyPath::line_aligned) {
    copy_bytes_line_aligned(dst, src, n);
  } else if (n > 0) {
    std::memcpy(dst, src, n);
  }
}

}  // namespace shardkit
