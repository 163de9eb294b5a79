// Kernel launches in the simulator: cudaLaunchKernelEx with CUDA's typed signature. The
// arguments are converted to the kernel's parameter types and copied once, as CUDA copies
// them into the launch's parameter buffer; every simulated thread then calls the kernel with
// its own copy of them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda_sim/types.hpp"

namespace cudasim {
namespace detail {

/// One launch as the scheduler sees it. `payload` holds the kernel pointer and its
/// arguments; run_thread calls the kernel once (for the current simulated thread).
struct kernel_launch {
  std::uintptr_t kernel = 0;  // identity: the address of the __global__ function
  dim3 grid, block;
  std::size_t dynamic_smem = 0;
  cudaStream_t stream = nullptr;
  const void* payload = nullptr;
  void (*run_thread)(const void* payload) = nullptr;
  void* (*clone_payload)(const void* payload) = nullptr;  // graph capture keeps a copy
  void (*destroy_payload)(void* payload) = nullptr;
};

cudaError_t launch(const kernel_launch& l) noexcept;
/// Records `err` as the calling host thread's last error (cudaGetLastError) and returns it.
cudaError_t record_error(cudaError_t err) noexcept;

template <class Kernel, class Args>
struct launch_payload {
  Kernel kernel;
  Args args;
};

template <class Payload>
void run_payload(const void* p) {
  const Payload& pl = *static_cast<const Payload*>(p);
  std::apply(pl.kernel, pl.args);
}
template <class Payload>
void* clone_payload(const void* p) {
  return new Payload(*static_cast<const Payload*>(p));
}
template <class Payload>
void destroy_payload(void* p) {
  delete static_cast<Payload*>(p);
}

}  // namespace detail
}  // namespace cudasim

template <class... Params, class... Args>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* config, void (*kernel)(Params...), Args&&... args) noexcept {
  static_assert(sizeof...(Params) == sizeof...(Args), "a kernel launch passes one argument per parameter");
  static_assert((std::is_trivially_copyable<std::decay_t<Params>>::value && ...),
                "kernel parameters are copied to the device as bytes: they must be trivially copyable");
  using args_t = std::tuple<std::decay_t<Params>...>;
  static_assert(sizeof(args_t) <= 32764, "kernel parameters exceed CUDA's 32764-byte parameter buffer");
  using payload_t = cudasim::detail::launch_payload<void (*)(Params...), args_t>;
  if (config == nullptr || config->numAttrs != 0) return cudasim::detail::record_error(cudaErrorNotSupported);
  const payload_t payload{kernel, args_t(std::forward<Args>(args)...)};
  cudasim::detail::kernel_launch l;
  l.kernel = reinterpret_cast<std::uintptr_t>(kernel);
  l.grid = config->gridDim;
  l.block = config->blockDim;
  l.dynamic_smem = config->dynamicSmemBytes;
  l.stream = config->stream;
  l.payload = &payload;
  l.run_thread = &cudasim::detail::run_payload<payload_t>;
  l.clone_payload = &cudasim::detail::clone_payload<payload_t>;
  l.destroy_payload = &cudasim::detail::destroy_payload<payload_t>;
  return cudasim::detail::launch(l);
}
