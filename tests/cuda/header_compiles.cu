// kvevict/cuda.cuh is self-contained: it compiles as the first and only include, twice.
#include "kvevict/cuda.cuh"

int kvevict_cuda_header_anchor = 0;
