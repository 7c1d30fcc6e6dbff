// Grad mode: whether operations record the graph for backward (DESIGN.md section 2).
//
// Grad mode is per thread (thread_local), never process-global: simulated ranks are threads of one
// process, and one rank turning gradients off must not affect another. A new thread starts with grad
// mode enabled. The engine turns it off on its own thread while a backward runs (backward functions
// do not build graphs: no double backward).
#pragma once

namespace shardkit::autograd {

// True when operations on the calling thread record the graph.
bool is_grad_enabled();
void set_grad_enabled(bool enabled);

// Sets grad mode on the calling thread until destruction, then restores the previous mode (nests).
class GradModeGuard {
 public:
  explicit GradModeGuard(bool enabled);
  ~GradModeGuard();
  GradModeGuard(const GradModeGuard&) = delete;
  GradModeGuard& operator=(const GradModeGuard&) = delete;

 private:
  bool previous_;
};

// `NoGradGuard g;` — no graph recording in this scope (inference, parameter updates, initialisation).
class NoGradGuard : public GradModeGuard {
 public:
  NoGradGuard() : GradModeGuard(false) {}
};

}  // namespace shardkit::autograd
