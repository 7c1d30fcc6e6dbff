#include "common/optim/multi_tensor_plan.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace shardkit::optim {
namespace {

// Walks a plan the way the kernel does (block -> tensor by first_block, chunk -> element range) and counts how
// often each element of each tensor is visited.
std::vector<std::vector<int>> Visits(const std::vector<std::int64_t>& numels, std::int64_t chunk,
                                     const std::vector<MultiTensorLaunch>& plan) {
  std::vector<std::vector<int>> visits;
  for (std::int64_t n : numels) visits.emplace_back(static_cast<std::size_t>(n), 0);
  for (const MultiTensorLaunch& l : plan) {
    EXPECT_EQ(l.first_block.size(), l.tensors.size() + 1);
    for (std::int64_t b = 0; b < l.blocks(); ++b) {
      std::size_t t = 0;
      while (l.first_block[t + 1] <= b) ++t;
      const int tensor = l.tensors[t];
      const std::int64_t begin = (b - l.first_block[t]) * chunk;
      const std::int64_t end = std::min(numels[static_cast<std::size_t>(tensor)], begin + chunk);
      EXPECT_LT(begin, end) << "block " << b << " of tensor " << tensor << " has no elements";
      for (std::int64_t i = begin; i < end; ++i) ++visits[static_cast<std::size_t>(tensor)][static_cast<std::size_t>(i)];
    }
  }
  return visits;
}

TEST(MultiTensorPlan, EveryElementOnceAndNoLaunchOverItsTensorLimit) {
  const std::vector<std::int64_t> numels = {5, 0, 16, 17, 1, 0, 40, 3, 32, 9};
  for (const std::int64_t chunk : {1, 4, 16, 100}) {
    for (const int max_tensors : {1, 2, 3, 8, 100}) {
      SCOPED_TRACE(::testing::Message() << "chunk " << chunk << ", max_tensors " << max_tensors);
      const std::vector<MultiTensorLaunch> plan = plan_multi_tensor_launches(numels, chunk, max_tensors);
      for (const MultiTensorLaunch& l : plan) {
        EXPECT_GE(l.tensors.size(), 1u);
        EXPECT_LE(static_cast<int>(l.tensors.size()), max_tensors);
      }
      const std::vector<std::vector<int>> visits = Visits(numels, chunk, plan);
      for (std::size_t t = 0; t < numels.size(); ++t) {
        for (std::size_t i = 0; i < visits[t].size(); ++i) ASSERT_EQ(visits[t][i], 1) << "tensor " << t << " element " << i;
      }
    }
  }
}

TEST(MultiTensorPlan, KeepsOrderSkipsEmptyTensorsAndFillsLaunches) {
  const std::vector<MultiTensorLaunch> plan = plan_multi_tensor_launches({3, 0, 8, 1, 0, 2}, 4, 2);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].tensors, (std::vector<int>{0, 2}));
  EXPECT_EQ(plan[0].first_block, (std::vector<std::int64_t>{0, 1, 3}));
  EXPECT_EQ(plan[1].tensors, (std::vector<int>{3, 5}));
  EXPECT_EQ(plan[1].first_block, (std::vector<std::int64_t>{0, 1, 2}));
  EXPECT_TRUE(plan_multi_tensor_launches({0, 0}, 4, 2).empty());
  EXPECT_TRUE(plan_multi_tensor_launches({}, 4, 2).empty());
}

}  // namespace
}  // namespace shardkit::optim
