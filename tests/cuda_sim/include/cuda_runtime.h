// <cuda_runtime.h> for kvevict's CPU SIMT simulator (tests/cuda_sim). Put this directory
// first on the include path and define KVEVICT_CUDA_SIMULATOR: the CUDA headers then compile
// with the host C++ compiler, and every kernel runs on the CPU, one fiber per CUDA thread.
// README.md in tests/cuda_sim lists the CUDA surface provided; anything else fails to compile.
#pragma once

#define CUDA_SIM 1

#include "cuda_sim/device.hpp"       // IWYU pragma: export
#include "cuda_sim/launch.hpp"       // IWYU pragma: export
#include "cuda_sim/runtime_api.hpp"  // IWYU pragma: export
#include "cuda_sim/types.hpp"        // IWYU pragma: export
