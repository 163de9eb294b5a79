// Entry point of the GPU tests: refuses to run (and fails) without a CUDA device, so a
// machine without one never reports these tests as passed.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>
#include <string>

#include "gpu_runner.hpp"

int main(int argc, char* argv[]) {
  std::string why;
  if (!gpu::available(&why)) {
    std::fprintf(stderr, "kvevict_cuda_tests: no usable CUDA device (%s); run them on a GPU machine\n", why.c_str());
    return 1;
  }
  std::printf("kvevict_cuda_tests on %s\n", gpu::device_name().c_str());
  return Catch::Session().run(argc, argv);
}
