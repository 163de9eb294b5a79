// tests/cuda/gpu_runner.cu compiled by the host compiler against the simulator: the same
// source that runs on a GPU (scripts/gpu-check), so the simulated suite is the GPU suite.
#include "gpu_runner.cu"
