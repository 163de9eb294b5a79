// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_SCOPE_CUH
#define KVEVICT_CUDA_SCOPE_CUH

// Shared selection scopes on the device (design.md §14): one keep set for every head of a
// layer, or for every layer of a sequence, chosen from a combined score per token -- the same
// bits as the CPU's combine_head_scores, compressor fold and select_shared, so scoring,
// combining, selection and compaction run in one stream with no host round trip.
//
//   1. magnitude bins (normalised rules only): grid (4096-key chunks, rows); each block sums
//      its keys' significands per exponent into shared integer bins, then adds them to the
//      row's global bins. Integer sums are exact, so the order of the atomics does not show.
//   2. row scales: one thread per row turns its bins into 1 / (exact sum), the CPU's
//      normaliser_of (detail/exact_sum.hpp, the same host+device code).
//   3. combine: one thread per token folds the rows in order with __fmul_rn / __fadd_rn
//      (the CPU's fold_row, which is compiled without FMA contraction), then the mean
//      (__frcp_rn: the CPU's correctly rounded 1.0f / rows, even under --use_fast_math).
// The bits match the CPU's for IEEE code on both sides: no -ftz=true / --use_fast_math on the
// device (they flush subnormal scores), no FTZ/DAZ (-ffast-math) in the host process.
// The sequence scope folds each layer's combined row into the sequence's row (one kernel per
// layer); select_shared selects one row and copies its keep set to every head.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/detail/launch.cuh"
#include "kvevict/cuda/detail/shared_memory.cuh"
#include "kvevict/cuda/detail/tiling.hpp"
#include "kvevict/cuda/select.cuh"
#include "kvevict/cuda/select_wide.cuh"
#include "kvevict/detail/exact_sum.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/selection/scope.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

constexpr int scope_threads = 256;
/// Keys per block of the bins kernel: enough work per block to amortise its 255 bins.
constexpr std::int64_t scope_chunk = 4096;

struct scope_workspace {
  unsigned long long* bins = nullptr;  // [R, magnitude_bins]
  float* scales = nullptr;             // [R]
};

inline void carve_scope_workspace(kvevict::detail::arena& a, std::int64_t rows, scope_workspace* out) noexcept {
  out->bins = a.take<unsigned long long>(kvevict::detail::saturating_mul(rows, kvevict::detail::magnitude_bins));
  out->scales = a.take<float>(rows);
}

/// nan_max of detail/pooling.hpp: a NaN in b wins, a NaN in a stays.
__device__ __forceinline__ float scope_nan_max(float a, float b) {
  return (b != b || b > a) ? b : a;
}

/// One block's share of a row's exact magnitude sum: keys [j0, j1) of x into the block's
/// shared bins `local`, then added to the row's bins `out` (every thread of the block calls it).
__device__ inline void add_magnitude_bins(const float* x, std::int64_t j0, std::int64_t j1, unsigned long long* local,
                                          unsigned long long* out) {
  const int tid = static_cast<int>(threadIdx.x);
  for (int b = tid; b < kvevict::detail::magnitude_bins; b += scope_threads) local[b] = 0;
  __syncthreads();
  for (std::int64_t j = j0 + tid; j < j1; j += scope_threads) {
    int bin = 0;
    std::uint64_t significand = 0;
    if (kvevict::detail::magnitude_parts(x[j], &bin, &significand))
      atomicAdd(&local[bin], static_cast<unsigned long long>(significand));
  }
  __syncthreads();
  for (int b = tid; b < kvevict::detail::magnitude_bins; b += scope_threads)
    if (local[b] != 0) atomicAdd(&out[b], local[b]);
}

template <int Unused = 0>
__global__ void __launch_bounds__(scope_threads)
    magnitude_bins_kernel(const float* scores, std::int64_t row_stride, std::int64_t candidates,
                          unsigned long long* bins) {
  KVEVICT_SHARED_ARRAY(unsigned long long, local, kvevict::detail::magnitude_bins);
  const std::int64_t row = blockIdx.y;
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * scope_chunk;
  const std::int64_t j1 = j0 + scope_chunk < candidates ? j0 + scope_chunk : candidates;
  add_magnitude_bins(scores + row * row_stride, j0, j1, local, bins + row * kvevict::detail::magnitude_bins);
}

template <int Unused = 0>
__global__ void __launch_bounds__(scope_threads)
    row_scales_kernel(const unsigned long long* bins, std::int64_t rows, float* scales) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * scope_threads + threadIdx.x;
  if (r >= rows) return;
  std::uint64_t local[kvevict::detail::magnitude_bins];
  for (int b = 0; b < kvevict::detail::magnitude_bins; ++b) local[b] = bins[r * kvevict::detail::magnitude_bins + b];
  scales[r] = kvevict::detail::reciprocal_of_sum(kvevict::detail::bins_to_double(local));
}

/// acc <- v (first), nan_max(acc, v) or acc + v: one step of the CPU's fold_row.
__device__ __forceinline__ float fold_step(float acc, float v, bool first, bool by_max) {
  if (first) return v;
  return by_max ? scope_nan_max(acc, v) : __fadd_rn(acc, v);
}

template <int Unused = 0>
__global__ void __launch_bounds__(scope_threads)
    combine_rows_kernel(const float* scores, std::int64_t rows, std::int64_t row_stride, std::int64_t tokens,
                        std::int64_t candidates, bool by_max, const float* scales, float* out) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * scope_threads + threadIdx.x;
  if (j >= tokens) return;
  float acc = 0.0f;
  for (std::int64_t r = 0; r < rows; ++r) {
    const float x = scores[r * row_stride + j];
    const float v = j < candidates ? __fmul_rn(x, scales != nullptr ? scales[r] : 1.0f) : x;
    acc = fold_step(acc, v, r == 0, by_max);
  }
  // finish_mean: the candidates' sum becomes their mean (the +inf tail stays).
  if (!by_max && rows > 1 && j < candidates) acc = __fmul_rn(acc, __frcp_rn(static_cast<float>(rows)));
  out[j] = acc;
}

template <int Unused = 0>
__global__ void __launch_bounds__(scope_threads)
    fold_layer_kernel(const float* layer_row, float* sequence_row, std::int64_t tokens, std::int64_t candidates,
                      bool by_max, bool first, std::int64_t mean_of) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * scope_threads + threadIdx.x;
  if (j >= tokens) return;
  // Layers fold as more rows of the same combination, without a second normalisation; the
  // last layer turns a sum into the mean (mean_of > 1).
  float acc = fold_step(first ? 0.0f : sequence_row[j], layer_row[j], first, by_max);
  if (mean_of > 1 && j < candidates) acc = __fmul_rn(acc, __frcp_rn(static_cast<float>(mean_of)));
  sequence_row[j] = acc;
}

/// Copies head 0's n indices to every other head and writes the offsets h * n.
template <int Unused = 0>
__global__ void __launch_bounds__(scope_threads)
    broadcast_keep_kernel(std::int64_t* offsets, std::int64_t* indices, std::int64_t heads, std::int64_t n) {
  const std::int64_t h = static_cast<std::int64_t>(blockIdx.y) + 1;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * scope_threads + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * scope_threads)
    indices[h * n + i] = indices[i];
  if (blockIdx.x == 0 && blockIdx.y == 0)
    for (std::int64_t k = static_cast<std::int64_t>(threadIdx.x) + 2; k <= heads; k += scope_threads)
      offsets[k] = k * n;
}

inline status check_rule(scope_combine rule, const char* fn) noexcept {
  if (static_cast<unsigned>(rule) > 3u)
    return status::error(errc::invalid_argument, fn, "rule", "expected a scope_combine value, got %d",
                         static_cast<int>(rule));
  return status();
}

inline unsigned token_blocks(std::int64_t tokens) noexcept {
  return static_cast<unsigned>((tokens + scope_threads - 1) / scope_threads);
}

}  // namespace detail

/// Bytes of device workspace `combine_head_scores` needs for `num_rows` rows.
inline std::size_t combine_head_scores_workspace_size(std::int64_t num_rows) noexcept {
  kvevict::detail::arena a;
  detail::scope_workspace w;
  detail::carve_scope_workspace(a, num_rows, &w);
  return a.used();
}

/// kvevict::combine_head_scores on the device: one score per token from a layer's rows.
///
///   scores:         [R, L] float32 device (a layer's [Hkv, L]; any R >= 1)
///   protected_tail: P: candidates are [0, L - P); the tail is copied as it is (+inf)
///   rule:           the scope_combine rule
///   out:            [L] float32 device
///   ws:             device memory, >= combine_head_scores_workspace_size(R)
///
/// The same bits as kvevict::combine_head_scores. Enqueues one kernel for the raw rules,
/// a memset and three kernels for the normalised ones; no synchronisation, no allocation.
inline status combine_head_scores(const_score_view scores, std::int64_t protected_tail, scope_combine rule, float* out,
                                  workspace_span ws, const launch_options& opt = {}) {
  static constexpr const char* fn = "kvevict::cuda::combine_head_scores";
  if (scores.rows < 1)
    return status::error(errc::invalid_shape, fn, "scores.rows", "expected >= 1 row, got %lld",
                         static_cast<long long>(scores.rows));
  KVEVICT_RETURN_IF_ERROR(kvevict::detail::validate_matrix_view(scores, scores.rows, scores.cols, fn, "scores"));
  if (protected_tail < 0)
    return status::error(errc::invalid_argument, fn, "protected_tail", "expected >= 0, got %lld",
                         static_cast<long long>(protected_tail));
  KVEVICT_RETURN_IF_ERROR(detail::check_rule(rule, fn));
  if (scores.cols > 0 && out == nullptr) return status::error(errc::null_pointer, fn, "out", "expected non-null");
  if (!detail::fits_int32(scores.cols, detail::scope_chunk) || scores.rows > 65535)
    return status::error(errc::overflow, fn, "scores",
                         "expected fewer than 2^31 - 4096 tokens and 65535 rows, got "
                         "[%lld, %lld]",
                         static_cast<long long>(scores.rows), static_cast<long long>(scores.cols));
  KVEVICT_RETURN_IF_ERROR(detail::check_device_pointer(scores.data, opt, fn, "scores.data"));
  KVEVICT_RETURN_IF_ERROR(detail::check_device_pointer(out, opt, fn, "out"));
  kvevict::detail::arena a(ws);
  detail::scope_workspace w;
  detail::carve_scope_workspace(a, scores.rows, &w);
  KVEVICT_RETURN_IF_ERROR(detail::check_workspace(a, ws, opt, fn, "combine_head_scores_workspace_size"));
  if (scores.cols == 0) return status();

  const std::int64_t candidates = scores.cols > protected_tail ? scores.cols - protected_tail : 0;
  const float* scales = nullptr;
  if (kvevict::detail::normalizes(rule)) {
    const std::size_t bin_bytes = static_cast<std::size_t>(scores.rows) * kvevict::detail::magnitude_bins * 8u;
    KVEVICT_RETURN_IF_ERROR(detail::cuda_status(cudaMemsetAsync(w.bins, 0, bin_bytes, opt.stream), fn, "bins"));
    if (candidates > 0) {
      const auto chunks = static_cast<unsigned>((candidates + detail::scope_chunk - 1) / detail::scope_chunk);
      KVEVICT_RETURN_IF_ERROR(
          detail::launch(fn, "magnitude_bins_kernel",
                         {dim3(chunks, static_cast<unsigned>(scores.rows)), dim3(detail::scope_threads), 0, opt.stream},
                         detail::magnitude_bins_kernel<>, scores.data, scores.row_stride, candidates, w.bins));
    }
    KVEVICT_RETURN_IF_ERROR(detail::launch(
        fn, "row_scales_kernel", {dim3(detail::token_blocks(scores.rows)), dim3(detail::scope_threads), 0, opt.stream},
        detail::row_scales_kernel<>, w.bins, scores.rows, w.scales));
    scales = w.scales;
  }
  return detail::launch(fn, "combine_rows_kernel",
                        {dim3(detail::token_blocks(scores.cols)), dim3(detail::scope_threads), 0, opt.stream},
                        detail::combine_rows_kernel<>, scores.data, scores.rows, scores.row_stride, scores.cols,
                        candidates, kvevict::detail::combines_by_max(rule), scales, out);
}

/// The sequence scope's fold (one keep set for every layer): layer `layer` of `num_layers`
/// adds its combined row (from combine_head_scores) into the sequence's row, as
/// kvevict::compressor does -- the max rules by nan_max, the mean rules by sum and, at the
/// last layer, the division by the layer count. Layer 0 overwrites the sequence row.
///
///   layer_row:    [L] float32 device, this layer's combined scores
///   sequence_row: [L] float32 device, folded in place (the caller's, kept between layers)
///   layer:        in [0, num_layers); call the layers in order
///
/// One kernel; after the last layer, select_shared picks the set from sequence_row.
inline status fold_layer_scores(const float* layer_row, float* sequence_row, std::int64_t tokens,
                                std::int64_t protected_tail, scope_combine rule, std::int64_t layer,
                                std::int64_t num_layers, const launch_options& opt = {}) {
  static constexpr const char* fn = "kvevict::cuda::fold_layer_scores";
  if (tokens < 0 || !detail::fits_int32(tokens, detail::scope_threads))
    return status::error(errc::invalid_shape, fn, "tokens", "expected in [0, 2^31 - 256), got %lld",
                         static_cast<long long>(tokens));
  if (protected_tail < 0)
    return status::error(errc::invalid_argument, fn, "protected_tail", "expected >= 0, got %lld",
                         static_cast<long long>(protected_tail));
  KVEVICT_RETURN_IF_ERROR(detail::check_rule(rule, fn));
  if (num_layers < 1)
    return status::error(errc::invalid_argument, fn, "num_layers", "expected >= 1, got %lld",
                         static_cast<long long>(num_layers));
  if (layer < 0 || layer >= num_layers)
    return status::error(errc::invalid_argument, fn, "layer", "expected in [0, %lld), got %lld",
                         static_cast<long long>(num_layers), static_cast<long long>(layer));
  if (tokens == 0) return status();
  if (layer_row == nullptr) return status::error(errc::null_pointer, fn, "layer_row", "expected non-null");
  if (sequence_row == nullptr) return status::error(errc::null_pointer, fn, "sequence_row", "expected non-null");
  KVEVICT_RETURN_IF_ERROR(detail::check_device_pointer(layer_row, opt, fn, "layer_row"));
  KVEVICT_RETURN_IF_ERROR(detail::check_device_pointer(sequence_row, opt, fn, "sequence_row"));
  const bool by_max = kvevict::detail::combines_by_max(rule);
  const std::int64_t candidates = tokens > protected_tail ? tokens - protected_tail : 0;
  const std::int64_t mean_of = (!by_max && layer == num_layers - 1) ? num_layers : 0;
  return detail::launch(
      fn, "fold_layer_kernel", {dim3(detail::token_blocks(tokens)), dim3(detail::scope_threads), 0, opt.stream},
      detail::fold_layer_kernel<>, layer_row, sequence_row, tokens, candidates, by_max, layer == 0, mean_of);
}

namespace detail {
/// select_shared's workspace: select's for one row, then the wide selection's words.
inline void carve_select_shared(kvevict::detail::arena& a, workspace_span* select, wide_row_words** wide) noexcept {
  *select = kvevict::detail::take_bytes(a, select_workspace_size(1), true);
  carve_wide_workspace(a, 1, wide);
}
}  // namespace detail

/// Bytes of device workspace `select_shared` needs.
inline std::size_t select_shared_workspace_size() noexcept {
  kvevict::detail::arena a;
  workspace_span select;
  detail::wide_row_words* wide = nullptr;
  detail::carve_select_shared(a, &select, &wide);
  return a.used();
}

/// One keep set for every head (kvevict::select_shared with a uniform budget): the top of a
/// combined row, then the same indices for each of out.num_heads heads.
///
///   row: [1, L] float32 device (combine_head_scores' or the folded sequence row)
///   b:   tokens, or a compression ratio resolved against L (as kvevict::select)
///   out: CSR keep-list of out.num_heads heads, device offsets [H + 1] and indices
///        [capacity]; capacity (host-known) >= H * tokens_kept(b, L, params)
///   ws:  device memory, >= select_shared_workspace_size()
///
/// Three kernels (a row of 16 Ki keys or more: a memset and eight, the wide selection's); the
/// keep-lists equal kvevict::select_shared's.
inline status select_shared(const_score_view row, budget b, const selection_params& params, keep_list_view out,
                            workspace_span ws, const launch_options& opt = {}) {
  static constexpr const char* fn = "kvevict::cuda::select_shared";
  if (row.rows != 1)
    return status::error(errc::invalid_shape, fn, "row.rows", "expected 1 combined row, got %lld",
                         static_cast<long long>(row.rows));
  KVEVICT_RETURN_IF_ERROR(kvevict::detail::validate_matrix_view(row, 1, row.cols, fn, "row"));
  if (out.num_heads < 1 || out.num_heads > 65536)
    return status::error(errc::invalid_shape, fn, "out.num_heads", "expected in [1, 65536], got %lld",
                         static_cast<long long>(out.num_heads));
  KVEVICT_RETURN_IF_ERROR(detail::check_budget_ratio(b, fn));
  const std::int64_t uniform = b.resolve(row.cols);
  if (uniform < 0)
    return status::error(errc::invalid_argument, fn, "budget", "expected >= 0 tokens, got %lld",
                         static_cast<long long>(uniform));
  KVEVICT_RETURN_IF_ERROR(detail::check_selection_params(params, fn));
  const std::int64_t n =
      detail::select_tokens_kept(uniform, row.cols, params.protected_tail, static_cast<int>(params.mode));
  std::int64_t total = 0;
  if (!kvevict::detail::checked_mul(n, out.num_heads, &total) || total > out.capacity)
    return status::error(errc::invalid_keep_list, fn, "out.capacity", "expected >= %lld kept tokens, got %lld",
                         static_cast<long long>(total), static_cast<long long>(out.capacity));
  kvevict::detail::arena a(ws);
  workspace_span select;
  detail::wide_row_words* wide = nullptr;
  detail::carve_select_shared(a, &select, &wide);
  KVEVICT_RETURN_IF_ERROR(detail::check_workspace(a, ws, opt, fn, "select_shared_workspace_size"));
  const keep_list_view one{1, out.offsets, out.indices, out.capacity};
  const auto select_rows = [wide](const select_row* rows, std::int64_t num_rows, std::int64_t max_length,
                                  const std::uint32_t* gate, const launch_options& o, const char* f) {
    return detail::enqueue_select_rows(rows, num_rows, max_length, gate, wide, o, f);
  };
  KVEVICT_RETURN_IF_ERROR(detail::select_matrix(row, nullptr, uniform, params, one, select, opt, select_rows));
  if (out.num_heads == 1) return status();
  const unsigned chunks = n > 0 ? static_cast<unsigned>(detail::stride_grid(n, detail::scope_threads, 64)) : 1u;
  return detail::launch(
      fn, "broadcast_keep_kernel",
      {dim3(chunks, static_cast<unsigned>(out.num_heads - 1)), dim3(detail::scope_threads), 0, opt.stream},
      detail::broadcast_keep_kernel<>, out.offsets, out.indices, out.num_heads, n);
}

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_SCOPE_CUH
