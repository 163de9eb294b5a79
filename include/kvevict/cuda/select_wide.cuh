// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_SELECT_WIDE_CUH
#define KVEVICT_CUDA_SELECT_WIDE_CUH

// Exact top-B of long rows with many blocks per row: AdaKV's flattened layer (Hkv x L
// candidates in one row) and the shared scopes' combined rows. select_rows (cuda/select.cuh)
// gives a row one block, whose radix passes walk the whole row in sequence: latency-bound
// at 32K x 8 keys. Here a row's keys are cut into tiles of 4,096, each block of the row
// takes a run of tiles, and the passes are kernels of their own:
//   0. one memset clears every row's histograms;
//   1. four histogram passes, grid (blocks, rows): each block counts the digits of its keys
//      that match the prefix decided so far in shared memory and adds them to the row's
//      histogram of that pass. A pass derives its state from the previous pass's histogram
//      (one warp per block, the same integer arithmetic in every block: the same state); the
//      row's block 0 stores it for the next pass. A state that took its bucket whole ends
//      the search (the later passes count nothing);
//   2. count: each block counts its keys above the threshold and its ties;
//   3. emit: each block adds up the counts of the blocks before it, then sweeps its tiles in
//      index order and writes its kept indices at their slots (a block scan per tile); the
//      first `remaining` ties in index order are kept.
// The same keys, order and tie rule as select_rows (detail/radix_logic.hpp): the keep-lists
// are kvevict::select's, bit for bit. Integer counts only, so the result is deterministic.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/detail/launch.cuh"
#include "kvevict/cuda/detail/radix_logic.hpp"
#include "kvevict/cuda/detail/shared_memory.cuh"
#include "kvevict/cuda/detail/tiling.hpp"
#include "kvevict/cuda/select.cuh"
#include "kvevict/cuda/select_row.hpp"
#include "kvevict/error.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// Blocks one row takes at most: enough to fill the SMs with a few rows, and a fixed
/// workspace per row whatever its length.
constexpr std::int64_t wide_max_blocks = 128;

/// A row's device words: each pass's histogram, the state each pass started from (stored by
/// the row's block 0), and each block's (above, ties) counts packed as above << 32 | ties.
struct wide_row_words {
  std::uint32_t hist[radix_passes][radix_buckets];
  radix_state states[radix_passes];
  unsigned long long counts[wide_max_blocks];
};

/// How a launch cuts rows of up to max_length keys: blocks per row, tiles per block.
struct wide_grid {
  std::int64_t blocks = 1;
  std::int64_t tiles_per_block = 1;
};

inline wide_grid wide_grid_for(std::int64_t max_length) noexcept {
  const std::int64_t tiles = max_length > 0 ? (max_length + select_tile - 1) / select_tile : 1;
  wide_grid g;
  g.blocks = tiles < wide_max_blocks ? tiles : wide_max_blocks;
  g.tiles_per_block = (tiles + g.blocks - 1) / g.blocks;
  return g;
}

struct wide_args {
  const select_row* rows = nullptr;
  std::int64_t max_length = 0;
  std::int64_t tiles_per_block = 1;
  const std::uint32_t* gate = nullptr;  ///< nonzero cancels the launch (select_prepare_kernel's)
  std::uint32_t* flags = nullptr;
  wide_row_words* words = nullptr;  ///< [rows]
};

/// Block blockIdx.x's keys of a row: [first, end) of its candidates.
struct wide_span {
  std::int64_t first = 0, end = 0;
};

/// The row of blockIdx.y, checked as select_rows_kernel checks it (a bad row is flagged and
/// skipped by every kernel); its candidate count and candidates kept.
__device__ __forceinline__ bool wide_row(const wide_args& a, select_row* row, std::int64_t* cand, std::int64_t* k) {
  *row = a.rows[blockIdx.y];
  const select_row& r = *row;
  bool bad = r.length < 0 || r.length > a.max_length || r.budget < 0 || r.protected_tail < 0 ||
             static_cast<unsigned>(r.mode) > 1u || (r.length > 0 && r.scores == nullptr);
  if (!bad && kept_tokens(r) > 0 && r.out == nullptr) bad = true;
  if (bad) {
    if (blockIdx.x == 0 && threadIdx.x == 0) raise_flag(a.flags, flag_invalid_row);
    return false;
  }
  const std::int64_t protect = r.protected_tail < r.length ? r.protected_tail : r.length;
  *cand = r.length - protect;
  *k = select_candidates_kept(r.budget, r.length, r.protected_tail, static_cast<int>(r.mode));
  return true;
}

__device__ __forceinline__ wide_span wide_keys(const wide_args& a, std::int64_t cand) {
  const std::int64_t per_block = a.tiles_per_block * select_tile;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * per_block;
  const std::int64_t end = first + per_block < cand ? first + per_block : cand;
  return {first, end > first ? end : first};
}

/// The state pass `pass` starts from (pass 4: the final one), into shared `out`: the start, or
/// the previous pass's state advanced by its histogram -- select_rows_kernel's search, by
/// one warp. Every thread of the block calls it (it synchronises).
__device__ __forceinline__ void wide_state(const wide_row_words& w, std::int64_t k, int pass, radix_state* out) {
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31;
  if (pass == 0) {
    if (tid == 0) *out = radix_start(static_cast<std::uint32_t>(k));
  } else {
    const radix_state before = w.states[pass - 1];
    if (before.done != 0) {
      if (tid == 0) *out = before;
    } else if (tid < 32) {
      const std::uint32_t* hist = w.hist[pass - 1];
      const std::uint32_t sum = radix_lane_sum(hist, lane);
      std::uint32_t incl = sum;
      for (int o = 1; o < 32; o <<= 1) {
        const std::uint32_t v = __shfl_up_sync(full_warp, incl, o);
        if (lane >= o) incl += v;
      }
      const std::uint32_t greater = incl - sum;
      if (radix_lane_owns(greater, sum, before.remaining)) *out = radix_advance(hist, lane, greater, before, pass - 1);
    }
  }
  __syncthreads();
}

/// Pass `pass`'s histogram of the keys matching the decided prefix.
template <int Unused = 0>
__global__ void __launch_bounds__(select_threads) select_wide_hist_kernel(wide_args a, int pass) {
  KVEVICT_SHARED_ARRAY(std::uint32_t, local, radix_buckets);
  KVEVICT_SHARED(radix_state, state);
  if (a.gate != nullptr && *a.gate != 0) return;
  select_row row;
  std::int64_t cand = 0, k = 0;
  if (!wide_row(a, &row, &cand, &k) || k == 0 || k >= cand) return;  // the emission writes those rows
  wide_row_words& w = a.words[blockIdx.y];
  wide_state(w, k, pass, &state);
  const radix_state s = state;
  if (blockIdx.x == 0 && threadIdx.x == 0) w.states[pass] = s;
  const wide_span span = wide_keys(a, cand);
  if (s.done != 0 || span.first >= span.end) return;
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31;
  for (int i = tid; i < radix_buckets; i += select_threads) local[i] = 0;
  __syncthreads();
  const float* x = row.scores;
  // The loop bound is uniform, so every lane reaches __match_any_sync together.
  for (std::int64_t base = span.first; base < span.end; base += select_threads) {
    const std::int64_t j = base + tid;
    std::uint32_t digit = radix_buckets;  // no bucket
    if (j < span.end) {
      const std::uint32_t key = radix_key(x[j]);
      digit = radix_matches(key, s) ? radix_digit(key, pass) : digit;
    }
    const unsigned same = __match_any_sync(full_warp, digit);
    const bool leader = lane == __ffs(same) - 1;
    if (leader && digit != static_cast<std::uint32_t>(radix_buckets))
      atomicAdd(local + digit, static_cast<std::uint32_t>(__popc(same)));
  }
  __syncthreads();
  for (int i = tid; i < radix_buckets; i += select_threads)
    if (local[i] != 0) atomicAdd(&w.hist[pass][i], local[i]);
}

/// Each block's keys above the final threshold and its ties.
template <int Unused = 0>
__global__ void __launch_bounds__(select_threads) select_wide_count_kernel(wide_args a) {
  KVEVICT_SHARED(radix_state, state);
  KVEVICT_SHARED_ARRAY(unsigned long long, warp_sums, 32);
  if (a.gate != nullptr && *a.gate != 0) return;
  select_row row;
  std::int64_t cand = 0, k = 0;
  if (!wide_row(a, &row, &cand, &k) || k == 0 || k >= cand) return;
  wide_row_words& w = a.words[blockIdx.y];
  wide_state(w, k, radix_passes, &state);
  const radix_state fin = state;
  const wide_span span = wide_keys(a, cand);
  unsigned long long mine = 0;
  for (std::int64_t j = span.first + threadIdx.x; j < span.end; j += select_threads) {
    const int c = radix_class(radix_key(row.scores[j]), fin);
    mine += c == 2 ? (1ull << 32) : (c == 1 ? 1ull : 0ull);
  }
  unsigned long long total = 0;
  (void)block_exclusive_scan(mine, &total, warp_sums);
  if (threadIdx.x == 0) w.counts[blockIdx.x] = total;
}

/// The kept indices: the protected tail, every candidate of a row keeping them all, or each
/// block's kept keys at their slots.
template <int Unused = 0>
__global__ void __launch_bounds__(select_threads) select_wide_emit_kernel(wide_args a) {
  KVEVICT_SHARED(radix_state, state);
  KVEVICT_SHARED_ARRAY(unsigned long long, wide_sums, 32);
  KVEVICT_SHARED_ARRAY(std::uint32_t, tile_sums, 32);
  if (a.gate != nullptr && *a.gate != 0) return;
  select_row row;
  std::int64_t cand = 0, k = 0;
  if (!wide_row(a, &row, &cand, &k)) return;
  const int tid = static_cast<int>(threadIdx.x);
  const std::int64_t gtid = static_cast<std::int64_t>(blockIdx.x) * select_threads + tid;
  const std::int64_t nthreads = static_cast<std::int64_t>(gridDim.x) * select_threads;
  std::int64_t* out = row.out;
  for (std::int64_t i = gtid; i < row.length - cand; i += nthreads) out[k + i] = cand + i;
  if (k >= cand) {
    for (std::int64_t i = gtid; i < cand; i += nthreads) out[i] = i;
    return;
  }
  if (k == 0) return;
  const wide_row_words& w = a.words[blockIdx.y];
  wide_state(w, k, radix_passes, &state);
  const radix_state fin = state;
  const wide_span span = wide_keys(a, cand);
  if (span.first >= span.end) return;
  // The blocks before this one: their kept keys come first.
  unsigned long long earlier = 0;
  for (std::int64_t b = tid; b < static_cast<std::int64_t>(blockIdx.x); b += select_threads) earlier += w.counts[b];
  unsigned long long before = 0;
  (void)block_exclusive_scan(earlier, &before, wide_sums);
  std::int64_t above_run = static_cast<std::int64_t>(before >> 32);
  std::int64_t tie_run = static_cast<std::int64_t>(before & 0xffffffffull);
  for (std::int64_t base = span.first; base < span.end; base += select_tile)
    emit_tile(row.scores, base, span.end, fin, &above_run, &tie_run, out, tile_sums);
}

/// The wide selection's launches (no host checks of the rows: they are device data).
inline status enqueue_select_wide(const select_row* rows, std::int64_t num_rows, std::int64_t max_length,
                                  const std::uint32_t* gate, wide_row_words* words, const launch_options& opt,
                                  const char* fn) {
  const wide_grid g = wide_grid_for(max_length);
  wide_args a;
  a.rows = rows;
  a.max_length = max_length;
  a.tiles_per_block = g.tiles_per_block;
  a.gate = gate;
  a.flags = opt.device_flags;
  a.words = words;
  KVEVICT_RETURN_IF_ERROR(
      cuda_status(cudaMemsetAsync(words, 0, static_cast<std::size_t>(num_rows) * sizeof(wide_row_words), opt.stream),
                  fn, "cudaMemsetAsync"));
  const launch_config cfg{dim3(static_cast<unsigned>(g.blocks), static_cast<unsigned>(num_rows)), dim3(select_threads),
                          0, opt.stream};
  for (int pass = 0; pass < radix_passes; ++pass)
    KVEVICT_RETURN_IF_ERROR(launch(fn, "select_wide_hist_kernel", cfg, select_wide_hist_kernel<>, a, pass));
  KVEVICT_RETURN_IF_ERROR(launch(fn, "select_wide_count_kernel", cfg, select_wide_count_kernel<>, a));
  return launch(fn, "select_wide_emit_kernel", cfg, select_wide_emit_kernel<>, a);
}

inline void carve_wide_workspace(kvevict::detail::arena& a, std::int64_t num_rows, wide_row_words** out) noexcept {
  *out = a.take<wide_row_words>(num_rows);
}

/// Rows of at least this many keys take the wide selection: one block walks 16 Ki keys four
/// times in about what the wide selection's seven stream operations cost (the model's
/// `select_wide` and `adakv` rows, scripts/gpu-model.py).
constexpr std::int64_t wide_select_from = 16384;

/// Selects rows described on the device: select_rows_kernel (a block per row) below
/// wide_select_from keys, the wide selection from there (`words`: its workspace, [num_rows]).
inline status enqueue_select_rows(const select_row* rows, std::int64_t num_rows, std::int64_t max_length,
                                  const std::uint32_t* gate, wide_row_words* words, const launch_options& opt,
                                  const char* fn) {
  if (max_length >= wide_select_from) return enqueue_select_wide(rows, num_rows, max_length, gate, words, opt, fn);
  return launch(fn, "select_rows_kernel", {dim3(static_cast<unsigned>(num_rows)), dim3(select_threads), 0, opt.stream},
                select_rows_kernel<>, rows, max_length, gate, opt.device_flags);
}

}  // namespace detail

/// Bytes of device workspace select_rows_wide needs for `num_rows` rows (any length).
inline std::size_t select_rows_wide_workspace_size(std::int64_t num_rows) noexcept {
  kvevict::detail::arena a;
  detail::wide_row_words* w = nullptr;
  detail::carve_wide_workspace(a, num_rows, &w);
  return a.used();
}

/// select_rows for long rows: the same descriptors, checks, flags and outputs (rows[r].out
/// gets kept_tokens(rows[r]) ascending indices: its top candidates, then its protected
/// tail), with up to 128 blocks per row of tiles of 4,096 keys.
///
///   rows:       [num_rows] select_row in device memory; num_rows <= 65535
///   max_length: an upper bound on every row's length (host-known; it sizes the grid)
///   ws:         device memory, >= select_rows_wide_workspace_size(num_rows)
///
/// A memset and six kernels whatever the length (select_rows: one kernel); worth it when a
/// row's single block would walk tens of thousands of keys.
inline status select_rows_wide(const select_row* rows, std::int64_t num_rows, std::int64_t max_length,
                               workspace_span ws, const launch_options& opt = {}) {
  static constexpr const char* fn = "kvevict::cuda::select_rows_wide";
  if (num_rows < 0 || num_rows > 65535)
    return status::error(errc::invalid_shape, fn, "num_rows", "expected 0 .. 65535 rows, got %lld",
                         static_cast<long long>(num_rows));
  if (num_rows == 0) return status();
  KVEVICT_RETURN_IF_ERROR(detail::check_row_batch(rows, num_rows, max_length, opt, fn));
  kvevict::detail::arena a(ws);
  detail::wide_row_words* words = nullptr;
  detail::carve_wide_workspace(a, num_rows, &words);
  KVEVICT_RETURN_IF_ERROR(detail::check_workspace(a, ws, opt, fn, "select_rows_wide_workspace_size"));
  return detail::enqueue_select_wide(rows, num_rows, max_length, nullptr, words, opt, fn);
}

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_SELECT_WIDE_CUH
