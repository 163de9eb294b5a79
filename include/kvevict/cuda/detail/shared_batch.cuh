// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DETAIL_SHARED_BATCH_CUH
#define KVEVICT_CUDA_DETAIL_SHARED_BATCH_CUH

// Keep sets shared by a layer's heads for every sequence of a cuda::compressor call in one
// launch per kernel: the per-layer scope (combine the heads' scores, select one set, give it to
// every head) and the per-sequence scope (combine, fold into the sequence's row; at the last
// layer select from the row). The arithmetic is scope.cuh's, per sequence (its descriptor says
// where its scores, rows and keep-list are), so the rows and keep sets are the ones
// combine_head_scores, fold_layer_scores and select_shared give one sequence at a time; the
// selection is the batched radix select (select_rows, or the wide one for long rows), one row
// per sequence, the budgets the host's.

#include <cuda_runtime.h>

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/scope.cuh"
#include "kvevict/detail/exact_sum.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// One sequence's part of a shared-scope batch (device copy of a host array).
struct shared_job {
  const float* scores = nullptr;  ///< [Hkv, L], rows row_stride apart
  std::int64_t tokens = 0;        ///< L
  std::int64_t row_stride = 0;
  std::int64_t candidates = 0;  ///< L - protected tail (the tail is copied, +inf)
  float* combined = nullptr;    ///< [L] the layer's combined row
  /// The per-sequence scope: the sequence's row the layer folds into (null: per-layer scope),
  /// whether this is layer 0 (it overwrites the row), and the divisor of the last layer's mean
  /// (> 1 divides).
  float* folded = nullptr;
  std::int64_t first = 0;
  std::int64_t mean_of = 0;
  std::int64_t* indices = nullptr;  ///< the keep-list's indices: head 0's `kept`, then a copy per head
  std::int64_t kept = 0;            ///< tokens each head keeps (0: this call selects nothing for it)
};

/// magnitude_bins_kernel for every sequence: grid (chunks of the longest, Hkv, sequences).
template <int Unused = 0>
__global__ void __launch_bounds__(scope_threads)
    magnitude_bins_batch_kernel(const shared_job* jobs, unsigned long long* bins) {
  KVEVICT_SHARED_ARRAY(unsigned long long, local, kvevict::detail::magnitude_bins);
  const shared_job job = jobs[blockIdx.z];
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * scope_chunk;
  if (j0 >= job.candidates) return;  // (the whole block: no barrier inside is skipped by part of it)
  const std::int64_t j1 = j0 + scope_chunk < job.candidates ? j0 + scope_chunk : job.candidates;
  add_magnitude_bins(
      job.scores + static_cast<std::int64_t>(blockIdx.y) * job.row_stride, j0, j1, local,
      bins + (static_cast<std::int64_t>(blockIdx.z) * gridDim.y + blockIdx.y) * kvevict::detail::magnitude_bins);
}

/// combine_rows_kernel, then (per-sequence scope) fold_layer_kernel's step on the same value,
/// for every sequence: grid (token blocks of the longest, sequences). scales: [sequences, Hkv]
/// (normalised rules) or null.
template <int Unused = 0>
__global__ void __launch_bounds__(scope_threads)
    combine_fold_batch_kernel(const shared_job* jobs, std::int64_t heads, bool by_max, const float* scales) {
  const shared_job job = jobs[blockIdx.y];
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * scope_threads + threadIdx.x;
  if (j >= job.tokens) return;
  const float* own = scales != nullptr ? scales + static_cast<std::int64_t>(blockIdx.y) * heads : nullptr;
  float acc = 0.0f;
  for (std::int64_t r = 0; r < heads; ++r) {
    const float x = job.scores[r * job.row_stride + j];
    const float v = j < job.candidates ? __fmul_rn(x, own != nullptr ? own[r] : 1.0f) : x;
    acc = fold_step(acc, v, r == 0, by_max);
  }
  if (!by_max && heads > 1 && j < job.candidates) acc = __fmul_rn(acc, __frcp_rn(static_cast<float>(heads)));
  job.combined[j] = acc;
  if (job.folded == nullptr) return;
  float folded = fold_step(job.first != 0 ? 0.0f : job.folded[j], acc, job.first != 0, by_max);
  if (job.mean_of > 1 && j < job.candidates) folded = __fmul_rn(folded, __frcp_rn(static_cast<float>(job.mean_of)));
  job.folded[j] = folded;
}

/// Head 0's kept indices to every other head, for every sequence that selected: grid (chunks,
/// Hkv - 1, sequences). (The offsets h * kept are the host's.)
template <int Unused = 0>
__global__ void __launch_bounds__(scope_threads) broadcast_keep_batch_kernel(const shared_job* jobs) {
  const shared_job job = jobs[blockIdx.z];
  const std::int64_t h = static_cast<std::int64_t>(blockIdx.y) + 1;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * scope_threads + threadIdx.x; i < job.kept;
       i += static_cast<std::int64_t>(gridDim.x) * scope_threads)
    job.indices[h * job.kept + i] = job.indices[i];
}

}  // namespace detail
}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_DETAIL_SHARED_BATCH_CUH
