// tests/cuda/compressor_runner.cu compiled by the host compiler against the simulator.
#include "compressor_runner.cu"
