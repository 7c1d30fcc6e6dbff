# Helpers shared by every folder's CMakeLists.txt.
#
# shardkit_library(NAME SOURCES ... DEPS ... [PRIVATE_DEPS ...] [COMPONENT cuda]) defines the target shardkit_NAME
# (alias shardkit::NAME), compiled with the project's warnings, whose public include root is the source tree
# (in-tree) or include/shardkit (installed), so `#include "common/tensor/tensor.h"` works in both.
set(SHARDKIT_LIBRARY_TARGETS "" CACHE INTERNAL "")

function(shardkit_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wno-unused-parameter>)
  if(SHARDKIT_WARNINGS_AS_ERRORS)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>
                                             $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings -Xcompiler=-Werror>)
  endif()
  if(SHARDKIT_NATIVE)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-march=native>)
  endif()
  # Note [no-math-errno]: without it gcc will not vectorise loops that call sqrtf (DESIGN.md section 9).
  # Note [no-trapping-math]: without it gcc 12 keeps a float clamp whose result feeds arithmetic as a branch and
  # will not vectorise the loop ("control flow in loop" in -fopt-info-vec-all): fast_exp's range clamp kept GELU,
  # softmax, attention and cross-entropy scalar (bench/activation_bench measures them against their memory traffic).
  # Neither flag changes a result: no reassociation, no contraction (-std=c++20 keeps -ffp-contract=off).
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fno-math-errno -fno-trapping-math>)
endfunction()

function(shardkit_library name)
  cmake_parse_arguments(ARG "" "COMPONENT" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  set(target shardkit_${name})
  add_library(${target} STATIC ${ARG_SOURCES})
  add_library(shardkit::${name} ALIAS ${target})
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${name})
  target_include_directories(${target} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>
    $<INSTALL_INTERFACE:include/shardkit>)
  target_link_libraries(${target} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  target_compile_features(${target} PUBLIC cxx_std_20)
  shardkit_warnings(${target})
  # The CPU libraries form the package's default export set (shardkitTargets.cmake) and the umbrella
  # target; COMPONENT cuda goes to shardkitCudaTargets.cmake only (Note [cuda component]).
  if(ARG_COMPONENT STREQUAL "cuda")
    set(export_set shardkitCudaTargets)
  elseif(ARG_COMPONENT)
    message(FATAL_ERROR "shardkit_library(${name}): unknown COMPONENT ${ARG_COMPONENT}")
  else()
    set(export_set shardkitTargets)
    set(SHARDKIT_LIBRARY_TARGETS ${SHARDKIT_LIBRARY_TARGETS} ${target} CACHE INTERNAL "")
  endif()
  install(TARGETS ${target} EXPORT ${export_set} ARCHIVE DESTINATION lib)
  file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR})
  install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/ DESTINATION include/shardkit/${rel}
    FILES_MATCHING PATTERN "*.h")
endfunction()

# shardkit_cuda_sources(SOURCES ...) hands a folder's CUDA sources (.cu, or .cc that include CUDA headers) to
# the cuda component: common/cuda/CMakeLists.txt compiles them all into shardkit::cuda, which registers them
# with the CPU libraries at start-up (Note [cuda component] in common/cuda/cuda_component.h). Nothing happens
# in a build without CUDA, so folders call it unconditionally.
set_property(GLOBAL PROPERTY SHARDKIT_CUDA_SOURCES "")
function(shardkit_cuda_sources)
  cmake_parse_arguments(ARG "" "" "SOURCES" ${ARGN})
  if(NOT SHARDKIT_WITH_CUDA)
    return()
  endif()
  foreach(src ${ARG_SOURCES})
    get_filename_component(src ${src} ABSOLUTE BASE_DIR ${CMAKE_CURRENT_SOURCE_DIR})
    set_property(GLOBAL APPEND PROPERTY SHARDKIT_CUDA_SOURCES ${src})
  endforeach()
endfunction()

# shardkit_test(NAME SOURCES ... DEPS ... [LABELS ...]) builds a gtest binary and registers its tests.
# Tests labelled "long" are left out of the default ctest run (see README).
function(shardkit_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  target_compile_features(${name} PRIVATE cxx_std_20)
  shardkit_warnings(${name})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  # Note: CMake 3.25's gtest discovery (PRE_TEST) writes PROPERTIES unquoted, so a multi-value LABELS list
  # turns "long" into a property name; a test carries exactly one label: its LABELS, or "unit".
  set(labels unit)
  if(ARG_LABELS)
    list(GET ARG_LABELS 0 labels)
  endif()
  gtest_discover_tests(${name} DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60
    PROPERTIES LABELS "${labels}" TIMEOUT ${ARG_TIMEOUT})
endfunction()

# shardkit_test_link_cuda(NAME): a test binary with CUDA cases gets the device they run on: shardkit::cuda (Note
# [cuda component]) in a CUDA build, the CPU emulation of its seams under SHARDKIT_CUDA_EMULATOR (Note [cuda
# emulator]), else nothing (its CUDA cases skip).
function(shardkit_test_link_cuda name)
  if(TARGET shardkit::cuda)
    target_link_libraries(${name} PRIVATE shardkit::cuda)
  elseif(TARGET shardkit_cuda_emulator)
    target_link_libraries(${name} PRIVATE shardkit_cuda_emulator)
  endif()
endfunction()

# shardkit_bench(NAME SOURCES ... DEPS ...) builds a Google Benchmark binary in build/bench/.
function(shardkit_bench name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} benchmark::benchmark)
  target_compile_features(${name} PRIVATE cxx_std_20)
  shardkit_warnings(${name})
endfunction()
