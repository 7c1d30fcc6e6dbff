#include "common/comm/shm_transport.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/base/copy_bytes.h"

namespace shardkit::comm {

// Note [shm rings]
// A ring is single-producer single-consumer: `head` counts the bytes the writer (the peer) has put in, `tail`
// the bytes the reader (the segment's rank) has taken out; both only grow (64-bit: never wrap). The writer
// copies into data[head % cap ...] only where head - tail < cap, then publishes head with release order; the
// reader copies (or reduces) out of data[tail % cap ...] up to the head it read with acquire order, then
// publishes tail with release order, which hands the bytes back. `writer_closed` / `reader_closed` end the
// stream (shutdown); a reader drains what is in the ring before it reports the writer closed. No message
// boundaries are kept, as the Pair contract says. The control words sit on cache lines of their own, and
// std::atomic<std::uint64_t> is lock-free and address-free, so it works between processes.
//
// Note [shm doorbells]
// Every segment has one doorbell: a 32-bit futex word `bell` that counts rings, and `sleepers`. Whoever
// changes something a rank may be waiting for (a writer that published bytes, a reader that freed space, a
// shutdown) rings that rank's doorbell: bell.fetch_add(1), then FUTEX_WAKE only if sleepers > 0 (a wake-up
// costs a system call, ~50 us when the sleeper is descheduled: DESIGN.md section 9). A waiter reads bell
// (wake_seq) before it tries its pairs; when they moved nothing and its spin is over, it increments sleepers
// and calls FUTEX_WAIT(bell, seen, timeout), which returns at once if bell changed since it was read: a ring
// between the read and the wait is never lost (both sides use sequentially consistent read-modify-writes, so
// either the ringer sees the sleeper or the waiter's futex sees the new bell). The futex is a shared one (not
// FUTEX_PRIVATE_FLAG): the word is in memory of several processes. The timeout is the call's deadline, but at
// most kLivenessPoll, after which the runner asks check_peer() whether the peer's process still lives
// (its TCP connection closed): a SIGKILLed process rings nothing.
//
// Note [shm single copy]
// Through the ring every byte is copied twice (into the ring, out of it), and in this VM memory bandwidth is what
// limits the transport (DESIGN.md section 9). So a large send is read by the receiver straight out of the sender's
// memory with process_vm_readv (Linux cross-memory attach, as Open MPI's shared-memory transport does for large
// messages): one copy. Each ring has a mailbox next to its control words:
//   desc_end   (sender) the bytes of all descriptors posted so far; a release store publishes a descriptor
//   desc_pid, desc_addr, desc_start, desc_at   (sender) the current descriptor: whose memory, where, its first
//              byte's position among descriptor bytes, and the ring position (head) at which it comes in the stream
//   desc_read  (reader) the descriptor bytes read so far (release)
//   single_copy  (reader, at the rendezvous) the writer may post descriptors
// Sender: try_send(data, n) with n >= single_copy_min_bytes, on a ring whose reader allowed it, posts (data, n)
// and returns 0 (it rings the reader's doorbell). While a descriptor is posted the sender writes nothing into the
// ring, and each later try_send must continue it (data = the first unreported byte; SK_CHECK: the runner
// never does otherwise, stream_runner.cc) and returns the bytes the reader has read since the last report:
// bytes reported sent may be reused by the caller, so none is reported before the peer has read it. Once all are
// reported the descriptor is retired and the next send may use the ring again or post another.
// Reader: the stream is the ring's bytes up to desc_at, then the descriptor's, then the ring's again (FIFO: the
// descriptor may be posted while the ring still holds bytes; they come first). try_recv reads a descriptor with
// process_vm_readv straight into the destination; peek reads a piece of at most kBouncePiece into a per-pair
// bounce buffer, which stays in cache for the reduction that reads it (so all_reduce and reduce_scatter read the
// peer's data once from memory) and consume hands it back. Either publishes desc_read as soon as the bytes are
// copied out and rings the sender's doorbell.
// Why fields behind desc_end are safe to read: the sender writes them only when desc_read == desc_end (the reader
// is done with the previous descriptor) and publishes them with desc_end; the reader reads them only after an
// acquire load of desc_end saw more than it has read.
// Faults: the sender's memory is only valid while it waits in its call. A sender whose call fails (deadline, a
// peer lost) shuts its pairs down (TcpProcessGroup::fail_group) before the caller can free the buffer, so the
// reader checks the closed flags after each read too and discards what it read if the sender closed meanwhile
// (Unavailable, as a lost connection); a read that fails (ESRCH: the peer's process is gone; EFAULT) is
// Unavailable saying so, never a hang. A sender waiting for its descriptor to be read waits on its doorbell as for
// room in the ring, so deadlines, shutdown() and check_peer() work as before.
// Enablement: at the rendezvous (shm_rendezvous.cc) each rank probes every local peer with probe_single_copy
// (process_vm_readv of a private copy of the peer's nonce, whose address the peer's segment header holds) and
// allows single copy on its inbound ring from that peer when it succeeds and TcpProcessGroupOptions::shm_single_copy
// is on; the writer uses it when the flag is set and its own option is on. So the choice is per direction and
// needs no agreement: a rank with the option off neither allows nor posts. Where the kernel refuses (EPERM under a
// Yama ptrace_scope of 1 or more between non-descendants, ENOSYS) the ring carries everything as before.
// Why it is off by default (TcpProcessGroupOptions::shm_single_copy; measured on VM B, AMD EPYC, 2 vCPUs, comm_bench
// at 64 MiB, N = 2, load 4-8): it was slower than the ring in every configuration tried: all_reduce /
// all_gather / reduce_scatter 48 / 39 / 23 ms against 23 / 19 / 10 ms through the ring; with the tensors on 2 MiB
// pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1) 30 / 21 / 22 against 28 / 13 / 14 ms; with 4 MiB chunks (fewer
// hand-shakes) no better. process_vm_readv pins the sender's pages one at a time: 3.6 GB/s into a cached buffer on
// 4 KiB pages (7-9 GB/s on 2 MiB pages) where memcpy reads 11 GB/s. And the ring's second copy is cheap, since a
// 1 MiB ring stays in cache: both paths read the sender's bytes from memory once and the destination once, so
// single copy saves a cache-to-cache copy and pays the pinning, and its per-chunk hand-shake keeps the two ranks in
// lock step where the ring lets the sender run up to a ring ahead. It may pay where pinning is cheaper (bare metal,
// huge pages) or rings do not stay in cache; measure there with SHARDKIT_SHM_SINGLE_COPY=1.

namespace {

constexpr std::uint32_t kMagic = 0x4d48534b;  // "KSHM"
constexpr std::uint32_t kVersion = 2;  // 2: the single-copy mailbox and probe word
constexpr std::size_t kLine = 64;

// Note [shm single copy]: peek reads a descriptor in pieces of at most this into the bounce buffer (well inside a
// core's L2 next to the reduction's other operand).
constexpr std::size_t kBouncePiece = std::size_t{128} << 10;

std::size_t round_up(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }

// process_vm_readv of `n` bytes at `remote` in process `pid` into `local`: the bytes read (at least one), or
// Unavailable saying why.
absl::StatusOr<std::size_t> read_remote(std::int64_t pid, std::uint64_t remote, void* local, std::size_t n) {
  const iovec liov{local, n};
  const iovec riov{reinterpret_cast<void*>(static_cast<std::uintptr_t>(remote)), n};
  for (;;) {
    const ssize_t k = ::process_vm_readv(static_cast<pid_t>(pid), &liov, 1, &riov, 1, 0);
    if (k > 0) return static_cast<std::size_t>(k);
    const int e = k < 0 ? errno : EFAULT;
    if (e == EINTR) continue;
    if (e == ESRCH) {
      return absl::UnavailableError(
          absl::StrCat("the peer's process has gone (process_vm_readv from pid ", pid, ": ", std::strerror(e), ")"));
    }
    return absl::UnavailableError(absl::StrCat("cannot read the peer's memory (process_vm_readv of ", n,
                                               " bytes from pid ", pid, "): ", std::strerror(e)));
  }
}

long futex(std::atomic<std::uint32_t>* word, int op, std::uint32_t val, const timespec* timeout) {
  return ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), op, val, timeout, nullptr, 0);
}

}  // namespace

struct ShmSegment::Header {
  std::uint32_t magic;
  std::uint32_t version;
  std::uint64_t nonce;
  std::int64_t pid;
  std::uint64_t rings;
  std::uint64_t ring_bytes;
  std::uint64_t probe_addr;  // Note [shm single copy]: where the creator keeps a copy of `nonce`
  alignas(kLine) std::atomic<std::uint32_t> bell;
  std::atomic<std::uint32_t> sleepers;
};

struct ShmSegment::Ring {
  alignas(kLine) std::atomic<std::uint64_t> head;  // writer
  alignas(kLine) std::atomic<std::uint64_t> tail;  // reader
  alignas(kLine) std::atomic<std::uint32_t> writer_closed;
  std::atomic<std::uint32_t> reader_closed;
  // Note [shm single copy].
  std::atomic<std::uint32_t> single_copy;  // reader: the writer may post descriptors
  alignas(kLine) std::atomic<std::uint64_t> desc_end;  // writer
  std::atomic<std::int64_t> desc_pid;
  std::atomic<std::uint64_t> desc_addr;
  std::atomic<std::uint64_t> desc_start;
  std::atomic<std::uint64_t> desc_at;
  alignas(kLine) std::atomic<std::uint64_t> desc_read;  // reader
};

static_assert(std::atomic<std::uint64_t>::is_always_lock_free && std::atomic<std::uint32_t>::is_always_lock_free);
static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t));

namespace {
std::size_t header_bytes() { return round_up(sizeof(ShmSegment::Header), kLine); }
std::size_t rings_bytes(int rings) { return round_up(static_cast<std::size_t>(rings) * sizeof(ShmSegment::Ring), 4096); }
}  // namespace

std::size_t ShmSegment::size_for(int rings, std::size_t ring_bytes) {
  return round_up(header_bytes(), 4096) + rings_bytes(rings) + static_cast<std::size_t>(rings) * round_up(ring_bytes, 4096);
}

ShmSegment::Header* ShmSegment::header() const { return static_cast<Header*>(base_); }
ShmSegment::Ring* ShmSegment::ring(int i) const {
  return reinterpret_cast<Ring*>(static_cast<char*>(base_) + round_up(header_bytes(), 4096)) + i;
}
char* ShmSegment::ring_data(int i) const {
  return static_cast<char*>(base_) + round_up(header_bytes(), 4096) + rings_bytes(rings_) +
         static_cast<std::size_t>(i) * round_up(ring_bytes_, 4096);
}

absl::StatusOr<std::shared_ptr<ShmSegment>> ShmSegment::create(const std::string& name, int rings,
                                                               std::size_t ring_bytes, std::uint64_t nonce) {
  const std::size_t size = size_for(rings, ring_bytes);
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("cannot create the shared-memory segment '", name,
                                               "' (shm_open): ", std::strerror(errno)));
  }
  auto fail = [&](absl::StatusCode code, const std::string& what, int err) {
    ::close(fd);
    ::shm_unlink(name.c_str());
    return absl::Status(code, absl::StrCat("cannot create the shared-memory segment '", name, "' of ", size,
                                           " bytes (", what, "): ", std::strerror(err)));
  };
  // posix_fallocate, not ftruncate alone: a /dev/shm without room is an error now, not a SIGBUS on first touch.
  if (const int e = ::posix_fallocate(fd, 0, static_cast<off_t>(size)); e != 0) {
    return fail(e == ENOSPC ? absl::StatusCode::kResourceExhausted : absl::StatusCode::kUnavailable,
                "posix_fallocate; is /dev/shm large enough?", e);
  }
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return fail(absl::StatusCode::kUnavailable, "mmap", errno);
  ::close(fd);
  auto* h = new (base) Header{};
  h->magic = kMagic;
  h->version = kVersion;
  h->nonce = nonce;
  h->pid = ::getpid();
  h->rings = static_cast<std::uint64_t>(rings);
  h->ring_bytes = ring_bytes;
  std::shared_ptr<ShmSegment> seg(new ShmSegment(name, base, size, rings, ring_bytes));
  seg->private_nonce_ = nonce;
  h->probe_addr = reinterpret_cast<std::uintptr_t>(&seg->private_nonce_);
  for (int i = 0; i < rings; ++i) new (seg->ring(i)) Ring{};
  return seg;
}

absl::StatusOr<std::shared_ptr<ShmSegment>> ShmSegment::open(const std::string& name, int rings,
                                                             std::size_t ring_bytes, std::uint64_t nonce) {
  const std::size_t size = size_for(rings, ring_bytes);
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    const int e = errno;
    return absl::Status(e == ENOENT ? absl::StatusCode::kNotFound : absl::StatusCode::kUnavailable,
                        absl::StrCat("cannot open the shared-memory segment '", name, "' (shm_open): ",
                                     std::strerror(e)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) != size) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat("shared-memory segment '", name, "': expected ", size,
                                                   " bytes, found ", st.st_size));
  }
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int e = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    return absl::UnavailableError(absl::StrCat("cannot map the shared-memory segment '", name, "': ", std::strerror(e)));
  }
  std::shared_ptr<ShmSegment> seg(new ShmSegment(name, base, size, rings, ring_bytes));
  const Header* h = seg->header();
  if (h->magic != kMagic || h->version != kVersion || h->nonce != nonce || h->rings != static_cast<std::uint64_t>(rings) ||
      h->ring_bytes != ring_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory segment '", name, "' is not the one expected: expected magic ", kMagic, " version ", kVersion,
        " nonce ", nonce, ", found ", h->magic, " ", h->version, " ", h->nonce));
  }
  return seg;
}

ShmSegment::~ShmSegment() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

absl::Status ShmSegment::unlink() const {
  if (::shm_unlink(name_.c_str()) == 0 || errno == ENOENT) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("shm_unlink('", name_, "'): ", std::strerror(errno)));
}

void ShmSegment::allow_single_copy(int i) { ring(i)->single_copy.store(1, std::memory_order_release); }

absl::Status probe_single_copy(const ShmSegment& peer) {
  const ShmSegment::Header* h = peer.header();
  std::uint64_t got = ~h->nonce;
  const iovec liov{&got, sizeof(got)};
  const iovec riov{reinterpret_cast<void*>(static_cast<std::uintptr_t>(h->probe_addr)), sizeof(got)};
  const ssize_t k = ::process_vm_readv(static_cast<pid_t>(h->pid), &liov, 1, &riov, 1, 0);
  if (k != static_cast<ssize_t>(sizeof(got))) {
    const int e = k < 0 ? errno : EFAULT;
    return absl::FailedPreconditionError(absl::StrCat("process_vm_readv of pid ", h->pid, " failed: ", std::strerror(e),
                                                      e == EPERM ? " (the kernel's ptrace policy forbids it)" : ""));
  }
  if (got != h->nonce) {
    return absl::FailedPreconditionError(absl::StrCat("process_vm_readv of pid ", h->pid, ": expected the word ",
                                                      h->nonce, ", found ", got));
  }
  return absl::OkStatus();
}

void ring_doorbell(ShmSegment& segment) {
  ShmSegment::Header* h = segment.header();
  h->bell.fetch_add(1, std::memory_order_seq_cst);
  if (h->sleepers.load(std::memory_order_seq_cst) > 0) futex(&h->bell, FUTEX_WAKE, INT_MAX, nullptr);
}

ShmPair::ShmPair(std::shared_ptr<ShmSegment> self, int from_peer, std::shared_ptr<ShmSegment> peer, int to_peer,
                 tcp::Socket liveness, ShmPairOptions options)
    : self_(std::move(self)),
      peer_(std::move(peer)),
      in_(self_->ring(from_peer)),
      in_data_(self_->ring_data(from_peer)),
      out_(peer_->ring(to_peer)),
      out_data_(peer_->ring_data(to_peer)),
      cap_(self_->ring_bytes()),
      out_cap_(peer_->ring_bytes()),
      liveness_(std::move(liveness)),
      single_copy_(options.single_copy && out_->single_copy.load(std::memory_order_acquire) != 0),
      single_copy_min_(std::max<std::size_t>(options.single_copy_min_bytes, 1)),
      pid_(::getpid()) {
  // Descriptor positions continue from wherever the mailboxes stand (a new pair on a ring is not expected, but
  // costs nothing to allow).
  posted_start_ = posted_end_ = reported_ = out_->desc_end.load(std::memory_order_acquire);
  fetched_ = in_->desc_read.load(std::memory_order_acquire);
}

ShmPair::~ShmPair() { shutdown(); }

absl::StatusOr<std::size_t> ShmPair::try_send(const void* data, std::size_t n) {
  if (shut_.load(std::memory_order_acquire)) return absl::UnavailableError("shut down on this rank");
  if (out_->reader_closed.load(std::memory_order_acquire) != 0) return absl::UnavailableError("closed by the peer");
  if (peer_gone_.load(std::memory_order_acquire)) {
    return absl::UnavailableError("the peer's process has gone (its connection closed)");
  }
  const auto* bytes = static_cast<const char*>(data);
  if (reported_ < posted_end_) {
    // A descriptor is posted: report what the reader has read of it (Note [shm single copy]).
    SK_CHECK(bytes == posted_ + (reported_ - posted_start_))
        << "ShmPair::try_send: a posted single-copy descriptor must be continued, expected the send at byte "
        << (reported_ - posted_start_) << " of " << (posted_end_ - posted_start_);
    const std::uint64_t read = out_->desc_read.load(std::memory_order_acquire);
    const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(read - reported_, n));
    reported_ += k;
    stats_.bytes_sent += k;
    return k;
  }
  const std::uint64_t head = out_->head.load(std::memory_order_relaxed);
  if (single_copy_ && n >= single_copy_min_) {
    out_->desc_pid.store(pid_, std::memory_order_relaxed);
    out_->desc_addr.store(reinterpret_cast<std::uintptr_t>(bytes), std::memory_order_relaxed);
    out_->desc_start.store(posted_end_, std::memory_order_relaxed);
    out_->desc_at.store(head, std::memory_order_relaxed);
    posted_ = bytes;
    posted_start_ = posted_end_;
    posted_end_ += n;
    out_->desc_end.store(posted_end_, std::memory_order_release);
    ++stats_.descriptors_posted;
    ring_doorbell(*peer_);
    return std::size_t{0};
  }
  const std::uint64_t tail = out_->tail.load(std::memory_order_acquire);
  const std::size_t room = out_cap_ - static_cast<std::size_t>(head - tail);
  const std::size_t k = std::min(n, room);
  if (k == 0) return std::size_t{0};
  const std::size_t at = static_cast<std::size_t>(head % out_cap_);
  const std::size_t first = std::min(k, out_cap_ - at);
  copy_bytes(out_data_ + at, bytes, first);  // Note [copy alignment]: the ring position moves with every call
  if (k > first) copy_bytes(out_data_, bytes + first, k - first);
  out_->head.store(head + k, std::memory_order_release);
  ring_doorbell(*peer_);
  return k;
}

absl::Status ShmPair::recv_closed() const {
  if (shut_.load(std::memory_order_acquire)) return absl::UnavailableError("shut down on this rank");
  if (in_->writer_closed.load(std::memory_order_acquire) != 0) return absl::UnavailableError("closed by the peer");
  if (peer_gone_.load(std::memory_order_acquire)) {
    return absl::UnavailableError("the peer's process has gone (its connection closed)");
  }
  return absl::OkStatus();
}

bool ShmPair::descriptor_at_head(std::uint64_t tail) const {
  // Note [shm single copy]: a descriptor not fully read whose place in the stream has come (the ring's bytes
  // before it are drained; while it is posted the sender writes nothing into the ring, so tail <= desc_at).
  return in_->desc_end.load(std::memory_order_acquire) > fetched_ &&
         in_->desc_at.load(std::memory_order_relaxed) == tail;
}

absl::StatusOr<std::size_t> ShmPair::read_descriptor(char* dst, std::size_t n) {
  // The sender's memory is valid only while its call waits: not once it has closed (Note [shm single copy]).
  if (absl::Status closed = recv_closed(); !closed.ok()) return closed;
  const std::uint64_t end = in_->desc_end.load(std::memory_order_acquire);
  const std::uint64_t start = in_->desc_start.load(std::memory_order_relaxed);
  const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(end - fetched_, n));
  auto got = read_remote(in_->desc_pid.load(std::memory_order_relaxed),
                         in_->desc_addr.load(std::memory_order_relaxed) + (fetched_ - start), dst, k);
  if (!got.ok()) return got.status();
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (absl::Status closed = recv_closed(); !closed.ok()) return closed;  // it may have closed while we read
  fetched_ += *got;
  stats_.bytes_read += *got;
  in_->desc_read.store(fetched_, std::memory_order_release);
  ring_doorbell(*peer_);  // the sender waits for its bytes to be read
  return *got;
}

absl::StatusOr<std::pair<const char*, std::size_t>> ShmPair::peek(std::size_t n) {
  if (bounce_left() > 0) return std::pair<const char*, std::size_t>{bounce_.get() + bounce_off_, std::min(n, bounce_left())};
  if (n > 0 && descriptor_at_head(in_->tail.load(std::memory_order_relaxed))) {
    if (!bounce_) bounce_.reset(new char[kBouncePiece]);
    auto k = read_descriptor(bounce_.get(), std::min(n, kBouncePiece));
    if (!k.ok()) return k.status();
    bounce_off_ = 0;
    bounce_len_ = *k;
    return std::pair<const char*, std::size_t>{bounce_.get(), *k};
  }
  return ring_view(n);
}

absl::StatusOr<std::pair<const char*, std::size_t>> ShmPair::ring_view(std::size_t n) const {
  // The closed flags are read before head: bytes published before a close are drained first.
  const absl::Status closed = recv_closed();
  const std::uint64_t tail = in_->tail.load(std::memory_order_relaxed);
  const std::uint64_t head = in_->head.load(std::memory_order_acquire);
  const std::size_t avail = static_cast<std::size_t>(head - tail);
  if (avail == 0) {
    if (!closed.ok()) return closed;
    return std::pair<const char*, std::size_t>{in_data_, 0};
  }
  // With a descriptor posted, head stands at its desc_at (the sender writes nothing more until it is read), so
  // these are the bytes before it.
  const std::size_t at = static_cast<std::size_t>(tail % cap_);
  return std::pair<const char*, std::size_t>{in_data_ + at, std::min({n, avail, cap_ - at})};
}

void ShmPair::consume(std::size_t n) {
  if (n == 0) return;
  if (bounce_left() > 0) {
    // peek returned bounce bytes (it always does while there are some); their read was published already.
    SK_CHECK(n <= bounce_left()) << "ShmPair::consume: " << n << " bytes, only " << bounce_left() << " peeked";
    bounce_off_ += n;
    if (bounce_off_ == bounce_len_) bounce_off_ = bounce_len_ = 0;
    return;
  }
  in_->tail.store(in_->tail.load(std::memory_order_relaxed) + n, std::memory_order_release);
  ring_doorbell(*peer_);  // the peer may wait for room
}

absl::StatusOr<std::size_t> ShmPair::try_recv(void* data, std::size_t n) {
  char* dst = static_cast<char*>(data);
  std::size_t done = 0;
  if (bounce_left() > 0) {  // what peek read and no one consumed comes first
    done = std::min(n, bounce_left());
    copy_bytes(dst, bounce_.get() + bounce_off_, done);
    consume(done);
  }
  bool freed = false;
  for (int piece = 0; piece < 3 && done < n; ++piece) {  // the ring up to its end, from its start, a descriptor
    if (descriptor_at_head(in_->tail.load(std::memory_order_relaxed))) {
      auto k = read_descriptor(dst + done, n - done);
      if (!k.ok()) {
        if (done > 0) break;
        return k.status();
      }
      done += *k;
      break;
    }
    auto p = ring_view(n - done);
    if (!p.ok()) {
      if (done > 0) break;
      return p.status();
    }
    if (p->second == 0) break;
    copy_bytes(dst + done, p->first, p->second);
    in_->tail.store(in_->tail.load(std::memory_order_relaxed) + p->second, std::memory_order_release);
    done += p->second;
    freed = true;
  }
  if (freed) ring_doorbell(*peer_);
  return done;
}

void ShmPair::shutdown() {
  if (shut_.exchange(true)) return;
  out_->writer_closed.store(1, std::memory_order_release);
  in_->reader_closed.store(1, std::memory_order_release);
  ring_doorbell(*peer_);
  ring_doorbell(*self_);  // this rank's own comm thread may sleep on it
  if (liveness_.valid()) ::shutdown(liveness_.fd(), SHUT_RDWR);
}

std::uint32_t ShmPair::wake_seq() const { return self_->header()->bell.load(std::memory_order_seq_cst); }

bool ShmPair::wait_wake(std::uint32_t seen, absl::Time until) {
  ShmSegment::Header* h = self_->header();
  const absl::Duration left = until - absl::Now();
  if (left <= absl::ZeroDuration()) return h->bell.load() != seen;
  const timespec ts = absl::ToTimespec(left);
  h->sleepers.fetch_add(1, std::memory_order_seq_cst);
  futex(&h->bell, FUTEX_WAIT, seen, &ts);
  h->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  return h->bell.load(std::memory_order_seq_cst) != seen;
}

void ShmPair::check_peer() {
  if (!liveness_.valid() || peer_gone_.load()) return;
  pollfd p{liveness_.fd(), POLLRDHUP, 0};
  if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
    peer_gone_.store(true, std::memory_order_release);
  }
}

}  // namespace shardkit::comm
