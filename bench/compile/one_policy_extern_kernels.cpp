// Compile cost: one_policy.cpp with the CPU kernels compiled once per program
// (KVEVICT_EXTERN_KERNELS=1, config.hpp): kernel_instances.cpp is the program's one TU that
// compiles them.
#define KVEVICT_EXTERN_KERNELS 1
#include "one_policy.cpp"
