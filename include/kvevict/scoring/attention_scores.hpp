// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_SCORING_ATTENTION_SCORES_HPP
#define KVEVICT_SCORING_ATTENTION_SCORES_HPP

// Scores from attention rows the engine already has ([Hq, W, L] probabilities), with the
// same window aggregation, GQA reduction, pooling and protected tail as observation
// scoring. The softmax domain does not apply: the rows are used as given.

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/detail/finalize.hpp"
#include "kvevict/detail/pooling.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/scoring/observation_scores.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/views/attention_view.hpp"
#include "kvevict/views/index_ptr.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

namespace detail {
struct attention_layout {
  float* acc = nullptr;                ///< [G, C]
  float* tmp = nullptr;                ///< [C]
  float* counts = nullptr;             ///< [C]
  std::int64_t* sorted_pos = nullptr;  ///< [W]
};
inline void carve_attention_layout(arena& a, std::int64_t group, std::int64_t candidates, std::int64_t window,
                                   attention_layout* out) noexcept {
  out->acc = a.take<float>(saturating_mul(group, candidates));  // saturating: shapes are unvalidated
  out->tmp = a.take<float>(candidates);
  out->counts = a.take<float>(candidates);
  out->sorted_pos = a.take<std::int64_t>(window);
}
}  // namespace detail

/// Bytes of workspace `attention_scores` needs.
inline std::size_t attention_scores_workspace_size(const layer_shape& shape, const scoring_params& params) noexcept {
  detail::arena a;
  detail::attention_layout layout;
  const std::int64_t candidates = std::max<std::int64_t>(0, shape.num_tokens - params.protected_tail);
  detail::carve_attention_layout(a, shape.group_size() > 0 ? shape.group_size() : 1, candidates, shape.num_queries,
                                 &layout);
  return a.used();
}

/// Scores [Hkv, L] from attention rows [Hq, W, L].
///
///   attention:   [Hq, W, L] float32 probabilities (query head q belongs to KV head q / G)
///   num_kv_heads: Hkv (Hq must be a multiple)
///   key_positions: [L] or null (key j at position j); used by visible_mean only
///   weights:     [W] for window_aggregation::weighted, else ignored
inline status attention_scores(const attention_view& attention, std::int64_t num_kv_heads, const scoring_params& params,
                               score_view scores, workspace_span ws, index_ptr key_positions = nullptr,
                               const float* weights = nullptr) {
  static constexpr const char* fn = "kvevict::attention_scores";
  if (attention.num_heads < 1 || attention.num_queries < 1 || attention.num_tokens < 0)
    return status::error(errc::invalid_shape, fn, "attention",
                         "expected Hq >= 1, W >= 1, L >= 0, got [%lld, %lld, %lld]",
                         static_cast<long long>(attention.num_heads), static_cast<long long>(attention.num_queries),
                         static_cast<long long>(attention.num_tokens));
  if (attention.num_tokens > 0) {  // an empty cache's rows address nothing (any data and strides)
    if (attention.data == nullptr) return status::error(errc::null_pointer, fn, "attention.data", "expected non-null");
    detail::strided_dim dims[3] = {{attention.num_heads, attention.head_stride, "head_stride"},
                                   {attention.num_queries, attention.query_stride, "query_stride"},
                                   {attention.num_tokens, 1, "key_stride"}};
    if (attention.head_stride < 0 || attention.query_stride < 0)
      return status::error(errc::invalid_stride, fn, "attention", "expected non-negative strides");
    std::int64_t span = 0;
    KVEVICT_RETURN_IF_ERROR(detail::check_box(fn, "attention", dims, 3, &span));
  }
  if (num_kv_heads < 1 || attention.num_heads % num_kv_heads != 0)
    return status::error(errc::invalid_shape, fn, "num_kv_heads", "expected a divisor of Hq = %lld, got %lld",
                         static_cast<long long>(attention.num_heads), static_cast<long long>(num_kv_heads));
  KVEVICT_RETURN_IF_ERROR(detail::validate_matrix_view(scores, num_kv_heads, attention.num_tokens, fn, "scores"));
  KVEVICT_RETURN_IF_ERROR(detail::validate_scoring_params(params, fn));
  if (params.window == window_aggregation::weighted)
    KVEVICT_RETURN_IF_ERROR(detail::validate_window_weights(weights, attention.num_queries, fn, "weights"));
  if (params.window == window_aggregation::visible_mean && attention.positions == nullptr)
    return status::error(errc::null_pointer, fn, "attention.positions",
                         "window_aggregation::visible_mean divides by the queries that see each key: positions needed");

  const std::int64_t group = attention.num_heads / num_kv_heads, window = attention.num_queries;
  const std::int64_t tokens = attention.num_tokens;
  const std::int64_t candidates = std::max<std::int64_t>(0, tokens - params.protected_tail);
  detail::arena a(ws);
  detail::attention_layout layout;
  detail::carve_attention_layout(a, group, candidates, window, &layout);
  if (a.overflowed())
    return status::error(errc::workspace_too_small, fn, "ws",
                         "expected at least %zu bytes (attention_scores_workspace_size), got %zu", a.used(), ws.size);

  if (tokens == 0) return status();  // an empty cache: no score to write, no attention row to read

  // Weights are read only for window_aggregation::weighted (validated non-null there). Reading
  // them through `wts` keeps the default null `weights` out of every read, which GCC 12
  // otherwise reports (-Warray-bounds at -O3) at call sites that pass no weights.
  const float* const wts = params.window == window_aggregation::weighted ? weights : nullptr;
  detail::window_normaliser norm;
  if (wts != nullptr) {
    double weight_sum = 0.0;
    for (std::int64_t t = 0; t < window; ++t) weight_sum += static_cast<double>(wts[t]);
    norm.scale = static_cast<float>(1.0 / weight_sum);  // weight_sum >= FLT_MIN (validated): finite
  } else if (params.window == window_aggregation::mean) {
    norm.scale = static_cast<float>(1.0 / static_cast<double>(window));
  }
  if (params.window == window_aggregation::visible_mean) {
    detail::observation_problem p;
    p.window = window;
    p.candidates = candidates;
    p.query_positions = attention.positions;
    p.key_positions = key_positions;
    detail::count_observers(p, layout.sorted_pos, layout.counts);
    norm.per_key_count = layout.counts;
  }
  for (std::int64_t h = 0; h < num_kv_heads; ++h) {
    for (std::int64_t g = 0; g < group; ++g) {
      float* acc = layout.acc + g * candidates;
      for (std::int64_t j = 0; j < candidates; ++j) acc[j] = 0.0f;
      for (std::int64_t t = 0; t < window; ++t) {
        const float* row = attention.row(h * group + g, t);
        if (params.window == window_aggregation::max) {
          for (std::int64_t j = 0; j < candidates; ++j) acc[j] = detail::nan_max(acc[j], row[j]);
        } else {
          const float w = wts != nullptr ? wts[t] : 1.0f;
          for (std::int64_t j = 0; j < candidates; ++j) acc[j] += w * row[j];
        }
      }
    }
    detail::finalize_head(layout.acc, group, candidates, tokens, params, norm, layout.tmp, scores.row(h));
  }
  return status();
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_SCORING_ATTENTION_SCORES_HPP
