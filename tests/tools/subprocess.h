// Test helper: run a command with a deadline and capture its stdout and stderr (merged or separate).
// Used by the shardrun tests and the multi-process TCP tests. On deadline the child's process group is
// SIGKILLed, so a hung launch never outlives the test.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

namespace shardkit::testing {

struct RunResult {
  int exit_code = -1;       // exit status, 128+signal when killed by a signal, -1 when the deadline hit
  bool timed_out = false;
  std::string out;          // child's stdout
  std::string err;          // child's stderr
  double seconds = 0;
};

// Starts argv (argv[0] is a path) in its own process group. `on_started` (optional) gets the pid.
template <typename OnStarted>
RunResult run_command(const std::vector<std::string>& argv, double timeout_seconds, OnStarted on_started,
                      const std::vector<std::pair<std::string, std::string>>& env = {}) {
  RunResult res;
  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) return res;
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    ::dup2(out[1], 1);
    ::dup2(err[1], 2);
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::setpgid(pid, pid);
  ::close(out[1]);
  ::close(err[1]);
  on_started(pid);
  const auto deadline = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                    std::chrono::duration<double>(timeout_seconds));
  int fds[2] = {out[0], err[0]};
  std::string* sinks[2] = {&res.out, &res.err};
  while (fds[0] >= 0 || fds[1] >= 0) {
    pollfd p[2];
    int np = 0;
    int which[2];
    for (int i = 0; i < 2; ++i)
      if (fds[i] >= 0) {
        p[np] = pollfd{fds[i], POLLIN, 0};
        which[np++] = i;
      }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      res.timed_out = true;
      ::kill(-pid, SIGKILL);
      break;
    }
    const int rc = ::poll(p, static_cast<nfds_t>(np), static_cast<int>(left.count()));
    if (rc <= 0) continue;
    for (int j = 0; j < np; ++j) {
      if (p[j].revents == 0) continue;
      char buf[8192];
      const ssize_t k = ::read(p[j].fd, buf, sizeof(buf));
      if (k > 0) {
        sinks[which[j]]->append(buf, static_cast<std::size_t>(k));
      } else {
        ::close(p[j].fd);
        fds[which[j]] = -1;
      }
    }
  }
  for (int fd : fds)
    if (fd >= 0) ::close(fd);
  int status = 0;
  ::waitpid(pid, &status, 0);
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!res.timed_out) res.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return res;
}

inline RunResult run_command(const std::vector<std::string>& argv, double timeout_seconds,
                             const std::vector<std::pair<std::string, std::string>>& env = {}) {
  return run_command(argv, timeout_seconds, [](pid_t) {}, env);
}

// True when pid no longer runs (gone, or a zombie awaiting its reaper).
inline bool process_dead(pid_t pid) {
  if (::kill(pid, 0) != 0) return true;
  std::string path = "/proc/" + std::to_string(pid) + "/stat";
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return true;
  char buf[512] = {};
  const std::size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  std::string s(buf, n);
  const auto paren = s.rfind(')');
  return paren != std::string::npos && paren + 2 < s.size() && (s[paren + 2] == 'Z' || s[paren + 2] == 'X');
}

}  // namespace shardkit::testing
