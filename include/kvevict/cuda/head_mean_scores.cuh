// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_HEAD_MEAN_SCORES_CUH
#define KVEVICT_CUDA_HEAD_MEAN_SCORES_CUH

// TOVA's last step on the GPU: a layer's scores [Hkv, L] (each KV head's mean over its query
// group, from the observation scoring) averaged across the KV heads in place, as kvevict::tova
// does on the CPU, bit for bit: one thread per candidate adds the heads' scores in double in
// ascending head order, divides once by Hkv, rounds to float and writes the mean to every head.
// The protected tail keeps its scores (+inf).

#include <cuda_runtime.h>

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/cuda/chunk_scores.cuh"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/detail/launch.cuh"
#include "kvevict/cuda/detail/tiling.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/views/matrix_view.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

constexpr int head_mean_block = 256;

template <int Unused = 0>
__global__ void __launch_bounds__(head_mean_block)
    head_mean_kernel(float* scores, std::int64_t score_stride, int heads, int candidates) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * head_mean_block + threadIdx.x;
  if (j >= candidates) return;
  double sum = 0.0;
  for (int h = 0; h < heads; ++h) sum += static_cast<double>(scores[h * score_stride + j]);
  const float mean = static_cast<float>(sum / static_cast<double>(heads));
  for (int h = 0; h < heads; ++h) scores[h * score_stride + j] = mean;
}

}  // namespace detail

/// Every head's candidate scores replaced by their mean across heads (kvevict::tova::score's
/// last loop, bit for bit).
///
///   scores:         [Hkv, L] float32, device, in and out
///   protected_tail: its entries [L - tail, L) are left as they are
inline status head_mean_scores(score_view scores, std::int64_t protected_tail,
                               const launch_options& opt = {}) noexcept {
  static constexpr const char* fn = "kvevict::cuda::head_mean_scores";
  std::int64_t candidates = 0;
  KVEVICT_RETURN_IF_ERROR(
      detail::check_score_rows(scores, protected_tail, detail::head_mean_block, opt, fn, &candidates));
  if (candidates == 0) return status();
  return detail::launch(fn, "head_mean_kernel",
                        {dim3(static_cast<unsigned>(detail::num_tiles(candidates, detail::head_mean_block))),
                         dim3(static_cast<unsigned>(detail::head_mean_block)), 0, opt.stream},
                        detail::head_mean_kernel<>, scores.data, scores.row_stride, static_cast<int>(scores.rows),
                        static_cast<int>(candidates));
}

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_HEAD_MEAN_SCORES_CUH
