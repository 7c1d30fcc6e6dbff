// The MPI backend's entry points in a build without MPI (mpi_process_group.h).
#include "common/comm/mpi_process_group.h"

namespace shardkit::comm {

bool mpi_backend_built() { return false; }

absl::StatusOr<std::shared_ptr<ProcessGroup>> create_mpi_world(const MpiOptions& /*options*/) {
  return absl::UnimplementedError(
      "create_mpi_world: shardkit was built without MPI (install Open MPI, e.g. Debian's libopenmpi-dev, and "
      "configure again)");
}

}  // namespace shardkit::comm
