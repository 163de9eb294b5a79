// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DETAIL_LAUNCH_CUH
#define KVEVICT_CUDA_DETAIL_LAUNCH_CUH

// The one place kernels are launched. Every launch of the CUDA header goes through
// detail::launch: it raises the kernel's dynamic shared-memory limit when the launch needs
// more than the default 48 KiB, enqueues the kernel, and turns a launch-configuration error
// into a status. Under nvcc it is the triple-chevron launch; under KVEVICT_CUDA_SIMULATOR
// (tests/cuda_sim) the typed cudaLaunchKernelEx, which the simulator implements, so the
// simulator runs exactly the launches the library makes.

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// A status for a failed CUDA runtime call.
inline status cuda_status(cudaError_t err, const char* fn, const char* what) noexcept {
  if (err == cudaSuccess) return status();
  return status::error(errc::device_error, fn, what, "CUDA error %d (%s): %s", static_cast<int>(err),
                       cudaGetErrorName(err), cudaGetErrorString(err));
}

/// After a kernel launch: launch-configuration errors (too much shared memory, a bad grid)
/// come back from cudaGetLastError without synchronising.
inline status launch_status(const char* fn, const char* kernel) noexcept {
  return cuda_status(cudaGetLastError(), fn, kernel);
}

/// Shared memory a kernel may use per block on the current device (opt-in maximum).
inline status max_shared_bytes(std::size_t* out, const char* fn) noexcept {
  int device = 0;
  KVEVICT_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&device), fn, "cudaGetDevice"));
  int bytes = 0;
  KVEVICT_RETURN_IF_ERROR(cuda_status(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                                      fn, "cudaDeviceGetAttribute"));
  *out = static_cast<std::size_t>(bytes);
  return status();
}

/// Lets `kernel` launch with `bytes` of dynamic shared memory when that is more than the
/// default 48 KiB. The limit is a per-kernel, process-wide attribute, so it is raised to the
/// most the device allows the kernel (opt-in maximum less its static shared memory), never
/// to this call's need: host threads launching the kernel for different shapes would
/// otherwise lower it under each other between one's cudaFuncSetAttribute and its launch.
/// Setting the same value every time also makes concurrent calls harmless.
template <class... Params>
status allow_shared_bytes(void (*kernel)(Params...), std::size_t bytes, const char* fn) noexcept {
  if (bytes <= 48 * 1024) return status();
  std::size_t optin = 0;
  KVEVICT_RETURN_IF_ERROR(max_shared_bytes(&optin, fn));
  cudaFuncAttributes attr{};
  KVEVICT_RETURN_IF_ERROR(cuda_status(cudaFuncGetAttributes(&attr, kernel), fn, "cudaFuncGetAttributes"));
  const std::size_t limit = optin > attr.sharedSizeBytes ? optin - attr.sharedSizeBytes : 0;
  if (bytes > limit)
    return status::error(errc::unsupported, fn, "shape",
                         "the kernel needs %zu bytes of shared memory per block for this head_dim, group and window "
                         "(or pooling kernel), the device offers %zu",
                         bytes, limit);
  if (attr.maxDynamicSharedSizeBytes >= 0 && static_cast<std::size_t>(attr.maxDynamicSharedSizeBytes) >= limit)
    return status();
  return cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(limit)),
                     fn, "cudaFuncSetAttribute");
}

/// Grid, block, dynamic shared memory and stream of one launch.
struct launch_config {
  dim3 grid;
  dim3 block;
  std::size_t shared_bytes = 0;
  cudaStream_t stream = nullptr;
};

/// Enqueues kernel(args...) with `cfg`. `fn` and `name` label the status of a failed launch.
template <class... Params, class... Args>
status launch(const char* fn, const char* name, const launch_config& cfg, void (*kernel)(Params...),
              Args&&... args) noexcept {
  KVEVICT_RETURN_IF_ERROR(allow_shared_bytes(kernel, cfg.shared_bytes, fn));
#if defined(KVEVICT_CUDA_SIMULATOR)
  cudaLaunchConfig_t c{};
  c.gridDim = cfg.grid;
  c.blockDim = cfg.block;
  c.dynamicSmemBytes = cfg.shared_bytes;
  c.stream = cfg.stream;
  // Errors surface through cudaGetLastError below, as for a triple-chevron launch.
  (void)cudaLaunchKernelEx(&c, kernel, std::forward<Args>(args)...);
#else
  // clang-format off
  kernel<<<cfg.grid, cfg.block, cfg.shared_bytes, cfg.stream>>>(std::forward<Args>(args)...);
  // clang-format on
#endif
  return launch_status(fn, name);
}

}  // namespace detail
}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_DETAIL_LAUNCH_CUH
