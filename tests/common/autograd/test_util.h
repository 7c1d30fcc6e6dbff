// Test helpers shared by the autograd and nn tests.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>

#include "common/tensor/tensor.h"

namespace shardkit::testing_util {

// A leaf that requires grad, from values.
inline Tensor Leaf(const std::vector<float>& v, const Shape& shape) {
  Tensor t = Tensor::from_vector(v, shape);
  t.set_requires_grad(true);
  return t;
}

// n threads meet here; a thread that waits longer than the deadline throws (tests never hang).
class Meeting {
 public:
  explicit Meeting(int n) : n_(n) {}
  void arrive_and_wait(std::chrono::milliseconds deadline = std::chrono::milliseconds(20000)) {
    std::unique_lock<std::mutex> lock(mu_);
    const int gen = generation_;
    if (++count_ == n_) {
      count_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lock, deadline, [&] { return generation_ != gen; })) {
      throw std::runtime_error("Meeting: deadline passed waiting for the other threads");
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_;
  int count_ = 0;
  int generation_ = 0;
};

}  // namespace shardkit::testing_util
