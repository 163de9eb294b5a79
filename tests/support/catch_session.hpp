// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_TESTS_SUPPORT_CATCH_SESSION_HPP
#define KVEVICT_TESTS_SUPPORT_CATCH_SESSION_HPP

// Runs Catch2 over a test program's arguments. Defined beside Catch2's implementation
// (catch_impl.cpp, compiled once per build), which alone declares Catch::Session.
namespace kvevict_tests {
int run_catch(int argc, char* argv[]);
}

#endif  // KVEVICT_TESTS_SUPPORT_CATCH_SESSION_HPP
