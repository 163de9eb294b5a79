// SPDX-License-Identifier: Apache-2.0
// Catch2's implementation, compiled once per build for every Catch2 program (kvevict_catch_impl
// in tests/CMakeLists.txt): the unit tests', Eigen's and the GPU suite's main() call run_catch,
// so none of them compiles Catch2 itself (docs/compile-cost.md).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "catch_session.hpp"

int kvevict_tests::run_catch(int argc, char* argv[]) {
  return Catch::Session().run(argc, argv);
}
