// shardkit-store run as a user runs it: its --help, bad flags, and its memory (peak RSS of the process) under
// a flood of unauthenticated connections that each announce a 16 MiB frame (issue 17 acceptance).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/comm/tcp_socket.h"
#include "common/comm/tcp_store.h"
#include "common/comm/tcp_store_protocol.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/tools/subprocess.h"

namespace shardkit::testing {
namespace {

namespace proto = comm::tcp_store_protocol;
using ::testing::HasSubstr;

const std::string kStore = SHARDKIT_STORE_PATH;

// Whether this build (and so shardkit-store, built with the same flags) runs under the sanitizers.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitizerBuild = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(undefined_behavior_sanitizer)
constexpr bool kSanitizerBuild = true;
#else
constexpr bool kSanitizerBuild = false;
#endif
#else
constexpr bool kSanitizerBuild = false;
#endif

// A running shardkit-store (its own process group; SIGKILLed on destruction) and the port it printed.
class RunningStore {
 public:
  // max_open_files > 0: the server's RLIMIT_NOFILE.
  explicit RunningStore(const std::string& token, int max_open_files = 0) {
    int out[2];
    EXPECT_EQ(::pipe2(out, O_CLOEXEC), 0);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setpgid(0, 0);
      ::dup2(out[1], 1);
      ::setenv("SHARDKIT_STORE_TOKEN", token.c_str(), 1);
      if (max_open_files > 0) {
        const rlimit limit{static_cast<rlim_t>(max_open_files), static_cast<rlim_t>(max_open_files)};
        if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) ::_exit(126);
      }
      ::execl(kStore.c_str(), kStore.c_str(), "--port", "0", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(out[1]);
    // Read the "listening on host:port" line (bounded: the pipe closes if the server dies).
    std::string line;
    char c;
    pollfd p{out[0], POLLIN, 0};
    while (line.find('\n') == std::string::npos && ::poll(&p, 1, 20000) > 0 && ::read(out[0], &c, 1) == 1) line += c;
    ::close(out[0]);
    const auto colon = line.rfind(':');
    if (colon != std::string::npos) port_ = static_cast<std::uint16_t>(std::atoi(line.c_str() + colon + 1));
  }
  ~RunningStore() {
    ::kill(-pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
  std::uint16_t port() const { return port_; }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  std::uint16_t port_ = 0;
};

// The process's peak resident set ("VmHWM") in bytes, or -1.
long long peak_rss_bytes(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::atoll(line.c_str() + 6) * 1024;
  }
  return -1;
}

// The process's user + system CPU time in seconds, or -1.
double cpu_seconds(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto paren = stat.rfind(')');
  if (paren == std::string::npos) return -1;
  std::istringstream fields(stat.substr(paren + 2));  // from field 3 (state) on
  std::string skip;
  for (int i = 3; i < 14; ++i) fields >> skip;
  long long utime = 0, stime = 0;
  fields >> utime >> stime;
  return static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

int open_fds(pid_t pid) {
  std::error_code ec;
  int n = 0;
  for (std::filesystem::directory_iterator it("/proc/" + std::to_string(pid) + "/fd", ec), end; !ec && it != end;
       it.increment(ec)) {
    ++n;
  }
  return n;
}

std::string header(std::uint32_t len) {
  std::string h(4, '\0');
  for (int i = 0; i < 4; ++i) h[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  return h;
}

TEST(ShardkitStore, HelpListsTheFlagsAndTheToken) {
  auto r = run_command({kStore, "--help"}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("usage: shardkit-store"));
  for (const char* flag : {"--host H", "--port P", "--frame-timeout-seconds S", "--max-connections N",
                           "--max-connections-per-address N", "SHARDKIT_STORE_TOKEN"}) {
    EXPECT_THAT(r.out, HasSubstr(flag));
  }
}

TEST(ShardkitStore, RejectsBadFlags) {
  auto zero = run_command({kStore, "--max-connections", "0"}, 30);
  EXPECT_EQ(zero.exit_code, 2);
  EXPECT_THAT(zero.err, HasSubstr("--max-connections: expected an integer in [1, 1048576], found '0'"));
  auto unknown = run_command({kStore, "--bogus"}, 30);
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_THAT(unknown.err, HasSubstr("unknown argument '--bogus'"));
  EXPECT_THAT(unknown.err, HasSubstr("usage: shardkit-store"));
  auto timeout = run_command({kStore, "--frame-timeout-seconds", "nan"}, 30);
  EXPECT_EQ(timeout.exit_code, 2);
  EXPECT_THAT(timeout.err, HasSubstr("expected a number in (0, 86400], found 'nan'"));
}

// 200 connections without the token each announce a 16 MiB frame. Before the fix the server zero-filled a
// 16 MiB buffer for each (3.2 GB); now each is refused before anything is allocated, a client with the
// token is served, and the server's peak RSS stays under the stated bound of 128 MiB (under 5 MiB in a
// release build; sanitizer builds need more).
TEST(ShardkitStore, UnauthenticatedLargePrefixesKeepTheServerSmall) {
  RunningStore store("job-secret");
  ASSERT_GT(store.port(), 0);
  constexpr int kFlood = 200;
  std::vector<comm::tcp::Socket> flood;
  for (int i = 0; i < kFlood; ++i) {
    auto s = comm::tcp::connect_with_retry("127.0.0.1", store.port(), absl::Now() + absl::Seconds(10), "store");
    ASSERT_TRUE(s.ok()) << s.status();
    const std::string h = header(16u << 20);
    ASSERT_TRUE(comm::tcp::send_all(*s, h.data(), h.size(), absl::Now() + absl::Seconds(10), "store").ok());
    flood.push_back(std::move(*s));
  }
  comm::TcpStoreOptions o;
  o.port = store.port();
  o.token = "job-secret";
  o.connect_timeout = absl::Seconds(20);
  auto client = comm::TcpStore::create(o);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->set("k", "v").ok());
  EXPECT_EQ(*(*client)->get("k", absl::Seconds(10)), "v");
  int refused = 0;
  for (auto& s : flood) {
    unsigned char h[4];
    if (!comm::tcp::recv_all(s, h, 4, absl::Now() + absl::Seconds(20), "store").ok()) continue;
    std::string body(proto::decode_header(h), '\0');
    if (!comm::tcp::recv_all(s, body.data(), body.size(), absl::Now() + absl::Seconds(20), "store").ok()) continue;
    auto m = proto::decode_payload(body);
    if (m.ok() && m->type == proto::MessageType::kError &&
        m->value.find("expected a hello frame of at most") != std::string::npos) {
      ++refused;
    }
  }
  EXPECT_EQ(refused, kFlood);
  const long long peak = peak_rss_bytes(store.pid());
  ASSERT_GT(peak, 0);
  RecordProperty("peak_rss_bytes", std::to_string(peak));
  EXPECT_LT(peak, 128ll << 20) << "peak RSS " << (peak >> 20) << " MiB";
}


// The server runs out of file descriptors (RLIMIT_NOFILE 64, 80 idle connections). Before the fix accept()
// failed with EMFILE and was retried at once, over and over: a core spent spinning while the connections
// stayed. Now it waits accept_backoff (100 ms) between tries: under 0.1 s of CPU in the 1 s measured (the
// one wall-clock wait here measures, it does not synchronise), and once the connections go, a client with
// the token is served.
TEST(ShardkitStore, OutOfFileDescriptorsDoesNotSpinAndRecovers) {
  if (kSanitizerBuild) {
    // The sanitizer runtime needs descriptors of its own: UBSan's vptr check probes memory through a pipe,
    // fails to open one, and reports a false "invalid vptr" that aborts the server.
    GTEST_SKIP() << "a process with no file descriptors left cannot run under the sanitizers";
  }
  constexpr int kMaxFiles = 64;
  RunningStore store("job-secret", kMaxFiles);
  ASSERT_GT(store.port(), 0);
  std::vector<comm::tcp::Socket> idle;
  for (int i = 0; i < 80; ++i) {
    auto s = comm::tcp::connect_with_retry("127.0.0.1", store.port(), absl::Now() + absl::Seconds(10), "store");
    ASSERT_TRUE(s.ok()) << s.status();
    idle.push_back(std::move(*s));
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (open_fds(store.pid()) < kMaxFiles && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_GE(open_fds(store.pid()), kMaxFiles);
  const double cpu_before = cpu_seconds(store.pid());
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const double cpu_spent = cpu_seconds(store.pid()) - cpu_before;
  RecordProperty("cpu_seconds_in_window", std::to_string(cpu_spent));
  EXPECT_LT(cpu_spent, 0.1) << "CPU seconds spent in 1 s with no file descriptors left";
  idle.clear();
  comm::TcpStoreOptions o;
  o.port = store.port();
  o.token = "job-secret";
  o.connect_timeout = absl::Seconds(20);
  auto client = comm::TcpStore::create(o);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_TRUE((*client)->set("k", "v").ok());
}

}  // namespace
}  // namespace shardkit::testing
