// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_KEYDIFF_SCORES_CUH
#define KVEVICT_CUDA_KEYDIFF_SCORES_CUH

// KeyDiff's scores on the GPU, bit for bit with kvevict::keydiff::score: minus each key's
// cosine similarity to its head's anchor, the mean of the head's normalised keys.
//
// The CPU fixes one summation order (keydiff_arithmetic: channel sums over chunks of 256
// tokens, then the chunks' sums in order) and writes every product as a fused multiply-add, so
// four launches reproduce it with parallelism over chunks: the keys' norms (one thread per
// row), each chunk's channel sums (one thread per channel and chunk), the anchor and its norm
// (one block per head), then the scores (one thread per row). Every sum is double precision
// in the CPU's order; a float square is exact in double, so the norms need no fused form.

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/detail/launch.cuh"
#include "kvevict/cuda/key_scores.cuh"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policies/keydiff_traits.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

constexpr int keydiff_row_block = 256;
constexpr int keydiff_channel_block = 128;

/// The workspace, all double: norms [Hkv, L], chunk sums [Hkv, chunks, d], anchor [Hkv, d],
/// anchor norms [Hkv].
struct keydiff_workspace {
  double* norms = nullptr;
  double* chunk_sums = nullptr;
  double* anchor = nullptr;
  double* anchor_norms = nullptr;
};

inline std::int64_t keydiff_chunks(std::int64_t tokens) noexcept {
  return (tokens + keydiff_arithmetic::anchor_chunk - 1) / keydiff_arithmetic::anchor_chunk;
}

inline void carve_keydiff_workspace(kvevict::detail::arena& a, std::int64_t heads, std::int64_t tokens,
                                    std::int64_t dim, keydiff_workspace* out) noexcept {
  using kvevict::detail::saturating_mul;
  out->norms = a.take<double>(saturating_mul(heads, tokens));
  out->chunk_sums = a.take<double>(saturating_mul(saturating_mul(heads, keydiff_chunks(tokens)), dim));
  out->anchor = a.take<double>(saturating_mul(heads, dim));
  out->anchor_norms = a.take<double>(heads);
}

template <class T>
struct keydiff_args {
  cache_view<const T> keys;
  int tokens = 0;      ///< L
  int candidates = 0;  ///< L - protected_tail (at least 0)
  int chunks = 0;
  keydiff_workspace ws;
  float* scores = nullptr;
  std::int64_t score_stride = 0;
  std::uint32_t* flags = nullptr;
};

/// std::max(x, floor) as the CPU has it: a NaN x stays NaN (fmax would return the floor).
__device__ __forceinline__ double keydiff_floor(double x, double floor) {
  return x < floor ? floor : x;
}

/// Key h, j's channel c as float, NaN for a row outside the pool (flagged by the norms).
template <class T>
__device__ __forceinline__ double keydiff_key(const cache_view<const T>& k, std::int64_t off, std::int64_t c) {
  return off < 0 ? static_cast<double>(::nanf("")) : static_cast<double>(load_float(k.data + off + c * k.dim_stride));
}

template <class T>
__global__ void __launch_bounds__(keydiff_row_block) keydiff_norm_kernel(keydiff_args<T> a) {
  const std::int64_t h = blockIdx.y;
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * keydiff_row_block + threadIdx.x;
  if (j >= a.tokens) return;
  const std::int64_t off = checked_row_offset(a.keys, h, j, a.flags);
  double sum = 0.0;
  for (std::int64_t c = 0; c < a.keys.head_dim; ++c) {
    const double x = keydiff_key(a.keys, off, c);
    sum += x * x;  // exact: a float's square fits a double
  }
  a.ws.norms[h * a.tokens + j] = ::sqrt(sum);
}

template <class T>
__global__ void __launch_bounds__(keydiff_channel_block) keydiff_chunk_kernel(keydiff_args<T> a) {
  const std::int64_t h = blockIdx.y, chunk = blockIdx.x;
  const std::int64_t first = chunk * keydiff_arithmetic::anchor_chunk;
  const std::int64_t last = first + keydiff_arithmetic::anchor_chunk < a.tokens
                                ? first + keydiff_arithmetic::anchor_chunk
                                : static_cast<std::int64_t>(a.tokens);
  const double* norms = a.ws.norms + h * a.tokens;
  for (std::int64_t c = threadIdx.x; c < a.keys.head_dim; c += keydiff_channel_block) {
    double sum = 0.0;
    for (std::int64_t j = first; j < last; ++j) {
      const std::int64_t off = checked_row_offset(a.keys, h, j, nullptr);  // flagged by the norms
      const double inv = 1.0 / keydiff_floor(norms[j], keydiff_arithmetic::normalize_eps);
      sum = __fma_rn(keydiff_key(a.keys, off, c), inv, sum);
    }
    a.ws.chunk_sums[(h * a.chunks + chunk) * a.keys.head_dim + c] = sum;
  }
}

template <int Unused = 0>
__global__ void __launch_bounds__(keydiff_channel_block)
    keydiff_anchor_kernel(std::int64_t dim, int tokens, int chunks, keydiff_workspace ws) {
  const std::int64_t h = blockIdx.x;
  double* anchor = ws.anchor + h * dim;
  for (std::int64_t c = threadIdx.x; c < dim; c += keydiff_channel_block) {
    double sum = 0.0;
    for (std::int64_t k = 0; k < chunks; ++k) sum += ws.chunk_sums[(h * chunks + k) * dim + c];
    anchor[c] = sum / static_cast<double>(tokens);
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  double sq = 0.0;
  for (std::int64_t c = 0; c < dim; ++c) sq = __fma_rn(anchor[c], anchor[c], sq);
  ws.anchor_norms[h] = ::sqrt(sq);
}

template <class T>
__global__ void __launch_bounds__(keydiff_row_block) keydiff_score_kernel(keydiff_args<T> a) {
  const std::int64_t h = blockIdx.y;
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * keydiff_row_block + threadIdx.x;
  if (j >= a.tokens) return;
  float* out = a.scores + h * a.score_stride + j;
  if (j >= a.candidates) {
    *out = pos_infinity();
    return;
  }
  const std::int64_t off = checked_row_offset(a.keys, h, j, nullptr);  // flagged by the norms
  const double* anchor = a.ws.anchor + h * a.keys.head_dim;
  double dot = 0.0;
  for (std::int64_t c = 0; c < a.keys.head_dim; ++c) dot = __fma_rn(keydiff_key(a.keys, off, c), anchor[c], dot);
  const double denom =
      keydiff_floor(__dmul_rn(a.ws.norms[h * a.tokens + j], a.ws.anchor_norms[h]), keydiff_arithmetic::cosine_eps);
  *out = static_cast<float>(-dot / denom);
}

}  // namespace detail

/// Bytes of device workspace keydiff_scores needs for [num_kv_heads, num_tokens, head_dim] keys.
inline std::size_t keydiff_scores_workspace_size(std::int64_t num_kv_heads, std::int64_t num_tokens,
                                                 std::int64_t head_dim) noexcept {
  kvevict::detail::arena a;
  detail::keydiff_workspace w;
  detail::carve_keydiff_workspace(a, num_kv_heads, num_tokens, head_dim, &w);
  return a.used();
}

/// KeyDiff's scores (kvevict::keydiff::score, bit for bit):
///   a_h = (1/L) sum_j k_hj / max(||k_hj||, 1e-12)
///   scores[h, j] = -(k_hj . a_h) / max(||k_hj|| ||a_h||, 1e-8)   for j < L - protected_tail
///   scores[h, j] = +inf                                           for the protected tail
///
///   keys:   [Hkv, L, d] device view (any layout: strided, paged, per-head tables); its scale
///           is not applied (a positive scale changes no cosine)
///   scores: [Hkv, L] float32, device (out)
///   ws:     device memory, >= keydiff_scores_workspace_size(Hkv, L, d)
/// Four launches on opt.stream. A block id outside the pool raises flag_block_id_out_of_range;
/// the key reads as NaN, so its head's anchor and scores are NaN.
template <class KT>
status keydiff_scores(const cache_view<KT>& key_view, std::int64_t protected_tail, score_view scores, workspace_span ws,
                      const launch_options& opt = {}) noexcept {
  static constexpr const char* fn = "kvevict::cuda::keydiff_scores";
  using T = std::remove_const_t<KT>;
  const cache_view<const T> keys = key_view;
  KVEVICT_RETURN_IF_ERROR(detail::validate_device_cache_view(keys, opt, fn, "keys"));
  if (protected_tail < 0)
    return status::error(errc::invalid_argument, fn, "protected_tail", "expected >= 0, got %lld",
                         static_cast<long long>(protected_tail));
  KVEVICT_RETURN_IF_ERROR(detail::check_score_rows(scores, keys.num_heads, keys.num_tokens, opt, fn));
  kvevict::detail::arena carve(ws);
  detail::keydiff_args<T> a;
  detail::carve_keydiff_workspace(carve, keys.num_heads, keys.num_tokens, keys.head_dim, &a.ws);
  if (keys.num_tokens == 0) return status();
  KVEVICT_RETURN_IF_ERROR(detail::check_workspace(carve, ws, opt, fn, "keydiff_scores_workspace_size"));
  a.keys = keys;
  a.tokens = static_cast<int>(keys.num_tokens);
  a.candidates = keys.num_tokens > protected_tail ? static_cast<int>(keys.num_tokens - protected_tail) : 0;
  a.chunks = static_cast<int>(detail::keydiff_chunks(keys.num_tokens));
  a.scores = scores.data;
  a.score_stride = scores.row_stride;
  a.flags = opt.device_flags;
  const dim3 rows = detail::key_scores_grid(keys.num_heads, keys.num_tokens);
  const dim3 row_block(static_cast<unsigned>(detail::keydiff_row_block));
  const dim3 channel_block(static_cast<unsigned>(detail::keydiff_channel_block));
  KVEVICT_RETURN_IF_ERROR(
      detail::launch(fn, "keydiff_norm_kernel", {rows, row_block, 0, opt.stream}, detail::keydiff_norm_kernel<T>, a));
  KVEVICT_RETURN_IF_ERROR(detail::launch(
      fn, "keydiff_chunk_kernel",
      {dim3(static_cast<unsigned>(a.chunks), static_cast<unsigned>(keys.num_heads)), channel_block, 0, opt.stream},
      detail::keydiff_chunk_kernel<T>, a));
  KVEVICT_RETURN_IF_ERROR(detail::launch(fn, "keydiff_anchor_kernel",
                                         {dim3(static_cast<unsigned>(keys.num_heads)), channel_block, 0, opt.stream},
                                         detail::keydiff_anchor_kernel<>, keys.head_dim, a.tokens, a.chunks, a.ws));
  return detail::launch(fn, "keydiff_score_kernel", {rows, row_block, 0, opt.stream}, detail::keydiff_score_kernel<T>,
                        a);
}

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_KEYDIFF_SCORES_CUH
