#include "common/autograd/node.h"

namespace shardkit::autograd {
namespace {
// Per thread (rank): sequence numbers order nodes within one rank's graph only.
thread_local std::uint64_t tl_next_sequence_nr = 0;
}  // namespace

std::uint64_t peek_sequence_nr() { return tl_next_sequence_nr; }

Node::Node() : sequence_nr_(tl_next_sequence_nr++) {}

void Node::release() {
  if (!releasable()) return;
  release_saved();
  released_ = true;
}

int Node::add_output(const Shape& shape, DType dtype, Device device) {
  output_shapes_.push_back(shape);
  output_dtypes_.push_back(dtype);
  output_devices_.push_back(device);
  output_hooks_.emplace_back();
  return static_cast<int>(output_shapes_.size()) - 1;
}

const std::shared_ptr<TensorHookList>& Node::output_hooks(int i) const {
  return output_hooks_.at(static_cast<std::size_t>(i));
}

void Node::set_output_hooks(int i, std::shared_ptr<TensorHookList> hooks) {
  output_hooks_.at(static_cast<std::size_t>(i)) = std::move(hooks);
}

}  // namespace shardkit::autograd
