#include <string>
#include <thread>
#include <vector>

#include "common/comm/device_mesh.h"
#include "common/comm/testing/run_ranks.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::comm {
namespace {

TEST(DeviceMeshTest, TwoDimensionalGroupsForHsdp) {
  // 2 x 3 mesh: 2 replicas ("replicate") of 3-way sharding ("shard").
  absl::Status st = RunRanks(6, [&](RankEnv& env) -> absl::Status {
    auto mesh = DeviceMesh::create(env.group_ptr, {2, 3}, {"replicate", "shard"});
    if (!mesh.ok()) return mesh.status();
    const int r = env.rank, i = r / 3, j = r % 3;
    EXPECT_EQ(mesh->coordinate(), (std::vector<int>{i, j}));
    EXPECT_EQ(mesh->dim_index("shard"), 1);
    EXPECT_EQ(mesh->rank_at({i, j}), r);
    ProcessGroup& rep = mesh->group(0);
    ProcessGroup& shard = mesh->group(1);
    EXPECT_EQ(rep.size(), 2);
    EXPECT_EQ(rep.rank(), i);
    EXPECT_EQ(shard.size(), 3);
    EXPECT_EQ(shard.rank(), j);
    EXPECT_EQ(shard.global_ranks(), (std::vector<int>{3 * i, 3 * i + 1, 3 * i + 2}));
    EXPECT_EQ(shard.name(), "world/shard." + std::to_string(i));
    // HSDP gradient path: reduce_scatter within the shard group, then all_reduce across replicas.
    Tensor grad = Tensor::full({6}, r);
    Tensor piece = Tensor::zeros({2});
    if (absl::Status s = shard.reduce_scatter(piece, grad)->wait(); !s.ok()) return s;
    EXPECT_EQ(piece.to_vector(), std::vector<float>(2, static_cast<float>(3 * i + 3 * i + 1 + 3 * i + 2)));
    if (absl::Status s = rep.all_reduce(piece)->wait(); !s.ok()) return s;
    EXPECT_EQ(piece.to_vector(), std::vector<float>(2, 15.f));  // 0 + 1 + ... + 5
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

TEST(DeviceMeshTest, BothDimensionsConcurrentlyFromTwoThreadsPerRank) {
  // The contract allows different groups to be driven from different threads of one rank.
  absl::Status st = RunRanks(4, [&](RankEnv& env) -> absl::Status {
    auto mesh = DeviceMesh::create(env.group_ptr, {2, 2});
    if (!mesh.ok()) return mesh.status();
    const int r = env.rank;
    absl::Status side_status;
    std::thread side([&] {
      for (int k = 0; k < 200 && side_status.ok(); ++k) {
        Tensor t = Tensor::full({33}, r + k);
        side_status = mesh->group(0).all_reduce(t)->wait();
        // Column of r: ranks j and 2 + j.
        const int j = r % 2;
        if (side_status.ok() && t.to_vector()[32] != static_cast<float>(j + 2 + j + 2 * k)) {
          side_status = absl::InternalError("wrong column sum");
        }
      }
    });
    absl::Status main_status;
    for (int k = 0; k < 200 && main_status.ok(); ++k) {
      Tensor t = Tensor::full({17}, r * k);
      main_status = mesh->group(1).all_reduce(t, {.op = ReduceOp::max()})->wait();
      const int i = r / 2;
      if (main_status.ok() && t.to_vector()[0] != static_cast<float>((2 * i + 1) * k)) {
        main_status = absl::InternalError("wrong row max");
      }
    }
    side.join();
    if (!side_status.ok()) return side_status;
    return main_status;
  });
  EXPECT_TRUE(st.ok()) << st;
}

TEST(DeviceMeshTest, OneDimensionalIsTheWorld) {
  absl::Status st = RunRanks(3, [&](RankEnv& env) -> absl::Status {
    auto mesh = DeviceMesh::create(env.group_ptr, {3});
    if (!mesh.ok()) return mesh.status();
    EXPECT_EQ(&mesh->group(0), &env.group);
    EXPECT_EQ(mesh->coordinate(), std::vector<int>{env.rank});
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

TEST(DeviceMeshTest, ShapeMustCoverTheWorld) {
  absl::Status st = RunRanks(4, [&](RankEnv& env) -> absl::Status {
    auto mesh = DeviceMesh::create(env.group_ptr, {3, 2});
    EXPECT_EQ(mesh.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(mesh.status().message()),
                ::testing::HasSubstr("product is the world size 4, found [3, 2]"));
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace shardkit::comm
