// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DETAIL_ADAKV_BATCH_CUH
#define KVEVICT_CUDA_DETAIL_ADAKV_BATCH_CUH

// AdaKV's per-head keep sets for every sequence of a cuda::compressor call in one launch per
// kernel: adakv_head_budgets' steps (cuda/adakv.cuh: each head's own top under the safeguard
// rule or the normalisation, the factors, the flattened candidates, their global top, the
// counts) with the sequence on a grid dimension, then select's head-budget selection
// (select_prepare_kernel's descriptors and offsets) of every sequence's heads in one launch.
// Each step is the single-sequence kernel's arithmetic on that sequence's descriptor, so the
// budgets and keep-lists are the ones adakv_head_budgets and select give one sequence at a time.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kvevict/budgets/adakv_params.hpp"
#include "kvevict/config.hpp"
#include "kvevict/cuda/adakv.cuh"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/device_flags.hpp"
#include "kvevict/cuda/select.cuh"
#include "kvevict/cuda/select_row.hpp"
#include "kvevict/selection/keep_list.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// One sequence's part of an AdaKV batch (device copy of a host array); the counts are the
/// host's (adakv_head_budgets computes them the same way from the same arguments).
struct adakv_job {
  const float* scores = nullptr;  ///< [Hkv, L], rows row_stride apart
  std::int64_t row_stride = 0;
  std::int64_t tokens = 0;      ///< L
  std::int64_t tail = 0;        ///< the protected tail P (kept on top of the budgets)
  std::int64_t candidates = 0;  ///< C = L - P
  std::int64_t budget = 0;      ///< B, the mean candidates a head keeps
  std::int64_t forced = 0;      ///< the safeguard's f (0 under the paper's rule)
  std::int64_t global = 0;      ///< Hkv * (B - f) picked from the flattened row
  std::int64_t own = 0;         ///< each head's own top first: f, the normalisation's B, or 0
  bool normalises = false;
  float* flat = nullptr;            ///< [Hkv * C]
  std::int64_t* picked = nullptr;   ///< [Hkv * C]
  double* factors = nullptr;        ///< [Hkv]
  std::int64_t* budgets = nullptr;  ///< [Hkv] each head's candidates kept
  keep_list_view out;               ///< the sequence's keep-list (offsets [Hkv + 1], indices [capacity])
};

/// Step 0: each head's own top (`own` of its C candidates) as a row per head: grid (sequences).
template <int Unused = 0>
__global__ void __launch_bounds__(256)
    adakv_head_rows_batch_kernel(const adakv_job* jobs, std::int64_t heads, select_row* rows) {
  const adakv_job job = jobs[blockIdx.x];
  for (std::int64_t h = threadIdx.x; h < heads; h += blockDim.x) {
    select_row r;
    r.scores = job.scores + h * job.row_stride;
    r.length = job.own > 0 ? job.candidates : 0;
    r.budget = job.own;
    r.protected_tail = 0;
    r.mode = protected_mode::inside_budget;
    r.out = job.picked + h * job.own;
    rows[static_cast<std::int64_t>(blockIdx.x) * heads + h] = r;
  }
}

/// adakv_factor_kernel per sequence that normalises: grid (sequences).
template <int Unused = 0>
__global__ void __launch_bounds__(256) adakv_factor_batch_kernel(const adakv_job* jobs, std::int64_t heads) {
  const adakv_job job = jobs[blockIdx.x];
  if (!job.normalises) return;
  for (std::int64_t h = threadIdx.x; h < heads; h += blockDim.x) {
    const float* row = job.scores + h * job.row_stride;
    const std::int64_t* top_b = job.picked + h * job.budget;
    double top = 0.0, total = 0.0;
    for (std::int64_t i = 0; i < job.budget; ++i) top += static_cast<double>(row[top_b[i]]);
    for (std::int64_t j = 0; j < job.candidates; ++j) total += static_cast<double>(row[j]);
    job.factors[h] = (total > 0.0 && ::isfinite(total) && ::isfinite(top)) ? top / total : 1.0;
  }
}

/// adakv_flatten_kernel per sequence, and its step-2 descriptor (a row of length 0 when it
/// picks nothing): grid (chunks, sequences).
template <int Unused = 0>
__global__ void __launch_bounds__(256)
    adakv_flatten_batch_kernel(const adakv_job* jobs, std::int64_t heads, select_row* rows) {
  const adakv_job job = jobs[blockIdx.y];
  const std::int64_t rest = job.candidates - job.forced;
  if (job.global > 0) {
    const std::int64_t n = heads * job.candidates;
    for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
      const std::int64_t h = i / job.candidates, j = i - h * job.candidates;
      const std::int64_t* mine = job.picked + h * job.forced;
      const std::int64_t lo = first_at_least(mine, job.forced, j);
      if (lo < job.forced && mine[lo] == j) continue;
      const float v = job.scores[h * job.row_stride + j];
      job.flat[h * rest + j - lo] = job.normalises ? static_cast<float>(static_cast<double>(v) * job.factors[h]) : v;
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    select_row r;
    r.scores = job.flat;
    r.length = job.global > 0 ? heads * rest : 0;
    r.budget = job.global;
    r.protected_tail = 0;
    r.mode = protected_mode::inside_budget;
    r.out = job.picked;
    rows[blockIdx.y] = r;
  }
}

/// adakv_count_kernel (or adakv_all_kernel when B >= C) per sequence: grid (sequences).
template <int Unused = 0>
__global__ void __launch_bounds__(256)
    adakv_count_batch_kernel(const adakv_job* jobs, std::int64_t heads, adakv_params params) {
  const adakv_job job = jobs[blockIdx.x];
  const std::int64_t rest = job.candidates - job.forced;
  for (std::int64_t h = threadIdx.x; h < heads; h += blockDim.x) {
    if (job.budget >= job.candidates) {
      job.budgets[h] = job.candidates;
      continue;
    }
    const std::int64_t picks =
        first_at_least(job.picked, job.global, (h + 1) * rest) - first_at_least(job.picked, job.global, h * rest);
    job.budgets[h] = params.rule == adakv_rule::kvpress_safeguard
                         ? job.forced + picks
                         : kvevict::detail::adakv_head_budget(picks, job.budget, job.candidates, params);
  }
}

/// select_prepare_kernel with each sequence's head budgets, on top of its tail: per-head kept
/// counts, their prefix sum into the sequence's offsets, the row descriptors. A sequence whose
/// sets would pass its keep-list's capacity selects nothing (rows of length 0) and raises
/// flag_capacity_exceeded, as select's gate does. Grid (sequences), 1024 threads.
template <int Unused = 0>
__global__ void __launch_bounds__(1024)
    adakv_prepare_batch_kernel(const adakv_job* jobs, std::int64_t heads, select_row* rows, std::uint32_t* flags) {
  KVEVICT_SHARED_ARRAY(unsigned long long, warp_sums, 32);
  const adakv_job job = jobs[blockIdx.x];
  const int tid = static_cast<int>(threadIdx.x);
  const int on_top = static_cast<int>(protected_mode::on_top_of_budget);
  // The total first (the same scan as below), so that no row is described before it is known.
  unsigned long long all = 0;
  for (std::int64_t base = 0; base < heads; base += blockDim.x) {
    const std::int64_t r = base + tid;
    const std::int64_t kept = r < heads ? select_tokens_kept(job.budgets[r], job.tokens, job.tail, on_top) : 0;
    unsigned long long total = 0;
    (void)block_exclusive_scan(static_cast<unsigned long long>(kept), &total, warp_sums);
    all += total;
  }
  const bool over = all > static_cast<unsigned long long>(job.out.capacity);
  unsigned long long running = 0;
  for (std::int64_t base = 0; base < heads; base += blockDim.x) {
    const std::int64_t r = base + tid;
    const std::int64_t b = r < heads ? job.budgets[r] : 0;
    const std::int64_t kept = r < heads ? select_tokens_kept(b, job.tokens, job.tail, on_top) : 0;
    unsigned long long total = 0;
    const unsigned long long excl = block_exclusive_scan(static_cast<unsigned long long>(kept), &total, warp_sums);
    if (r < heads) {
      const auto off = static_cast<std::int64_t>(running + excl);
      job.out.offsets[r] = off;
      select_row d;
      d.scores = job.scores + r * job.row_stride;
      d.length = over ? 0 : job.tokens;
      d.budget = over ? 0 : b;
      d.protected_tail = over ? 0 : job.tail;
      d.mode = protected_mode::on_top_of_budget;
      d.out = job.out.indices + off;
      rows[static_cast<std::int64_t>(blockIdx.x) * heads + r] = d;
    }
    running += total;
  }
  if (tid == 0) {
    job.out.offsets[heads] = static_cast<std::int64_t>(running);
    if (over) raise_flag(flags, flag_capacity_exceeded);
  }
}

}  // namespace detail
}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_DETAIL_ADAKV_BATCH_CUH
