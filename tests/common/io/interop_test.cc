// Interoperability with the Python ecosystem (ctest label `interop`, part of the default run).
//
// Files written by the `safetensors` package (PyPI) load in shardkit with identical bytes, and shardkit's files
// (single and sharded) load in Python with identical values: interop_safetensors.py. A PyTorch GPT-2 of the same
// configuration (interop_gpt2.py, written in plain PyTorch: no transformers, no download) computes the same
// logits as shardkit's GPT from shardkit's export, and shardkit computes the same logits as PyTorch from
// PyTorch's file.
//
// Each test skips with a message when python3 or a package is missing. .ci/install-deps.sh installs
// safetensors and numpy; PyTorch is optional (too big for CI's install step): `pip install torch` to run
// the GPT-2 logits tests.
#include <sys/wait.h>

#include <cmath>
#include <cstdio>

#include "common/autograd/grad_mode.h"
#include "common/io/gpt2_names.h"
#include "absl/strings/str_cat.h"
#include "common/io/safetensors_sharded.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "io_test_util.h"

namespace shardkit::io {
namespace {

using ::testing::HasSubstr;
using testing::Bytes;
using testing::PatternTensor;
using testing::ScratchDir;

struct PyRun {
  int exit_code = -1;
  std::string output;
};

std::string Quoted(const std::string& s) { return "'" + s + "'"; }

// Runs `python3 <args>` with stderr merged into stdout.
PyRun Python(const std::string& args) {
  PyRun r;
  FILE* p = ::popen(("python3 " + args + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string Script(const std::string& name) { return Quoted(std::string(SHARDKIT_IO_TEST_DIR) + "/" + name); }

// Empty when python3 can import `modules`; otherwise why not.
std::string Missing(const std::string& modules) {
  const PyRun r = Python("-c " + Quoted("import " + modules));
  if (r.exit_code == 0) return {};
  if (r.exit_code == 127) return "python3 is not installed";
  // The last line of the traceback: "ModuleNotFoundError: No module named 'torch'".
  std::string out = r.output;
  while (!out.empty() && out.back() == '\n') out.pop_back();
  const std::size_t nl = out.rfind('\n');
  return nl == std::string::npos ? out : out.substr(nl + 1);
}

#define SKIP_WITHOUT_SAFETENSORS()                                                                          \
  if (const std::string why = Missing("safetensors, numpy"); !why.empty()) {                                \
    GTEST_SKIP() << "needs python3 with the safetensors and numpy packages (pip install safetensors numpy; " \
                    ".ci/install-deps.sh installs them): "                                                  \
                 << why;                                                                                    \
  }

#define SKIP_WITHOUT_TORCH()                                                                                     \
  SKIP_WITHOUT_SAFETENSORS();                                                                                    \
  if (const std::string why = Missing("torch"); !why.empty()) {                                                  \
    GTEST_SKIP() << "needs PyTorch for the GPT-2 logits comparison (pip install torch; CI does not install it: " \
                    "too big): "                                                                                 \
                 << why;                                                                                         \
  }

// The tensors interop_safetensors.py writes and checks (its TENSORS list).
NamedTensors EveryDtype() {
  return {
      {"f32.matrix", PatternTensor(DType::f32, {3, 5}, 1)}, {"bf16.odd", PatternTensor(DType::bf16, {7}, 2)},
      {"f16.cube", PatternTensor(DType::f16, {2, 3, 2}, 3)}, {"i64.tokens", PatternTensor(DType::i64, {4, 2}, 4)},
      {"f32.scalar", PatternTensor(DType::f32, {}, 5)},       {"bf16.empty", PatternTensor(DType::bf16, {0, 3}, 6)},
      {"f16.one", PatternTensor(DType::f16, {1}, 7)},
  };
}

void ExpectHolds(const SafetensorsFile& file, const NamedTensors& want) {
  EXPECT_EQ(file.entries().size(), want.size());
  for (const auto& [name, t] : want) {
    SCOPED_TRACE(name);
    const SafetensorsEntry* e = file.find(name);
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->info.dtype, t.dtype());
    EXPECT_EQ(e->info.shape, t.shape());
    EXPECT_EQ(Bytes(e->bytes), Bytes(t));
  }
}

TEST(InteropTest, FilesWrittenByPythonSafetensorsLoadBitwise) {
  SKIP_WITHOUT_SAFETENSORS();
  ScratchDir dir;
  const PyRun w = Python(Script("interop_safetensors.py") + " write " + Quoted(dir.file("py.safetensors")));
  ASSERT_EQ(w.exit_code, 0) << w.output;
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::open(dir.file("py.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  ExpectHolds(*file, EveryDtype());
  EXPECT_EQ(file->metadata(), (SafetensorsMetadata{{"origin", "python"}}));
  // Python's writer and shardkit's produce the same bytes for the same tensors.
  absl::StatusOr<std::string> mine = serialize_safetensors(EveryDtype(), {{"origin", "python"}});
  ASSERT_TRUE(mine.ok());
  EXPECT_EQ(*mine, testing::ReadAll(dir.file("py.safetensors")));

  const PyRun n = Python(Script("interop_safetensors.py") + " write-numpy " + Quoted(dir.file("np.safetensors")));
  ASSERT_EQ(n.exit_code, 0) << n.output;
  absl::StatusOr<SafetensorsFile> np = SafetensorsFile::open(dir.file("np.safetensors"));
  ASSERT_TRUE(np.ok()) << np.status();
  NamedTensors numpy_types;
  for (const auto& nt : EveryDtype()) {
    if (nt.second.dtype() != DType::bf16) numpy_types.push_back(nt);
  }
  ExpectHolds(*np, numpy_types);
  EXPECT_EQ(np->metadata(), (SafetensorsMetadata{{"origin", "numpy"}, {"format", "np"}}));
}

TEST(InteropTest, FilesWrittenByShardkitLoadInPythonWithIdenticalValues) {
  SKIP_WITHOUT_SAFETENSORS();
  ScratchDir dir;
  ASSERT_TRUE(write_safetensors(dir.file("sk.safetensors"), EveryDtype(), {{"origin", "shardkit"}, {"format", "pt"}}).ok());
  const PyRun r = Python(Script("interop_safetensors.py") + " check " + Quoted(dir.file("sk.safetensors")));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("checked 7 tensors"));
  std::printf("%s", r.output.c_str());
}

TEST(InteropTest, ShardedExportsLoadInPython) {
  SKIP_WITHOUT_SAFETENSORS();
  ScratchDir dir;
  const NamedTensors model = EveryDtype();
  absl::StatusOr<ShardedSafetensorsPlan> plan = plan_sharded_safetensors(tensor_infos(model), 3);
  ASSERT_TRUE(plan.ok());
  for (int rank = 0; rank < 3; ++rank) {
    NamedTensors mine;
    for (std::size_t i = 0; i < model.size(); ++i) {
      if (plan->part[i] == rank) mine.push_back(model[i]);
    }
    ASSERT_TRUE(write_sharded_safetensors(dir.path(), *plan, rank, mine).ok());
  }
  const PyRun r = Python(Script("interop_safetensors.py") + " check-index " + Quoted(dir.file(plan->index_file())));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("checked 7 tensors in 3 parts"));
}

// ---- GPT-2 logits ------------------------------------------------------------------------------------------

nn::GPTConfig InteropConfig() {
  nn::GPTConfig c;
  c.vocab_size = 96;
  c.context = 16;
  c.width = 32;
  c.num_layers = 2;
  c.num_heads = 4;  // head size 8: a wrong head layout would show
  return c;
}

std::string ConfigArgs(const nn::GPTConfig& c) {
  return absl::StrCat(c.vocab_size, " ", c.context, " ", c.width, " ", c.num_layers, " ", c.num_heads);
}

Tensor Tokens(const nn::GPTConfig& c) {
  std::vector<std::int64_t> ids;
  for (std::int64_t i = 0; i < 2 * c.context; ++i) ids.push_back((i * 37 + 11) % c.vocab_size);
  return Tensor::from_int64(ids, {2, c.context});
}

// Max |a - b| over all elements; both [B, T, V] f32. Also reports the largest |b| so the comparison is known
// to be between non-trivial values.
std::pair<double, double> MaxAbsDiff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  const std::vector<float> x = a.to_vector(), y = b.to_vector();
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < std::min(x.size(), y.size()); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(x[i]) - y[i]));
    scale = std::max(scale, std::abs(static_cast<double>(y[i])));
  }
  return {diff, scale};
}

TEST(InteropTest, TorchGpt2LoadedFromShardkitsExportGivesTheSameLogits) {
  SKIP_WITHOUT_TORCH();
  const nn::GPTConfig c = InteropConfig();
  nn::GPT gpt(c, 5);
  {  // Values far from the init (layer norms included), so a swapped or untransposed tensor cannot go unnoticed.
    Generator gen(99);
    for (const auto& [name, p] : gpt.named_parameters()) {
      const bool ln = name.find(".ln") != std::string::npos || name.rfind("ln_f", 0) == 0;
      const float center = ln && name.ends_with("weight") ? 1.f : 0.f;
      p.copy_(Tensor::uniform(p.shape(), gen, center - 0.5f, center + 0.5f));
    }
  }
  ScratchDir dir;
  absl::StatusOr<NamedTensors> hf = gpt2_from_shardkit(gpt.state_dict(), c);
  ASSERT_TRUE(hf.ok()) << hf.status();
  ASSERT_TRUE(write_safetensors(dir.file("model.safetensors"), *hf, {{"format", "pt"}}).ok());
  const Tensor tokens = Tokens(c);
  ASSERT_TRUE(write_safetensors(dir.file("tokens.safetensors"), {{"tokens", tokens}}).ok());

  const PyRun r = Python(Script("interop_gpt2.py") + " forward " + Quoted(dir.file("model.safetensors")) + " " +
                       Quoted(dir.file("tokens.safetensors")) + " " + Quoted(dir.file("logits.safetensors")) + " " +
                       ConfigArgs(c));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  absl::StatusOr<SafetensorsFile> out = SafetensorsFile::open(dir.file("logits.safetensors"));
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<Tensor> torch_logits = out->tensor("logits");
  ASSERT_TRUE(torch_logits.ok()) << torch_logits.status();

  autograd::NoGradGuard no_grad;
  const Tensor logits = gpt(tokens);
  const auto [diff, scale] = MaxAbsDiff(logits, *torch_logits);
  std::printf("%sshardkit -> torch: max |logit| %.4f, max abs diff %.3g\n", r.output.c_str(), scale, diff);
  EXPECT_GT(scale, 1.0);
  EXPECT_LT(diff, 1e-4 * scale);
}

TEST(InteropTest, ShardkitLoadedFromATorchGpt2FileGivesTheSameLogits) {
  SKIP_WITHOUT_TORCH();
  const nn::GPTConfig c = InteropConfig();
  ScratchDir dir;
  const Tensor tokens = Tokens(c);
  ASSERT_TRUE(write_safetensors(dir.file("tokens.safetensors"), {{"tokens", tokens}}).ok());
  const PyRun r = Python(Script("interop_gpt2.py") + " export " + Quoted(dir.file("model.safetensors")) + " " +
                       Quoted(dir.file("tokens.safetensors")) + " " + Quoted(dir.file("logits.safetensors")) + " " +
                       ConfigArgs(c) + " 1234");
  ASSERT_EQ(r.exit_code, 0) << r.output;

  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::open(dir.file("model.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_NE(file->find("h.0.attn.bias"), nullptr);  // GPT2Model's names and its mask buffers, as "gpt2" has them
  std::vector<SafetensorsTensorInfo> infos;
  for (const SafetensorsEntry& e : file->entries()) infos.push_back(e.info);
  absl::StatusOr<nn::GPTConfig> inferred = infer_gpt2_config(infos, c.num_heads);
  ASSERT_TRUE(inferred.ok()) << inferred.status();
  EXPECT_EQ(inferred->num_layers, c.num_layers);
  EXPECT_EQ(inferred->vocab_size, c.vocab_size);

  absl::StatusOr<NamedTensors> state = shardkit_from_gpt2(file->tensors(), c);
  ASSERT_TRUE(state.ok()) << state.status();
  nn::GPT gpt(c, 77);
  ASSERT_TRUE(gpt.load_state_dict(*state).ok());

  absl::StatusOr<SafetensorsFile> out = SafetensorsFile::open(dir.file("logits.safetensors"));
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<Tensor> torch_logits = out->tensor("logits");
  ASSERT_TRUE(torch_logits.ok());
  autograd::NoGradGuard no_grad;
  const auto [diff, scale] = MaxAbsDiff(gpt(tokens), *torch_logits);
  std::printf("%storch -> shardkit: max |logit| %.4f, max abs diff %.3g\n", r.output.c_str(), scale, diff);
  EXPECT_GT(scale, 1.0);
  EXPECT_LT(diff, 1e-4 * scale);
}

}  // namespace
}  // namespace shardkit::io
