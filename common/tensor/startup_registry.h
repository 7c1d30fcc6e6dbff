// StartupRegistry<T>: one pointer slot, filled at most once during static initialisation and read after.
// It is how the CPU libraries reach the CUDA implementations that shardkit::cuda registers when a program
// links it (Note [cuda component] in common/cuda/cuda_component.h); it is not a general plugin mechanism.
//
// Thread-safety: set() runs from a static initialiser, before main() and before any rank thread starts;
// get() may then be called from any thread. The slot is constant-initialised (constinit), so a get() or
// set() from another translation unit's static initialiser never sees it unconstructed.
#pragma once

#include <atomic>

#include "common/base/check.h"

namespace shardkit::detail {

template <typename T>
class StartupRegistry {
 public:
  constexpr StartupRegistry() = default;
  StartupRegistry(const StartupRegistry&) = delete;
  StartupRegistry& operator=(const StartupRegistry&) = delete;

  // Fills the slot. Registering a second, different value is a broken invariant (two implementations
  // of one seam in a program); registering the same value again is harmless.
  void set(const T* value, const char* what) {
    SK_CHECK(value != nullptr) << what << ": registering a null implementation";
    const T* expected = nullptr;
    if (!slot_.compare_exchange_strong(expected, value, std::memory_order_acq_rel)) {
      SK_CHECK(expected == value) << what << ": a second, different implementation was registered";
    }
  }

  // The registered value, or null when nothing registered one (the program does not link shardkit::cuda).
  const T* get() const { return slot_.load(std::memory_order_acquire); }

 private:
  std::atomic<const T*> slot_{nullptr};
};

}  // namespace shardkit::detail
