// shardkit-store: a standalone TcpStore server (common/comm/tcp_store_server.h), for jobs whose ranks
// should not host the store themselves (InitFromEnvOptions::host_store = false). `shardkit-store --help`
// lists the flags (kUsage below).
//
// Port 0 (the default) picks a free port. Prints "shardkit-store listening on H:P" once serving (flushed),
// then serves until SIGINT / SIGTERM. The token comes from SHARDKIT_STORE_TOKEN when set.
#include <signal.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/comm/tcp_store_server.h"

namespace {

constexpr char kUsage[] =
    "usage: shardkit-store [--host H] [--port P] [--frame-timeout-seconds S] [--max-connections N]\n"
    "                      [--max-connections-per-address N]\n"
    "\n"
    "A standalone TcpStore server for shardkit ranks started with host_store = false.\n"
    "\n"
    "  --host H                         address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)\n"
    "  --port P                         port (default 0: a free port, printed once listening)\n"
    "  --frame-timeout-seconds S        a started frame or handshake must complete within S seconds (default 10)\n"
    "  --max-connections N              open connections at most, in total (default 8192)\n"
    "  --max-connections-per-address N  open connections at most from one peer address (default 2048)\n"
    "  -h, --help                       this text\n"
    "\n"
    "Environment: SHARDKIT_STORE_TOKEN, when set, is the token every client must present (the ranks read the\n"
    "same variable). A client that has not presented it may send only a small hello frame; over a connection\n"
    "limit a connection is refused with a message naming the limit. Stops on SIGINT or SIGTERM.\n"
    "Prints \"shardkit-store listening on H:P\" once serving.\n";

bool parse_long(const char* s, long lo, long hi, long& out) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi) return false;
  out = v;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  shardkit::comm::TcpStoreServerOptions options;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    const bool known = a == "--host" || a == "--port" || a == "--frame-timeout-seconds" ||
                       a == "--max-connections" || a == "--max-connections-per-address";
    if (!known) {
      std::fprintf(stderr, "shardkit-store: unknown argument '%s'\n%s", a.c_str(), kUsage);
      return 2;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "shardkit-store: %s expects a value\n", a.c_str());
      return 2;
    }
    const char* v = argv[++i];
    long n = 0;
    if (a == "--host") {
      options.host = v;
    } else if (a == "--port") {
      if (!parse_long(v, 0, 65535, n)) {
        std::fprintf(stderr, "shardkit-store: --port: expected an integer in [0, 65535], found '%s'\n", v);
        return 2;
      }
      options.port = static_cast<std::uint16_t>(n);
    } else if (a == "--frame-timeout-seconds") {
      char* end = nullptr;
      const double s = std::strtod(v, &end);
      if (end == v || *end != '\0' || !(s > 0) || s > 86400) {
        std::fprintf(stderr, "shardkit-store: --frame-timeout-seconds: expected a number in (0, 86400], found '%s'\n",
                     v);
        return 2;
      }
      options.frame_timeout = absl::Seconds(s);
    } else {
      if (!parse_long(v, 1, 1 << 20, n)) {
        std::fprintf(stderr, "shardkit-store: %s: expected an integer in [1, 1048576], found '%s'\n", a.c_str(), v);
        return 2;
      }
      (a == "--max-connections" ? options.max_connections : options.max_connections_per_address) = static_cast<int>(n);
    }
  }
  if (const char* token = std::getenv("SHARDKIT_STORE_TOKEN")) options.token = token;
  // Block the stop signals before the server starts its thread, then wait for one.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  auto server = shardkit::comm::TcpStoreServer::start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "shardkit-store: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::printf("shardkit-store listening on %s:%u\n", options.host.c_str(), (*server)->port());
  std::fflush(stdout);
  int sig = 0;
  sigwait(&stop, &sig);
  return 0;
}
