// Storage takes its CPU bytes from the HostBlockSource installed on the allocating thread and gives them back
// there (also when released and reallocated, and when the last reference goes on another thread); the ledger is
// charged the same as from the heap; scopes nest.
#include "common/tensor/host_block_source.h"

#include <cstdlib>
#include <thread>
#include <vector>

#include "common/tensor/device_memory.h"
#include "common/tensor/pinned_host_source.h"
#include "common/tensor/rank_context.h"
#include "common/tensor/storage.h"
#include "gtest/gtest.h"

namespace shardkit {
namespace {

// Serves from the heap and counts.
class CountingSource final : public HostBlockSource {
 public:
  void* allocate(std::size_t nbytes) override {
    ++allocated;
    sizes.push_back(nbytes);
    return std::aligned_alloc(64, nbytes);
  }
  void free(void* data, std::size_t nbytes) override {
    ++freed;
    freed_bytes += static_cast<std::int64_t>(nbytes);
    std::free(data);
  }
  int allocated = 0;
  int freed = 0;
  std::int64_t freed_bytes = 0;
  std::vector<std::size_t> sizes;
};

TEST(HostBlockSourceTest, StorageTakesAndGivesBackThroughTheInstalledSource) {
  RankContext ctx;
  RankContextScope rank(ctx);
  auto source = std::make_shared<CountingSource>();
  std::shared_ptr<Storage> s;
  {
    HostBlockSourceScope scope(source);
    EXPECT_EQ(current_host_block_source().get(), source.get());
    s = Storage::allocate(100, Device::cpu(), MemoryCategory::activation);
  }
  EXPECT_EQ(current_host_block_source(), nullptr);
  EXPECT_EQ(source->allocated, 1);
  EXPECT_EQ(source->sizes, std::vector<std::size_t>{128});  // a multiple of 64
  EXPECT_EQ(ctx.memory->current(MemoryCategory::activation), 100);  // charged as from the heap
  s->release();  // back to the source, though it is no longer installed
  EXPECT_EQ(source->freed, 1);
  EXPECT_EQ(source->freed_bytes, 128);
  EXPECT_EQ(ctx.memory->current(MemoryCategory::activation), 0);
  s->reallocate();  // no source installed now: the heap
  EXPECT_EQ(source->allocated, 1);
  s.reset();
  EXPECT_EQ(source->freed, 1);
}

TEST(HostBlockSourceTest, TheLastReferenceMayGoOnAnotherThreadAndScopesNest) {
  RankContext ctx;
  RankContextScope rank(ctx);
  auto outer = std::make_shared<CountingSource>();
  auto inner = std::make_shared<CountingSource>();
  std::shared_ptr<Storage> a, b;
  {
    HostBlockSourceScope o(outer);
    {
      HostBlockSourceScope i(inner);
      b = Storage::allocate(64, Device::cpu(), MemoryCategory::other);
    }
    a = Storage::allocate(64, Device::cpu(), MemoryCategory::other);
  }
  EXPECT_EQ(outer->allocated, 1);
  EXPECT_EQ(inner->allocated, 1);
  std::thread([b = std::move(b)]() mutable { b.reset(); }).join();
  EXPECT_EQ(inner->freed, 1);
  a.reset();
  EXPECT_EQ(outer->freed, 1);
}

// PinnedHostSource (pinned_host_source.h): host bytes a Storage reads and writes like any others, page-locked
// exactly when the program can pin memory (a CUDA device is usable: shardkit::cuda with a GPU, or the CUDA
// emulator), the heap's otherwise; given back to the source when released; charged to the host ledger.
TEST(PinnedHostSourceTest, HostBytesPinnedWhenADeviceIsUsable) {
  RankContext ctx;
  RankContextScope rank(ctx);
  auto source = std::make_shared<PinnedHostSource>();
  std::shared_ptr<Storage> s;
  {
    HostBlockSourceScope scope(source);
    s = Storage::allocate(1000, Device::cpu(), MemoryCategory::parameter);
  }
  const bool can_pin = detail::cuda_device_count() > 0;
  EXPECT_EQ(s->pinned(), can_pin);
  static_cast<char*>(s->data())[999] = 7;
  EXPECT_EQ(static_cast<char*>(s->data())[999], 7);
  EXPECT_EQ(ctx.memory->snapshot().at(MemoryLocation::host).current_of(MemoryCategory::parameter), 1000);
  s->release();
  EXPECT_FALSE(s->pinned());
  s.reset();
  EXPECT_EQ(ctx.memory->current(MemoryCategory::parameter), 0);
  EXPECT_FALSE(Storage::allocate(64, Device::cpu(), MemoryCategory::other)->pinned()) << "the heap's";
}

}  // namespace
}  // namespace shardkit
