// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DETAIL_ROW_LSE_CUH
#define KVEVICT_CUDA_DETAIL_ROW_LSE_CUH

// The middle pass of a two-pass softmax: each row's per-tile partials (max, sum of
// exp(x - max)), written by a logits kernel, folded once into the row's log-sum-exp, which
// the next kernel reads. Shared by fused observation scoring (a row per observation) and the
// decode step (a row per query head). Folding once per row keeps the cost O(rows * tiles);
// folding in every block that needs the LSE would be O(rows * tiles^2).

#include <cuda_runtime.h>

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/detail/launch.cuh"
#include "kvevict/cuda/detail/score_logic.hpp"
#include "kvevict/cuda/detail/tiling.hpp"
#include "kvevict/error.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

constexpr int row_lse_threads = 256;
constexpr int row_lse_rows_per_block = row_lse_threads / 32;

/// One warp folds row `row` of partials [rows, tiles] into row_lse[row]: lanes stride over
/// the row's tiles, then a butterfly; combine is commutative, so every lane ends with the
/// same bits and the result is deterministic. All 32 lanes must call it.
__device__ __forceinline__ void fold_row_lse(const softmax_partial* partials, int tiles, std::int64_t row,
                                             float* row_lse) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  softmax_partial p;
  for (int i = lane; i < tiles; i += 32) p = combine(p, partials[row * tiles + i]);
  for (int o = 16; o > 0; o /= 2) {
    softmax_partial other;
    other.max = __shfl_xor_sync(full_warp, p.max, o);
    other.sum = __shfl_xor_sync(full_warp, p.sum, o);
    p = combine(p, other);
  }
  if (lane == 0) row_lse[row] = partial_lse(p);
}

/// One warp per row.
template <int Unused = 0>
__global__ void __launch_bounds__(row_lse_threads)
    row_lse_kernel(const softmax_partial* partials, int tiles, std::int64_t rows, float* row_lse) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * row_lse_rows_per_block + (threadIdx.x >> 5);
  if (row >= rows) return;  // whole warps leave together
  fold_row_lse(partials, tiles, row, row_lse);
}

/// row_lse[r] <- LSE of partials[r * tiles .. (r + 1) * tiles) for r < rows (rows < 2^31,
/// checked by the callers).
inline status launch_row_lse(const softmax_partial* partials, int tiles, std::int64_t rows, float* row_lse,
                             cudaStream_t stream, const char* fn) noexcept {
  return launch(fn, "row_lse_kernel",
                {dim3(static_cast<unsigned>(ceil_div(rows, row_lse_rows_per_block))), dim3(row_lse_threads), 0, stream},
                row_lse_kernel<>, partials, tiles, rows, row_lse);
}

}  // namespace detail
}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_DETAIL_ROW_LSE_CUH
