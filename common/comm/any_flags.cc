#include "common/comm/any_flags.h"

#include <cstdint>

#include "common/tensor/memory_tracker.h"

namespace shardkit::comm {

Tensor flags_tensor(const std::vector<char>& flags, Device device, DType dtype) {
  const std::vector<float> values(flags.begin(), flags.end());
  return Tensor::from_vector(values, {static_cast<std::int64_t>(values.size())},
                             TensorOptions{}.with_category(MemoryCategory::communication_buffer))
      .to(dtype, MemoryCategory::communication_buffer)
      .to(device, MemoryCategory::communication_buffer);
}

std::vector<char> read_flags(const Tensor& reduced) {
  const std::vector<float> values = reduced.to(Device::cpu(), MemoryCategory::communication_buffer)
                                        .to(DType::f32, MemoryCategory::communication_buffer)
                                        .to_vector();
  std::vector<char> out(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) out[i] = values[i] != 0.f ? 1 : 0;
  return out;
}

}  // namespace shardkit::comm
