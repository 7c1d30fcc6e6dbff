#include "common/tensor/host_block_source.h"

#include <utility>

namespace shardkit {
namespace {
// Thread-local, not process-global: each simulated rank is its own thread (DESIGN.md section 2).
std::shared_ptr<HostBlockSource>& installed() {
  thread_local std::shared_ptr<HostBlockSource> source;
  return source;
}
}  // namespace

const std::shared_ptr<HostBlockSource>& current_host_block_source() { return installed(); }

HostBlockSourceScope::HostBlockSourceScope(std::shared_ptr<HostBlockSource> source)
    : previous_(std::exchange(installed(), std::move(source))) {}

HostBlockSourceScope::~HostBlockSourceScope() { installed() = std::move(previous_); }

}  // namespace shardkit
