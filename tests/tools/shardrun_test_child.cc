// Helper launched by shardrun in shardrun_test. Modes (argv[1]):
//   env                     print the rank environment, then a last line without a newline; exit 0
//   fail R CODE DIR         write DIR/pid.<rank>; rank R exits CODE once every rank wrote its pid, the others pause
//   stubborn DIR            ignore SIGTERM, write DIR/pid.<rank>, pause (rank 0 exits 3 once all are ready)
//   grandchild DIR          fork a child that pauses, write both pids to DIR; rank 0 exits 1 once all are ready
//   hang DIR                write DIR/pid.<rank>, pause
//   nonewline BYTES [end]   write BYTES bytes of 'a'..'z' (repeating) to stdout without a newline (then, with
//                           "end", a newline and "end\n"); exit 0
//   token                   print "TOKEN=<SHARDKIT_STORE_TOKEN>" or "TOKEN unset"; exit 0
//   store DIR               rank 0 hosts a TcpStore on MASTER_ADDR:MASTER_PORT (token from the environment) and
//                           writes DIR/token (its token) then DIR/port once every rank has connected; every
//                           rank gets key "done" (60 s), then sets "finished.<rank>"; rank 0 keeps the store
//                           until every rank has finished (60 s); exit 0
// Waiting for "every rank ready" polls the directory with a 20 s bound (a helper, not a test assertion).
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "common/comm/tcp_store.h"

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
  if (mode == "token") {
    const char* t = std::getenv("SHARDKIT_STORE_TOKEN");
    if (t == nullptr) {
      std::printf("TOKEN unset\n");
    } else {
      std::printf("TOKEN=%s\n", t);
    }
    return 0;
  }
  if (argc < 3) return 64;
  if (mode == "nonewline") {
    const long long total = std::atoll(argv[2]);
    std::string piece(1 << 16, ' ');
    long long written = 0;
    while (written < total) {
      const std::size_t n = static_cast<std::size_t>(std::min<long long>(total - written, 1 << 16));
      for (std::size_t i = 0; i < n; ++i) piece[i] = static_cast<char>('a' + (written + i) % 26);
      if (std::fwrite(piece.data(), 1, n, stdout) != n) return 92;
      written += static_cast<long long>(n);
    }
    if (argc > 3 && std::string(argv[3]) == "end") std::fputs("\nend\n", stdout);
    return 0;
  }
  const std::string dir = argv[argc - 1];
  if (mode == "store") {
    shardkit::comm::TcpStoreOptions o;
    o.host = std::getenv("MASTER_ADDR");
    o.port = static_cast<std::uint16_t>(env_int("MASTER_PORT"));
    o.is_server = rank == 0;
    o.connect_timeout = absl::Seconds(30);
    auto store = shardkit::comm::TcpStore::create(o);
    if (!store.ok()) {
      std::printf("rank %d: %s\n", rank, store.status().ToString().c_str());
      return 3;
    }
    // Every rank has connected before rank 0 tells the test (which then releases the job).
    std::vector<std::string> joined;
    for (int r = 0; r < world; ++r) joined.push_back("joined." + std::to_string(r));
    auto set = (*store)->set(joined[static_cast<std::size_t>(rank)], "1");
    auto all = set.ok() ? (*store)->wait(joined, absl::Seconds(60)) : set;
    if (!all.ok()) {
      std::printf("rank %d: %s\n", rank, all.ToString().c_str());
      return 5;
    }
    if (rank == 0) {
      const char* t = std::getenv("SHARDKIT_STORE_TOKEN");
      write_file(dir + "/token", t != nullptr ? t : "");
      write_file(dir + "/port", std::to_string((*store)->port()));
    }
    auto done = (*store)->get("done", absl::Seconds(60));
    if (!done.ok()) {
      std::printf("rank %d: %s\n", rank, done.status().ToString().c_str());
      return 4;
    }
    // The store lives in rank 0's process: it stays until every rank has had its answer (before, rank 0 could
    // exit as soon as it read "done" and a rank still on its way to the get lost the store).
    std::vector<std::string> finished;
    for (int r = 0; r < world; ++r) finished.push_back("finished." + std::to_string(r));
    auto fin = (*store)->set(finished[static_cast<std::size_t>(rank)], "1");
    if (fin.ok() && rank == 0) fin = (*store)->wait(finished, absl::Seconds(60));
    if (!fin.ok()) {
      std::printf("rank %d: %s\n", rank, fin.ToString().c_str());
      return 6;
    }
    return 0;
  }
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
