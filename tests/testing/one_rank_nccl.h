// The one-rank NCCL check shared by the layers' GPU tests: NCCL takes one rank per GPU, so on a one-GPU machine a
// layer's NCCL path runs with one rank, against the same run over the in-process group.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/comm/hash_store.h"
#include "common/comm/nccl_process_group.h"
#include "common/comm/testing/run_ranks.h"
#include "gtest/gtest.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::gpt_tiny {

// `train(group)` returns the trained parameters' values; it runs once over an in-process group of one rank and
// once over an NCCL group of one rank on cuda:0 (skipped when the build has no NCCL), and the two must agree
// within `tol`.
template <typename Train>
void ExpectOneRankOverNcclEqualsInProcess(Train train, double tol) {
  if (!comm::nccl_backend_built()) GTEST_SKIP() << "built without NCCL";
  std::vector<std::vector<float>> want;
  ASSERT_TRUE(comm::RunRanks(1, [&](comm::RankEnv& env) -> absl::Status {
                absl::StatusOr<std::vector<std::vector<float>>> v = train(env.group_ptr);
                if (!v.ok()) return v.status();
                want = std::move(*v);
                return absl::OkStatus();
              }).ok());
  auto nccl = comm::create_nccl_group(std::make_shared<comm::HashStore>(), 0, 1, 0);
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  absl::StatusOr<std::vector<std::vector<float>>> got = train(*nccl);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectMatches({*got}, want, tol);
}

}  // namespace shardkit::gpt_tiny
