// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_FINALIZE_CUH
#define KVEVICT_CUDA_FINALIZE_CUH

// Finalisation on the GPU: window-aggregated rows in, score rows [Hkv, L] out. Window
// normalisation, GQA reduction and pooling in the configured order, +inf for the protected
// tail: kvevict::detail::finalize_head (per-query-head rows) and finalize_reduced_row
// (already reduced rows, e.g. DeferKV's running state), operation for operation.
//
// One block finalises 256 consecutive keys of one KV head. Pooling reads k/2 keys either
// side, so the block stages its keys plus that halo in shared memory: for gqa_order::
// before_pooling it reduces the G rows into the staged window first and pools once; for
// after_pooling it stages, pools and reduces one query head's row at a time (each output
// owned by one thread, reductions in ascending g: deterministic).

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/detail/score_logic.hpp"
#include "kvevict/cuda/detail/tiling.hpp"
#include "kvevict/cuda/detail/workspace_plan.hpp"
#include "kvevict/error.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/views/index_ptr.hpp"
#include "kvevict/views/matrix_view.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// Pooling radius the finalize kernel stages around each tile (0 without pooling).
KVEVICT_HOST_DEVICE inline std::int64_t pool_radius(const pooling& p) noexcept {
  return p.kind == pooling_kind::none ? 0 : p.kernel / 2;
}

/// Dynamic shared memory of the finalize kernel: three staged windows (values, reduced
/// values, visible counts) of a tile plus its halo.
inline std::size_t finalize_shared_bytes(std::int64_t radius) noexcept {
  return static_cast<std::size_t>(3 * (finalize_tile_keys + 2 * radius)) * sizeof(float);
}

struct finalize_args {
  const float* acc = nullptr;  ///< row (h * rows_per_head + g) at acc + row * acc_stride, [C] each
  std::int64_t acc_stride = 0;
  int rows_per_head = 1;  ///< G (one row per query head) or 1 (already reduced)
  int group = 1;          ///< G, for mean's 1/G
  int candidates = 0;     ///< C
  int tokens = 0;         ///< L
  scoring_params params;
  float scale = 1.0f;                   ///< window normaliser when not per key and weights == null
  const float* weights = nullptr;       ///< [window] device: scale = 1 / sum (weighted aggregation)
  bool per_key = false;                 ///< visible_mean: divide by the observations that see the key
  index_ptr query_positions = nullptr;  ///< [window] (per_key)
  index_ptr key_positions = nullptr;    ///< [L] or null: key j at position j (per_key)
  int window = 0;
  float* scores = nullptr;  ///< [Hkv, L]
  std::int64_t score_stride = 0;
  std::uint32_t* flags = nullptr;
};

/// Tile blockIdx.x of head blockIdx.y: the whole block calls it (it synchronises).
template <int Unused = 0>
__device__ void finalize_tile(const finalize_args& a) {
  KVEVICT_DYNAMIC_SHARED(float, finalize_smem);
  const int tid = static_cast<int>(threadIdx.x);
  const std::int64_t h = blockIdx.y;
  const index_range tile = tile_range(blockIdx.x, finalize_tile_keys, a.tokens);
  float* out_row = a.scores + h * a.score_stride;
  const std::int64_t j = tile.begin + tid;
  if (tile.begin >= a.candidates) {  // the protected tail only
    if (j < tile.end) out_row[j] = pos_infinity();
    return;
  }
  const std::int64_t radius = pool_radius(a.params.pool);
  const index_range own = {tile.begin, tile.end < a.candidates ? tile.end : a.candidates};
  const index_range halo = halo_range(own, radius, a.candidates);
  const int window_size = static_cast<int>(finalize_tile_keys + 2 * radius);
  float* xs = finalize_smem;
  float* red = xs + window_size;
  float* cnt = red + window_size;

  KVEVICT_SHARED(float, weighted_scale);
  if (a.weights != nullptr && tid == 0) {
    double sum = 0.0;
    bool bad = false;
    for (int t = 0; t < a.window; ++t) {
      const float w = a.weights[t];
      if (!(w >= 0.0f) || isinf(w)) bad = true;
      sum += static_cast<double>(w);
    }
    // As on the CPU: the sum must be at least FLT_MIN, or 1 / sum is not a finite float.
    if (bad || !(sum >= 1.17549435082228750797e-38)) raise_flag(a.flags, flag_invalid_weights);
    weighted_scale = static_cast<float>(1.0 / sum);
  }
  if (a.per_key) {
    for (std::int64_t i = halo.begin + tid; i < halo.end; i += blockDim.x) {
      const std::int64_t kp = a.key_positions != nullptr ? a.key_positions[i] : i;
      cnt[i - halo.begin] = visible_count(kp, a.query_positions, a.window);
    }
  }
  __syncthreads();
  const float scale = a.weights != nullptr ? weighted_scale : a.scale;
  const gqa_reduction r = a.params.gqa;
  float out = 0.0f;

  if (a.params.order == gqa_order::before_pooling) {
    for (std::int64_t i = halo.begin + tid; i < halo.end; i += blockDim.x) {
      float v = 0.0f;
      for (int g = 0; g < a.rows_per_head; ++g)
        v = gqa_step(v, a.acc[(h * a.rows_per_head + g) * a.acc_stride + i], r, g == 0);
      v = normalise(v, scale, a.per_key, a.per_key ? cnt[i - halo.begin] : 0.0f);
      red[i - halo.begin] = gqa_mean_scale(v, r, a.group);
    }
    __syncthreads();
    if (j < own.end) out = pool_at(red, halo.begin, a.candidates, j, a.params.pool);
  } else {
    for (int g = 0; g < a.rows_per_head; ++g) {
      const float* row = a.acc + (h * a.rows_per_head + g) * a.acc_stride;
      for (std::int64_t i = halo.begin + tid; i < halo.end; i += blockDim.x)
        xs[i - halo.begin] = normalise(row[i], scale, a.per_key, a.per_key ? cnt[i - halo.begin] : 0.0f);
      __syncthreads();
      if (j < own.end) out = gqa_step(out, pool_at(xs, halo.begin, a.candidates, j, a.params.pool), r, g == 0);
      __syncthreads();
    }
    out = gqa_mean_scale(out, r, a.group);
  }
  if (j < own.end) {
    out_row[j] = out;
  } else if (j < tile.end) {
    out_row[j] = pos_infinity();
  }
}

// Kernels are templates (here on a dummy parameter) so that every translation unit that
// includes the header may instantiate them without multiple-definition errors.
template <int Unused = 0>
__global__ void __launch_bounds__(256) finalize_kernel(finalize_args a) {
  finalize_tile(a);
}

/// A batch: sequence blockIdx.z finalises with args[blockIdx.z]; the grid covers the longest
/// sequence, so blocks past a shorter one's tiles return (whole blocks: no barrier is split).
template <int Unused = 0>
__global__ void __launch_bounds__(256) finalize_batch_kernel(const finalize_args* args) {
  const finalize_args& a = args[blockIdx.z];
  if (static_cast<std::int64_t>(blockIdx.x) >= num_tiles(a.tokens, finalize_tile_keys)) return;
  finalize_tile(a);
}

/// Launches the finalize kernel over [Hkv, L] (validated arguments).
inline status launch_finalize(const finalize_args& a, std::int64_t kv_heads, cudaStream_t stream,
                              const char* fn) noexcept {
  if (a.tokens == 0) return status();
  const std::size_t smem = finalize_shared_bytes(pool_radius(a.params.pool));
  const dim3 grid(static_cast<unsigned>(num_tiles(a.tokens, finalize_tile_keys)), static_cast<unsigned>(kv_heads));
  return launch(fn, "finalize_kernel", {grid, dim3(static_cast<unsigned>(finalize_tile_keys)), smem, stream},
                finalize_kernel<>, a);
}

/// Host checks shared by every entry that finalises: the pooling window fits shared memory.
inline status check_pooling_fits(const pooling& p, const char* fn) noexcept {
  const std::int64_t radius = pool_radius(p);
  if (radius > 4096)
    return status::error(errc::unsupported, fn, "params.pool.kernel",
                         "expected a pooling kernel <= 8193 on the GPU, got %lld", static_cast<long long>(p.kernel));
  return status();
}

}  // namespace detail

/// Scores from already GQA-reduced, un-normalised rows, e.g. DeferKV's running state
/// (decode_observation). Per KV head h:
///   row = state[h] * scale          (1/Z for DeferKV; 1 leaves it)
///   row = row / G                   (gqa_reduction::mean only, G = group)
///   scores[h, :C] = pool(row),  scores[h, C:] = +inf      (C = L - params.protected_tail)
/// exactly kvevict::detail::finalize_reduced_row.
///
///   state:  [Hkv, C] float32, device
///   scores: [Hkv, L] float32, device (out); L = scores.cols, C = max(0, L - protected_tail)
///   params: gqa, pool and protected_tail are used
inline status finalize_state_scores(const_score_view state, std::int64_t group, float scale,
                                    const scoring_params& params, score_view scores,
                                    const launch_options& opt = {}) noexcept {
  static constexpr const char* fn = "kvevict::cuda::finalize_state_scores";
  KVEVICT_RETURN_IF_ERROR(kvevict::detail::validate_scoring_params(params, fn));
  KVEVICT_RETURN_IF_ERROR(detail::check_pooling_fits(params.pool, fn));
  if (group < 1)
    return status::error(errc::invalid_argument, fn, "group", "expected >= 1, got %lld", static_cast<long long>(group));
  if (group > detail::int32_limit)
    return status::error(errc::overflow, fn, "group", "expected a group size < 2^31 on the GPU, got %lld",
                         static_cast<long long>(group));
  if (!(scale == scale) || scale == detail::pos_infinity() || scale == detail::neg_infinity())
    return status::error(errc::invalid_argument, fn, "scale", "expected a finite scale, got %g",
                         static_cast<double>(scale));
  if (scores.rows < 1)
    return status::error(errc::invalid_shape, fn, "scores.rows", "expected >= 1 KV head, got %lld",
                         static_cast<long long>(scores.rows));
  const std::int64_t tokens = scores.cols;
  const std::int64_t candidates = tokens > params.protected_tail ? tokens - params.protected_tail : 0;
  KVEVICT_RETURN_IF_ERROR(kvevict::detail::validate_matrix_view(scores, scores.rows, tokens, fn, "scores"));
  KVEVICT_RETURN_IF_ERROR(kvevict::detail::validate_matrix_view(state, scores.rows, candidates, fn, "state"));
  if (!detail::fits_int32(tokens, detail::finalize_tile_keys) || !detail::grid_fits(1, scores.rows))
    return status::error(errc::overflow, fn, "scores", "expected L < 2^31 and Hkv <= 65535, got [%lld, %lld]",
                         static_cast<long long>(scores.rows), static_cast<long long>(tokens));
  KVEVICT_RETURN_IF_ERROR(detail::check_device_pointer(scores.data, opt, fn, "scores.data"));
  KVEVICT_RETURN_IF_ERROR(detail::check_device_pointer(state.data, opt, fn, "state.data"));
  detail::finalize_args a;
  a.acc = state.data;
  a.acc_stride = state.row_stride;
  a.rows_per_head = 1;
  a.group = static_cast<int>(group);
  a.candidates = static_cast<int>(candidates);
  a.tokens = static_cast<int>(tokens);
  a.params = params;
  a.params.order = gqa_order::before_pooling;
  a.scale = scale;
  a.scores = scores.data;
  a.score_stride = scores.row_stride;
  a.flags = opt.device_flags;
  return detail::launch_finalize(a, scores.rows, opt.stream, fn);
}

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_FINALIZE_CUH
