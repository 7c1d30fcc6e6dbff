// Safetensors from a fully sharded model (fsdp/safetensors_export.h): the sharded export written at N ranks reads
// back equal, bitwise, to the single-rank model's GPT-2 export, and the ledger shows that no rank held the whole
// model while writing it (at N = 1 the one rank does: the measure measures); the single-file export gathers to
// rank 0 only; loading copies each rank's rows straight from the file, bitwise, and refuses a file of another
// shape on every rank with the model unchanged.
#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "common/io/model_safetensors.h"
#include "fsdp/safetensors_export.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/io/io_test_util.h"
#include "tests/fsdp/fsdp_test_util.h"

namespace shardkit::fsdp {
namespace {

using ::testing::HasSubstr;
using gpt_tiny::TinyConfig;
using io::testing::Bytes;
using io::testing::ScratchDir;

using FileBytes = std::map<std::string, std::string>;

FileBytes BytesOf(const io::NamedTensors& tensors) {
  FileBytes out;
  for (const auto& [name, t] : tensors) out[name] = Bytes(t);
  return out;
}

io::ModelExportOptions Gpt2() { return {.names = io::TensorNames::gpt2(TinyConfig())}; }

// The single-rank model after 2 steps on the whole batch: its state, values, and GPT-2 file tensors.
struct Reference {
  nn::StateDict state;
  std::vector<std::vector<float>> values;
  FileBytes gpt2;
  std::int64_t psi = 0;
  std::uint64_t largest_bytes = 0;
};

// Call with a RankContext in scope that outlives the result (its tensors are charged to it).
Reference MakeReference() {
  nn::GPT model(TinyConfig(), 1);
  auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
  EXPECT_TRUE(test_util::TrainRows(model, **opt, 0, 1, 0, 2).ok());
  Reference r;
  for (const auto& [name, t] : model.state_dict()) r.state.emplace_back(name, t.clone());
  r.values = gpt_tiny::Values(model);
  r.gpt2 = BytesOf(*io::gpt2_from_shardkit(model.state_dict(), TinyConfig()));
  r.psi = model.num_parameters();
  for (const Tensor& p : model.parameters()) r.largest_bytes = std::max<std::uint64_t>(r.largest_bytes, p.nbytes());
  return r;
}

// Bytes of the tensors the plan gives part `rank` of `world`.
std::uint64_t PartBytes(const Reference& ref, int rank, int world) {
  auto plan = io::plan_model_export(io::tensor_infos(ref.state), world, Gpt2());
  EXPECT_TRUE(plan.ok()) << plan.status();
  std::uint64_t n = 0;
  for (const auto& t : plan->tensors_of(rank)) n += t.nbytes();
  return n;
}

absl::StatusOr<FileBytes> ReadIndex(const std::string& dir) {
  auto t = io::read_safetensors_tensors(dir + "/model.safetensors.index.json");
  if (!t.ok()) return t.status();
  return BytesOf(*t);
}

TEST(FsdpSafetensorsExport, ShardedExportEqualsSingleRankBitwiseAndNoRankHoldsTheModel) {
  RankContext ctx;
  RankContextScope scope(ctx);
  const Reference ref = MakeReference();
  for (const int world : {1, 2, 3}) {
    SCOPED_TRACE(::testing::Message() << "n=" << world);
    ScratchDir loaded, trained;
    absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
      MemoryTracker& mem = *env.context.memory;
      nn::GPT model(TinyConfig(), 5);
      if (absl::Status s = test_util::ShardGpt(model, env, {}, /*nested=*/world == 3); !s.ok()) return s;
      if (absl::Status s = load_full_state_dict(model, ref.state); !s.ok()) return s;

      const std::int64_t other0 = mem.current(MemoryCategory::other), total0 = mem.total_current();
      mem.reset_peaks();
      if (absl::Status s = export_sharded_safetensors(model, loaded.path(), Gpt2()); !s.ok()) return s;
      const std::int64_t held = mem.peak(MemoryCategory::other) - other0;
      EXPECT_LE(held, static_cast<std::int64_t>(PartBytes(ref, env.rank, world) + 2 * ref.largest_bytes))
          << "rank " << env.rank << ": its part plus one tensor in flight (and its transpose)";
      if (world > 1) {
        EXPECT_LT(held, ref.psi * 4) << "rank " << env.rank << " held the whole model";
        EXPECT_LT(mem.total_peak() - total0, ref.psi * 4) << "rank " << env.rank << ", every category";
      } else {
        EXPECT_GE(held, ref.psi * 4) << "one rank writes the whole model";
      }
      EXPECT_EQ(mem.current(MemoryCategory::other), other0) << "nothing kept";
      if (env.rank == 0) {  // the export's barrier: every part is written
        auto back = ReadIndex(loaded.path());
        if (!back.ok()) return back.status();
        EXPECT_EQ(*back, ref.gpt2) << "the export must equal the single-rank model's, bitwise";
        EXPECT_EQ(loaded.listing().size(), static_cast<std::size_t>(world + 1)) << "N parts and the index";
      }

      // After a training step (gradients and optimizer state live, the root kept unsharded after forward):
      // the export equals FSDP's own gathered state.
      auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
      if (!opt.ok()) return opt.status();
      if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, world, 2, 3); !s.ok()) return s;
      if (absl::Status s = export_sharded_safetensors(model, trained.path(), Gpt2()); !s.ok()) return s;
      auto full = full_state_dict(model);
      if (!full.ok()) return full.status();
      if (env.rank == 0) {
        auto back = ReadIndex(trained.path());
        if (!back.ok()) return back.status();
        EXPECT_EQ(*back, BytesOf(*io::gpt2_from_shardkit(*full, TinyConfig())));
        EXPECT_NE(*back, ref.gpt2) << "the step changed the parameters";
      }
      return absl::OkStatus();
    });
    EXPECT_TRUE(st.ok()) << st;
  }
}

TEST(FsdpSafetensorsExport, OneFileIsGatheredToRankZeroOnly) {
  RankContext ctx;
  RankContextScope scope(ctx);
  const Reference ref = MakeReference();
  ScratchDir dir;
  const std::string path = dir.file("model.safetensors");
  absl::Status st = comm::RunRanks(3, [&](comm::RankEnv& env) -> absl::Status {
    MemoryTracker& mem = *env.context.memory;
    nn::GPT model(TinyConfig(), 5);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    if (absl::Status s = load_full_state_dict(model, ref.state); !s.ok()) return s;
    const std::int64_t other0 = mem.current(MemoryCategory::other), total0 = mem.total_current();
    mem.reset_peaks();
    if (absl::Status s = export_single_safetensors(model, path, Gpt2()); !s.ok()) return s;
    if (env.rank == 0) {
      EXPECT_GE(mem.peak(MemoryCategory::other) - other0, ref.psi * 4);
      auto back = io::read_safetensors_tensors(path);
      if (!back.ok()) return back.status();
      EXPECT_EQ(BytesOf(*back), ref.gpt2);
    } else {
      EXPECT_EQ(mem.total_peak(), total0) << "rank " << env.rank << " sends its rows and allocates nothing";
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

TEST(FsdpSafetensorsLoad, EachRankCopiesItsRowsBitwiseFromOneFileOrAnIndex) {
  RankContext ctx;
  RankContextScope scope(ctx);
  const Reference ref = MakeReference();
  ScratchDir one, sharded;
  ASSERT_TRUE(io::export_safetensors(ref.state, one.file("model.safetensors"), Gpt2()).ok());
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(io::export_sharded_safetensors(ref.state, sharded.path(), r, 3, Gpt2()).ok());
  for (const int world : {2, 3}) {
    for (const std::string& path : {one.file("model.safetensors"), sharded.path()}) {
      SCOPED_TRACE(::testing::Message() << "n=" << world << " " << path);
      absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
        MemoryTracker& mem = *env.context.memory;
        nn::GPT model(TinyConfig(), 7);
        if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
        const std::int64_t total0 = mem.total_current();
        mem.reset_peaks();
        if (absl::Status s = load_safetensors_rows(model, path, io::TensorNames::gpt2(TinyConfig())); !s.ok()) return s;
        EXPECT_LE(mem.total_peak() - total0, static_cast<std::int64_t>(ref.largest_bytes))
            << "rank " << env.rank << ": at most one tensor's rows beyond the shards";
        EXPECT_EQ(mem.total_current(), total0);
        auto values = test_util::FullValues(model);
        if (!values.ok()) return values.status();
        EXPECT_EQ(*values, ref.values) << "rank " << env.rank;
        return absl::OkStatus();
      });
      EXPECT_TRUE(st.ok()) << st;
    }
  }
}

TEST(FsdpSafetensorsLoad, RefusesAFileOfAnotherShapeOnEveryRankAndChangesNothing) {
  ScratchDir dir;
  nn::GPTConfig wide = TinyConfig(), shallow = TinyConfig();
  wide.width = 32;
  shallow.num_layers = 2;
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    ASSERT_TRUE(io::export_safetensors(nn::GPT(wide, 1), dir.file("wide.safetensors"),
                                       {.names = io::TensorNames::gpt2(wide)}).ok());
    ASSERT_TRUE(io::export_safetensors(nn::GPT(shallow, 1), dir.file("shallow.safetensors"),
                                       {.names = io::TensorNames::gpt2(shallow)}).ok());
  }
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 7);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    auto before = test_util::FullValues(model);
    if (!before.ok()) return before.status();
    absl::Status s = load_safetensors_rows(model, dir.file("wide.safetensors"), io::TensorNames::gpt2(TinyConfig()));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("tensor 'transformer.wte.weight' (for 'wte.weight'): expected shape [64, 16], found F32[64, 32]"));
    s = load_safetensors_rows(model, dir.file("shallow.safetensors"), io::TensorNames::gpt2(TinyConfig()));
    EXPECT_THAT(std::string(s.message()), HasSubstr("expected tensor 'transformer.h.2.ln_1.weight' (for "
                                                    "'blocks.2.ln1.weight'), found it missing from the file"));
    auto after = test_util::FullValues(model);
    if (!after.ok()) return after.status();
    EXPECT_EQ(*after, *before) << "rank " << env.rank;
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace shardkit::fsdp
