#include "common/comm/device_mesh.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/check.h"

namespace shardkit::comm {

absl::StatusOr<DeviceMesh> DeviceMesh::create(std::shared_ptr<ProcessGroup> world, std::vector<int> shape,
                                              std::vector<std::string> dim_names) {
  SK_CHECK(world != nullptr);
  std::int64_t product = 1;
  for (int s : shape) product *= s;
  const bool bad_shape = shape.empty() || shape.size() > 2 || product != world->size() ||
                         (shape.size() == 2 && (shape[0] <= 0 || shape[1] <= 0));
  if (bad_shape) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceMesh: expected 1 or 2 positive dims whose product is the ",
                                                   "world size ", world->size(), ", found [",
                                                   absl::StrJoin(shape, ", "), "]"));
  }
  if (!dim_names.empty() && dim_names.size() != shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceMesh: expected ", shape.size(), " dim names, found ",
                                                   dim_names.size()));
  }
  if (dim_names.empty()) {
    for (std::size_t d = 0; d < shape.size(); ++d) dim_names.push_back(absl::StrCat("dim", d));
  }
  DeviceMesh mesh;
  mesh.world_ = world;
  mesh.shape_ = shape;
  mesh.names_ = dim_names;
  const int r = world->rank();
  if (shape.size() == 1) {
    mesh.coordinate_ = {r};
    mesh.groups_ = {world};
    return mesh;
  }
  const int i = r / shape[1], j = r % shape[1];
  mesh.coordinate_ = {i, j};
  // Column (dim 0): ranks sharing j, ordered by i. Row (dim 1): ranks sharing i, ordered by j.
  auto col = world->split(j, i, {.name = absl::StrCat(world->name(), "/", dim_names[0], ".", j)});
  if (!col.ok()) return col.status();
  auto row = world->split(i, j, {.name = absl::StrCat(world->name(), "/", dim_names[1], ".", i)});
  if (!row.ok()) return row.status();
  mesh.groups_ = {*std::move(col), *std::move(row)};
  return mesh;
}

ProcessGroup& DeviceMesh::group(int dim) const { return *group_ptr(dim); }

const std::shared_ptr<ProcessGroup>& DeviceMesh::group_ptr(int dim) const {
  SK_CHECK(dim >= 0 && dim < ndim()) << "dim " << dim << " of a " << ndim() << "-D mesh";
  return groups_[dim];
}

int DeviceMesh::dim_index(const std::string& name) const {
  for (int d = 0; d < ndim(); ++d) {
    if (names_[d] == name) return d;
  }
  return -1;
}

int DeviceMesh::rank_at(const std::vector<int>& coordinate) const {
  SK_CHECK_EQ(static_cast<int>(coordinate.size()), ndim());
  return ndim() == 1 ? coordinate[0] : coordinate[0] * shape_[1] + coordinate[1];
}

}  // namespace shardkit::comm
