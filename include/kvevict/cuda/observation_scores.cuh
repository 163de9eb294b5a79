// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_OBSERVATION_SCORES_CUH
#define KVEVICT_CUDA_OBSERVATION_SCORES_CUH

// Fused observation scoring on the GPU (design.md §4): the same scores as
// kvevict::observation_scores, never materialising the [Hq, W, L] attention.
//
// Kernels, in stream order:
//   1. stats (skipped when the engine passes its log-sum-exp): grid (key tiles, Hkv). A block
//      holds one tile of 64 keys of KV head h in shared memory, widened to float32, and
//      computes the logits of all R = G*W observation rows of h's group against it, 64 rows
//      at a time in a 64x64 register tile (queries staged 32 channels at a time). So each K
//      tile is read from memory once per KV head for all G*W queries. Per row it writes the
//      tile's softmax partial (max, sum of exp(x - max)).
//   2. row LSE (detail/row_lse.cuh): one warp per row folds that row's tile partials, in a
//      fixed order, into its log-sum-exp.
//   3. accumulate: grid (candidate tiles, Hkv). Recomputes each tile's logits the same way,
//      turns them into probabilities with the row's lse, and aggregates over the window in
//      ascending t, per query head, in shared memory; writes acc[Hq, C].
//   4. finalize (finalize.cuh): window normalisation, GQA reduction, pooling, +inf tail.
// Every reduction has a fixed order (no floating-point atomics): results are deterministic.
// They match the CPU to float32 rounding (the dot products and exp differ in summation order
// and implementation), and the finalisation matches it operation for operation.

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/detail/mma.cuh"
#include "kvevict/cuda/detail/observation_kernels.cuh"
#include "kvevict/cuda/detail/row_lse.cuh"
#include "kvevict/cuda/detail/score_logic.hpp"
#include "kvevict/cuda/detail/tiling.hpp"
#include "kvevict/cuda/detail/workspace_plan.hpp"
#include "kvevict/cuda/finalize.cuh"
#include "kvevict/error.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/index_ptr.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/views/query_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {

/// Optional device inputs of GPU observation scoring (all device pointers).
struct observation_inputs {
  /// [L] absolute position of every key; null means key j is at position j. Any order.
  index_ptr key_positions = nullptr;
  /// [W] weight of each observation, for window_aggregation::weighted. Checked on the device
  /// (flag_invalid_weights): finite, >= 0, sum >= FLT_MIN.
  const float* weights = nullptr;
  /// [Hq, W] natural-log log-sum-exp of each query's scaled logits over every key it sees
  /// (flash attention's LSE; multiply base-2 LSEs by ln 2). softmax_domain::visible only.
  /// Skips the stats and combine kernels (one pass over K instead of two).
  const float* lse = nullptr;
  std::int64_t lse_head_stride = 0;  ///< elements between query heads of `lse`; 0 means W
};

namespace detail {

/// Everything observation_scores and observation_state share: host validation of the
/// inputs, workspace carving, kernel arguments, then the stats/combine/accumulate kernels
/// that leave acc [Hq, C] in the workspace.
template <class Q, class K>
struct obs_plan {
  obs_args<Q, K> args;
  obs_dims dims;
  obs_workspace ws;
};

template <class Q, class K>
status obs_prepare(const query_view<const Q>& queries, const cache_view<const K>& keys, const scoring_params& params,
                   workspace_span ws, const observation_inputs& in, const launch_options& opt, const char* fn,
                   obs_plan<Q, K>* plan) {
  KVEVICT_RETURN_IF_ERROR(validate_device_query_view(queries, opt, fn, "queries"));
  KVEVICT_RETURN_IF_ERROR(validate_device_cache_view(keys, opt, fn, "keys"));
  if (queries.head_dim != keys.head_dim)
    return status::error(errc::invalid_shape, fn, "queries.head_dim", "expected keys.head_dim = %lld, got %lld",
                         static_cast<long long>(keys.head_dim), static_cast<long long>(queries.head_dim));
  if (queries.num_heads % keys.num_heads != 0)
    return status::error(errc::invalid_shape, fn, "queries.num_heads",
                         "expected a multiple of keys.num_heads = %lld (GQA), got %lld",
                         static_cast<long long>(keys.num_heads), static_cast<long long>(queries.num_heads));
  KVEVICT_RETURN_IF_ERROR(kvevict::detail::validate_scoring_params(params, fn));
  KVEVICT_RETURN_IF_ERROR(check_pooling_fits(params.pool, fn));
  if (params.window == window_aggregation::weighted) {
    if (in.weights == nullptr)
      return status::error(errc::null_pointer, fn, "inputs.weights", "window_aggregation::weighted needs %lld weights",
                           static_cast<long long>(queries.num_queries));
    KVEVICT_RETURN_IF_ERROR(check_device_pointer(in.weights, opt, fn, "inputs.weights"));
  }
  KVEVICT_RETURN_IF_ERROR(check_device_pointer(in.key_positions, opt, fn, "inputs.key_positions"));
  const std::int64_t lse_stride = in.lse_head_stride != 0 ? in.lse_head_stride : queries.num_queries;
  if (in.lse != nullptr) {
    if (params.domain != softmax_domain::visible)
      return status::error(errc::unsupported, fn, "inputs.lse",
                           "an engine log-sum-exp covers every visible key; it cannot be used with "
                           "softmax_domain::candidates");
    if (lse_stride < queries.num_queries)
      return status::error(errc::invalid_stride, fn, "inputs.lse_head_stride", "expected >= W = %lld, got %lld",
                           static_cast<long long>(queries.num_queries), static_cast<long long>(lse_stride));
    KVEVICT_RETURN_IF_ERROR(check_device_pointer(in.lse, opt, fn, "inputs.lse"));
  }
  plan->dims = make_obs_dims(keys.num_heads, queries.num_heads, queries.num_queries, keys.num_tokens, params);
  const obs_dims& dims = plan->dims;
  KVEVICT_RETURN_IF_ERROR(check_obs_limits(dims, keys.head_dim, fn));
  kvevict::detail::arena arena(ws);
  carve_obs_workspace(arena, dims, in.lse != nullptr, &plan->ws);
  KVEVICT_RETURN_IF_ERROR(check_workspace(arena, ws, opt, fn, "observation_scores_workspace_size"));

  obs_args<Q, K>& a = plan->args;
  a.q = queries;
  a.k = keys;
  a.key_positions = in.key_positions;
  a.weights = params.window == window_aggregation::weighted ? in.weights : nullptr;
  a.engine_lse = in.lse;
  a.engine_lse_stride = lse_stride;
  a.partials = plan->ws.partials;
  a.row_lse = plan->ws.row_lse;
  a.acc = plan->ws.acc;
  a.flags = opt.device_flags;
  // As the CPU's logit_scale(): 1/sqrt(d), times the keys' dequantisation scale (fp8).
  a.scale = (1.0f / std::sqrt(static_cast<float>(keys.head_dim))) * keys.scale;
  a.group = static_cast<int>(dims.group);
  a.window = static_cast<int>(dims.window);
  a.dim = static_cast<int>(keys.head_dim);
  a.rows = static_cast<int>(dims.rows());
  a.tokens = static_cast<int>(dims.tokens);
  a.candidates = static_cast<int>(dims.candidates);
  a.softmax_end = static_cast<int>(dims.softmax_end());
  a.stat_tiles = static_cast<int>(dims.stat_tiles());
  a.max_window = params.window == window_aggregation::max;
  return status();
}

template <class Q, class K>
status obs_run_passes(const obs_plan<Q, K>& plan, std::int64_t dim, const launch_options& opt, const char* fn) {
  const obs_args<Q, K>& a = plan.args;
  const obs_dims& dims = plan.dims;
  if (dims.candidates == 0) return status();
  const unsigned hkv = static_cast<unsigned>(dims.kv_heads);
  if (a.engine_lse == nullptr && a.softmax_end > 0) {
    const std::size_t smem = obs_shared_bytes(dim, dims.group, dims.window, false, uses_tensor_cores<Q, K>::value);
    KVEVICT_RETURN_IF_ERROR(
        launch(fn, "obs_tile_kernel<stats>",
               {dim3(static_cast<unsigned>(a.stat_tiles), hkv), dim3(obs_threads), smem, opt.stream},
               obs_tile_kernel<Q, K, false>, a));
    KVEVICT_RETURN_IF_ERROR(
        launch_row_lse(a.partials, a.stat_tiles, dims.kv_heads * dims.rows(), plan.ws.row_lse, opt.stream, fn));
  }
  const std::size_t smem = obs_shared_bytes(dim, dims.group, dims.window, true, uses_tensor_cores<Q, K>::value);
  return launch(fn, "obs_tile_kernel<accumulate>",
                {dim3(static_cast<unsigned>(num_tiles(dims.candidates, obs_tile_keys)), hkv), dim3(obs_threads), smem,
                 opt.stream},
                obs_tile_kernel<Q, K, true>, a);
}

}  // namespace detail

namespace detail {

/// The finalisation of observation_scores for a prepared sequence.
template <class Q, class K>
finalize_args scores_finalize_args(const obs_plan<Q, K>& plan, const scoring_params& params,
                                   const observation_inputs& in, const query_view<const Q>& queries, score_view scores,
                                   const launch_options& opt) {
  const obs_dims& dims = plan.dims;
  finalize_args f;
  f.acc = plan.ws.acc;
  f.acc_stride = dims.candidates;
  f.rows_per_head = static_cast<int>(dims.group);
  f.group = static_cast<int>(dims.group);
  f.candidates = static_cast<int>(dims.candidates);
  f.tokens = static_cast<int>(dims.tokens);
  f.params = params;
  f.scale = params.window == window_aggregation::mean ? 1.0f / static_cast<float>(dims.window) : 1.0f;
  f.weights = params.window == window_aggregation::weighted ? in.weights : nullptr;
  f.per_key = params.window == window_aggregation::visible_mean;
  f.query_positions = queries.positions;
  f.key_positions = in.key_positions;
  f.window = static_cast<int>(dims.window);
  f.scores = scores.data;
  f.score_stride = scores.row_stride;
  f.flags = opt.device_flags;
  return f;
}

}  // namespace detail

/// Bytes of device workspace `observation_scores` and `observation_state` need for a layer of
/// this shape (upper bounds on L and W are fine): acc [Hq, C] floats, plus, without an engine
/// LSE, the tile partials [Hq * W, ceil(L / 64)] and the row LSEs [Hq * W].
inline std::size_t observation_scores_workspace_size(const layer_shape& shape, const scoring_params& params,
                                                     bool engine_lse = false) noexcept {
  kvevict::detail::arena a;
  detail::obs_workspace w;
  detail::carve_obs_workspace(
      a, detail::make_obs_dims(shape.num_kv_heads, shape.num_query_heads, shape.num_queries, shape.num_tokens, params),
      engine_lse, &w);
  return a.used();
}

/// Scores every key of one layer by the attention the observation queries pay it, on the GPU.
///
///   queries: [Hq, W, d] post-RoPE (query_view of device memory; positions [W] on the device)
///   keys:    [Hkv, L, d] (cache_view of device memory, any layout; a paged view's block
///            table on the device)
///   params:  as for kvevict::observation_scores
///   scores:  [Hkv, L] float32 device (out): candidates [0, L - P) scored, the tail +inf
///   ws:      device memory, >= observation_scores_workspace_size(shape, params, in.lse != null)
///   in:      optional device inputs (key positions, window weights, engine LSE)
///   opt:     stream, device flag word, pointer checks
///
/// Enqueues up to four kernels on opt.stream and returns; no synchronisation, no allocation.
/// Hq must be a multiple of Hkv. Device-side checks: block ids (bad ones read as NaN keys),
/// negative positions, weights (see device_flags.hpp). On a host-side error nothing is
/// launched.
template <class QT, class KT>
status observation_scores(query_view<QT> queries_in, cache_view<KT> keys_in, const scoring_params& params,
                          score_view scores, workspace_span ws, const observation_inputs& in = {},
                          const launch_options& opt = {}) {
  static constexpr const char* fn = "kvevict::cuda::observation_scores";
  using Q = std::remove_cv_t<QT>;
  using K = std::remove_cv_t<KT>;
  const query_view<const Q> queries = queries_in;
  const cache_view<const K> keys = keys_in;
  detail::obs_plan<Q, K> plan;
  KVEVICT_RETURN_IF_ERROR(detail::obs_prepare(queries, keys, params, ws, in, opt, fn, &plan));
  KVEVICT_RETURN_IF_ERROR(kvevict::detail::validate_matrix_view(scores, keys.num_heads, keys.num_tokens, fn, "scores"));
  KVEVICT_RETURN_IF_ERROR(detail::check_device_pointer(scores.data, opt, fn, "scores.data"));
  const detail::obs_dims& dims = plan.dims;
  if (dims.tokens == 0) return status();
  KVEVICT_RETURN_IF_ERROR(detail::obs_run_passes(plan, keys.head_dim, opt, fn));

  const detail::finalize_args f = detail::scores_finalize_args(plan, params, in, queries, scores, opt);
  return detail::launch_finalize(f, keys.num_heads, opt.stream, fn);
}

namespace detail {

/// A validated observation_state call: what enqueue_observation_state launches.
template <class Q, class K>
struct state_observation {
  obs_plan<Q, K> plan;
  score_view state;
  float eta = 1.0f;
  gqa_reduction gqa = gqa_reduction::mean;
  std::int64_t dim = 0;
};

/// observation_state's host half: every check and the kernel arguments; nothing enqueued.
template <class Q, class K>
status prepare_observation_state(const query_view<const Q>& queries, const cache_view<const K>& keys,
                                 const scoring_params& params, float eta, score_view state, workspace_span ws,
                                 const observation_inputs& in, const launch_options& opt, const char* fn,
                                 state_observation<Q, K>* out) {
  if (params.window == window_aggregation::mean || params.window == window_aggregation::visible_mean)
    return status::error(errc::invalid_argument, fn, "params.window",
                         "the state is un-normalised: expected sum, weighted or max (normalise at finalisation)");
  if (!(eta >= 0.0f && eta <= 1.0f))
    return status::error(errc::invalid_argument, fn, "eta", "expected eta in [0, 1], got %g", static_cast<double>(eta));
  KVEVICT_RETURN_IF_ERROR(obs_prepare(queries, keys, params, ws, in, opt, fn, &out->plan));
  const obs_dims& dims = out->plan.dims;
  KVEVICT_RETURN_IF_ERROR(kvevict::detail::validate_matrix_view(state, keys.num_heads, dims.candidates, fn, "state"));
  KVEVICT_RETURN_IF_ERROR(check_device_pointer(state.data, opt, fn, "state.data"));
  out->state = state;
  out->eta = eta;
  out->gqa = params.gqa;
  out->dim = keys.head_dim;
  return status();
}

/// observation_state's device half: the scoring passes, then the fold into the state.
template <class Q, class K>
status enqueue_observation_state(const state_observation<Q, K>& o, const launch_options& opt, const char* fn) {
  const obs_dims& dims = o.plan.dims;
  if (dims.candidates == 0) return status();
  KVEVICT_RETURN_IF_ERROR(obs_run_passes(o.plan, o.dim, opt, fn));
  const std::int64_t n = dims.kv_heads * dims.candidates;
  return launch(fn, "obs_state_kernel",
                {dim3(static_cast<unsigned>(stride_grid(n, 256, 4096))), dim3(256), 0, opt.stream}, obs_state_kernel<>,
                o.plan.ws.acc, dims.candidates, static_cast<int>(dims.group), o.gqa, o.state.data, o.state.row_stride,
                o.eta, dims.kv_heads);
}

}  // namespace detail

/// The window's attention folded into a running, un-normalised state per KV head, for
/// DeferKV's prefill observation on the GPU (then decode_observation for the decode steps and
/// finalize_state_scores with scale 1/Z):
///
///   state[h, j] <- eta * state[h, j] + reduce_g sum_t w_t * A[g, t, j]      j < C = L - P
///
/// with w_t = in.weights[t] (window_aggregation::weighted, used as given, not normalised:
/// the caller keeps Z = sum of weights) or 1 (window_aggregation::sum); reduce_g is the sum
/// (gqa_reduction::mean or ::sum; mean's 1/G is applied at finalisation) or the max.
/// window_aggregation::max folds max_t A instead of the sum. eta == 0 overwrites the state.
///
///   state: [Hkv, C] float32 device, in/out. Other arguments as for observation_scores;
///          params.pool and params.order are not used (finalisation applies them).
template <class QT, class KT>
status observation_state(query_view<QT> queries_in, cache_view<KT> keys_in, const scoring_params& params, float eta,
                         score_view state, workspace_span ws, const observation_inputs& in = {},
                         const launch_options& opt = {}) {
  static constexpr const char* fn = "kvevict::cuda::observation_state";
  using Q = std::remove_cv_t<QT>;
  using K = std::remove_cv_t<KT>;
  detail::state_observation<Q, K> o;
  KVEVICT_RETURN_IF_ERROR(detail::prepare_observation_state(
      query_view<const Q>(queries_in), cache_view<const K>(keys_in), params, eta, state, ws, in, opt, fn, &o));
  return detail::enqueue_observation_state(o, opt, fn);
}

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_OBSERVATION_SCORES_CUH
