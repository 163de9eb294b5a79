// Entry point of the GPU tests: refuses to run (and fails) without a CUDA device, so a
// machine without one never reports these tests as passed. (Catch2 itself:
// tests/support/catch_impl.cpp.)
#include <cstdio>
#include <string>

#include "gpu_runner.hpp"
#include "support/catch_session.hpp"

int main(int argc, char* argv[]) {
  std::string why;
  if (!gpu::available(&why)) {
    std::fprintf(stderr, "kvevict_cuda_tests: no usable CUDA device (%s); run them on a GPU machine\n", why.c_str());
    return 1;
  }
  std::printf("kvevict_cuda_tests on %s\n", gpu::device_name().c_str());
  return kvevict_tests::run_catch(argc, argv);
}
