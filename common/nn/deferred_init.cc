#include "common/nn/deferred_init.h"

#include <vector>

#include "common/nn/module.h"

namespace shardkit::nn {
namespace {
thread_local DeferredInit* tl_deferred = nullptr;
}  // namespace

DeferredInit* current_deferred_init() { return tl_deferred; }

DeferredInitScope::DeferredInitScope(DeferredInit& d) : previous_(tl_deferred) { tl_deferred = &d; }
DeferredInitScope::~DeferredInitScope() { tl_deferred = previous_; }

Tensor DeferredInit::defer(const Shape& shape, const TensorOptions& options, Kind kind, Generator* gen, float a,
                           float b) {
  Tensor t = Tensor::empty(shape, options);
  if (t.nbytes() > 0) t.release_storage();
  Recipe r{t.impl_ptr(), kind, gen != nullptr ? *gen : Generator(), a, b};
  if (gen != nullptr) {
    // Exactly the blocks Generator::fill_uniform / fill_normal consume for n values (random.h).
    const auto n = static_cast<std::uint64_t>(t.numel());
    const std::uint64_t blocks = kind == Kind::uniform ? (n + 3) / 4 : (n + 1) / 2;
    gen->set_offset(gen->offset() + blocks);
  }
  recipes_[t.id()] = std::move(r);
  return t;
}

bool DeferredInit::is_deferred(const Tensor& t) const {
  auto it = recipes_.find(t.id());
  return it != recipes_.end() && it->second.tensor.lock() == t.impl_ptr();
}

void DeferredInit::transfer(const Tensor& from, const Tensor& to) {
  if (!is_deferred(from)) return;
  auto it = recipes_.find(from.id());
  Recipe r = std::move(it->second);
  recipes_.erase(it);
  r.tensor = to.impl_ptr();
  recipes_[to.id()] = std::move(r);
}

void DeferredInit::materialize(const Tensor& t) {
  auto it = recipes_.find(t.id());
  if (it == recipes_.end()) return;
  Recipe r = std::move(it->second);
  recipes_.erase(it);
  if (r.tensor.lock() != t.impl_ptr()) return;  // a dead tensor's address reused
  if (t.nbytes() > 0) t.reallocate_storage();
  // On another device (transfer): filled on the host, then copied there.
  const Tensor host = t.device().is_cpu() ? t : Tensor::empty(t.shape(), TensorOptions{}.with_dtype(t.dtype()));
  const std::int64_t n = t.numel();
  if (r.kind == Kind::constant) {
    host.fill_(r.a);
  } else {
    std::vector<float> v(static_cast<std::size_t>(n));
    if (r.kind == Kind::uniform) {
      r.gen.fill_uniform(v.data(), n, r.a, r.b);
    } else {
      r.gen.fill_normal(v.data(), n, r.a, r.b);
    }
    convert_elements(v.data(), DType::f32, host.raw_data(), host.dtype(), n);
  }
  if (!host.is_same(t)) t.copy_(host);
}

void DeferredInit::materialize(const Module& m) {
  for (const auto& [name, t] : m.named_parameters()) materialize(t);
}

}  // namespace shardkit::nn
