// Compile cost: runtime_dtype.cpp with the CPU kernels compiled once per program
// (KVEVICT_EXTERN_KERNELS=1, config.hpp).
#define KVEVICT_EXTERN_KERNELS 1
#include "runtime_dtype.cpp"
