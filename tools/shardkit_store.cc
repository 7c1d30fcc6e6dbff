// shardkit-store: a standalone TcpStore server (common/comm/tcp_store_server.h), for jobs whose ranks
// should not host the store themselves (InitFromEnvOptions::host_store = false).
//
//   shardkit-store [--host H] [--port P] [--frame-timeout-seconds S]
//
// Port 0 (the default) picks a free port. Prints "shardkit-store listening on H:P" once serving (flushed),
// then serves until SIGINT / SIGTERM. The token comes from SHARDKIT_STORE_TOKEN when set.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/comm/tcp_store_server.h"

int main(int argc, char** argv) {
  shardkit::comm::TcpStoreServerOptions options;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "shardkit-store: %s expects a value\n", a.c_str());
      return 2;
    }
    const char* v = argv[++i];
    char* end = nullptr;
    if (a == "--host") {
      options.host = v;
    } else if (a == "--port") {
      const long p = std::strtol(v, &end, 10);
      if (*end != '\0' || p < 0 || p > 65535) {
        std::fprintf(stderr, "shardkit-store: --port: expected an integer in [0, 65535], found '%s'\n", v);
        return 2;
      }
      options.port = static_cast<std::uint16_t>(p);
    } else if (a == "--frame-timeout-seconds") {
      const double s = std::strtod(v, &end);
      if (*end != '\0' || s <= 0) {
        std::fprintf(stderr, "shardkit-store: --frame-timeout-seconds: expected a positive number, found '%s'\n", v);
        return 2;
      }
      options.frame_timeout = absl::Seconds(s);
    } else {
      std::fprintf(stderr, "usage: shardkit-store [--host H] [--port P] [--frame-timeout-seconds S]\n");
      return 2;
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
