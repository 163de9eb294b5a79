// Helpers for the simulator's own tests: device buffers and a typed launch.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

namespace simtest {

/// A device buffer of n T (freed on scope exit) with host copies in and out.
template <class T>
class device_vector {
 public:
  explicit device_vector(std::size_t n, const T& fill = T()) : n_(n) {
    if (n_ > 0) cudaMalloc(&p_, n_ * sizeof(T));
    assign(std::vector<T>(n_, fill));
  }
  explicit device_vector(const std::vector<T>& v) : device_vector(v.size()) { assign(v); }
  device_vector(const device_vector&) = delete;
  device_vector& operator=(const device_vector&) = delete;
  ~device_vector() { cudaFree(p_); }
  void assign(const std::vector<T>& v) {
    if (!v.empty()) cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> host() const {
    std::vector<T> v(n_);
    if (n_ > 0) cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }
  T* get() const { return p_; }
  std::size_t size() const { return n_; }

 private:
  std::size_t n_ = 0;
  T* p_ = nullptr;
};

template <class... Params, class... Args>
cudaError_t launch(dim3 grid, dim3 block, std::size_t smem, void (*kernel)(Params...), Args... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

template <class... Params, class... Args>
cudaError_t launch_on(cudaStream_t stream, dim3 grid, dim3 block, void (*kernel)(Params...), Args... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.stream = stream;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

}  // namespace simtest
