// The batches a CUDA multi-tensor update is launched in: one per (parameter dtype, gradient dtype) pair, since a
// launch's kernel is compiled for one pair (common/optim/cuda/cuda_optim_kernels.h). Internal to common/optim.
#pragma once

#include <utility>
#include <vector>

#include "common/tensor/dtype.h"

namespace shardkit::optim {

struct DtypePair {
  DType param, grad;
  friend bool operator==(DtypePair a, DtypePair b) { return a.param == b.param && a.grad == b.grad; }
};

// Appends `item` to the batch of `key`, creating the batch (in first-seen order) when it is new.
template <typename T>
void add_to_batch(std::vector<std::pair<DtypePair, std::vector<T>>>& batches, DtypePair key, T item) {
  for (auto& [k, items] : batches) {
    if (k == key) {
      items.push_back(std::move(item));
      return;
    }
  }
  batches.emplace_back(key, std::vector<T>{std::move(item)});
}

}  // namespace shardkit::optim
