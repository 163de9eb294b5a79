// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_SCORING_OBSERVATION_SCORES_HPP
#define KVEVICT_SCORING_OBSERVATION_SCORES_HPP

// Observation scoring: importance scores [Hkv, L] of a layer's keys from the queries that
// observe them (design.md §4). This is the engine under SnapKV, H2O (from queries),
// DeferKV and DapQ. The library computes the logits itself; engines that ran flash
// attention may pass its log-sum-exp to skip the first of the two softmax sweeps.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvevict/config.hpp"
#include "kvevict/detail/abi_std.hpp"
#include "kvevict/detail/finalize.hpp"
#include "kvevict/detail/observe.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/index_ptr.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/views/query_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

/// Optional inputs of observation scoring.
struct observation_inputs {
  /// [L] absolute position of every key; null means key j is at position j. Query t sees key
  /// j iff key_positions[j] <= queries.positions[t]. Any order is accepted (llama.cpp cells);
  /// non-decreasing positions take the fast path.
  index_ptr key_positions = nullptr;
  /// [W] weight of each observation, for window_aggregation::weighted (finite, >= 0, with a
  /// sum >= FLT_MIN, about 1.2e-38: smaller sums are rejected, as 1 / sum is not a float).
  const float* weights = nullptr;
  /// [Hq, W] natural-log log-sum-exp of each query's scaled logits q.k/sqrt(d) over every key it
  /// sees, as flash attention returns it (base-2 LSEs must be multiplied by ln 2). Only with
  /// softmax_domain::visible. Skips the first softmax sweep.
  const float* lse = nullptr;
  std::int64_t lse_head_stride = 0;  ///< elements between query heads of `lse`; 0 means W
};

namespace detail {

inline status validate_window_weights(const float* weights, std::int64_t count, const char* fn,
                                      const char* arg) noexcept {
  if (weights == nullptr)
    return status::error(errc::null_pointer, fn, arg, "window_aggregation::weighted needs %lld weights",
                         static_cast<long long>(count));
  double sum = 0.0;
  for (std::int64_t t = 0; t < count; ++t) {
    if (!(weights[t] >= 0.0f) || std::isinf(weights[t]))
      return status::error(errc::invalid_argument, fn, arg, "expected finite weights >= 0, got %g at %lld",
                           static_cast<double>(weights[t]), static_cast<long long>(t));
    sum += static_cast<double>(weights[t]);
  }
  // The window normaliser is the float 1 / sum: a sum below FLT_MIN (denormal weights) would
  // make it +inf, and unseen keys NaN. The weighted mean does not depend on the weights' scale.
  if (!(sum >= static_cast<double>(std::numeric_limits<float>::min())))
    return status::error(errc::invalid_argument, fn, arg,
                         "expected weights with a sum >= %g (FLT_MIN; the weighted mean does not depend on their "
                         "scale: scale them up), got %g",
                         static_cast<double>(std::numeric_limits<float>::min()), sum);
  return status();
}

inline bool is_non_decreasing(index_ptr v, std::int64_t n) noexcept {
  for (std::int64_t i = 1; i < n; ++i)
    if (v[i] < v[i - 1]) return false;
  return true;
}

/// Per-call shared scratch plus one set per worker, carved in a fixed order.
struct observation_layout {
  float* counts = nullptr;             ///< [C] observations seeing each key (visible_mean)
  std::int64_t* sorted_pos = nullptr;  ///< [W]
  observation_scratch* workers = nullptr;
  float** tmp = nullptr;  ///< per worker [C]
};

inline void carve_observation_layout(arena& a, const observation_problem& p, bool counts, int workers,
                                     observation_layout* out) noexcept {
  out->counts = counts ? a.take<float>(p.candidates) : nullptr;
  out->sorted_pos = counts ? a.take<std::int64_t>(p.window) : nullptr;
  out->workers = a.take<observation_scratch>(workers);
  out->tmp = a.take<float*>(workers);
  for (int w = 0; w < workers; ++w) {
    observation_scratch s;
    carve_observation_scratch(a, p, &s);
    float* tmp = a.take<float>(p.candidates);
    if (out->workers != nullptr) out->workers[w] = s;
    if (out->tmp != nullptr) out->tmp[w] = tmp;
  }
}

/// counts[j] = #{t : key_position(j) <= query_position(t)} for j < C.
inline void count_observers(const observation_problem& p, std::int64_t* sorted_pos, float* counts) {
  for (std::int64_t t = 0; t < p.window; ++t) sorted_pos[t] = p.query_positions[t];
  std::sort(sorted_pos, sorted_pos + p.window, abi_less());
  for (std::int64_t j = 0; j < p.candidates; ++j) {
    const std::int64_t kp = p.key_positions != nullptr ? p.key_positions[j] : j;
    counts[j] =
        static_cast<float>(sorted_pos + p.window - std::lower_bound(sorted_pos, sorted_pos + p.window, kp, abi_less()));
  }
}

inline observation_problem make_problem(const layer_shape& shape, const scoring_params& params) noexcept {
  observation_problem p;
  p.group = shape.group_size() > 0 ? shape.group_size() : 1;
  p.window = shape.num_queries;
  p.dim = shape.head_dim;
  p.tokens = shape.num_tokens;
  p.candidates = shape.num_tokens > params.protected_tail ? shape.num_tokens - params.protected_tail : 0;
  p.domain = params.domain;
  return p;
}

}  // namespace detail

/// Bytes of workspace `observation_scores` needs for a layer of this shape (upper bounds on
/// L and W are fine) with this executor's worker count.
inline std::size_t observation_scores_workspace_size(const layer_shape& shape, const scoring_params& params,
                                                     const executor& exec = {}) noexcept {
  detail::arena a;
  detail::observation_layout layout;
  detail::carve_observation_layout(a, detail::make_problem(shape, params),
                                   params.window == window_aggregation::visible_mean, exec.workers(), &layout);
  return a.used();
}

/// Scores every key of one layer by the attention the observation queries pay it.
///
///   queries: [Hq, W, d] post-RoPE, with positions          (query_view, any storage type)
///   keys:    [Hkv, L, d]                                    (cache_view, any layout/type)
///   scores:  [Hkv, L] float32 out; candidates [0, L-P) get scores, the protected tail +inf
///   ws:      at least observation_scores_workspace_size(...) bytes
///
/// Hq must be a multiple of Hkv (query head q belongs to KV head q / (Hq/Hkv)). On error
/// nothing is written.
template <class QT, class KT>
status observation_scores(query_view<QT> queries_in, cache_view<KT> keys_in, const scoring_params& params,
                          score_view scores, workspace_span ws, const observation_inputs& in = {},
                          const executor& exec = {}) {
  static constexpr const char* fn = "kvevict::observation_scores";
  const query_view<const std::remove_cv_t<QT>> queries = queries_in;
  const cache_view<const std::remove_cv_t<KT>> keys = keys_in;
  KVEVICT_RETURN_IF_ERROR(detail::validate_query_view(queries, fn, "queries"));
  KVEVICT_RETURN_IF_ERROR(detail::validate_cache_view(keys, fn, "keys"));
  if (queries.head_dim != keys.head_dim)
    return status::error(errc::invalid_shape, fn, "queries.head_dim", "expected keys.head_dim = %lld, got %lld",
                         static_cast<long long>(keys.head_dim), static_cast<long long>(queries.head_dim));
  if (queries.num_heads % keys.num_heads != 0)
    return status::error(errc::invalid_shape, fn, "queries.num_heads",
                         "expected a multiple of keys.num_heads = %lld (GQA), got %lld",
                         static_cast<long long>(keys.num_heads), static_cast<long long>(queries.num_heads));
  KVEVICT_RETURN_IF_ERROR(detail::validate_matrix_view(scores, keys.num_heads, keys.num_tokens, fn, "scores"));
  KVEVICT_RETURN_IF_ERROR(detail::validate_scoring_params(params, fn));
  if (params.window == window_aggregation::weighted)
    KVEVICT_RETURN_IF_ERROR(detail::validate_window_weights(in.weights, queries.num_queries, fn, "inputs.weights"));
  const std::int64_t lse_stride = in.lse_head_stride != 0 ? in.lse_head_stride : queries.num_queries;
  if (in.lse != nullptr) {
    if (params.domain != softmax_domain::visible)
      return status::error(errc::unsupported, fn, "inputs.lse",
                           "an engine log-sum-exp covers every visible key; it cannot be used with "
                           "softmax_domain::candidates");
    if (lse_stride < queries.num_queries)
      return status::error(errc::invalid_stride, fn, "inputs.lse_head_stride", "expected >= W = %lld, got %lld",
                           static_cast<long long>(queries.num_queries), static_cast<long long>(lse_stride));
  }

  const layer_shape shape{queries.num_heads, keys.num_heads, keys.head_dim, keys.num_tokens, queries.num_queries};
  detail::observation_problem p = detail::make_problem(shape, params);
  p.query_positions = queries.positions;
  p.key_positions = in.key_positions;
  p.key_scale = keys.scale;
  p.key_positions_sorted = in.key_positions == nullptr || detail::is_non_decreasing(in.key_positions, keys.num_tokens);
  p.lse = in.lse;
  p.lse_head_stride = lse_stride;
  p.max_over_window = params.window == window_aggregation::max;
  if (params.window == window_aggregation::weighted) p.weights = in.weights;

  const bool counts = params.window == window_aggregation::visible_mean;
  const int workers = exec.workers();
  detail::arena a(ws);
  detail::observation_layout layout;
  detail::carve_observation_layout(a, p, counts, workers, &layout);
  if (a.overflowed())
    return status::error(errc::workspace_too_small, fn, "ws",
                         "expected at least %zu bytes (observation_scores_workspace_size), got %zu", a.used(), ws.size);

  detail::window_normaliser norm;
  if (params.window == window_aggregation::mean) {
    norm.scale = 1.0f / static_cast<float>(queries.num_queries);
  } else if (params.window == window_aggregation::weighted) {
    double sum = 0.0;
    for (std::int64_t t = 0; t < queries.num_queries; ++t) sum += static_cast<double>(in.weights[t]);
    norm.scale = static_cast<float>(1.0 / sum);
  } else if (counts) {
    detail::count_observers(p, layout.sorted_pos, layout.counts);
    norm.per_key_count = layout.counts;
  }

  struct task_context {
    const query_view<const std::remove_cv_t<QT>>* queries;
    const cache_view<const std::remove_cv_t<KT>>* keys;
    const detail::observation_problem* p;
    const detail::observation_layout* layout;
    const scoring_params* params;
    const detail::window_normaliser* norm;
    score_view scores;
  } ctx{&queries, &keys, &p, &layout, &params, &norm, scores};
  exec.run(
      keys.num_heads,
      [](void* arg, std::int64_t h, int worker) {
        const auto& c = *static_cast<const task_context*>(arg);
        const detail::observation_scratch& s = c.layout->workers[worker];
        detail::observe_head(*c.queries, *c.keys, h, *c.p, s);
        detail::finalize_head(s.acc, c.p->group, c.p->candidates, c.p->tokens, *c.params, *c.norm,
                              c.layout->tmp[worker], c.scores.row(h));
      },
      &ctx);
  return status();
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_SCORING_OBSERVATION_SCORES_HPP
