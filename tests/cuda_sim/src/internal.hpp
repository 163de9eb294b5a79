// Between the simulator's runtime (runtime.cpp: memory, streams, attributes, launch checks)
// and its scheduler (scheduler.cpp: fibers, blocks, barriers, warp collectives).
#pragma once

#include <cstddef>

#include "cuda_sim/launch.hpp"

namespace cudasim {
namespace detail {

/// Runs every block of `l` on the calling host thread, blocks one after another, one fiber
/// per CUDA thread. `shared_limit` bounds static + dynamic shared memory per block. Returns
/// the largest static shared memory a block declared.
std::size_t run_grid(const kernel_launch& l, std::size_t shared_limit) noexcept;

/// Whether the calling host thread is inside a kernel (device code calling the runtime).
bool in_kernel() noexcept;

/// Prints "cudasim: <message>" and, inside a kernel, which block and thread; then aborts.
[[noreturn]] void fatal(const char* format, ...) noexcept __attribute__((format(printf, 1, 2)));

}  // namespace detail
}  // namespace cudasim
