// DeviceMesh: ranks arranged in a 1-D or 2-D grid, with one ProcessGroup per dimension (DESIGN.md
// section 2), e.g. HSDP: dim 0 = "replicate" (across hosts), dim 1 = "shard" (within a host).
//
// Layout is row-major: on a (R, C) mesh, world rank = i·C + j at coordinate (i, j). group(0) holds the
// ranks that share j (the column: size R, group rank = i); group(1) holds the ranks that share i (the
// row: size C, group rank = j). On a 1-D mesh group(0) is the world group itself.
//
// create() is a collective over the world group (it splits it): every rank calls it with the same
// shape. A DeviceMesh is one rank's view (like a ProcessGroup handle); copy it freely (it shares the
// groups).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/comm/process_group.h"

namespace shardkit::comm {

class DeviceMesh {
 public:
  // shape: 1 or 2 positive sizes whose product is world->size(). dim_names: empty or one per dim
  // (used in group names and by dim_index()).
  static absl::StatusOr<DeviceMesh> create(std::shared_ptr<ProcessGroup> world, std::vector<int> shape,
                                           std::vector<std::string> dim_names = {});

  int ndim() const { return static_cast<int>(shape_.size()); }
  const std::vector<int>& shape() const { return shape_; }
  // This rank's coordinate, one entry per dim.
  const std::vector<int>& coordinate() const { return coordinate_; }
  // The group along `dim` (see the layout above).
  ProcessGroup& group(int dim) const;
  const std::shared_ptr<ProcessGroup>& group_ptr(int dim) const;
  // The dim named `name`, or -1.
  int dim_index(const std::string& name) const;
  ProcessGroup& world() const { return *world_; }
  // World rank at a coordinate.
  int rank_at(const std::vector<int>& coordinate) const;

 private:
  std::shared_ptr<ProcessGroup> world_;
  std::vector<int> shape_;
  std::vector<std::string> names_;
  std::vector<int> coordinate_;
  std::vector<std::shared_ptr<ProcessGroup>> groups_;
};

}  // namespace shardkit::comm
