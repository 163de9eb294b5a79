// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_SELECT_CUH
#define KVEVICT_CUDA_SELECT_CUH

// Batched exact top-B selection on the GPU: many score rows (sequences x layers x heads,
// ragged lengths, per-row budgets) in one launch, with the CPU's rules (design.md §6):
// exact top-k of the candidates, equal scores -> smaller index wins, NaN below every number,
// -0 == +0, output ascending, protected tail appended. Results equal kvevict::select's bit
// for bit (tests compare them exactly).
//
// One block of 512 threads per row. Radix select over the 32-bit order-preserving keys
// (detail/radix_logic.hpp), 8 bits per pass, most significant first: each pass builds a
// 256-bucket histogram of the keys that still match the decided prefix in shared memory
// (warp-aggregated atomics: lanes with the same digit add once, so rows full of equal
// scores do not serialise), and one warp finds the bucket of the k-th largest key with a
// prefix sum over lanes. A pass that takes its whole bucket ends the search early. Then
// one sweep over the row in index order emits the kept indices: a block-wide exclusive scan
// of (above-threshold, tie) counts, packed in one 32-bit word, gives every kept key its
// output slot, and the first `remaining` ties in index order are the ones kept. Integer
// counts only, so the result is deterministic.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/detail/radix_logic.hpp"
#include "kvevict/cuda/detail/tiling.hpp"
#include "kvevict/cuda/detail/workspace_plan.hpp"
#include "kvevict/cuda/select_row.hpp"
#include "kvevict/error.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

constexpr int select_threads = 512;
/// Consecutive keys per thread in the emission sweep; a sweep tile is 4096 keys (< 2^16,
/// which the packed counts need).
constexpr int select_items = 8;
constexpr std::int64_t select_tile = static_cast<std::int64_t>(select_threads) * select_items;
static_assert(select_tile < 65536, "packed (above, tie) counts hold 16 bits each");

/// Block-wide exclusive prefix sum in thread order; *total gets the block's sum. Every
/// thread of the block must call it (it synchronises); warp_sums holds 32 values.
template <class T>
__device__ T block_exclusive_scan(T v, T* total, T* warp_sums) {
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int warps = static_cast<int>(blockDim.x) >> 5;
  T incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    const T n = __shfl_up_sync(full_warp, incl, o);
    if (lane >= o) incl += n;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    T w = lane < warps ? warp_sums[lane] : T(0);
    for (int o = 1; o < 32; o <<= 1) {
      const T n = __shfl_up_sync(full_warp, w, o);
      if (lane >= o) w += n;
    }
    if (lane < warps) warp_sums[lane] = w;  // inclusive prefix over warps
  }
  __syncthreads();
  const T before = warp == 0 ? T(0) : warp_sums[warp - 1];
  *total = warp_sums[warps - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return before + incl - v;
}

/// One tile of the emission sweep: the keys [base, base + select_tile) below `end`, classified
/// against the final state `fin`, each kept one written at its slot in `out`; the counts of
/// above-threshold keys and ties before the tile (*above_run, *tie_run) advance by the tile's.
/// Every thread of the block calls it (it synchronises).
__device__ __forceinline__ void emit_tile(const float* x, std::int64_t base, std::int64_t end, const radix_state& fin,
                                          std::int64_t* above_run, std::int64_t* tie_run, std::int64_t* out,
                                          std::uint32_t* warp_sums) {
  int cls[select_items];
  std::uint32_t above = 0, ties = 0;
  const std::int64_t first = base + static_cast<std::int64_t>(threadIdx.x) * select_items;
#pragma unroll
  for (int i = 0; i < select_items; ++i) {
    const std::int64_t j = first + i;
    cls[i] = j < end ? radix_class(radix_key(x[j]), fin) : 0;
    above += cls[i] == 2 ? 1u : 0u;
    ties += cls[i] == 1 ? 1u : 0u;
  }
  std::uint32_t total = 0;
  const std::uint32_t excl = block_exclusive_scan(radix_pack(above, ties), &total, warp_sums);
  std::int64_t ab = *above_run + radix_packed_above(excl);
  std::int64_t tb = *tie_run + radix_packed_ties(excl);
#pragma unroll
  for (int i = 0; i < select_items; ++i) {
    if (cls[i] == 2) {
      out[radix_output_slot(ab, tb, fin.remaining)] = first + i;
      ++ab;
    } else if (cls[i] == 1) {
      if (tb < static_cast<std::int64_t>(fin.remaining)) out[radix_output_slot(ab, tb, fin.remaining)] = first + i;
      ++tb;
    }
  }
  *above_run += radix_packed_above(total);
  *tie_run += radix_packed_ties(total);
}

/// Selects every row of `rows`; block b handles row b. `gate`, when set, is a device word
/// that cancels the launch when nonzero (the matrix entry's capacity check).
template <int Unused = 0>
__global__ void __launch_bounds__(select_threads) select_rows_kernel(const select_row* rows, std::int64_t max_length,
                                                                     const std::uint32_t* gate, std::uint32_t* flags) {
  KVEVICT_SHARED_ARRAY(std::uint32_t, hist, radix_buckets);
  KVEVICT_SHARED_ARRAY(std::uint32_t, warp_sums, 32);
  KVEVICT_SHARED(radix_state, state);
  if (gate != nullptr && *gate != 0) return;
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31;
  const select_row row = rows[blockIdx.x];
  bool bad = row.length < 0 || row.length > max_length || row.budget < 0 || row.protected_tail < 0 ||
             static_cast<unsigned>(row.mode) > 1u || (row.length > 0 && row.scores == nullptr);
  if (!bad && kept_tokens(row) > 0 && row.out == nullptr) bad = true;
  if (bad) {
    if (tid == 0) raise_flag(flags, flag_invalid_row);
    return;
  }
  const int n = static_cast<int>(row.length);
  const int protect = row.protected_tail < n ? static_cast<int>(row.protected_tail) : n;
  const int cand = n - protect;
  const int k =
      static_cast<int>(select_candidates_kept(row.budget, row.length, row.protected_tail, static_cast<int>(row.mode)));
  std::int64_t* out = row.out;
  for (int i = tid; i < protect; i += select_threads) out[k + i] = cand + i;
  if (k >= cand) {
    for (int i = tid; i < cand; i += select_threads) out[i] = i;
    return;
  }
  if (k == 0) return;
  const float* x = row.scores;

  if (tid == 0) state = radix_start(static_cast<std::uint32_t>(k));
  for (int pass = 0; pass < radix_passes; ++pass) {
    for (int i = tid; i < radix_buckets; i += select_threads) hist[i] = 0;
    __syncthreads();
    const radix_state s = state;
    // The loop bound is uniform, so every lane reaches __match_any_sync together.
    for (int base = 0; base < cand; base += select_threads) {
      const int j = base + tid;
      std::uint32_t digit = radix_buckets;  // "no bucket"
      if (j < cand) {
        const std::uint32_t key = radix_key(x[j]);
        if (radix_matches(key, s)) digit = radix_digit(key, pass);
      }
      const unsigned peers = __match_any_sync(full_warp, digit);
      if (digit < static_cast<std::uint32_t>(radix_buckets) && lane == __ffs(peers) - 1)
        atomicAdd(&hist[digit], static_cast<std::uint32_t>(__popc(peers)));
    }
    __syncthreads();
    if (tid < 32) {
      const std::uint32_t sum = radix_lane_sum(hist, lane);
      std::uint32_t incl = sum;
      for (int o = 1; o < 32; o <<= 1) {
        const std::uint32_t v = __shfl_up_sync(full_warp, incl, o);
        if (lane >= o) incl += v;
      }
      const std::uint32_t greater = incl - sum;
      if (radix_lane_owns(greater, sum, s.remaining)) state = radix_advance(hist, lane, greater, s, pass);
    }
    __syncthreads();
    if (state.done) break;  // every thread reads the same word
  }

  const radix_state fin = state;
  std::int64_t above_run = 0, tie_run = 0;
  for (std::int64_t base = 0; base < cand; base += select_tile) {
    emit_tile(x, base, cand, fin, &above_run, &tie_run, out, warp_sums);
    if (radix_output_slot(above_run, tie_run, fin.remaining) >= k) break;  // uniform: block totals
  }
}

/// One block: per-row kept counts, their prefix sum into out.offsets, and the row
/// descriptors. Writes the gate word: nonzero cancels selection (a negative budget or a
/// total above the capacity; both flagged).
template <int Unused = 0>
__global__ void __launch_bounds__(1024)
    select_prepare_kernel(const float* scores, std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                          const std::int64_t* head_budgets, std::int64_t uniform, selection_params params,
                          keep_list_view out, select_row* descs, std::uint32_t* gate, std::uint32_t* flags) {
  KVEVICT_SHARED_ARRAY(unsigned long long, warp_sums, 32);
  const int tid = static_cast<int>(threadIdx.x);
  unsigned long long running = 0;
  bool bad = false;
  for (std::int64_t base = 0; base < rows; base += blockDim.x) {
    const std::int64_t r = base + tid;
    std::int64_t b = uniform, kept = 0;
    if (r < rows) {
      if (head_budgets != nullptr) b = head_budgets[r];
      if (b < 0) {
        bad = true;
      } else {
        kept = select_tokens_kept(b, cols, params.protected_tail, static_cast<int>(params.mode));
      }
    }
    unsigned long long total = 0;
    const unsigned long long excl = block_exclusive_scan(static_cast<unsigned long long>(kept), &total, warp_sums);
    if (r < rows) {
      const auto off = static_cast<std::int64_t>(running + excl);
      out.offsets[r] = off;
      select_row d;
      d.scores = scores + r * row_stride;
      d.length = cols;
      d.budget = b < 0 ? 0 : b;
      d.protected_tail = params.protected_tail;
      d.mode = params.mode;
      d.out = out.indices + off;
      descs[r] = d;
    }
    running += total;
  }
  bad = __syncthreads_or(bad ? 1 : 0) != 0;
  if (tid == 0) {
    out.offsets[rows] = static_cast<std::int64_t>(running);
    const bool over = running > static_cast<unsigned long long>(out.capacity);
    if (bad) raise_flag(flags, flag_invalid_row);
    if (over) raise_flag(flags, flag_capacity_exceeded);
    *gate = (bad || over) ? 1u : 0u;
  }
}

/// The selection parameters, as every selection checks them (detail/validate.hpp).
using kvevict::detail::check_selection_params;

/// A ratio budget within [0, 1] (token budgets are checked once resolved).
inline status check_budget_ratio(const budget& b, const char* fn) noexcept {
  if (b.type == budget::kind::ratio && !(b.compression_ratio >= 0.0 && b.compression_ratio <= 1.0))
    return status::error(errc::invalid_argument, fn, "budget", "expected a compression ratio in [0, 1], got %g",
                         b.compression_ratio);
  return status();
}

/// select_matrix's last launch by default: a block per row.
struct launch_select_rows {
  status operator()(const select_row* rows, std::int64_t num_rows, std::int64_t max_length, const std::uint32_t* gate,
                    const launch_options& opt, const char* fn) const {
    return launch(fn, "select_rows_kernel",
                  {dim3(static_cast<unsigned>(num_rows)), dim3(select_threads), 0, opt.stream}, select_rows_kernel<>,
                  rows, max_length, gate, opt.device_flags);
  }
};

/// The checks, the prepare kernel (descriptors, offsets, the capacity gate), then `select_rows`
/// over the descriptors (a block per row, or the wide selection: cuda/select_wide.cuh).
template <class SelectRows = launch_select_rows>
inline status select_matrix(const_score_view scores, const std::int64_t* head_budgets, std::int64_t uniform,
                            const selection_params& params, const keep_list_view& out, workspace_span ws,
                            const launch_options& opt, const SelectRows& select_rows = SelectRows()) {
  static constexpr const char* fn = "kvevict::cuda::select";
  if (scores.rows < 1)
    return status::error(errc::invalid_shape, fn, "scores.rows", "expected >= 1 row, got %lld",
                         static_cast<long long>(scores.rows));
  if (scores.cols < 0)
    return status::error(errc::invalid_shape, fn, "scores.cols", "expected >= 0, got %lld",
                         static_cast<long long>(scores.cols));
  KVEVICT_RETURN_IF_ERROR(kvevict::detail::validate_matrix_view(scores, scores.rows, scores.cols, fn, "scores"));
  if (!fits_int32(scores.cols, select_tile) || !grid_fits(scores.rows, 1))
    return status::error(errc::overflow, fn, "scores",
                         "expected fewer than 2^31 - 4096 tokens and 2^31 rows, got [%lld, %lld]",
                         static_cast<long long>(scores.rows), static_cast<long long>(scores.cols));
  KVEVICT_RETURN_IF_ERROR(check_selection_params(params, fn));
  if (out.num_heads != scores.rows)
    return status::error(errc::invalid_shape, fn, "out.num_heads", "expected %lld (scores.rows), got %lld",
                         static_cast<long long>(scores.rows), static_cast<long long>(out.num_heads));
  if (out.offsets == nullptr) return status::error(errc::null_pointer, fn, "out.offsets", "expected non-null");
  if (out.capacity < 0)
    return status::error(errc::invalid_shape, fn, "out.capacity", "expected >= 0, got %lld",
                         static_cast<long long>(out.capacity));
  if (head_budgets == nullptr) {
    if (uniform < 0)
      return status::error(errc::invalid_argument, fn, "budget", "expected >= 0 tokens, got %lld",
                           static_cast<long long>(uniform));
    const std::int64_t per_row =
        select_tokens_kept(uniform, scores.cols, params.protected_tail, static_cast<int>(params.mode));
    if (per_row > 0 && per_row * scores.rows / per_row != scores.rows)
      return status::error(errc::overflow, fn, "out.capacity", "the kept tokens overflow 2^63");
    if (per_row * scores.rows > out.capacity)
      return status::error(errc::invalid_keep_list, fn, "out.capacity", "expected >= %lld kept tokens, got %lld",
                           static_cast<long long>(per_row * scores.rows), static_cast<long long>(out.capacity));
  } else {
    KVEVICT_RETURN_IF_ERROR(check_device_pointer(head_budgets, opt, fn, "head_budgets"));
  }
  if (out.capacity > 0 && out.indices == nullptr)
    return status::error(errc::null_pointer, fn, "out.indices", "expected non-null");
  KVEVICT_RETURN_IF_ERROR(check_device_pointer(scores.data, opt, fn, "scores.data"));
  KVEVICT_RETURN_IF_ERROR(check_device_pointer(out.offsets, opt, fn, "out.offsets"));
  KVEVICT_RETURN_IF_ERROR(check_device_pointer(out.indices, opt, fn, "out.indices"));
  kvevict::detail::arena a(ws);
  select_workspace w;
  carve_select_workspace(a, scores.rows, &w);
  KVEVICT_RETURN_IF_ERROR(check_workspace(a, ws, opt, fn, "select_workspace_size"));

  KVEVICT_RETURN_IF_ERROR(launch(fn, "select_prepare_kernel", {dim3(1), dim3(1024), 0, opt.stream},
                                 select_prepare_kernel<>, scores.data, scores.rows, scores.cols, scores.row_stride,
                                 head_budgets, uniform, params, out, w.rows, w.status, opt.device_flags));
  return select_rows(w.rows, scores.rows, scores.cols, w.status, opt, fn);
}

}  // namespace detail

namespace detail {
/// The host checks of a launch over row descriptors (select_rows, select_rows_wide): the
/// descriptors in device memory, a length bound within the kernels' 32-bit indices.
inline status check_row_batch(const select_row* rows, std::int64_t num_rows, std::int64_t max_length,
                              const launch_options& opt, const char* fn) {
  if (rows == nullptr)
    return status::error(errc::null_pointer, fn, "rows", "expected [%lld] row descriptors",
                         static_cast<long long>(num_rows));
  if (max_length < 0 || !fits_int32(max_length, select_tile))
    return status::error(errc::overflow, fn, "max_length", "expected a length in [0, 2^31 - 4096), got %lld",
                         static_cast<long long>(max_length));
  return check_device_pointer(rows, opt, fn, "rows");
}
}  // namespace detail

/// Selects a batch of rows described by a device array of descriptors, in one launch.
///
///   rows:       [num_rows] select_row in device memory (scores, length, budget, protected
///               tail, mode, output pointer each; the outputs must not overlap)
///   max_length: an upper bound on every row's length (host-known; rows above it, and rows
///               with a negative budget or tail, an unknown mode or a null pointer, are
///               flagged flag_invalid_row and not written)
///
/// Row r writes kept_tokens(rows[r]) ascending indices to rows[r].out: its top candidates,
/// then its protected tail. Needs no workspace. Enqueues one kernel on opt.stream.
inline status select_rows(const select_row* rows, std::int64_t num_rows, std::int64_t max_length,
                          const launch_options& opt = {}) {
  static constexpr const char* fn = "kvevict::cuda::select_rows";
  if (num_rows < 0)
    return status::error(errc::invalid_shape, fn, "num_rows", "expected >= 0, got %lld",
                         static_cast<long long>(num_rows));
  if (num_rows == 0) return status();
  if (!detail::grid_fits(num_rows, 1))
    return status::error(errc::overflow, fn, "num_rows", "expected fewer than 2^31 rows, got %lld",
                         static_cast<long long>(num_rows));
  KVEVICT_RETURN_IF_ERROR(detail::check_row_batch(rows, num_rows, max_length, opt, fn));
  return detail::launch(fn, "select_rows_kernel",
                        {dim3(static_cast<unsigned>(num_rows)), dim3(detail::select_threads), 0, opt.stream},
                        detail::select_rows_kernel<>, rows, max_length, nullptr, opt.device_flags);
}

/// Bytes of device workspace `select` needs for a scores matrix of `num_rows` rows.
inline std::size_t select_workspace_size(std::int64_t num_rows) noexcept {
  kvevict::detail::arena a;
  detail::select_workspace w;
  detail::carve_select_workspace(a, num_rows, &w);
  return a.used();
}

/// Uniform budget over a scores matrix (one layer [Hkv, L], or any [rows, L]).
///
///   scores: [R, L] float32 device
///   b:      tokens, or a compression ratio in [0, 1] resolved against L (as kvevict::select)
///   out:    CSR keep-list with device offsets [R + 1] and indices [capacity]; capacity
///           (host-known) >= R * tokens_kept(B, L, params)
///   ws:     device memory, >= select_workspace_size(R)
///
/// Writes out.offsets and out.indices exactly as kvevict::select does. Two kernels (a
/// one-block prefix sum that builds the row descriptors, then select_rows').
inline status select(const_score_view scores, budget b, const selection_params& params, keep_list_view out,
                     workspace_span ws, const launch_options& opt = {}) {
  KVEVICT_RETURN_IF_ERROR(detail::check_budget_ratio(b, "kvevict::cuda::select"));
  return detail::select_matrix(scores, nullptr, b.resolve(scores.cols), params, out, ws, opt);
}

/// Head-adaptive budgets (AdaKV): row r keeps head_budgets[r] tokens (device array [R]) under
/// the same protected-tail rule. The capacity check needs the budgets, so it runs on the
/// device: a negative budget (flag_invalid_row) or a total above out.capacity
/// (flag_capacity_exceeded) writes out.offsets but no index.
inline status select(const_score_view scores, const std::int64_t* head_budgets, const selection_params& params,
                     keep_list_view out, workspace_span ws, const launch_options& opt = {}) {
  if (head_budgets == nullptr)
    return status::error(errc::null_pointer, "kvevict::cuda::select", "head_budgets",
                         "expected one budget per row (device array)");
  return detail::select_matrix(scores, head_budgets, 0, params, out, ws, opt);
}

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_SELECT_CUH
