# comm_bench_mpi (comm_bench_mpi.cc): the MPI backend's collectives between processes started by mpirun.
if(SHARDKIT_WITH_MPI AND TARGET shardkit_comm_mpi)
  shardkit_bench(comm_bench_mpi SOURCES ${CMAKE_CURRENT_LIST_DIR}/comm_bench_mpi.cc DEPS shardkit::comm_mpi)
endif()
