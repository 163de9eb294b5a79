// Simulator-only controls for tests: the launch log and an after-launch hook, the device
// the simulator pretends to be, and how it maps registered host memory. Never included by
// kvevict; tests include it to observe or steer what the CUDA runtime would do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "cuda_sim/types.hpp"

namespace cudasim {

/// One completed kernel launch.
struct launch_record {
  std::uintptr_t kernel = 0;  ///< compare with reinterpret_cast<std::uintptr_t>(&kernel_function)
  dim3 grid, block;
  std::size_t dynamic_smem = 0;
  std::size_t static_smem = 0;  ///< largest static shared memory a block of it declared
  cudaStream_t stream = nullptr;
};

/// Launches completed on the calling host thread since the last clear, oldest first.
std::vector<launch_record> launch_log();
void clear_launch_log();

/// Called on the calling host thread after each of its kernels completes (null: none). The
/// hook may use the runtime API (copies, memsets) but must not launch kernels.
void set_after_launch_hook(std::function<void(const launch_record&)> hook);

/// The device the simulator reports (cudaGetDeviceProperties, cudaDeviceGetAttribute) and
/// whose limits it enforces at launch. Defaults: an H100 (sm_90, 227 KiB opt-in shared
/// memory per block); CUDA_SIM_DEVICE=a100 in the environment selects an A100 (sm_80, 163 KiB).
struct device_profile {
  char name[128];
  int major, minor;
  int multiprocessors;
  std::size_t shared_per_block;        ///< default limit, 48 KiB
  std::size_t shared_per_block_optin;  ///< with cudaFuncSetAttribute
  std::size_t shared_per_multiprocessor;
  std::size_t global_memory;
  int l2_bytes;
  /// cudaDevAttrCanUseHostPointerForRegisteredMem: when false, cudaHostRegister'ed memory
  /// gets a device pointer different from its host pointer, as on devices without it.
  bool host_pointer_for_registered_memory;
};
device_profile get_device_profile();
void set_device_profile(const device_profile& p);

}  // namespace cudasim
