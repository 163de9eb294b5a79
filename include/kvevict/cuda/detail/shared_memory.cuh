// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DETAIL_SHARED_MEMORY_CUH
#define KVEVICT_CUDA_DETAIL_SHARED_MEMORY_CUH

// Shared-memory declarations of the kernels. Under nvcc they are exactly the CUDA
// declarations. Under KVEVICT_CUDA_SIMULATOR (tests/cuda_sim, which compiles the kernels
// with the host compiler) they become per-block storage the simulator allocates: a fresh,
// exactly sized, poisoned arena per block, so an overrun, a read of memory no thread of the
// block wrote, or a race between blocks is visible to the sanitizers. A function-scope
// `static` cannot do that (one object shared by every block), and `extern __shared__ T x[]`
// has no host-compiler spelling.
//
//   KVEVICT_SHARED(T, name)              __shared__ T name;
//   KVEVICT_SHARED_ARRAY(T, name, count) __shared__ T name[count];
//   KVEVICT_DYNAMIC_SHARED(T, name)      extern __shared__ T name[];   (the launch's bytes)

#include <cuda_runtime.h>

#if defined(KVEVICT_CUDA_SIMULATOR)
// The simulator's <cuda_runtime.h> provides the CUDA_SIM_* forms.
#if !defined(CUDA_SIM_SHARED)
#error "KVEVICT_CUDA_SIMULATOR is set but <cuda_runtime.h> is not the simulator's (tests/cuda_sim/include)"
#endif
#define KVEVICT_SHARED(T, name) CUDA_SIM_SHARED(T, name)
#define KVEVICT_SHARED_ARRAY(T, name, count) CUDA_SIM_SHARED_ARRAY(T, name, count)
#define KVEVICT_DYNAMIC_SHARED(T, name) CUDA_SIM_DYNAMIC_SHARED(T, name)
#else
#define KVEVICT_SHARED(T, name) __shared__ T name
#define KVEVICT_SHARED_ARRAY(T, name, count) __shared__ T name[count]
#define KVEVICT_DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

#endif  // KVEVICT_CUDA_DETAIL_SHARED_MEMORY_CUH
