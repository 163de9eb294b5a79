// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_REROTATE_CUH
#define KVEVICT_CUDA_REROTATE_CUH

// DapQ's re-rotated window on the device (policies/dapq.hpp, dapq_rerotate): post-RoPE queries
// moved `delta` positions on, every RoPE convention of rope/rope.hpp, bit for bit with the CPU.
//
// The CPU rotates each pair in double: x1*cos - x2*sin and x1*sin + x2*cos with cos and sin of
// delta*inv_freq(i) from the C library. A device's cos and sin round differently, so the host
// computes the table once (rotation_table, the CPU's own functions) and the kernel reads it;
// the products and sums are rounded one by one (__dmul_rn, __dadd_rn, __dsub_rn) because a
// fused multiply-add would round once where the CPU rounds twice.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/detail/launch.cuh"
#include "kvevict/detail/validate.hpp"
#include "kvevict/dtype.hpp"
#include "kvevict/error.hpp"
#include "kvevict/rope/rope.hpp"
#include "kvevict/views/query_view.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {

/// Doubles of the table for `rope`: cos and sin of each rotated pair.
inline std::int64_t rotation_table_size(const rope_config& rope) noexcept {
  return 2 * (rope.rotated() / 2);
}

/// The table for a rotation by `delta` positions, [cos_0, sin_0, cos_1, ...], computed on the
/// host as rope_rotate computes it (a valid config: validate_rope_config).
inline void rotation_table(const rope_config& rope, std::int64_t delta, double* out) noexcept {
  const std::int64_t pairs = rope.rotated() / 2;
  for (std::int64_t i = 0; i < pairs; ++i) {
    const double angle = static_cast<double>(delta) * rope_inv_freq(rope, i);
    out[2 * i] = std::cos(angle);
    out[2 * i + 1] = std::sin(angle);
  }
}

namespace detail {

constexpr int rerotate_threads = 128;

template <class QT, class OutT>
__global__ void __launch_bounds__(rerotate_threads)
    rerotate_kernel(query_view<const QT> q, const double* table, std::int64_t pairs, std::int64_t rotated, bool neox,
                    std::int64_t delta, OutT* out, std::int64_t* out_positions) {
  const std::int64_t row = blockIdx.x;  // h * W + t
  const std::int64_t h = row / q.num_queries, t = row - h * q.num_queries;
  const QT* x = q.row(h, t);
  OutT* dst = out + row * q.head_dim;
  for (std::int64_t i = threadIdx.x; i < pairs; i += blockDim.x) {
    const std::int64_t a = neox ? i : 2 * i, b = neox ? i + pairs : 2 * i + 1;
    const double cs = table[2 * i], sn = table[2 * i + 1];
    const double x1 = static_cast<double>(to_float(x[a * q.dim_stride]));
    const double x2 = static_cast<double>(to_float(x[b * q.dim_stride]));
    dst[a] = from_float<OutT>(static_cast<float>(__dsub_rn(__dmul_rn(x1, cs), __dmul_rn(x2, sn))));
    dst[b] = from_float<OutT>(static_cast<float>(__dadd_rn(__dmul_rn(x1, sn), __dmul_rn(x2, cs))));
  }
  for (std::int64_t c = rotated + threadIdx.x; c < q.head_dim; c += blockDim.x)
    dst[c] = from_float<OutT>(to_float(x[c * q.dim_stride]));
  if (row == 0)
    for (std::int64_t u = threadIdx.x; u < q.num_queries; u += blockDim.x) out_positions[u] = q.positions[u] + delta;
}

}  // namespace detail

/// kvevict::dapq_rerotate on the device: post-RoPE queries [Hq, W, d] at positions p_t, rotated
/// by `delta` positions.
///
///   window:        [Hq, W, d] device queries with device positions [W] (any strides)
///   rope:          the model's RoPE (rope.head_dim = d <= 1024, as on the CPU)
///   table:         [rotation_table_size(rope)] device doubles: rotation_table(rope, delta)
///   out:           [Hq, W, d] contiguous device; out_positions [W] device: p_t + delta
///
/// One launch on opt.stream, no synchronisation, no allocation; `out` equals the CPU's
/// dapq_rerotate bit for bit (tested in the simulator for every RoPE convention).
template <class QT, class OutT>
status dapq_rerotate(const query_view<QT>& window, const rope_config& rope, const double* table, std::int64_t delta,
                     OutT* out, std::int64_t* out_positions, const launch_options& opt = {}) {
  static constexpr const char* fn = "kvevict::cuda::dapq_rerotate";
  const query_view<const std::remove_cv_t<QT>> q = window;
  KVEVICT_RETURN_IF_ERROR(detail::validate_device_query_view(q, opt, fn, "window"));  // reads no device memory
  KVEVICT_RETURN_IF_ERROR(validate_rope_config(rope, fn));
  if (rope.head_dim != q.head_dim)
    return status::error(errc::invalid_shape, fn, "rope.head_dim", "expected window.head_dim = %lld, got %lld",
                         static_cast<long long>(q.head_dim), static_cast<long long>(rope.head_dim));
  if (q.head_dim > 1024)
    return status::error(errc::unsupported, fn, "window.head_dim", "expected at most 1024, got %lld",
                         static_cast<long long>(q.head_dim));
  const std::int64_t rows = q.num_heads * q.num_queries;
  if (rows > 0x7fffffff)
    return status::error(errc::overflow, fn, "window", "expected fewer than 2^31 query rows, got %lld",
                         static_cast<long long>(rows));
  if (table == nullptr || out == nullptr || out_positions == nullptr)
    return status::error(errc::null_pointer, fn,
                         table == nullptr ? "table"
                         : out == nullptr ? "out"
                                          : "out_positions",
                         "expected device memory");
  KVEVICT_RETURN_IF_ERROR(detail::check_device_pointer(table, opt, fn, "table"));
  KVEVICT_RETURN_IF_ERROR(detail::check_device_pointer(out, opt, fn, "out"));
  KVEVICT_RETURN_IF_ERROR(detail::check_device_pointer(out_positions, opt, fn, "out_positions"));
  if (rows == 0) return status();
  return detail::launch(fn, "rerotate_kernel",
                        {dim3(static_cast<unsigned>(rows)), dim3(detail::rerotate_threads), 0, opt.stream},
                        detail::rerotate_kernel<std::remove_cv_t<QT>, OutT>, q, table, rope.rotated() / 2,
                        rope.rotated(), rope.pairing == rope_pairing::neox, delta, out, out_positions);
}

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_REROTATE_CUH
