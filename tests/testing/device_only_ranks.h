// The device-only check shared by the layers' GPU tests: several simulated ranks on one GPU over a group that moves
// only device tensors, as NCCL (DeviceOnlyGroup), against the same ranks over the in-process group it wraps.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/comm/testing/run_ranks.h"
#include "gtest/gtest.h"
#include "tests/testing/device_only_group.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::gpt_tiny {

// `train(group)` returns the rank's trained parameters' values; at N = 2 and 3 it runs over the in-process group
// and over DeviceOnlyGroup wrapping it, and each rank's two results must agree within `tol`.
template <typename Train>
void ExpectDeviceOnlyEqualsInProcess(Train train, double tol) {
  for (int world : {2, 3}) {
    std::vector<std::vector<std::vector<float>>> plain(static_cast<std::size_t>(world)), device_only = plain;
    for (bool wrap : {false, true}) {
      absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
        std::shared_ptr<comm::ProcessGroup> pg = env.group_ptr;
        if (wrap) pg = std::make_shared<comm::testing::DeviceOnlyGroup>(pg);
        absl::StatusOr<std::vector<std::vector<float>>> v = train(pg);
        if (!v.ok()) return v.status();
        (wrap ? device_only : plain)[static_cast<std::size_t>(env.rank)] = std::move(*v);
        return absl::OkStatus();
      });
      ASSERT_TRUE(st.ok()) << "N = " << world << (wrap ? ", device-only group: " : ": ") << st;
    }
    for (std::size_t r = 0; r < plain.size(); ++r) {
      SCOPED_TRACE(::testing::Message() << "N = " << world << ", rank " << r);
      ExpectMatches({device_only[r]}, plain[r], tol);
    }
  }
}

}  // namespace shardkit::gpt_tiny
