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

# kvevict_add_compile_check_flags(<target>): a target that is compiled, never run (the README
# sample, docs/integration.md's recipes). clang's warnings come from its front end whatever the
# optimisation level, so clang compiles it at -O0 (integration_runtime_dtype.cpp: 53 s at -O3,
# 8.5 s at -O0); GCC's -Wmaybe-uninitialized and its kin need the optimiser, so GCC keeps the
# build's level.
function(kvevict_add_compile_check_flags target)
  kvevict_add_target_flags(${target})
  if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    target_compile_options(${target} PRIVATE -O0)
  endif()
endfunction()

# The one Python that has Debian's torch/numpy/matplotlib (a pyenv python3 may come first on PATH).
set(KVEVICT_PYTHON /usr/bin/python3 CACHE FILEPATH "Python with Debian's python3-torch")
