// Deferred initialisation: build a model's structure without holding its parameters, then materialise
// them a part at a time (DESIGN.md section 5: FSDP builds the model so that no rank ever holds all of it).
//
//   nn::DeferredInit deferred;
//   std::shared_ptr<nn::GPT> gpt;
//   { nn::DeferredInitScope scope(deferred); gpt = std::make_shared<nn::GPT>(config, seed); }
//   // every parameter has its shape and dtype but no bytes (storage_released())
//   deferred.materialize(*gpt->blocks->child("3"));   // this unit's parameters get their values
//
// While a scope is installed on the calling thread, the nn::init functions (which every layer uses
// for its parameters) record a recipe per parameter instead of filling it: the kind of fill, its
// arguments and a copy of the Generator at that point, and advance the caller's Generator by exactly
// the counter blocks the fill would have used. Generators are counter-based, so materialising a
// parameter later, in any order, gives bit-identical values to an eager build from the same seed.
//
// Memory: each parameter is allocated and immediately released at construction (the ledger's
// parameter peak during construction is one parameter, not the model); materialize() allocates it
// again under MemoryCategory::parameter. Buffers (BatchNorm running statistics) are not deferred.
//
// Thread-safety: a DeferredInit belongs to one rank (thread); the scope is per thread, never global.
#pragma once

#include <cstddef>
#include <memory>

#include "absl/container/flat_hash_map.h"
#include "common/tensor/random.h"
#include "common/tensor/tensor.h"

namespace shardkit::nn {

class Module;

class DeferredInit {
 public:
  enum class Kind { uniform, normal, constant };

  DeferredInit() = default;
  DeferredInit(const DeferredInit&) = delete;
  DeferredInit& operator=(const DeferredInit&) = delete;

  // Gives `t` its values (reallocating its storage) if it is still deferred; otherwise nothing.
  void materialize(const Tensor& t);
  // Every deferred parameter of `m` and its descendants.
  void materialize(const Module& m);
  bool is_deferred(const Tensor& t) const;
  // `to` (a tensor without bytes, of `from`'s shape and dtype, e.g. on another device: Module::to(Device)) takes
  // over `from`'s recipe; materialize(to) then fills it where it lives. Nothing when `from` is not deferred.
  void transfer(const Tensor& from, const Tensor& to);
  // Number of parameters not materialised yet.
  std::size_t pending() const { return recipes_.size(); }

  // Used by nn::init: a released tensor with a recipe; `gen` is advanced as the fill would advance it.
  Tensor defer(const Shape& shape, const TensorOptions& options, Kind kind, Generator* gen, float a, float b);

 private:
  struct Recipe {
    std::weak_ptr<TensorImpl> tensor;
    Kind kind;
    Generator gen;
    float a, b;
  };
  absl::flat_hash_map<const TensorImpl*, Recipe> recipes_;
};

// Installs `d` for the calling thread's nn::init calls until destruction (nests).
class DeferredInitScope {
 public:
  explicit DeferredInitScope(DeferredInit& d);
  ~DeferredInitScope();
  DeferredInitScope(const DeferredInitScope&) = delete;
  DeferredInitScope& operator=(const DeferredInitScope&) = delete;

 private:
  DeferredInit* previous_;
};

// The calling thread's installed DeferredInit, or nullptr.
DeferredInit* current_deferred_init();

}  // namespace shardkit::nn
