// Shared-memory transport: the Pair (transport.h) between two process ranks on one host, over POSIX shared
// memory (DESIGN.md section 2; issue 15 item 2). shm_rendezvous.h decides which pairs use it and builds them.
//
// Every rank of a group creates one segment (ShmSegment::create, shm_open + posix_fallocate + mmap) holding its
// doorbell and one inbound ring per other rank on its host; every other local rank maps it
// (ShmSegment::open). The ring from rank p to rank r lives in r's segment (Note [shm rings] in shm_transport.cc):
// p copies into it (try_send), r copies out of it (try_recv) or reduces straight out of it (peek / consume).
// Once every local rank has mapped the segments, their names are unlinked (shm_rendezvous.cc), so a crash leaks
// nothing: the memory goes away with the last mapping.
//
// Waiting (Note [shm doorbells]): the writer of a ring and the reader who frees space ring the other rank's
// doorbell, a futex word in that rank's segment; a rank's pairs share its doorbell (wake_key), so the runner
// waits for its send and receive pairs at once, after a bounded spin, until the call's deadline.
// Single copy (Note [shm single copy] in shm_transport.cc): a send of at least single_copy_min_bytes is not
// copied into the ring; the sender posts a descriptor (its pid, the address, the length) in the ring's mailbox and
// the reader copies the bytes straight out of the sender's memory with process_vm_readv (Linux cross-memory
// attach; Open MPI's "single copy"), into the destination (try_recv) or a small bounce buffer that stays in cache
// (peek / consume). Each byte then crosses memory once instead of twice. A send is reported only once the reader
// has read its bytes (the Pair contract: the caller may reuse reported bytes). The reader of each ring allows it at
// the rendezvous only when it could read a known word of the writer's memory (probe_single_copy: EPERM / ENOSYS
// where the kernel or its policy refuses, then the ring carries everything as before). Off by default: on the VMs
// measured it is slower than the ring (Note [shm single copy]); TcpProcessGroupOptions::shm_single_copy /
// SHARDKIT_SHM_SINGLE_COPY=1 turns it on.
// Liveness: each ShmPair keeps the pair's TCP connection from the rendezvous, unused for data; a peer process
// that dies closes it (hangup_fd, check_peer), so a dead peer is an error naming it, as over TCP. shutdown()
// marks both rings closed, rings both doorbells and shuts the connection down.
//
// Thread-safety: as Pair. ShmSegment: immutable after creation (the mapped memory is shared by design).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "common/comm/tcp_socket.h"
#include "common/comm/transport.h"

namespace shardkit::comm {

// One rank's mapped segment: a header (magic, the creator's nonce and pid, the address of a private copy of the
// nonce for probe_single_copy, the doorbell) and `rings` inbound rings of `ring_bytes` each, each with its
// single-copy mailbox.
class ShmSegment {
 public:
  // Creates a new segment named `name` ("/..."; refused when the name exists: O_EXCL, mode 0600) and maps it.
  // ResourceExhausted when /dev/shm has no room for it (posix_fallocate, so a full /dev/shm is an error here,
  // not SIGBUS later).
  static absl::StatusOr<std::shared_ptr<ShmSegment>> create(const std::string& name, int rings, std::size_t ring_bytes,
                                                            std::uint64_t nonce);
  // Maps an existing segment; InvalidArgument / NotFound when it is not the one expected (size, magic, nonce).
  static absl::StatusOr<std::shared_ptr<ShmSegment>> open(const std::string& name, int rings, std::size_t ring_bytes,
                                                          std::uint64_t nonce);
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // shm_unlink(name()) (the mapping stays); NotFound is fine (already unlinked).
  absl::Status unlink() const;
  const std::string& name() const { return name_; }
  int rings() const { return rings_; }
  std::size_t ring_bytes() const { return ring_bytes_; }
  // Bytes of a segment with these dimensions.
  static std::size_t size_for(int rings, std::size_t ring_bytes);
  // Lets the writer of inbound ring `ring` post single-copy descriptors (Note [shm single copy]); the rank that
  // created the segment (the ring's reader) calls it at the rendezvous once probe_single_copy of the writer's
  // segment succeeded, before the writer builds its ShmPair.
  void allow_single_copy(int ring);

  struct Header;
  struct Ring;
  Header* header() const;
  Ring* ring(int i) const;
  char* ring_data(int i) const;

 private:
  ShmSegment(std::string name, void* base, std::size_t size, int rings, std::size_t ring_bytes)
      : name_(std::move(name)), base_(base), size_(size), rings_(rings), ring_bytes_(ring_bytes) {}
  std::string name_;
  void* base_ = nullptr;
  std::size_t size_ = 0;
  int rings_ = 0;
  std::size_t ring_bytes_ = 0;
  std::uint64_t private_nonce_ = 0;  // the creator's probe word (its address is in the header)
};

// Whether this process can read the memory of the process that created `peer` with process_vm_readv: reads the
// word whose address that process published in its segment's header and compares it with the header's nonce.
// FailedPrecondition saying why otherwise (EPERM: the kernel's ptrace policy forbids it; ENOSYS: no
// cross-memory attach; a different word).
absl::Status probe_single_copy(const ShmSegment& peer);

struct ShmPairOptions {
  // Post single-copy descriptors for large sends where the reader allowed it (ShmSegment::allow_single_copy).
  // Off by default (Note [shm single copy]: slower than the ring where measured).
  bool single_copy = false;
  // Sends (one try_send) of at least this many bytes go by single copy; smaller ones through the ring. 64 KiB:
  // below the runner's 128 KiB pieces of all_gather sends and 256 KiB chunks (stream_runner.cc), above the size
  // where a descriptor's hand-shake costs more than the copy it saves.
  std::size_t single_copy_min_bytes = std::size_t{64} << 10;
};

class ShmPair final : public Pair {
 public:
  // This rank's end towards one local peer: `self` is this rank's segment (its ring `from_peer` is the
  // inbound ring from the peer), `peer` the peer's segment (its ring `to_peer` is this rank's outbound ring).
  // `liveness`: the pair's TCP connection from the rendezvous (closed when the peer's process dies).
  // Single copy is used towards the peer when options.single_copy and the peer allowed it for this rank's ring.
  ShmPair(std::shared_ptr<ShmSegment> self, int from_peer, std::shared_ptr<ShmSegment> peer, int to_peer,
          tcp::Socket liveness, ShmPairOptions options = {});
  ~ShmPair() override;

  absl::StatusOr<std::size_t> try_send(const void* data, std::size_t n) override;
  absl::StatusOr<std::size_t> try_recv(void* data, std::size_t n) override;
  int poll_fd() const override { return -1; }
  void shutdown() override;

  const void* wake_key() const override { return self_.get(); }
  std::uint32_t wake_seq() const override;
  bool wait_wake(std::uint32_t seen, absl::Time until) override;
  void check_peer() override;
  int hangup_fd() const override { return liveness_.fd(); }
  bool peekable() const override { return true; }
  absl::StatusOr<std::pair<const char*, std::size_t>> peek(std::size_t n) override;
  void consume(std::size_t n) override;

  // Whether this end's sends of single_copy_min_bytes or more go by single copy (Note [shm single copy]).
  bool sends_single_copy() const { return single_copy_; }
  // What went by single copy through this end (for tests and benchmarks; the thread that sends / receives).
  struct Stats {
    std::uint64_t descriptors_posted = 0;  // sends
    std::uint64_t bytes_sent = 0;          // of them, reported sent
    std::uint64_t bytes_read = 0;          // received, read from the peer's memory
  };
  const Stats& stats() const { return stats_; }

 private:
  absl::Status recv_closed() const;
  // The receive side of a posted descriptor (Note [shm single copy]).
  bool descriptor_at_head(std::uint64_t tail) const;
  absl::StatusOr<std::size_t> read_descriptor(char* dst, std::size_t n);
  // Up to n bytes readable in place in the inbound ring (peek without descriptors or the bounce buffer).
  absl::StatusOr<std::pair<const char*, std::size_t>> ring_view(std::size_t n) const;
  std::size_t bounce_left() const { return bounce_len_ - bounce_off_; }

  std::shared_ptr<ShmSegment> self_, peer_;
  ShmSegment::Ring* in_;   // in self_: the peer writes, this rank reads
  char* in_data_;
  ShmSegment::Ring* out_;  // in peer_: this rank writes, the peer reads
  char* out_data_;
  std::size_t cap_;        // in_ capacity
  std::size_t out_cap_;
  tcp::Socket liveness_;
  std::atomic<bool> shut_{false};
  std::atomic<bool> peer_gone_{false};
  // Single copy: sender side (the thread that sends).
  bool single_copy_ = false;
  std::size_t single_copy_min_ = 0;
  std::int64_t pid_ = 0;
  const char* posted_ = nullptr;  // the posted descriptor's bytes; first unreported at posted_ + (reported_ - posted_start_)
  std::uint64_t posted_start_ = 0, posted_end_ = 0, reported_ = 0;  // descriptor stream positions
  // Receive side (the thread that receives): bytes of descriptors read so far, and the bounce buffer of peek.
  std::uint64_t fetched_ = 0;
  std::unique_ptr<char[]> bounce_;
  std::size_t bounce_off_ = 0, bounce_len_ = 0;
  Stats stats_;
};

// Rings a segment's doorbell (wakes its rank if it sleeps on it). For ShmPair and tests.
void ring_doorbell(ShmSegment& segment);

}  // namespace shardkit::comm
