// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_CHUNK_SCORES_CUH
#define KVEVICT_CUDA_CHUNK_SCORES_CUH

// ChunkKV on the GPU: a policy's scores [Hkv, L] turned, in place, into chunk scores shared by
// every head, as kvevict::chunkkv does after its base policy on the CPU, bit for bit. One
// thread per chunk adds the chunk's scores in the CPU's order (heads ascending, then tokens)
// in float, divides once by the chunk's length and writes the result to every head's entries
// of the chunk; the protected tail keeps its scores (+inf). The selection after it is any
// per-head or shared one: equal scores within a chunk take its earliest tokens first.

#include <cuda_runtime.h>

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/detail/launch.cuh"
#include "kvevict/cuda/detail/tiling.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/views/matrix_view.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

constexpr int chunk_scores_block = 128;

/// The checks of an in-place pass over a layer's scores [Hkv, L] whose protected tail it leaves
/// as it is (chunk_scores, head_mean_scores): a tail >= 0, Hkv >= 1, a valid view within the
/// kernels' 32-bit limits (grids of `block` threads), device memory; *candidates = L - tail.
inline status check_score_rows(const score_view& scores, std::int64_t protected_tail, int block,
                               const launch_options& opt, const char* fn, std::int64_t* candidates) noexcept {
  if (protected_tail < 0)
    return status::error(errc::invalid_argument, fn, "protected_tail", "expected >= 0, got %lld",
                         static_cast<long long>(protected_tail));
  if (scores.rows < 1)
    return status::error(errc::invalid_shape, fn, "scores.rows", "expected >= 1 KV head, got %lld",
                         static_cast<long long>(scores.rows));
  KVEVICT_RETURN_IF_ERROR(kvevict::detail::validate_matrix_view(scores, scores.rows, scores.cols, fn, "scores"));
  if (!fits_int32(scores.cols, block) || scores.rows > int32_limit)
    return status::error(errc::overflow, fn, "scores", "expected L < 2^31 and Hkv < 2^31, got [%lld, %lld]",
                         static_cast<long long>(scores.rows), static_cast<long long>(scores.cols));
  *candidates = scores.cols > protected_tail ? scores.cols - protected_tail : 0;
  return *candidates == 0 ? status() : check_device_pointer(scores.data, opt, fn, "scores.data");
}

struct chunk_args {
  float* scores = nullptr;
  std::int64_t score_stride = 0;
  int heads = 0;
  int candidates = 0;
  int chunk_length = 1;
};

template <int Unused = 0>
__global__ void __launch_bounds__(chunk_scores_block) chunk_scores_kernel(chunk_args a) {
  const std::int64_t chunk = static_cast<std::int64_t>(blockIdx.x) * chunk_scores_block + threadIdx.x;
  const std::int64_t c0 = chunk * a.chunk_length;
  if (c0 >= a.candidates) return;
  const std::int64_t c1 = c0 + a.chunk_length < a.candidates ? c0 + a.chunk_length : a.candidates;
  float sum = 0.0f;
  for (int h = 0; h < a.heads; ++h)
    for (std::int64_t j = c0; j < c1; ++j) sum += a.scores[h * a.score_stride + j];
  const float mean = sum / static_cast<float>(c1 - c0);
  for (int h = 0; h < a.heads; ++h)
    for (std::int64_t j = c0; j < c1; ++j) a.scores[h * a.score_stride + j] = mean;
}

}  // namespace detail

/// ChunkKV's chunk scores in place (kvevict::chunkkv::score after its base, bit for bit):
/// for each chunk [c0, c1) of `chunk_length` candidates (the last may be shorter), every
/// head's entries become (sum over heads h, tokens j of scores[h, j]) / (c1 - c0).
///
///   scores:         [Hkv, L] float32, device, in and out
///   protected_tail: the base policy's; its entries [L - tail, L) are left as they are
///   chunk_length:   >= 1
inline status chunk_scores(score_view scores, std::int64_t protected_tail, std::int64_t chunk_length,
                           const launch_options& opt = {}) noexcept {
  static constexpr const char* fn = "kvevict::cuda::chunk_scores";
  if (chunk_length < 1)
    return status::error(errc::invalid_argument, fn, "chunk_length", "expected >= 1, got %lld",
                         static_cast<long long>(chunk_length));
  std::int64_t candidates = 0;
  KVEVICT_RETURN_IF_ERROR(
      detail::check_score_rows(scores, protected_tail, detail::chunk_scores_block, opt, fn, &candidates));
  if (candidates == 0) return status();
  detail::chunk_args a;
  a.scores = scores.data;
  a.score_stride = scores.row_stride;
  a.heads = static_cast<int>(scores.rows);
  a.candidates = static_cast<int>(candidates);
  a.chunk_length = chunk_length < candidates ? static_cast<int>(chunk_length) : static_cast<int>(candidates);
  const std::int64_t chunks = detail::num_tiles(candidates, a.chunk_length);
  return detail::launch(fn, "chunk_scores_kernel",
                        {dim3(static_cast<unsigned>(detail::num_tiles(chunks, detail::chunk_scores_block))),
                         dim3(static_cast<unsigned>(detail::chunk_scores_block)), 0, opt.stream},
                        detail::chunk_scores_kernel<>, a);
}

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_CHUNK_SCORES_CUH
