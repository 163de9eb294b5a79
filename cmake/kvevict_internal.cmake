# Settings for kvevict's own targets (tests, benchmarks, examples, fuzzers). They live on
# an internal INTERFACE target linked privately, so nothing leaks into a parent project
# or into the installed kvevict::kvevict target.

add_library(kvevict_internal_flags INTERFACE)
if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  target_compile_options(kvevict_internal_flags INTERFACE -Wall -Wextra -Wpedantic -Wshadow -Wconversion
                                                          -Wno-sign-conversion -Werror)
  if(KVEVICT_NATIVE)
    target_compile_options(kvevict_internal_flags INTERFACE -march=native)
  endif()
  if(KVEVICT_SANITIZE)
    target_compile_options(kvevict_internal_flags INTERFACE -fsanitize=${KVEVICT_SANITIZE} -fno-omit-frame-pointer
                                                            -fno-sanitize-recover=all)
    target_link_options(kvevict_internal_flags INTERFACE -fsanitize=${KVEVICT_SANITIZE})
  endif()
endif()

# kvevict_add_target_flags(<target>): our warnings (as errors) and optional -march/sanitizers.
function(kvevict_add_target_flags target)
  target_link_libraries(${target} PRIVATE kvevict::kvevict kvevict_internal_flags)
endfunction()

# kvevict_use_kernel_instances(<target>): the target's translation units take the CPU kernels
# from one object compiled per build (KVEVICT_EXTERN_KERNELS, include/kvevict/instantiate_kernels.hpp)
# instead of compiling them in each: under ASan at -O0 they were 60% of a test TU's compile
# (docs/compile-cost.md). For the tests and compile checks; examples, benchmarks, fuzzers and
# the packaging consumers stay header-only.
add_library(kvevict_kernel_instances OBJECT EXCLUDE_FROM_ALL ${PROJECT_SOURCE_DIR}/tests/support/kernel_instances.cpp)
target_compile_definitions(kvevict_kernel_instances PRIVATE KVEVICT_EXTERN_KERNELS=1)
target_link_libraries(kvevict_kernel_instances PRIVATE kvevict::kvevict kvevict_internal_flags)
function(kvevict_use_kernel_instances target)
  target_compile_definitions(${target} PRIVATE KVEVICT_EXTERN_KERNELS=1)
  get_target_property(type ${target} TYPE)
  if(type STREQUAL "EXECUTABLE")  # a library's executables link the instances themselves
    target_sources(${target} PRIVATE $<TARGET_OBJECTS:kvevict_kernel_instances>)
  endif()
endfunction()

# kvevict_add_compile_check_flags(<target>): a target that is compiled, never run (the README
# sample, docs/integration.md's recipes). clang's warnings come from its front end whatever the
# optimisation level, so clang compiles it at -O0 (integration_runtime_dtype.cpp: 53 s at -O3,
# 8.5 s at -O0); GCC's -Wmaybe-uninitialized and its kin need the optimiser, so GCC keeps the
# build's level.
function(kvevict_add_compile_check_flags target)
  kvevict_add_target_flags(${target})
  kvevict_use_kernel_instances(${target})
  if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    target_compile_options(${target} PRIVATE -O0)
  endif()
endfunction()

# The one Python that has Debian's torch/numpy/matplotlib (a pyenv python3 may come first on PATH).
set(KVEVICT_PYTHON /usr/bin/python3 CACHE FILEPATH "Python with Debian's python3-torch")
