// shardkit-train's input bounds (issue 17 item 5, Note [--data bounds] in tools/shardkit_train/corpus.cc):
// --data must be a regular file of at most 1 GiB (a device, a FIFO without a writer, a directory or a larger
// file is a clear error, at once); --sample and --timeout have documented ranges.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/tools/subprocess.h"

namespace shardkit {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

testing::RunResult Train(std::vector<std::string> args) {
  args.insert(args.begin(), SHARDKIT_TRAIN_PATH);
  return testing::run_command(args, 60);
}

TEST(ShardkitTrainInput, DataMustBeARegularFile) {
  const auto zero = Train({"--data", "/dev/zero", "--steps", "1"});
  EXPECT_EQ(zero.exit_code, 1) << zero.err;
  EXPECT_THAT(zero.err, HasSubstr("expected --data to name a regular file, found a character device: '/dev/zero'"));

  const fs::path dir = fs::temp_directory_path() / ("shardkit_input_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string fifo = (dir / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto from_fifo = Train({"--data", fifo, "--steps", "1"});  // no writer: must not block
  EXPECT_FALSE(from_fifo.timed_out);
  EXPECT_EQ(from_fifo.exit_code, 1) << from_fifo.err;
  EXPECT_THAT(from_fifo.err, HasSubstr("found a FIFO"));

  const auto from_dir = Train({"--data", dir.string(), "--steps", "1"});
  EXPECT_THAT(from_dir.err, HasSubstr("found a directory"));

  // A sparse file one byte over the limit: refused from its size, without reading it.
  const std::string big = (dir / "big").string();
  const int fd = ::open(big.c_str(), O_CREAT | O_WRONLY, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, (off_t{1} << 30) + 1), 0);
  ::close(fd);
  const auto too_big = Train({"--data", big, "--steps", "1"});
  EXPECT_EQ(too_big.exit_code, 1) << too_big.err;
  EXPECT_THAT(too_big.err, HasSubstr("expected a data file of at most 1073741824 bytes (1 GiB; it is read whole), "
                                     "found 1073741825 bytes"));
  fs::remove_all(dir);
}

TEST(ShardkitTrainInput, SampleAndTimeoutHaveRanges) {
  const auto sample = Train({"--sample", "1000000000"});
  EXPECT_EQ(sample.exit_code, 1);
  EXPECT_THAT(sample.err, HasSubstr("a number of bytes in [0, 65536]"));
  const auto timeout = Train({"--timeout", "0"});
  EXPECT_EQ(timeout.exit_code, 1);
  EXPECT_THAT(timeout.err, HasSubstr("a number of seconds in (0, 86400]"));
  const auto help = Train({"--help"});
  EXPECT_THAT(help.out, HasSubstr("--timeout S"));
  EXPECT_THAT(help.out, HasSubstr("a regular file of at most"));
}

TEST(ShardkitTrainInput, ATimeoutIsAccepted) {
  const auto r = Train({"--timeout", "30", "--steps", "2", "--model", "tiny", "--ranks", "2", "--sample", "0"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

}  // namespace
}  // namespace shardkit
