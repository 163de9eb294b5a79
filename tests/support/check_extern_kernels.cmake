# ctest build.extern_kernels: the test programs compile the CPU kernels once
# (KVEVICT_EXTERN_KERNELS, docs/compile-cost.md). The kernel-instance object defines every
# observe_head instance (15 query x key types) and no other object of the unit-test binary
# defines one, nor one of a kernel set's observe_head (isa_scalar, isa_avx2, isa_avx512: what
# a header-only TU defines even where the optimiser inlined the dispatching one). A TU that
# compiled them again would cost the sanitizer builds ~30 s. test_cpu_isa.cpp calls the kernel
# sets directly (their own tests): it is the one exception.
# Run as: cmake -DNM=<nm> "-DOBJECTS=<the binary's objects>" "-DINSTANCES=<the instance object>" -P ...
cmake_minimum_required(VERSION 3.16)  # (script mode: IN_LIST)
set(instances 0)
set(elsewhere "")
foreach(object IN LISTS OBJECTS INSTANCES)
  execute_process(COMMAND ${NM} -C --defined-only ${object} OUTPUT_VARIABLE symbols RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${NM} failed on ${object}")
  endif()
  string(REGEX MATCHALL "detail::observe_head<[^\n]*" dispatching "${symbols}")
  string(REGEX MATCHALL "detail::(isa_[a-z0-9_]+::)?observe_head<[^\n]*" any "${symbols}")
  list(LENGTH any n)
  if(object IN_LIST INSTANCES)
    list(LENGTH dispatching instances)
  elseif(n GREATER 0 AND NOT object MATCHES "test_cpu_isa\\.cpp\\.o$")
    list(APPEND elsewhere "${object} (${n})")
  endif()
endforeach()
if(NOT instances EQUAL 15)
  message(FATAL_ERROR "the kernel-instance object defines ${instances} observe_head instances, not 15")
endif()
if(elsewhere)
  message(FATAL_ERROR "objects that compiled observe_head again: ${elsewhere}")
endif()
message(STATUS "observe_head: 15 instances in one object, none elsewhere")
