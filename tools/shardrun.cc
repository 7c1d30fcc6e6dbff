// shardrun: start N local ranks of a program with the torchrun-style environment (DESIGN.md section 2).
//
//   shardrun --nproc N [--master-addr A] [--master-port P] [--grace-seconds S] -- PROGRAM ARGS...
//   shardrun --nnodes M --node-rank K --nproc N --master-addr A --master-port P -- PROGRAM ARGS...   (one per host)
//   [--timeout S] [--heartbeat-window S]: every collective's deadline and the watchdog's window, handed to the
//   ranks as SHARDKIT_TIMEOUT / SHARDKIT_HEARTBEAT_WINDOW (init_from_env, common/comm/watchdog.h)
//
// Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the node rank), MASTER_ADDR,
// MASTER_PORT. Without --master-port (or with 0) shardrun asks the kernel for a free port.
//
// Note [several hosts]: torchrun's static rendezvous. Start one shardrun per host with the same --nnodes M,
// --nproc N, --master-addr (an address of node 0's host, which rank 0 binds for the store) and --master-port, and
// its own --node-rank K; node K's local rank r is global rank K·N + r of M·N. There is no free-port pick and no
// per-job token across hosts: --master-port is required, and SHARDKIT_STORE_TOKEN must be set to one value on
// every host (or to empty for no token, on a trusted network), since a token made up by each shardrun would not
// match. Every line a rank writes to stdout /
// stderr is forwarded to shardrun's stdout / stderr prefixed with "[rank R] "; a line longer than
// kMaxLineBytes (64 KiB) is forwarded in pieces of that size, each on its own prefixed line, so output
// without newlines costs linear time and bounded memory (a partial line at a rank's exit gets a newline).
//
// Note [job token]: each rank also gets SHARDKIT_STORE_TOKEN, a fresh random token per job (32 bytes from
// getrandom, hex), so the job's TcpStore refuses clients that do not have it, e.g. other users of the node,
// with no set-up. It travels in the environment, never on a command line (which every local user can read).
// When SHARDKIT_STORE_TOKEN is already set in shardrun's environment (even empty: no token), the ranks
// inherit that value instead: the way to share one token with a standalone shardkit-store.
//
// Exit: 0 when every rank exits 0. When a rank exits non-zero (or is killed by a signal, code 128+sig), the
// other ranks get SIGTERM, then SIGKILL after the grace period, and shardrun returns that first code.
// SIGINT / SIGTERM / SIGHUP sent to shardrun are forwarded to the ranks (same escalation).
//
// Note [no orphans]: the ranks form one new process group, so a signal to the group also reaches their own
// children; each rank also has PR_SET_PDEATHSIG(SIGKILL), so even if shardrun itself is SIGKILLed the ranks
// die with it. shardrun never exits before it has reaped every rank.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <netinet/in.h>
#include <arpa/inet.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  const int saved = errno;
  const unsigned char b = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t r = ::write(g_signal_pipe[1], &b, 1);
  errno = saved;
}

void usage() {
  std::fprintf(stderr,
               "usage: shardrun --nproc N [--master-addr A] [--master-port P] [--grace-seconds S] "
               "-- PROGRAM ARGS...\n"
               "       shardrun --nnodes M --node-rank K --nproc N --master-addr A --master-port P [--grace-seconds S] "
               "-- PROGRAM ARGS...   (one per host)\n");
}

void write_all(int fd, const char* p, std::size_t n) {
  while (n > 0) {
    const ssize_t k = ::write(fd, p, n);
    if (k < 0) {
      if (errno == EINTR) continue;
      return;
    }
    p += k;
    n -= static_cast<std::size_t>(k);
  }
}

// One output stream of one rank: complete lines are forwarded with the prefix; a partial line waits, up to
// kMaxLineBytes. Each byte read is searched at most twice, and pending never holds more than kMaxLineBytes.
constexpr std::size_t kMaxLineBytes = 64 << 10;

struct Stream {
  int fd = -1;
  int out_fd = 1;
  std::string prefix;
  std::string pending;  // a partial line, at most kMaxLineBytes

  void emit(const char* data, std::size_t n) {
    std::string out;
    while (n > 0) {
      // The line's content may take `room` more bytes; a newline at position room still ends it in time.
      const std::size_t room = kMaxLineBytes - pending.size();
      const std::size_t search = std::min(n, room + 1);
      const char* nl = static_cast<const char*>(std::memchr(data, '\n', search));
      std::size_t take = 0;  // bytes of data that complete a line (the newline included, if any)
      if (nl != nullptr) {
        take = static_cast<std::size_t>(nl - data) + 1;
        append_line(out, data, take - 1);
      } else if (n > room) {
        take = room;  // the line passed kMaxLineBytes: forward this piece as a line of its own
        append_line(out, data, take);
      } else {  // (pending may now hold exactly kMaxLineBytes: a newline next still ends that line)
        pending.append(data, n);
        break;
      }
      data += take;
      n -= take;
    }
    if (!out.empty()) write_all(out_fd, out.data(), out.size());
  }
  void flush() {
    if (pending.empty()) return;
    std::string out;
    append_line(out, "", 0);
    write_all(out_fd, out.data(), out.size());
  }

 private:
  // Appends prefix + pending + data[0, n) + newline to out, and empties pending.
  void append_line(std::string& out, const char* data, std::size_t n) {
    out += prefix;
    out += pending;
    out.append(data, n);
    out += '\n';
    pending.clear();
  }
};

// 32 random bytes as 64 hex digits (Note [job token]); empty when no random source answered.
std::string random_token() {
  unsigned char bytes[32];
  std::size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t k = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) break;
    got += static_cast<std::size_t>(k);
  }
  if (got < sizeof(bytes)) {  // getrandom unavailable (old kernel, seccomp): the same pool through the file
    const int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    got = 0;
    while (fd >= 0 && got < sizeof(bytes)) {
      const ssize_t k = ::read(fd, bytes + got, sizeof(bytes) - got);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) break;
      got += static_cast<std::size_t>(k);
    }
    if (fd >= 0) ::close(fd);
    if (got < sizeof(bytes)) return {};
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string token;
  for (unsigned char b : bytes) {
    token += kHex[b >> 4];
    token += kHex[b & 15];
  }
  return token;
}

struct Rank {
  pid_t pid = -1;
  bool running = false;
  int code = 0;
};

int pick_free_port(const std::string& addr) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = 0;
  if (::inet_pton(AF_INET, addr.c_str(), &sa.sin_addr) != 1) sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0) {
    socklen_t len = sizeof(sa);
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) == 0) port = ntohs(sa.sin_port);
  }
  ::close(fd);
  return port;
}

bool parse_int(const char* s, long lo, long hi, long& out) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi) return false;
  out = v;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  long nproc = -1;
  long nnodes = 1;
  long node_rank = -1;
  bool addr_given = false;
  long port = 0;
  double grace_seconds = 5.0;
  std::string addr = "127.0.0.1";
  int i = 1;
  for (; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "shardrun: %s expects a value\n", name);
        usage();
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--") {
      ++i;
      break;
    } else if (a == "--nproc" || a == "--nproc-per-node" || a == "--nproc_per_node") {
      const char* v = value("--nproc");
      if (!parse_int(v, 1, 1024, nproc)) {
        std::fprintf(stderr, "shardrun: --nproc: expected an integer in [1, 1024], found '%s'\n", v);
        return 2;
      }
    } else if (a == "--master-port") {
      const char* v = value("--master-port");
      if (!parse_int(v, 0, 65535, port)) {
        std::fprintf(stderr, "shardrun: --master-port: expected an integer in [0, 65535], found '%s'\n", v);
        return 2;
      }
    } else if (a == "--nnodes") {
      const char* v = value("--nnodes");
      if (!parse_int(v, 1, 1024, nnodes)) {
        std::fprintf(stderr, "shardrun: --nnodes: expected an integer in [1, 1024], found '%s'\n", v);
        return 2;
      }
    } else if (a == "--node-rank" || a == "--node_rank") {
      const char* v = value("--node-rank");
      if (!parse_int(v, 0, 1023, node_rank)) {
        std::fprintf(stderr, "shardrun: --node-rank: expected an integer in [0, 1023], found '%s'\n", v);
        return 2;
      }
    } else if (a == "--master-addr") {
      addr = value("--master-addr");
      addr_given = true;
    } else if (a == "--timeout" || a == "--heartbeat-window") {
      // Passed to the ranks as SHARDKIT_TIMEOUT / SHARDKIT_HEARTBEAT_WINDOW (init_from_env reads them).
      const char* v = value(a.c_str());
      char* end = nullptr;
      const double seconds = std::strtod(v, &end);
      if (end == v || *end != '\0' || !(seconds >= 0) || seconds > 86400 || (a == "--timeout" && seconds == 0)) {
        std::fprintf(stderr, "shardrun: %s: expected a number of seconds in (0, 86400]%s, found '%s'\n", a.c_str(),
                     a == "--timeout" ? "" : " (0: no watchdog)", v);
        return 2;
      }
      ::setenv(a == "--timeout" ? "SHARDKIT_TIMEOUT" : "SHARDKIT_HEARTBEAT_WINDOW", v, 1);
    } else if (a == "--grace-seconds") {
      const char* v = value("--grace-seconds");
      char* end = nullptr;
      grace_seconds = std::strtod(v, &end);
      if (end == v || *end != '\0' || grace_seconds < 0) {
        std::fprintf(stderr, "shardrun: --grace-seconds: expected a non-negative number, found '%s'\n", v);
        return 2;
      }
    } else if (a == "-h" || a == "--help") {
      usage();
      std::fprintf(stderr,
                   "Starts N local ranks with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,\n"
                   "MASTER_PORT. Several hosts: one shardrun per host with --nnodes, --node-rank, --master-addr (node 0's\n"
                   "address), --master-port, and SHARDKIT_STORE_TOKEN set alike on every host.\n"
                   "--timeout S sets every collective's deadline (SHARDKIT_TIMEOUT; default 5 minutes) and\n"
                   "--heartbeat-window S how soon a stopped rank is named (SHARDKIT_HEARTBEAT_WINDOW; default 10, 0: off).\n"
                   "and SHARDKIT_STORE_TOKEN (a random token per job; set it yourself to choose one, e.g. to share\n"
                   "it with a standalone shardkit-store). Output lines are prefixed with \"[rank R] \".\n");
      return 0;
    } else {
      std::fprintf(stderr, "shardrun: unknown argument '%s'\n", a.c_str());
      usage();
      return 2;
    }
  }
  if (nproc < 1 || i >= argc) {
    usage();
    return 2;
  }
  // Note [several hosts]: what every host must agree on has to be given, not picked.
  if (node_rank < 0) node_rank = nnodes == 1 ? 0 : -1;
  if (nnodes > 1) {
    if (node_rank < 0 || node_rank >= nnodes) {
      std::fprintf(stderr, "shardrun: --nnodes %ld: expected --node-rank in [0, %ld), found %s\n", nnodes, nnodes,
                   node_rank < 0 ? "none" : std::to_string(node_rank).c_str());
      return 2;
    }
    if (!addr_given || port == 0) {
      std::fprintf(stderr, "shardrun: --nnodes %ld: expected --master-addr (node 0's address) and --master-port, the "
                           "same on every node, found %s\n", nnodes, !addr_given ? "no --master-addr" : "no --master-port");
      return 2;
    }
    if (std::getenv("SHARDKIT_STORE_TOKEN") == nullptr) {
      std::fprintf(stderr, "shardrun: --nnodes %ld: expected SHARDKIT_STORE_TOKEN set to the same value on every node "
                           "(e.g. export SHARDKIT_STORE_TOKEN=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n')), "
                           "or set empty for no token; found it unset\n", nnodes);
      return 2;
    }
  } else if (node_rank != 0) {
    std::fprintf(stderr, "shardrun: expected --node-rank 0 with one node, found %ld\n", node_rank);
    return 2;
  }
  const long world = nnodes * nproc;
  if (port == 0) {
    const int p = pick_free_port(addr);
    if (p <= 0) {
      std::fprintf(stderr, "shardrun: could not find a free port on %s\n", addr.c_str());
      return 1;
    }
    port = p;
  }

  // Note [job token]: the ranks inherit shardrun's environment, so setting it here reaches every one.
  if (std::getenv("SHARDKIT_STORE_TOKEN") == nullptr) {
    const std::string token = random_token();
    if (token.empty()) {
      std::fprintf(stderr, "shardrun: expected 32 random bytes for the job's store token (getrandom or /dev/urandom), "
                           "found none; set SHARDKIT_STORE_TOKEN to choose one\n");
      return 1;
    }
    ::setenv("SHARDKIT_STORE_TOKEN", token.c_str(), 1);
  }

  if (::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    std::perror("shardrun: pipe");
    return 1;
  }
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : {SIGCHLD, SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  const pid_t self = ::getpid();
  pid_t pgid = 0;
  std::vector<Rank> ranks(static_cast<std::size_t>(nproc));
  std::vector<Stream> streams;
  streams.reserve(static_cast<std::size_t>(2 * nproc));
  for (long r = 0; r < nproc; ++r) {
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
      std::perror("shardrun: pipe");
      if (pgid > 0) ::kill(-pgid, SIGKILL);
      return 1;
    }
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("shardrun: fork");
      if (pgid > 0) ::kill(-pgid, SIGKILL);
      return 1;
    }
    if (pid == 0) {
      // Child: own process group shared by all ranks; die with shardrun (Note [no orphans]).
      ::setpgid(0, pgid);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != self) ::_exit(1);  // shardrun already gone
      for (int sig : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGPIPE}) ::signal(sig, SIG_DFL);
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      ::setenv("RANK", std::to_string(node_rank * nproc + r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("GROUP_RANK", std::to_string(node_rank).c_str(), 1);
      ::setenv("MASTER_ADDR", addr.c_str(), 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::execvp(argv[i], argv + i);
      std::fprintf(stderr, "shardrun: cannot execute '%s': %s\n", argv[i], std::strerror(errno));
      ::_exit(127);
    }
    if (pgid == 0) pgid = pid;
    ::setpgid(pid, pgid);  // also in the parent, so the group exists before we may signal it
    ::close(out[1]);
    ::close(err[1]);
    ranks[static_cast<std::size_t>(r)] = Rank{pid, true, 0};
    const std::string prefix = "[rank " + std::to_string(node_rank * nproc + r) + "] ";
    streams.push_back(Stream{out[0], 1, prefix, {}});
    streams.push_back(Stream{err[0], 2, prefix, {}});
  }

  using Clock = std::chrono::steady_clock;
  int exit_code = 0;
  bool stopping = false;
  Clock::time_point kill_at{};
  bool killed = false;
  long running = nproc;

  auto begin_stop = [&](int sig) {
    if (!stopping) {
      stopping = true;
      kill_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(grace_seconds));
    }
    ::kill(-pgid, sig);
  };

  auto reap = [&] {
    for (;;) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) return;
      for (std::size_t r = 0; r < ranks.size(); ++r) {
        if (ranks[r].pid != pid || !ranks[r].running) continue;
        ranks[r].running = false;
        --running;
        const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        ranks[r].code = code;
        if (code != 0 && exit_code == 0) {
          exit_code = code;
          if (!stopping) {
            std::string msg = "shardrun: rank " + std::to_string(r) + " exited with code " + std::to_string(code) +
                              "; stopping the other ranks\n";
            write_all(2, msg.data(), msg.size());
          }
          if (running > 0) begin_stop(SIGTERM);
        }
      }
    }
  };

  std::vector<pollfd> fds;
  for (;;) {
    fds.clear();
    fds.push_back(pollfd{g_signal_pipe[0], POLLIN, 0});
    for (auto& s : streams)
      if (s.fd >= 0) fds.push_back(pollfd{s.fd, POLLIN, 0});
    const bool pipes_open = fds.size() > 1;
    if (running == 0 && !pipes_open) break;
    int timeout_ms = -1;
    if (stopping && !killed) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(kill_at - Clock::now()).count();
      timeout_ms = static_cast<int>(std::max<long long>(0, left));
    }
    // Every rank reaped but a grandchild still holds a pipe: give it the grace period, then stop reading.
    if (running == 0 && pipes_open) {
      if (!stopping) begin_stop(SIGTERM);
      if (killed) timeout_ms = 200;
    }
    const int rc = ::poll(fds.data(), fds.size(), timeout_ms);
    if (rc < 0 && errno != EINTR) break;
    if (stopping && !killed && Clock::now() >= kill_at) {
      ::kill(-pgid, SIGKILL);
      killed = true;
    } else if (rc == 0 && killed && running == 0) {
      break;  // leftover pipe holders ignore us; every rank is reaped
    }
    if (rc <= 0) continue;
    if (fds[0].revents & POLLIN) {
      unsigned char sigs[64];
      const ssize_t k = ::read(g_signal_pipe[0], sigs, sizeof(sigs));
      for (ssize_t j = 0; j < k; ++j) {
        const int sig = sigs[j];
        if (sig == SIGCHLD) continue;
        if (exit_code == 0) exit_code = 128 + sig;
        begin_stop(sig);
      }
      reap();
    }
    std::size_t f = 1;
    for (auto& s : streams) {
      if (s.fd < 0) continue;
      const short rev = fds[f++].revents;
      if (rev == 0) continue;
      char buf[65536];
      const ssize_t k = ::read(s.fd, buf, sizeof(buf));
      if (k > 0) {
        s.emit(buf, static_cast<std::size_t>(k));
      } else if (k == 0 || (errno != EINTR && errno != EAGAIN)) {
        s.flush();
        ::close(s.fd);
        s.fd = -1;
      }
    }
    reap();
  }
  bool leftovers = false;
  for (auto& s : streams) {
    s.flush();
    if (s.fd >= 0) {
      leftovers = true;
      ::close(s.fd);
    }
  }
  // A rank's background child still held a pipe: it goes now.
  if (leftovers) ::kill(-pgid, SIGKILL);
  return exit_code;
}
