#include "common/nn/models.h"

namespace shardkit::nn {

std::shared_ptr<Sequential> make_mlp(const std::vector<std::int64_t>& sizes, Generator& gen, Activation activation) {
  SK_CHECK_GE(sizes.size(), 2u) << "make_mlp needs at least input and output sizes";
  auto net = std::make_shared<Sequential>();
  for (std::size_t i = 0; i + 1 < sizes.size(); ++i) {
    net->push_back(std::make_shared<Linear>(sizes[i], sizes[i + 1], gen));
    if (i + 2 < sizes.size()) {
      if (activation == Activation::relu) {
        net->push_back(std::make_shared<ReLU>());
      } else {
        net->push_back(std::make_shared<GELU>());
      }
    }
  }
  return net;
}

std::shared_ptr<Sequential> make_batchnorm_mlp(const std::vector<std::int64_t>& sizes, Generator& gen) {
  SK_CHECK_GE(sizes.size(), 2u) << "make_batchnorm_mlp needs at least input and output sizes";
  auto net = std::make_shared<Sequential>();
  for (std::size_t i = 0; i + 1 < sizes.size(); ++i) {
    net->push_back(std::make_shared<Linear>(sizes[i], sizes[i + 1], gen));
    if (i + 2 < sizes.size()) {
      net->push_back(std::make_shared<BatchNorm1d>(sizes[i + 1]));
      net->push_back(std::make_shared<ReLU>());
    }
  }
  return net;
}

}  // namespace shardkit::nn
