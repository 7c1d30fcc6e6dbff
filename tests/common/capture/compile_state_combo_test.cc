// An audit of capture::compile with state loaded between calls (one rank; sddp::ReplicateMode and
// fsdp::FullyShardMode at N = 2, 3), against the eager run doing the same and single-rank training
// (compile_combo_harness.h): the model's state dict, the optimizer's, or both (a resume from a checkpoint) taken
// before call 1 and loaded before call 3. Under the fully-shard mode the module's parameters and the optimizer's
// state are released between calls: they are read and written after mode->unshard_parameters() (fully_shard_mode.h:
// "the module's parameters (and the optimizer's state) whole again, e.g. to save").
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "tests/common/capture/compile_combo_harness.h"

namespace shardkit::compile_combo {
namespace {

class CompileStateCombo : public ::testing::TestWithParam<Where> {};

struct Snapshot {
  nn::StateDict model;
  optim::OptimizerStateDict opt;
};

// Snapshots by copy and rank (the callbacks run on the rank threads).
class Snapshots {
 public:
  Snapshot& at(Copy c) {
    std::lock_guard<std::mutex> lock(mu_);
    return by_[{c, current_rank_context().rank}];
  }

 private:
  std::mutex mu_;
  std::map<std::pair<Copy, int>, Snapshot> by_;
};

// Takes the snapshot before call 1 and loads it before call 3 (what of it `load_model` / `load_opt` say).
Scenario SaveAndLoad(Snapshots& snaps, bool load_model, bool load_opt) {
  Scenario sc;
  sc.steps = 5;
  sc.before = [&snaps, load_model, load_opt](int s, nn::GPT& m, optim::Optimizer& opt, Copy c,
                                             fsdp::FullyShardMode* mode) -> absl::Status {
    if (s != 1 && s != 3) return absl::OkStatus();
    if (mode != nullptr) {
      if (absl::Status st = mode->unshard_parameters(); !st.ok()) return st;
    }
    Snapshot& snap = snaps.at(c);
    if (s == 1) {
      snap.model.clear();
      for (const auto& [name, t] : m.state_dict()) snap.model.emplace_back(name, t.clone());
      snap.opt = opt.state_dict();
      return absl::OkStatus();
    }
    if (load_model) {
      if (absl::Status st = m.load_state_dict(snap.model); !st.ok()) return st;
    }
    if (load_opt) {
      if (absl::Status st = opt.load_state_dict(snap.opt); !st.ok()) return st;
    }
    return absl::OkStatus();
  };
  return sc;
}

// The run must also differ from the one without the load (the load mattered).
void ExpectTheLoadMattered(const Result& loaded, const Where& w) {
  Scenario plain;
  plain.steps = 5;
  const Result without = RunScenario(plain, w);
  ASSERT_TRUE(without.status.ok()) << without.status;
  EXPECT_NE(loaded.eager[0].values, without.eager[0].values);
}

TEST_P(CompileStateCombo, AModelStateDictLoadedBetweenCalls) {
  Snapshots snaps;
  const Result res = RunScenario(SaveAndLoad(snaps, /*load_model=*/true, /*load_opt=*/false), GetParam());
  ExpectAgrees(res, GetParam());
  ExpectTheLoadMattered(res, GetParam());
}

TEST_P(CompileStateCombo, AnOptimizerStateDictLoadedBetweenCalls) {
  Snapshots snaps;
  const Result res = RunScenario(SaveAndLoad(snaps, /*load_model=*/false, /*load_opt=*/true), GetParam());
  ExpectAgrees(res, GetParam());
  ExpectTheLoadMattered(res, GetParam());
}

// A resume: both loaded. The run then repeats calls 1 and 2 as calls 3 and 4 from the same state, but on other
// batches; against eager doing the same.
TEST_P(CompileStateCombo, AModelAndOptimizerCheckpointLoadedBetweenCalls) {
  Snapshots snaps;
  const Result res = RunScenario(SaveAndLoad(snaps, /*load_model=*/true, /*load_opt=*/true), GetParam());
  ExpectAgrees(res, GetParam());
  ExpectTheLoadMattered(res, GetParam());
}

// Reading the state between calls (the snapshot only, nothing loaded) changes nothing.
TEST_P(CompileStateCombo, ReadingTheStateBetweenCallsChangesNothing) {
  Snapshots snaps;
  const Result res = RunScenario(SaveAndLoad(snaps, /*load_model=*/false, /*load_opt=*/false), GetParam());
  ExpectAgrees(res, GetParam());
  // What rank 0 read before call 1 is the state after call 0, as eager's: the values, and AdamW's state (step 1).
  ASSERT_EQ(current_rank_context().rank, 0);
  const Snapshot& c = snaps.at(Copy::compiled);
  const Snapshot& e = snaps.at(Copy::eager);
  ASSERT_EQ(c.model.size(), e.model.size());
  const double tol = GetParam().kind == Kind::fully_shard ? 1e-6 : 0.0;
  for (std::size_t i = 0; i < c.model.size(); ++i) {
    const std::vector<float> got = c.model[i].second.to_vector(), want = e.model[i].second.to_vector();
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t k = 0; k < got.size(); ++k) ASSERT_NEAR(got[k], want[k], tol) << c.model[i].first << "[" << k << "]";
  }
  ASSERT_EQ(c.opt.state.size(), e.opt.state.size());
  for (const auto& [index, st] : c.opt.state) {
    EXPECT_EQ(st.step, 1) << "parameter " << index;
    for (const auto& [key, t] : st.tensors) {
      const std::vector<float> got = t.to_vector(), want = e.opt.state.at(index).tensors.at(key).to_vector();
      ASSERT_EQ(got.size(), want.size());
      for (std::size_t k = 0; k < got.size(); ++k) ASSERT_NEAR(got[k], want[k], tol + 1e-6 * std::abs(want[k]));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, CompileStateCombo, ::testing::ValuesIn(AllWheres()),
                         [](const auto& info) { return Name(info.param); });

}  // namespace
}  // namespace shardkit::compile_combo
