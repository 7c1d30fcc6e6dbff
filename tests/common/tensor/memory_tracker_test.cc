#include <thread>

#include "common/tensor/rank_context.h"
#include "common/tensor/tensor.h"
#include "gtest/gtest.h"

namespace shardkit {
namespace {

TEST(MemoryTrackerTest, ExactFiguresForKnownAllocations) {
  RankContext ctx;
  RankContextScope scope(ctx);
  MemoryTracker& m = *ctx.memory;
  {
    Tensor p = Tensor::empty({1000}, TensorOptions{}.with_category(MemoryCategory::parameter));
    Tensor g = Tensor::zeros({10, 10}, TensorOptions{}.with_dtype(DType::bf16).with_category(MemoryCategory::gradient));
    EXPECT_EQ(m.current(MemoryCategory::parameter), 4000);
    EXPECT_EQ(m.current(MemoryCategory::gradient), 200);
    EXPECT_EQ(m.total_current(), 4200);
    {
      MemoryCategoryScope cat(MemoryCategory::optimizer_state);
      Tensor s = Tensor::zeros({7}, TensorOptions{}.with_dtype(DType::i64));
      EXPECT_EQ(m.current(MemoryCategory::optimizer_state), 56);
    }
    EXPECT_EQ(m.current(MemoryCategory::optimizer_state), 0);
    EXPECT_EQ(m.peak(MemoryCategory::optimizer_state), 56);
    EXPECT_EQ(m.total_peak(), 4256);
  }
  EXPECT_EQ(m.total_current(), 0);
  EXPECT_EQ(m.peak(MemoryCategory::parameter), 4000);
  m.reset_peaks();
  EXPECT_EQ(m.total_peak(), 0);
}

TEST(MemoryTrackerTest, DefaultCategoryIsOther) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Tensor t = Tensor::empty({3});
  EXPECT_EQ(ctx.memory->current(MemoryCategory::other), 12);
}

TEST(MemoryTrackerTest, ViewsAreNotCharged) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Tensor flat = Tensor::zeros({100});
  Tensor a = flat.view(0, {10, 5});
  Tensor b = flat.view(50, {50});
  EXPECT_EQ(ctx.memory->total_current(), 400);
}

TEST(MemoryTrackerTest, ReleaseAndReallocateAreCharged) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Tensor t = Tensor::zeros({256}, TensorOptions{}.with_category(MemoryCategory::parameter));
  Tensor v = t.view(128, {128});
  t.release_storage();
  EXPECT_TRUE(v.storage_released());
  EXPECT_EQ(ctx.memory->current(MemoryCategory::parameter), 0);
  t.reallocate_storage();
  EXPECT_EQ(ctx.memory->current(MemoryCategory::parameter), 1024);
  t.storage()->recategorize(MemoryCategory::gradient);
  EXPECT_EQ(ctx.memory->current(MemoryCategory::parameter), 0);
  EXPECT_EQ(ctx.memory->current(MemoryCategory::gradient), 1024);
}

TEST(MemoryTrackerTest, FreedStorageCreditsTheRankThatAllocatedIt) {
  RankContext a, b;
  Tensor t;
  {
    RankContextScope scope(a);
    t = Tensor::empty({10});
  }
  {
    RankContextScope scope(b);
    t = Tensor();  // freed while running as rank b
  }
  EXPECT_EQ(a.memory->total_current(), 0);
  EXPECT_EQ(a.memory->total_peak(), 40);
  EXPECT_EQ(b.memory->total_peak(), 0);
}

TEST(MemoryTrackerTest, RanksOnThreadsHaveSeparateLedgers) {
  RankContext ctx[2];
  std::thread th[2];
  for (int r = 0; r < 2; ++r) {
    th[r] = std::thread([&, r] {
      RankContextScope scope(ctx[r]);
      MemoryCategoryScope cat(MemoryCategory::activation);
      std::vector<Tensor> keep;
      for (int i = 0; i <= r; ++i) keep.push_back(Tensor::empty({1000}));
    });
  }
  for (auto& t : th) t.join();
  EXPECT_EQ(ctx[0].memory->peak(MemoryCategory::activation), 4000);
  EXPECT_EQ(ctx[1].memory->peak(MemoryCategory::activation), 8000);
}

TEST(MemoryTrackerTest, SnapshotPrintsEveryCategory) {
  MemoryTracker m;
  m.charge(MemoryCategory::communication_buffer, 5);
  const std::string s = m.snapshot().to_string();
  EXPECT_NE(s.find("communication_buffer  current=5 peak=5"), std::string::npos) << s;
  EXPECT_NE(s.find("total"), std::string::npos);
}

// Each location keeps its own figures and its own peaks; the base figures are both together.
TEST(MemoryTrackerTest, HostAndDeviceBytesAreKeptApart) {
  MemoryTracker m;
  m.charge(MemoryCategory::parameter, 100, MemoryLocation::device);
  m.charge(MemoryCategory::parameter, 30);  // host
  m.charge(MemoryCategory::optimizer_state, 800, MemoryLocation::host);
  m.credit(MemoryCategory::optimizer_state, 800, MemoryLocation::host);
  m.charge(MemoryCategory::gradient, 50, MemoryLocation::device);
  const MemorySnapshot s = m.snapshot();
  const MemoryFigures& host = s.at(MemoryLocation::host);
  const MemoryFigures& device = s.at(MemoryLocation::device);
  EXPECT_EQ(device.current_of(MemoryCategory::parameter), 100);
  EXPECT_EQ(host.current_of(MemoryCategory::parameter), 30);
  EXPECT_EQ(s.current_of(MemoryCategory::parameter), 130);
  EXPECT_EQ(device.total_current, 150);
  EXPECT_EQ(device.total_peak, 150);
  EXPECT_EQ(host.total_current, 30);
  EXPECT_EQ(host.total_peak, 830);  // the optimizer state's moment, before the device's gradient
  EXPECT_EQ(s.total_peak, 930);     // both together at that moment
  EXPECT_EQ(s.total_current, 180);
  EXPECT_EQ(device.peak_of(MemoryCategory::optimizer_state), 0);
  EXPECT_NE(s.to_string().find("device parameter      current=100 peak=100"), std::string::npos) << s.to_string();
  // A credit is checked against its own location: the host never held device gradient bytes.
  EXPECT_THROW(m.credit(MemoryCategory::gradient, 50, MemoryLocation::host), InternalError);
  m.reset_peaks();
  EXPECT_EQ(m.snapshot().at(MemoryLocation::host).total_peak, 30);
  EXPECT_EQ(m.snapshot().at(MemoryLocation::device).total_peak, 150);
}

// CPU storage is host memory in the ledger.
TEST(MemoryTrackerTest, CpuTensorsAreHostBytes) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Tensor p = Tensor::empty({16}, TensorOptions{}.with_category(MemoryCategory::parameter));
  const MemorySnapshot s = ctx.memory->snapshot();
  EXPECT_EQ(s.at(MemoryLocation::host).current_of(MemoryCategory::parameter), 64);
  EXPECT_EQ(s.at(MemoryLocation::device).total_peak, 0);
}

}  // namespace
}  // namespace shardkit
