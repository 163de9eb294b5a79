// Entry point of the unit tests and the Eigen adapter's tests (Catch2: support/catch_impl.cpp).
#include "../support/catch_session.hpp"

int main(int argc, char* argv[]) {
  return kvevict_tests::run_catch(argc, argv);
}
