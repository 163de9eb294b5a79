// Device memory for the GPU side of the CUDA tests (gpu_runner.cu, compressor_runner.cu):
// mirrors of host views and buffers, freed when the mirror goes. Included by the CUDA
// translation units of the tests only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "gpu_runner.hpp"
#include "kvevict/cuda/common.cuh"

namespace gpu {

using kvevict::errc;
using kvevict::status;

/// Device allocations of one test call, freed on scope exit. Buffers are deduplicated by
/// host address so that views sharing memory on the host share it on the device.
class mirror {
 public:
  mirror() { ok_ = cudaStreamCreate(&stream_) == cudaSuccess; }
  mirror(const mirror&) = delete;
  mirror& operator=(const mirror&) = delete;
  ~mirror() {
    for (const allocation& a : allocs_) cudaFree(a.data);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  /// `bytes` of device memory followed by a canary that finish() checks: a kernel writing past
  /// a keep list, an output row or a workspace fails its test with the buffer named, instead of
  /// corrupting a neighbour (or the allocator) and crashing later tests.
  void* alloc_bytes(std::size_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes + kCanaryBytes) != cudaSuccess) {
      ok_ = false;
      return nullptr;
    }
    check(cudaMemset(static_cast<unsigned char*>(p) + bytes, kCanary, kCanaryBytes));
    allocs_.push_back({p, bytes});
    return p;
  }
  template <class T>
  T* alloc(std::size_t count) {
    return static_cast<T*>(alloc_bytes(count * sizeof(T)));
  }
  /// Device copy of a host buffer (the same device buffer for the same host address).
  void* put(host_buffer b) {
    if (b.data == nullptr) return nullptr;
    for (const auto& e : map_)
      if (e.first == b.data) return e.second;
    void* d = alloc_bytes(b.bytes);
    if (d != nullptr && b.bytes > 0) check(cudaMemcpy(d, b.data, b.bytes, cudaMemcpyHostToDevice));
    map_.emplace_back(b.data, d);
    return d;
  }
  /// A new device copy of v (not looked up by host address: v may be a temporary).
  template <class T>
  T* fresh_copy(const std::vector<T>& v) {
    if (v.empty()) return nullptr;
    T* d = alloc<T>(v.size());
    if (d != nullptr) check(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
  }
  template <class T>
  T* put_vector(const std::vector<T>& v) {
    return v.empty() ? nullptr : static_cast<T*>(put(buffer_of(v)));
  }
  /// `host_ptr`, pointing into host buffer b, as a pointer into b's device copy. A pointer
  /// outside b (null, or host memory a test hands on purpose) is passed through unchanged:
  /// offsetting the copy by its distance to b would be undefined.
  template <class T>
  T* rebase(const T* host_ptr, host_buffer b) {
    const auto* p = reinterpret_cast<const unsigned char*>(host_ptr);
    const auto* first = static_cast<const unsigned char*>(b.data);
    if (host_ptr == nullptr || first == nullptr || std::less<const unsigned char*>()(p, first) ||
        std::less<const unsigned char*>()(first + b.bytes, p))
      return const_cast<T*>(host_ptr);
    auto* base = static_cast<unsigned char*>(put(b));
    const std::ptrdiff_t off =
        reinterpret_cast<const unsigned char*>(host_ptr) - static_cast<const unsigned char*>(b.data);
    return reinterpret_cast<T*>(base + off);
  }
  template <class T>
  void fill(T* d, std::size_t count, T value) {
    std::vector<T> h(count, value);
    if (count > 0) check(cudaMemcpy(d, h.data(), count * sizeof(T), cudaMemcpyHostToDevice));
  }
  template <class T>
  std::vector<T> get(const T* d, std::size_t count) {
    std::vector<T> h(count);
    if (count > 0) check(cudaMemcpy(h.data(), d, count * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  std::uint32_t* flags() {
    if (flags_ == nullptr) {
      flags_ = alloc<std::uint32_t>(1);
      if (flags_ != nullptr) check(cudaMemset(flags_, 0, 4));
    }
    return flags_;
  }
  kvevict::cuda::launch_options options(bool check_pointers = true) {
    kvevict::cuda::launch_options o;
    o.stream = stream_;
    o.device_flags = flags();
    o.check_pointers = check_pointers;
    return o;
  }
  /// Waits for the stream; a failure anywhere becomes a device_error status.
  status finish(const status& st) {
    check(cudaStreamSynchronize(stream_));
    check(cudaGetLastError());
    if (!ok_)
      return status::error(errc::device_error, "gpu_runner", "cuda", "%s", last_error_ ? last_error_ : "allocation");
    for (std::size_t i = 0; i < allocs_.size(); ++i) {
      unsigned char seen[kCanaryBytes];
      check(cudaMemcpy(seen, static_cast<unsigned char*>(allocs_[i].data) + allocs_[i].bytes, kCanaryBytes,
                       cudaMemcpyDeviceToHost));
      for (std::size_t b = 0; b < kCanaryBytes; ++b)
        if (seen[b] != kCanary)
          return status::error(errc::device_error, "gpu_runner", "canary",
                               "byte %zu past the end of device buffer %zu (%zu bytes) was overwritten", b, i,
                               allocs_[i].bytes);
    }
    return st;
  }
  std::uint32_t read_flags() { return flags_ == nullptr ? 0u : get(flags_, 1)[0]; }

 private:
  void check(cudaError_t e) {
    if (e != cudaSuccess) {
      ok_ = false;
      last_error_ = cudaGetErrorString(e);
    }
  }
  static constexpr std::size_t kCanaryBytes = 64;
  static constexpr unsigned char kCanary = 0xc5;
  struct allocation {
    void* data;
    std::size_t bytes;
  };
  cudaStream_t stream_ = nullptr;
  std::vector<allocation> allocs_;
  std::vector<std::pair<const void*, void*>> map_;
  std::uint32_t* flags_ = nullptr;
  bool ok_ = true;
  const char* last_error_ = nullptr;
};

template <class T>
inline kvevict::cache_view<T> device_view(mirror& m, const kvevict::cache_view<T>& v, host_buffer buf,
                                          const std::vector<std::int32_t>& table) {
  kvevict::cache_view<T> d = v;
  d.data = m.rebase(v.data, buf);
  if (v.block_table.width() == 8) {  // an int64 table (test::layout::paged_int64): its values are `table`'s
    const std::vector<std::int64_t> wide(table.begin(), table.end());
    d.block_table = m.fresh_copy(wide);
  } else if (v.is_paged()) {
    d.block_table = m.rebase(v.block_table.int32(), buffer_of(table));
  }
  return d;
}

template <class T>
inline kvevict::query_view<const T> device_queries(mirror& m, const kvevict::query_view<const T>& q, host_buffer buf) {
  kvevict::query_view<const T> d = q;
  d.data = m.rebase(q.data, buf);
  host_buffer pos;
  pos.data = q.positions.data();
  pos.bytes = static_cast<std::size_t>(q.num_queries) * static_cast<std::size_t>(q.positions.width());
  const void* copied = m.put(pos);
  if (q.positions.width() == 4)
    d.positions = static_cast<const std::int32_t*>(copied);
  else
    d.positions = static_cast<const std::int64_t*>(copied);
  return d;
}

}  // namespace gpu
