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

# The one Python that has Debian's torch/numpy/matplotlib (a pyenv python3 may come first on PATH).
set(KVEVICT_PYTHON /usr/bin/python3 CACHE FILEPATH "Python with Debian's python3-torch")
