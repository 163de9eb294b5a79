// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_ADAKV_CUH
#define KVEVICT_CUDA_ADAKV_CUH

// AdaKV head budgets computed on the device (design.md §5), so that scoring, the budgets and
// the per-head selection (kvevict::cuda::select with device head budgets) run in one stream
// without a copy to the host or a synchronisation. The same budgets as
// kvevict::adakv_head_budgets, bit for bit:
//   1. flatten: the candidates [0, C) of every head into one row [Hkv * C] (workspace);
//   2. the global top Hkv * B of that row with the radix select (select_rows_kernel, one
//      row; from 16 Ki keys the wide selection, many blocks per row: cuda/select_wide.cuh):
//      ties go to the lower flat index, i.e. the lower head, then the lower key, as on the
//      CPU; NaN ranks last;
//   3. one block counts each head's picks (the picks are ascending: a binary search per head
//      boundary) and applies detail::adakv_head_budget, the CPU's own function.
// Three launches, integer arithmetic after the scores: deterministic. The kvpress_safeguard rule
// (budgets/adakv.hpp) first selects each head's top f in one batched launch (step 0), packs the
// rest of each row around those picks in step 1, ranks Hkv*(B - f) in step 2, and gives head h
// f + its picks in step 3: five launches, the CPU's budgets bit for bit. The paper rule's
// normalisation selects each head's top B the same way, then one thread per head sums its top B
// and its whole row in double in the CPU's order (adakv_factor_kernel), and step 1 scales each
// score by its head's factor as the CPU does: six launches.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvevict/budgets/adakv_params.hpp"
#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/detail/launch.cuh"
#include "kvevict/cuda/detail/tiling.hpp"
#include "kvevict/cuda/select.cuh"
#include "kvevict/cuda/select_row.hpp"
#include "kvevict/cuda/select_wide.cuh"
#include "kvevict/error.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

struct adakv_workspace {
  select_row* rows = nullptr;      // [Hkv + 1]: the safeguard's per-head rows, then step 2's row
  float* flat = nullptr;           // [Hkv * C]
  std::int64_t* picked = nullptr;  // [Hkv * C]: each head's top f (safeguard) or B (normalise), then step 2's
  double* factors = nullptr;       // [Hkv] the normalisation's factors
  wide_row_words* wide = nullptr;  // [Hkv] the wide selection's words (long rows)
};

inline void carve_adakv_workspace(kvevict::detail::arena& a, std::int64_t heads, std::int64_t tokens,
                                  adakv_workspace* out) noexcept {
  const std::int64_t n = kvevict::detail::saturating_mul(heads, tokens);
  out->rows = a.take<select_row>(kvevict::detail::saturating_add(heads, 1));
  out->flat = a.take<float>(n);
  out->picked = a.take<std::int64_t>(n);
  out->factors = a.take<double>(heads);
  carve_wide_workspace(a, heads, &out->wide);
}

/// The first of n ascending values at or past `key` (n if none).
KVEVICT_HOST_DEVICE inline std::int64_t first_at_least(const std::int64_t* values, std::int64_t n,
                                                       std::int64_t key) noexcept {
  std::int64_t lo = 0, hi = n;
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (values[mid] < key) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

/// Step 0 of the safeguard rule and of the normalisation: one selection row per head, its top
/// `count` candidates (count >= 1) into picked [Hkv, count].
template <int Unused = 0>
__global__ void __launch_bounds__(256)
    adakv_head_rows_kernel(const_score_view scores, std::int64_t candidates, std::int64_t count, std::int64_t* picked,
                           select_row* rows) {
  for (std::int64_t h = threadIdx.x; h < scores.rows; h += blockDim.x) {
    select_row r;
    r.scores = scores.data + h * scores.row_stride;
    r.length = candidates;
    r.budget = count;
    r.protected_tail = 0;
    r.mode = protected_mode::inside_budget;
    r.out = picked + h * count;
    rows[h] = r;
  }
}

/// The normalisation's factors: head h's (sum of its top b) / (sum of all), both summed in
/// double by one thread in ascending index order, as the CPU sums them (adakv_head_row), so the
/// factors are its bits; 1 where the total is not positive and finite.
template <int Unused = 0>
__global__ void __launch_bounds__(256)
    adakv_factor_kernel(const_score_view scores, std::int64_t candidates, std::int64_t b, const std::int64_t* picked,
                        double* factors) {
  for (std::int64_t h = threadIdx.x; h < scores.rows; h += blockDim.x) {
    const float* row = scores.data + h * scores.row_stride;
    const std::int64_t* top_b = picked + h * b;
    double top = 0.0, total = 0.0;
    for (std::int64_t i = 0; i < b; ++i) top += static_cast<double>(row[top_b[i]]);
    for (std::int64_t j = 0; j < candidates; ++j) total += static_cast<double>(row[j]);
    factors[h] = (total > 0.0 && ::isfinite(total) && ::isfinite(top)) ? top / total : 1.0;
  }
}

/// Step 1, and the descriptor of step 2 (written by thread 0 of block 0). Under the safeguard
/// rule each head's f forced picks (ascending in `picked`, [Hkv, f]) leave its row and the
/// rest is packed in token order, as on the CPU: row h of `flat` is [C - f]. With `factors`
/// (the normalisation) each score is scaled as the CPU scales it: float(double(v) * factor).
template <int Unused = 0>
__global__ void __launch_bounds__(256)
    adakv_flatten_kernel(const_score_view scores, std::int64_t candidates, std::int64_t forced, std::int64_t global,
                         const double* factors, float* flat, std::int64_t* picked, select_row* row) {
  const std::int64_t n = scores.rows * candidates, rest = candidates - forced;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t h = i / candidates, j = i - h * candidates;
    // Forced picks of head h before token j (binary search), and whether j is one.
    const std::int64_t* mine = picked + h * forced;
    const std::int64_t lo = first_at_least(mine, forced, j);
    if (lo < forced && mine[lo] == j) continue;
    const float v = scores.data[h * scores.row_stride + j];
    flat[h * rest + j - lo] = factors == nullptr ? v : static_cast<float>(static_cast<double>(v) * factors[h]);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    select_row r;
    r.scores = flat;
    r.length = scores.rows * rest;
    r.budget = global;
    r.protected_tail = 0;
    r.mode = protected_mode::inside_budget;
    r.out = picked;
    *row = r;
  }
}

/// Step 3: out[h] from the ascending picks (global of them; none when global == 0) of rows of
/// `rest` candidates: the paper's rule, or the safeguard's f + picks.
template <int Unused = 0>
__global__ void __launch_bounds__(256)
    adakv_count_kernel(const std::int64_t* picked, std::int64_t global, std::int64_t heads, std::int64_t candidates,
                       std::int64_t forced, std::int64_t per_head_budget, adakv_params params, std::int64_t* out) {
  const std::int64_t rest = candidates - forced;
  for (std::int64_t h = threadIdx.x; h < heads; h += blockDim.x) {
    // First pick at or past each boundary: picks of head h are [lower(h rest), lower((h + 1) rest)).
    const std::int64_t picks =
        first_at_least(picked, global, (h + 1) * rest) - first_at_least(picked, global, h * rest);
    out[h] = params.rule == adakv_rule::kvpress_safeguard
                 ? forced + picks
                 : kvevict::detail::adakv_head_budget(picks, per_head_budget, candidates, params);
  }
}

/// Every head keeps all its candidates (B >= C).
template <int Unused = 0>
__global__ void __launch_bounds__(256)
    adakv_all_kernel(std::int64_t heads, std::int64_t candidates, std::int64_t* out) {
  for (std::int64_t h = threadIdx.x; h < heads; h += blockDim.x) out[h] = candidates;
}

}  // namespace detail

/// Bytes of device workspace `adakv_head_budgets` needs for [num_kv_heads, num_tokens] scores.
inline std::size_t adakv_workspace_size(std::int64_t num_kv_heads, std::int64_t num_tokens) noexcept {
  kvevict::detail::arena a;
  detail::adakv_workspace w;
  detail::carve_adakv_workspace(a, num_kv_heads, num_tokens, &w);
  return a.used();
}

/// AdaKV's head budgets of one layer, on the device.
///
///   scores:          [Hkv, L] float32 device (candidates [0, L - protected_tail))
///   per_head_budget: B, the average number of candidates a head keeps
///   params:          alpha in [0, 1], either rule; normalize with the paper's
///   out:             [Hkv] int64 device: the candidates each head keeps, equal to
///                    kvevict::adakv_head_budgets; feed it to kvevict::cuda::select's
///                    head-budget overload with the same protected tail
///   ws:              device memory, >= adakv_workspace_size(Hkv, L)
///
/// Enqueues up to six kernels on opt.stream; no synchronisation, no allocation. The per-head
/// normalisation (params.normalize, off in AdaKV's GQA setting) selects each head's top B in
/// one batched launch and sums in double in the CPU's order, one thread per head (a chain of
/// C additions: about C x 4 cycles), so its factors are the CPU's bits.
inline status adakv_head_budgets(const_score_view scores, std::int64_t protected_tail, std::int64_t per_head_budget,
                                 const adakv_params& params, std::int64_t* out, workspace_span ws,
                                 const launch_options& opt = {}) {
  static constexpr const char* fn = "kvevict::cuda::adakv_head_budgets";
  KVEVICT_RETURN_IF_ERROR(
      kvevict::detail::validate_adakv_inputs(scores, protected_tail, per_head_budget, params, out, fn));
  const std::int64_t heads = scores.rows;
  const std::int64_t candidates = scores.cols > protected_tail ? scores.cols - protected_tail : 0;
  const std::int64_t flat = kvevict::detail::saturating_mul(heads, candidates);
  if (!detail::fits_int32(flat, detail::select_tile) || heads > 65535)
    return status::error(errc::overflow, fn, "scores",
                         "expected fewer than 2^31 - 4096 candidates in a layer and Hkv <= 65535 on the GPU, got "
                         "%lld x %lld",
                         static_cast<long long>(heads), static_cast<long long>(candidates));
  KVEVICT_RETURN_IF_ERROR(detail::check_device_pointer(scores.data, opt, fn, "scores.data"));
  KVEVICT_RETURN_IF_ERROR(detail::check_device_pointer(out, opt, fn, "out"));
  kvevict::detail::arena a(ws);
  detail::adakv_workspace w;
  detail::carve_adakv_workspace(a, heads, candidates, &w);
  KVEVICT_RETURN_IF_ERROR(detail::check_workspace(a, ws, opt, fn, "adakv_workspace_size"));

  if (per_head_budget >= candidates)
    return detail::launch(fn, "adakv_all_kernel", {dim3(1), dim3(256), 0, opt.stream}, detail::adakv_all_kernel<>,
                          heads, candidates, out);
  const std::int64_t forced = params.rule == adakv_rule::kvpress_safeguard
                                  ? kvevict::detail::adakv_safeguard(per_head_budget, protected_tail, params)
                                  : 0;
  const std::int64_t global = heads * (per_head_budget - forced);
  // Each head's own top: the safeguard's f, or the normalisation's B (the rules exclude each other).
  const bool normalises = params.normalize && per_head_budget > 0;
  const std::int64_t own = normalises ? per_head_budget : forced;
  if (own > 0) {
    KVEVICT_RETURN_IF_ERROR(detail::launch(fn, "adakv_head_rows_kernel", {dim3(1), dim3(256), 0, opt.stream},
                                           detail::adakv_head_rows_kernel<>, scores, candidates, own, w.picked,
                                           w.rows));
    KVEVICT_RETURN_IF_ERROR(detail::enqueue_select_rows(w.rows, heads, candidates, nullptr, w.wide, opt, fn));
  }
  if (normalises)
    KVEVICT_RETURN_IF_ERROR(detail::launch(fn, "adakv_factor_kernel", {dim3(1), dim3(256), 0, opt.stream},
                                           detail::adakv_factor_kernel<>, scores, candidates, per_head_budget, w.picked,
                                           w.factors));
  if (global > 0) {
    KVEVICT_RETURN_IF_ERROR(
        detail::launch(fn, "adakv_flatten_kernel",
                       {dim3(static_cast<unsigned>(detail::stride_grid(flat, 256, 4096))), dim3(256), 0, opt.stream},
                       detail::adakv_flatten_kernel<>, scores, candidates, forced, global,
                       normalises ? static_cast<const double*>(w.factors) : nullptr, w.flat, w.picked, w.rows + heads));
    KVEVICT_RETURN_IF_ERROR(
        detail::enqueue_select_rows(w.rows + heads, 1, flat - heads * forced, nullptr, w.wide, opt, fn));
  }
  return detail::launch(fn, "adakv_count_kernel", {dim3(1), dim3(256), 0, opt.stream}, detail::adakv_count_kernel<>,
                        w.picked, global, heads, candidates, forced, per_head_budget, params, out);
}

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_ADAKV_CUH
