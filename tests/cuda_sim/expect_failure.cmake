# Runs PROGRAM with ARGS (a ;-list) and passes only when it fails (non-zero exit or a
# signal) AND its stderr matches EXPECT (a CMake regex): an expected-failure test that
# checks the kind of failure, not just that something went wrong.
#   cmake -DPROGRAM=... -DARGS=... -DEXPECT=... -P expect_failure.cmake
execute_process(COMMAND ${PROGRAM} ${ARGS} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc STREQUAL "0")
  message(FATAL_ERROR "expected '${PROGRAM} ${ARGS}' to fail with a report matching '${EXPECT}', "
                      "but it exited 0.\n--- stdout ---\n${out}\n--- stderr ---\n${err}")
endif()
if(NOT err MATCHES "${EXPECT}")
  message(FATAL_ERROR "'${PROGRAM} ${ARGS}' failed (${rc}) but its report does not match '${EXPECT}'.\n"
                      "--- stdout ---\n${out}\n--- stderr ---\n${err}")
endif()
string(REGEX MATCH "${EXPECT}" matched "${err}")
message(STATUS "caught as expected (exit: ${rc}): ${matched}")
