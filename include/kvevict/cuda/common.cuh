// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_COMMON_CUH
#define KVEVICT_CUDA_COMMON_CUH

// Shared pieces of the CUDA header: launch options (stream, device flag word), CUDA errors
// as kvevict::status, host-side validation of views whose memory lives on the device, and
// small device helpers. Never includes Eigen or a header that does.
//
// Validation split. The host checks everything it can see without reading device memory:
// shapes, strides (overlap and 2^63 span, via the CPU's check_box), parameters, null
// pointers, 32-bit index limits, grid limits, workspace size and, unless turned off, that
// every pointer is device-accessible (cudaPointerGetAttributes; it neither synchronises nor
// launches). Block-table entries, positions, keep-list contents and per-row descriptors live
// in device memory: the kernels check them and report through launch_options::device_flags
// (see device_flags.hpp for what each bit means and how the kernels proceed).

#if !defined(__CUDACC__) && !defined(KVEVICT_CUDA_SIMULATOR)
#error "kvevict/cuda/*.cuh holds CUDA kernels: compile this translation unit with nvcc (a .cu file)"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/cuda/detail/launch.cuh"
#include "kvevict/cuda/detail/shared_memory.cuh"
#include "kvevict/cuda/detail/tiling.hpp"
#include "kvevict/cuda/device_flags.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/dtype.hpp"
#include "kvevict/error.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/index_ptr.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/views/query_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {

/// Where and how a CUDA operation runs. Every operation only enqueues work on `stream`
/// (kernels, cudaMemsetAsync) and returns; nothing synchronises, nothing allocates.
struct launch_options {
  cudaStream_t stream = nullptr;
  /// Optional device word (one uint32 the caller zeroes and owns): kernels OR
  /// device_flag bits into it for problems only the device can see. Null: not reported
  /// (the kernels still handle them as documented).
  std::uint32_t* device_flags = nullptr;
  /// Check with cudaPointerGetAttributes that the pointers the kernels dereference are
  /// device-accessible (device, managed or mapped host memory). A host pointer passed by
  /// mistake would otherwise fault inside a kernel and poison the CUDA context. About a
  /// microsecond per pointer; engines that know their pointers may turn it off.
  bool check_pointers = true;
};

namespace detail {

/// `ptr` must be dereferenceable by kernels. Null pointers are reported by the callers'
/// shape checks, so they pass here.
inline status check_device_pointer(const void* ptr, const launch_options& opt, const char* fn,
                                   const char* arg) noexcept {
  if (!opt.check_pointers || ptr == nullptr) return status();
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the non-sticky error so the caller's next call is unaffected
    return cuda_status(err, fn, arg);
  }
  if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) return status();
  // Mapped host memory reaches the kernels through its device pointer, which is the host
  // pointer only where the device can use host pointers for registered memory. Any other
  // device pointer means the kernels would dereference an address the device does not map.
  if (attr.type == cudaMemoryTypeHost && attr.devicePointer == ptr) return status();
  if (attr.type == cudaMemoryTypeHost && attr.devicePointer != nullptr)
    return status::error(errc::invalid_argument, fn, arg,
                         "expected a pointer the kernels can dereference, got mapped host memory whose device "
                         "pointer differs (pass the pointer cudaHostGetDevicePointer returns)");
  return status::error(errc::invalid_argument, fn, arg,
                       "expected device-accessible memory (device, managed or mapped host), got an unregistered "
                       "host pointer");
}
inline status check_device_pointer(index_ptr ptr, const launch_options& opt, const char* fn, const char* arg) noexcept {
  return check_device_pointer(ptr.data(), opt, fn, arg);
}

/// Index i of the engine's int32 or int64 array through the read-only data cache.
__device__ __forceinline__ std::int64_t load_index(index_ptr p, std::int64_t i) {
  if (p.width() == 4) return __ldg(p.int32() + i);
  return __ldg(p.int64() + i);
}

/// cache_view checks that need no device memory (kvevict::detail::validate_cache_view_metadata)
/// plus pointer checks; the block table's entries (ids in range, no repeats) are checked on
/// the device.
template <class T>
status validate_device_cache_view(const cache_view<T>& v, const launch_options& opt, const char* fn,
                                  const char* arg) noexcept {
  using kvevict::detail::field_name;
  static_assert(is_storage_type<std::remove_const_t<T>>::value,
                "the CUDA path reads float, fp16, bf16 and fp8 (e4m3, e5m2) caches");
  // Includes the scale (finite, > 0): scoring folds it into the logits' factor, as the CPU.
  KVEVICT_RETURN_IF_ERROR(kvevict::detail::validate_cache_view_metadata(v, fn, arg));
  if (v.is_paged() && v.num_tokens > 0)
    KVEVICT_RETURN_IF_ERROR(check_device_pointer(v.block_table, opt, fn, field_name(arg, "block_table")));
  return check_device_pointer(v.data, opt, fn, field_name(arg, "data"));
}

/// query_view checks that need no device memory (kvevict::detail::validate_query_view_metadata)
/// plus pointer checks; a negative position raises flag_negative_position on the device.
template <class T>
status validate_device_query_view(const query_view<T>& q, const launch_options& opt, const char* fn,
                                  const char* arg) noexcept {
  using kvevict::detail::field_name;
  KVEVICT_RETURN_IF_ERROR(kvevict::detail::validate_query_view_metadata(q, fn, arg));
  KVEVICT_RETURN_IF_ERROR(check_device_pointer(q.data, opt, fn, field_name(arg, "data")));
  return check_device_pointer(q.positions, opt, fn, field_name(arg, "positions"));
}

/// The workspace must hold what the size query returned, and be device memory.
inline status check_workspace(const kvevict::detail::arena& a, workspace_span ws, const launch_options& opt,
                              const char* fn, const char* query) noexcept {
  if (a.overflowed())
    return status::error(errc::workspace_too_small, fn, "ws", "expected at least %zu bytes (%s), got %zu", a.used(),
                         query, ws.size);
  return check_device_pointer(ws.data, opt, fn, "ws.data");
}

// ---- device helpers -------------------------------------------------------------------

constexpr unsigned full_warp = 0xffffffffu;

/// Raises `bits` in the caller's flag word and, when given, in an internal status word.
__device__ inline void raise_flag(std::uint32_t* flags, std::uint32_t bits) {
  if (flags != nullptr) atomicOr(flags, bits);
}

/// Loads one storage element as float32 (exact widening).
__device__ __forceinline__ float load_float(const float* p) {
  return __ldg(p);
}
__device__ __forceinline__ float load_float(const fp16* p) {
  return kvevict::detail::fp16_bits_to_float(__ldg(reinterpret_cast<const unsigned short*>(p)));
}
__device__ __forceinline__ float load_float(const bf16* p) {
  return kvevict::detail::bf16_bits_to_float(__ldg(reinterpret_cast<const unsigned short*>(p)));
}

__device__ __forceinline__ float load_float(const fp8_e4m3* p) {
  return kvevict::detail::fp8_e4m3_bits_to_float(__ldg(reinterpret_cast<const unsigned char*>(p)));
}
__device__ __forceinline__ float load_float(const fp8_e5m2* p) {
  return kvevict::detail::fp8_e5m2_bits_to_float(__ldg(reinterpret_cast<const unsigned char*>(p)));
}

/// Widens the 16 bytes at p (4 floats) into out[0 .. 4). Decode's 16-bit and fp8 keys load
/// their words themselves (decode_observation.cuh's load_key_words: 16 and 8 bytes); scoring
/// reads elements one at a time (load_float).
__device__ __forceinline__ void load_vector(const float* p, float* out) {
  const float4 v = __ldg(reinterpret_cast<const float4*>(p));
  out[0] = v.x;
  out[1] = v.y;
  out[2] = v.z;
  out[3] = v.w;
}
/// Widens 16 bytes of 16-bit elements (bf16 or fp16) into out[0 .. 8) (exact).
template <class T>
__device__ __forceinline__ void widen_16bit_words(const uint4& v, float* out) {
  const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const auto lo = static_cast<std::uint16_t>(words[i] & 0xffffu);
    const auto hi = static_cast<std::uint16_t>(words[i] >> 16);
    if (std::is_same<T, bf16>::value) {
      out[2 * i] = kvevict::detail::bf16_bits_to_float(lo);
      out[2 * i + 1] = kvevict::detail::bf16_bits_to_float(hi);
    } else {
      out[2 * i] = kvevict::detail::fp16_bits_to_float(lo);
      out[2 * i + 1] = kvevict::detail::fp16_bits_to_float(hi);
    }
  }
}

/// Butterfly reductions over groups of `width` consecutive lanes (width a power of two <= 32).
/// Every lane of the group ends with the result; the order of operations is fixed.
__device__ __forceinline__ float group_max(float v, int width) {
  for (int o = width / 2; o > 0; o /= 2) {
    const float other = __shfl_xor_sync(full_warp, v, o);
    v = other > v ? other : v;
  }
  return v;
}
__device__ __forceinline__ float group_sum(float v, int width) {
  for (int o = width / 2; o > 0; o /= 2) v += __shfl_xor_sync(full_warp, v, o);
  return v;
}

/// Row-start offset (elements from view.data) of token j of head h, or -1 when the block
/// table names a block outside the pool (flagged).
template <class T>
__device__ __forceinline__ std::int64_t checked_row_offset(const cache_view<T>& v, std::int64_t h, std::int64_t j,
                                                           std::uint32_t* flags) {
  if (v.block_table != nullptr) {
    const std::int64_t block = j / v.block_size;
    // Per-head tables (head_table_stride != 0): head h's table starts h * head_table_stride in.
    const std::int64_t id = load_index(v.block_table, h * v.head_table_stride + block);
    if (id < 0 || id >= v.num_pool_blocks) {
      raise_flag(flags, flag_block_id_out_of_range);
      return -1;
    }
    return static_cast<std::int64_t>(id) * v.block_stride + (j - block * v.block_size) * v.token_stride +
           h * v.head_stride;
  }
  return h * v.head_stride + j * v.token_stride;
}

}  // namespace detail
}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_COMMON_CUH
