// Where a tensor's storage lives: the host, or CUDA device N.
#pragma once

#include <string>

namespace shardkit {

struct Device {
  enum class Kind : unsigned char { cpu = 0, cuda = 1 };
  Kind kind = Kind::cpu;
  int index = 0;

  static constexpr Device cpu() { return Device{Kind::cpu, 0}; }
  static constexpr Device cuda(int index) { return Device{Kind::cuda, index}; }
  constexpr bool is_cpu() const { return kind == Kind::cpu; }
  constexpr bool is_cuda() const { return kind == Kind::cuda; }
  friend constexpr bool operator==(Device a, Device b) { return a.kind == b.kind && a.index == b.index; }
  std::string str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }
};

}  // namespace shardkit
