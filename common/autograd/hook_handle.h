// HookHandle and HookList: the removable-hook machinery shared by tensor hooks, post-accumulate-grad
// hooks and module forward hooks (DESIGN.md section 2, the hook table).
//
// Every register_* function returns a HookHandle. Destroying the handle (or calling remove()) removes
// the hook; keep() gives up that right so the hook lives as long as what it is attached to. A wrapper
// that installs hooks (ShardedDDP, FSDP) owns their handles, so destroying the wrapper removes its hooks.
// A handle outliving the tensor or module it points at is harmless (removal becomes a no-op).
//
// Thread-safety: none. Hooks belong to one rank; register, remove and run them on that rank's thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

namespace shardkit::autograd {

class [[nodiscard]] HookHandle {
 public:
  HookHandle() = default;
  explicit HookHandle(std::function<void()> remover) : remover_(std::move(remover)) {}
  HookHandle(HookHandle&& other) noexcept : remover_(std::exchange(other.remover_, nullptr)) {}
  HookHandle& operator=(HookHandle&& other) noexcept {
    if (this != &other) {
      remove();
      remover_ = std::exchange(other.remover_, nullptr);
    }
    return *this;
  }
  HookHandle(const HookHandle&) = delete;
  HookHandle& operator=(const HookHandle&) = delete;
  ~HookHandle() { remove(); }

  // Removes the hook now (idempotent).
  void remove() {
    if (remover_) std::exchange(remover_, nullptr)();
  }
  // The hook stays installed for good; this handle no longer controls it.
  void keep() { remover_ = nullptr; }
  // True while this handle still controls an installed hook.
  bool active() const { return static_cast<bool>(remover_); }

 private:
  std::function<void()> remover_;
};

// An ordered list of hooks of one kind. Hooks run in registration order; a hook removed while the
// list is being run (even by a hook of the same list) is still skipped if it has not run yet.
template <typename Fn>
class HookList {
 public:
  std::uint64_t add(Fn fn) {
    const std::uint64_t id = next_id_++;
    hooks_.push_back({id, std::make_shared<Fn>(std::move(fn))});
    return id;
  }
  void remove(std::uint64_t id) {
    for (auto it = hooks_.begin(); it != hooks_.end(); ++it) {
      if (it->first == id) {
        hooks_.erase(it);
        return;
      }
    }
  }
  bool contains(std::uint64_t id) const {
    for (const auto& h : hooks_) {
      if (h.first == id) return true;
    }
    return false;
  }
  bool empty() const { return hooks_.empty(); }
  std::size_t size() const { return hooks_.size(); }

  // Calls visit(const Fn&) for each hook in registration order. Hooks added during the walk do not
  // run in it; hooks removed during the walk that have not run yet are skipped.
  template <typename Visit>
  void for_each(Visit&& visit) const {
    if (hooks_.empty()) return;
    const auto snapshot = hooks_;
    for (const auto& [id, fn] : snapshot) {
      if (contains(id)) visit(*fn);
    }
  }

 private:
  std::uint64_t next_id_ = 0;
  std::vector<std::pair<std::uint64_t, std::shared_ptr<Fn>>> hooks_;
};

// Adds `fn` to `list` and returns the handle that removes it (a no-op once the list is gone).
template <typename Fn>
HookHandle add_hook(const std::shared_ptr<HookList<Fn>>& list, Fn fn) {
  const std::uint64_t id = list->add(std::move(fn));
  return HookHandle([weak = std::weak_ptr<HookList<Fn>>(list), id] {
    if (auto l = weak.lock()) l->remove(id);
  });
}

}  // namespace shardkit::autograd
