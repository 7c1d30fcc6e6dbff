# copy_bench: copy_bytes and memcpy at every relative offset within a cache line (Note [copy alignment]).
shardkit_bench(copy_bench SOURCES ${CMAKE_CURRENT_LIST_DIR}/copy_bench.cc DEPS shardkit::base)
