// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_OBSERVATION_SCORES_BATCH_CUH
#define KVEVICT_CUDA_OBSERVATION_SCORES_BATCH_CUH

// Observation scoring of every sequence of a batch for one layer in one launch per kernel
// (ragged L and W, any mix of layouts and of engine LSEs): the kernels of observation_scores
// with the sequence as blockIdx.z, reading their arguments from a descriptor array in the
// workspace. One host-to-device copy of the descriptors (from the caller's staging buffer,
// pinned for an asynchronous copy) and up to four kernels per call, whatever the batch size,
// instead of four per sequence. Per sequence the results equal observation_scores' bit for
// bit: the same kernels compute the same tiles in the same order.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/detail/launch.cuh"
#include "kvevict/cuda/detail/row_lse.cuh"
#include "kvevict/cuda/detail/tiling.hpp"
#include "kvevict/cuda/finalize.cuh"
#include "kvevict/cuda/observation_scores.cuh"
#include "kvevict/detail/in_sequence.hpp"
#include "kvevict/error.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/views/query_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {

/// One sequence of a batched scoring call: views of device memory, as observation_scores
/// takes them. Every sequence of a batch has the layer's Hq, Hkv and d.
template <class Q, class K>
struct scoring_sequence {
  query_view<const Q> queries;  ///< [Hq, W_s, d]
  cache_view<const K> keys;     ///< [Hkv, L_s, d]
  score_view scores;            ///< [Hkv, L_s] out
  observation_inputs inputs;    ///< optional key positions, window weights, engine LSE
};

namespace detail {

constexpr std::size_t batch_align = 256;

inline std::size_t align_up(std::size_t n, std::size_t a) noexcept {
  return (n + a - 1) / a * a;
}

/// Bytes of the descriptor block: [n] obs_args, then [n] finalize_args.
template <class Q, class K>
std::size_t batch_descriptor_bytes(std::int64_t n) noexcept {
  const auto count = static_cast<std::size_t>(n < 0 ? 0 : n);
  return align_up(count * sizeof(obs_args<Q, K>), alignof(finalize_args)) + count * sizeof(finalize_args);
}

}  // namespace detail

/// Host staging bytes `observation_scores_batch` needs for n sequences (the descriptors it
/// copies to the device).
template <class Q, class K>
std::size_t observation_scores_batch_staging_size(std::int64_t num_sequences) noexcept {
  return detail::batch_descriptor_bytes<Q, K>(num_sequences);
}

/// Device workspace for up to `max_sequences` sequences, none larger than `max_shape`
/// (upper bounds on L and W are fine), with or without engine LSEs.
template <class Q, class K>
std::size_t observation_scores_batch_workspace_size(std::int64_t max_sequences, const layer_shape& max_shape,
                                                    const scoring_params& params, bool engine_lse = false) noexcept {
  const std::size_t one =
      detail::align_up(observation_scores_workspace_size(max_shape, params, engine_lse), detail::batch_align);
  const auto n = static_cast<std::size_t>(max_sequences < 0 ? 0 : max_sequences);
  // batch_align - 1: room to align an unaligned ws.data.
  return detail::batch_align - 1 +
         detail::align_up(detail::batch_descriptor_bytes<Q, K>(max_sequences), detail::batch_align) + n * one;
}

/// Scores every sequence of a batch for one layer, as observation_scores does for one.
///
///   seqs:    [n] host array of scoring_sequence (device views; same Hq, Hkv, d throughout)
///   params:  one scoring_params for the batch
///   ws:      device memory, >= observation_scores_batch_workspace_size(n, largest shape,
///            params, any engine LSE)
///   staging: host memory, >= observation_scores_batch_staging_size(n) bytes; page-locked
///            (cudaMallocHost) for the copy to be asynchronous. The call writes the
///            descriptors there and enqueues their copy to ws: the caller keeps the buffer
///            alive and unchanged until the stream has passed this call (e.g. until its next
///            synchronisation).
///
/// Every sequence is validated on the host before anything is enqueued (errors name
/// "seqs[i]...."); then one copy and up to four kernels, each covering the whole batch.
template <class Q, class K>
status observation_scores_batch(const scoring_sequence<Q, K>* seqs, std::int64_t n, const scoring_params& params,
                                workspace_span ws, void* staging, std::size_t staging_bytes,
                                const launch_options& opt = {}) {
  static constexpr const char* fn = "kvevict::cuda::observation_scores_batch";
  KVEVICT_RETURN_IF_ERROR(detail::check_batch_count(seqs, n, fn));
  if (n == 0) return status();
  const std::size_t desc_bytes = detail::batch_descriptor_bytes<Q, K>(n);
  KVEVICT_RETURN_IF_ERROR(detail::check_staging(staging, staging_bytes, desc_bytes, alignof(detail::obs_args<Q, K>), fn,
                                                "observation_scores_batch_staging_size"));
  const detail::aligned_workspace aws = detail::align_workspace(ws, detail::batch_align);
  if (aws.base == nullptr || aws.size < detail::align_up(desc_bytes, detail::batch_align))
    return status::error(errc::workspace_too_small, fn, "ws",
                         "expected at least %zu bytes (observation_scores_batch_workspace_size), got %zu",
                         detail::batch_align - 1 + detail::align_up(desc_bytes, detail::batch_align),
                         ws.data == nullptr ? std::size_t{0} : ws.size);
  KVEVICT_RETURN_IF_ERROR(detail::check_device_pointer(ws.data, opt, fn, "ws"));

  static_assert(std::is_trivially_copyable<detail::obs_args<Q, K>>::value &&
                    std::is_trivially_copyable<detail::finalize_args>::value,
                "descriptors are copied to the device as bytes");
  const std::size_t fin_offset =
      detail::align_up(static_cast<std::size_t>(n) * sizeof(detail::obs_args<Q, K>), alignof(detail::finalize_args));
  auto* host_obs = static_cast<detail::obs_args<Q, K>*>(staging);
  auto* host_fin = reinterpret_cast<detail::finalize_args*>(static_cast<unsigned char*>(staging) + fin_offset);

  // First pass: one layer's heads and head_dim throughout, and the workspace the batch needs.
  const std::int64_t hkv = seqs[0].keys.num_heads, hq = seqs[0].queries.num_heads, dim = seqs[0].keys.head_dim;
  const std::size_t head = detail::align_up(desc_bytes, detail::batch_align);
  std::size_t need = head;
  for (std::int64_t s = 0; s < n; ++s) {
    const scoring_sequence<Q, K>& q = seqs[s];
    const detail::batch_field layer[] = {{"keys.num_heads", q.keys.num_heads, hkv},
                                         {"queries.num_heads", q.queries.num_heads, hq},
                                         {"keys.head_dim", q.keys.head_dim, dim}};
    KVEVICT_RETURN_IF_ERROR(detail::check_batch_fields(s, layer, fn));
    const layer_shape shape{hq, hkv, dim, q.keys.num_tokens, q.queries.num_queries};
    need += detail::align_up(observation_scores_workspace_size(shape, params, q.inputs.lse != nullptr),
                             detail::batch_align);
  }
  if (aws.size < need)
    return status::error(
        errc::workspace_too_small, fn, "ws",
        "expected at least %zu bytes for this batch (observation_scores_batch_workspace_size), got %zu",
        need + (ws.size - aws.size), ws.size);

  // Second pass: each sequence validated and prepared as observation_scores does, into its
  // slice of the workspace; the launch shapes cover the largest.
  unsigned char* base = aws.base;
  std::size_t offset = head;
  std::int64_t stat_tiles = 0, acc_tiles = 0, fin_tiles = 0, max_window = 1, max_rows = 0;
  for (std::int64_t s = 0; s < n; ++s) {
    const scoring_sequence<Q, K>& q = seqs[s];
    const layer_shape shape{hq, hkv, dim, q.keys.num_tokens, q.queries.num_queries};
    const std::size_t bytes = observation_scores_workspace_size(shape, params, q.inputs.lse != nullptr);
    detail::obs_plan<Q, K> plan;
    KVEVICT_RETURN_IF_ERROR(kvevict::detail::in_sequence(
        detail::obs_prepare(q.queries, q.keys, params, {base + offset, bytes}, q.inputs, opt, fn, &plan), s, fn));
    KVEVICT_RETURN_IF_ERROR(kvevict::detail::in_sequence(
        kvevict::detail::validate_matrix_view(q.scores, hkv, q.keys.num_tokens, fn, "scores"), s, fn));
    KVEVICT_RETURN_IF_ERROR(
        kvevict::detail::in_sequence(detail::check_device_pointer(q.scores.data, opt, fn, "scores.data"), s, fn));
    host_obs[s] = plan.args;
    host_fin[s] = detail::scores_finalize_args(plan, params, q.inputs, q.queries, q.scores, opt);
    offset += detail::align_up(bytes, detail::batch_align);
    const detail::obs_dims& d = plan.dims;
    if (d.candidates > 0) {
      if (q.inputs.lse == nullptr && d.softmax_end() > 0) {
        stat_tiles = d.stat_tiles() > stat_tiles ? d.stat_tiles() : stat_tiles;
        max_rows = hkv * d.rows() > max_rows ? hkv * d.rows() : max_rows;
      }
      const std::int64_t t = detail::num_tiles(d.candidates, detail::obs_tile_keys);
      acc_tiles = t > acc_tiles ? t : acc_tiles;
    }
    const std::int64_t f = detail::num_tiles(d.tokens, detail::finalize_tile_keys);
    fin_tiles = f > fin_tiles ? f : fin_tiles;
    max_window = d.window > max_window ? d.window : max_window;
  }

  const auto* dev_obs = reinterpret_cast<const detail::obs_args<Q, K>*>(base);
  const auto* dev_fin = reinterpret_cast<const detail::finalize_args*>(base + fin_offset);
  KVEVICT_RETURN_IF_ERROR(detail::cuda_status(
      cudaMemcpyAsync(base, staging, desc_bytes, cudaMemcpyHostToDevice, opt.stream), fn, "cudaMemcpyAsync"));
  const auto seqs_z = static_cast<unsigned>(n), heads_y = static_cast<unsigned>(hkv);
  const std::int64_t group = hq / hkv;
  constexpr bool tc = detail::uses_tensor_cores<Q, K>::value;
  if (stat_tiles > 0) {
    KVEVICT_RETURN_IF_ERROR(
        detail::launch(fn, "obs_tile_batch_kernel<stats>",
                       {dim3(static_cast<unsigned>(stat_tiles), heads_y, seqs_z), dim3(detail::obs_threads),
                        detail::obs_shared_bytes(dim, group, max_window, false, tc), opt.stream},
                       detail::obs_tile_batch_kernel<Q, K, false>, dev_obs));
    KVEVICT_RETURN_IF_ERROR(detail::launch(
        fn, "obs_row_lse_batch_kernel",
        {dim3(static_cast<unsigned>(detail::ceil_div(max_rows, detail::row_lse_rows_per_block)), 1, seqs_z),
         dim3(detail::row_lse_threads), 0, opt.stream},
        detail::obs_row_lse_batch_kernel<Q, K>, dev_obs, hkv));
  }
  if (acc_tiles > 0)
    KVEVICT_RETURN_IF_ERROR(
        detail::launch(fn, "obs_tile_batch_kernel<accumulate>",
                       {dim3(static_cast<unsigned>(acc_tiles), heads_y, seqs_z), dim3(detail::obs_threads),
                        detail::obs_shared_bytes(dim, group, max_window, true, tc), opt.stream},
                       detail::obs_tile_batch_kernel<Q, K, true>, dev_obs));
  if (fin_tiles == 0) return status();
  return detail::launch(
      fn, "finalize_batch_kernel",
      {dim3(static_cast<unsigned>(fin_tiles), heads_y, seqs_z), dim3(static_cast<unsigned>(detail::finalize_tile_keys)),
       detail::finalize_shared_bytes(detail::pool_radius(params.pool)), opt.stream},
      detail::finalize_batch_kernel<>, dev_fin);
}

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_OBSERVATION_SCORES_BATCH_CUH
