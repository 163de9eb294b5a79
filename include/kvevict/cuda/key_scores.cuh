// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_KEY_SCORES_CUH
#define KVEVICT_CUDA_KEY_SCORES_CUH

// Scores that read no queries, on the GPU: KNorm's key norms and StreamingLLM's positions in
// the cache, written as kvevict::knorm and kvevict::streaming_llm write them on the CPU, bit
// for bit, so that the selection and compaction after them are the CPU's too.
//
// One thread per (head, token): KNorm sums its row's squares in double in ascending c, which
// makes the result independent of the order other threads run in and of multiply-add fusion
// (the square of a float is exact in double). A warp reads 32 rows at once; the rows' cache
// lines are reused from L1 over the channel loop, so the kernel reads each key byte from
// memory about once (docs/cuda.md, "Performance model").

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/detail/launch.cuh"
#include "kvevict/cuda/detail/score_logic.hpp"
#include "kvevict/cuda/detail/tiling.hpp"
#include "kvevict/cuda/device_flags.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/matrix_view.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

constexpr int key_scores_block = 256;

template <class T>
struct key_norm_args {
  cache_view<const T> keys;
  int candidates = 0;  ///< L - protected_tail (at least 0)
  int tokens = 0;      ///< L
  float* scores = nullptr;
  std::int64_t score_stride = 0;
  std::uint32_t* flags = nullptr;
};

template <class T>
__global__ void __launch_bounds__(key_scores_block) key_norm_kernel(key_norm_args<T> a) {
  const std::int64_t h = blockIdx.y;
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * key_scores_block + threadIdx.x;
  if (j >= a.tokens) return;
  float* out = a.scores + h * a.score_stride + j;
  if (j >= a.candidates) {
    *out = pos_infinity();
    return;
  }
  const std::int64_t off = checked_row_offset(a.keys, h, j, a.flags);
  if (off < 0) {  // a block outside the pool (flagged): the key reads as NaN, as in scoring
    *out = ::nanf("");
    return;
  }
  double sum = 0.0;
  for (std::int64_t c = 0; c < a.keys.head_dim; ++c) {
    const double x = static_cast<double>(load_float(a.keys.data + off + c * a.keys.dim_stride));
    sum += x * x;
  }
  *out = -static_cast<float>(::sqrt(sum) * static_cast<double>(a.keys.scale));
}

struct streaming_args {
  int sinks = 0;
  int tokens = 0;
  float* scores = nullptr;
  std::int64_t score_stride = 0;
};

template <int Unused = 0>
__global__ void __launch_bounds__(key_scores_block) streaming_kernel(streaming_args a) {
  const std::int64_t h = blockIdx.y;
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * key_scores_block + threadIdx.x;
  if (j >= a.tokens) return;
  a.scores[h * a.score_stride + j] = j < a.sinks ? pos_infinity() : static_cast<float>(j);
}

inline status check_score_rows(score_view scores, std::int64_t heads, std::int64_t tokens, const launch_options& opt,
                               const char* fn) noexcept {
  KVEVICT_RETURN_IF_ERROR(kvevict::detail::validate_matrix_view(scores, heads, tokens, fn, "scores"));
  if (!fits_int32(tokens, key_scores_block) || !grid_fits(1, heads))
    return status::error(errc::overflow, fn, "scores", "expected L < 2^31 and Hkv <= 65535, got [%lld, %lld]",
                         static_cast<long long>(heads), static_cast<long long>(tokens));
  if (tokens == 0) return status();
  return check_device_pointer(scores.data, opt, fn, "scores.data");
}

inline dim3 key_scores_grid(std::int64_t heads, std::int64_t tokens) noexcept {
  return dim3(static_cast<unsigned>(num_tiles(tokens, key_scores_block)), static_cast<unsigned>(heads));
}

}  // namespace detail

/// KNorm's scores (kvevict::knorm::score, bit for bit):
///   scores[h, j] = -||keys[h, j, :]|| * keys.scale   for j < L - protected_tail
///   scores[h, j] = +inf                               for the protected tail
///
///   keys:   [Hkv, L, d] device view (any layout: strided, paged, per-head tables)
///   scores: [Hkv, L] float32, device (out)
/// A block id outside the pool raises flag_block_id_out_of_range and scores that token NaN.
template <class KT>
status key_norm_scores(const cache_view<KT>& key_view, std::int64_t protected_tail, score_view scores,
                       const launch_options& opt = {}) noexcept {
  static constexpr const char* fn = "kvevict::cuda::key_norm_scores";
  using T = std::remove_const_t<KT>;
  const cache_view<const T> keys = key_view;
  KVEVICT_RETURN_IF_ERROR(detail::validate_device_cache_view(keys, opt, fn, "keys"));
  if (protected_tail < 0)
    return status::error(errc::invalid_argument, fn, "protected_tail", "expected >= 0, got %lld",
                         static_cast<long long>(protected_tail));
  KVEVICT_RETURN_IF_ERROR(detail::check_score_rows(scores, keys.num_heads, keys.num_tokens, opt, fn));
  if (keys.num_tokens == 0) return status();
  detail::key_norm_args<T> a;
  a.keys = keys;
  a.tokens = static_cast<int>(keys.num_tokens);
  a.candidates = keys.num_tokens > protected_tail ? static_cast<int>(keys.num_tokens - protected_tail) : 0;
  a.scores = scores.data;
  a.score_stride = scores.row_stride;
  a.flags = opt.device_flags;
  return detail::launch(fn, "key_norm_kernel",
                        {detail::key_scores_grid(keys.num_heads, keys.num_tokens),
                         dim3(static_cast<unsigned>(detail::key_scores_block)), 0, opt.stream},
                        detail::key_norm_kernel<T>, a);
}

/// StreamingLLM's scores (kvevict::streaming_llm::score, bit for bit): +inf for the first
/// `sinks` tokens, the token's index in the cache for the others, so that a budget of B keeps
/// the sinks and the B - sinks most recent tokens.
///
///   scores: [Hkv, L] float32, device (out); L <= 2^24 (indices are exact floats below it)
inline status streaming_scores(std::int64_t sinks, score_view scores, const launch_options& opt = {}) noexcept {
  static constexpr const char* fn = "kvevict::cuda::streaming_scores";
  if (sinks < 0)
    return status::error(errc::invalid_argument, fn, "sinks", "expected >= 0, got %lld", static_cast<long long>(sinks));
  if (scores.cols > (std::int64_t{1} << 24))
    return status::error(errc::overflow, fn, "scores.cols", "expected at most 2^24 tokens, got %lld",
                         static_cast<long long>(scores.cols));
  if (scores.rows < 1)
    return status::error(errc::invalid_shape, fn, "scores.rows", "expected >= 1 KV head, got %lld",
                         static_cast<long long>(scores.rows));
  KVEVICT_RETURN_IF_ERROR(detail::check_score_rows(scores, scores.rows, scores.cols, opt, fn));
  if (scores.cols == 0) return status();
  detail::streaming_args a;
  a.sinks = sinks < scores.cols ? static_cast<int>(sinks) : static_cast<int>(scores.cols);
  a.tokens = static_cast<int>(scores.cols);
  a.scores = scores.data;
  a.score_stride = scores.row_stride;
  return detail::launch(fn, "streaming_kernel",
                        {detail::key_scores_grid(scores.rows, scores.cols),
                         dim3(static_cast<unsigned>(detail::key_scores_block)), 0, opt.stream},
                        detail::streaming_kernel<>, a);
}

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_KEY_SCORES_CUH
