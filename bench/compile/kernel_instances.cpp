// Compile cost: the program's one TU of the CPU kernels under KVEVICT_EXTERN_KERNELS=1, every
// query and storage type with every kernel set.
#define KVEVICT_EXTERN_KERNELS 1
#include <kvevict/instantiate_kernels.hpp>
