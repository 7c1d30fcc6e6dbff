// Replays a fuzz target's seed corpus and its regressions (fuzz/corpus/<target>, fuzz/regressions/<target>)
// through the target's LLVMFuzzerTestOneInput in the ordinary build, so every input a fuzzer once crashed on
// stays a test even where clang / libFuzzer are not there. The target aborts on a broken property.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "gtest/gtest.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {

TEST(FuzzReplay, EveryCorpusAndRegressionInputPasses) {
  int replayed = 0;
  for (const char* dir : {FUZZ_CORPUS_DIR, FUZZ_REGRESSION_DIR}) {
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      if (!entry.is_regular_file() || entry.path().filename().string().front() == '.') continue;
      std::ifstream in(entry.path(), std::ios::binary);
      const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      SCOPED_TRACE(entry.path().string());
      EXPECT_EQ(LLVMFuzzerTestOneInput(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()), 0);
      ++replayed;
    }
  }
  EXPECT_GE(replayed, 1) << "the seed corpus is missing";
}

}  // namespace
