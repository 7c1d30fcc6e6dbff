#include "common/autograd/grad_mode.h"

namespace shardkit::autograd {
namespace {
thread_local bool tl_grad_enabled = true;
}  // namespace

bool is_grad_enabled() { return tl_grad_enabled; }
void set_grad_enabled(bool enabled) { tl_grad_enabled = enabled; }

GradModeGuard::GradModeGuard(bool enabled) : previous_(tl_grad_enabled) { tl_grad_enabled = enabled; }
GradModeGuard::~GradModeGuard() { tl_grad_enabled = previous_; }

}  // namespace shardkit::autograd
