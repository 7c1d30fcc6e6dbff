// Helper launched by shardrun in shardrun_test. Modes (argv[1]):
//   env                     print the rank environment, then a last line without a newline; exit 0
//   fail R CODE DIR         write DIR/pid.<rank>; rank R exits CODE once every rank wrote its pid, the others pause
//   stubborn DIR            ignore SIGTERM, write DIR/pid.<rank>, pause (rank 0 exits 3 once all are ready)
//   grandchild DIR          fork a child that pauses, write both pids to DIR; rank 0 exits 1 once all are ready
//   hang DIR                write DIR/pid.<rank>, pause
// Waiting for "every rank ready" polls the directory with a 20 s bound (a helper, not a test assertion).
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

namespace {
int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : -1;
}
void write_file(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) std::exit(90);
  std::fputs(text.c_str(), f);
  std::fclose(f);
  std::rename(tmp.c_str(), path.c_str());
}
void wait_all_ready(const std::string& dir, int world) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (;;) {
    int n = 0;
    for (int r = 0; r < world; ++r) {
      if (access((dir + "/pid." + std::to_string(r)).c_str(), F_OK) == 0) ++n;
    }
    if (n == world) return;
    if (std::chrono::steady_clock::now() > deadline) std::exit(91);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}
[[noreturn]] void pause_forever() {
  for (;;) ::pause();
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return 64;
  const std::string mode = argv[1];
  const int rank = env_int("RANK");
  const int world = env_int("WORLD_SIZE");
  if (mode == "env") {
    std::printf("RANK=%s WORLD_SIZE=%s LOCAL_RANK=%s MASTER_ADDR=%s MASTER_PORT=%s\n", std::getenv("RANK"),
                std::getenv("WORLD_SIZE"), std::getenv("LOCAL_RANK"), std::getenv("MASTER_ADDR"),
                std::getenv("MASTER_PORT"));
    std::fflush(stdout);
    std::fprintf(stderr, "to stderr\n");
    std::printf("no newline");
    return 0;
  }
  if (argc < 3) return 64;
  const std::string dir = argv[argc - 1];
  if (mode == "stubborn") ::signal(SIGTERM, SIG_IGN);
  if (mode == "grandchild") {
    const pid_t child = ::fork();
    if (child == 0) pause_forever();
    write_file(dir + "/grandchild." + std::to_string(rank), std::to_string(child));
  }
  write_file(dir + "/pid." + std::to_string(rank), std::to_string(::getpid()));
  if (mode == "fail") {
    const int fail_rank = std::atoi(argv[2]);
    const int code = std::atoi(argv[3]);
    if (rank == fail_rank) {
      wait_all_ready(dir, world);
      std::printf("rank %d failing with %d\n", rank, code);
      return code;
    }
    pause_forever();
  }
  if ((mode == "stubborn" || mode == "grandchild") && rank == 0) {
    wait_all_ready(dir, world);
    return mode == "stubborn" ? 3 : 1;
  }
  pause_forever();
}
