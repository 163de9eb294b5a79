// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_KNORM_HPP
#define KVEVICT_POLICIES_KNORM_HPP

// KNorm: score = -||k||_2 per KV head and token, summed in double (low-norm keys tend to draw
// attention; a cheap query-free baseline, as kvpress's KnormPress). NaN keys score NaN and rank
// last.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvevict/config.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/detail/widen.hpp"
#include "kvevict/error.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/policies/configs.hpp"
#include "kvevict/policies/layer_inputs.hpp"
#include "kvevict/policies/scoring_policy.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

template <class T, class Q = default_query_type_t<T>>
class knorm : public scoring_policy<knorm<T, Q>, T, Q> {
 public:
  static constexpr const char* evict_name = "kvevict::knorm::evict";
  using storage_type = T;
  using query_type = Q;
  using config_type = knorm_config;

  explicit knorm(const knorm_config& config = {}) noexcept : config_(config) {}
  const knorm_config& config() const noexcept { return config_; }

  std::size_t workspace_size(const layer_shape& shape, const executor& = {}) const noexcept {
    detail::arena a;
    (void)a.take<float>(rows_at_once * shape.head_dim);
    return a.used();
  }
  selection_params selection() const noexcept { return {config_.protected_tail, config_.protect}; }

  /// keys: [Hkv, L, d]; scores: [Hkv, L] out.
  status score(const layer_inputs<T, Q>& in, score_view scores, workspace_span ws, const executor& = {}) const {
    static constexpr const char* fn = "kvevict::knorm::score";
    if (config_.protected_tail < 0)
      return status::error(errc::invalid_argument, fn, "config.protected_tail", "expected >= 0, got %lld",
                           static_cast<long long>(config_.protected_tail));
    KVEVICT_RETURN_IF_ERROR(detail::validate_cache_view(in.keys, fn, "keys"));
    KVEVICT_RETURN_IF_ERROR(detail::validate_matrix_view(scores, in.keys.num_heads, in.keys.num_tokens, fn, "scores"));
    detail::arena a(ws);
    const std::int64_t d = in.keys.head_dim;
    float* rows = a.take<float>(rows_at_once * d);
    if (a.overflowed())
      return status::error(errc::workspace_too_small, fn, "ws", "expected at least %zu bytes, got %zu", a.used(),
                           ws.size);
    const std::int64_t tokens = in.keys.num_tokens;
    const std::int64_t candidates = tokens > config_.protected_tail ? tokens - config_.protected_tail : 0;
    for (std::int64_t h = 0; h < in.keys.num_heads; ++h) {
      float* out = scores.row(h);
      for (std::int64_t j0 = 0; j0 < candidates; j0 += rows_at_once) {
        const std::int64_t m = candidates - j0 < rows_at_once ? candidates - j0 : rows_at_once;
        for (std::int64_t i = 0; i < m; ++i)
          detail::widen_row(in.keys.row(h, j0 + i), in.keys.dim_stride, rows + i * d, d);
        for (std::int64_t i = m; i < rows_at_once; ++i)
          for (std::int64_t c = 0; c < d; ++c) rows[i * d + c] = 0.0f;
        double sums[rows_at_once];
        squared_norms(rows, d, sums);
        for (std::int64_t i = 0; i < m; ++i)
          out[j0 + i] = -static_cast<float>(std::sqrt(sums[i]) * static_cast<double>(in.keys.scale));
      }
      for (std::int64_t j = candidates; j < tokens; ++j) out[j] = std::numeric_limits<float>::infinity();
    }
    return status();
  }

 private:
  /// Keys normed together: their sums are independent chains of additions, so they overlap
  /// (one row's chain of d dependent additions left the core waiting on each).
  static constexpr std::int64_t rows_at_once = 8;

  /// ||k||^2 of rows_at_once rows ([rows_at_once, d]), the same bits on every build and on the
  /// GPU (cuda::key_norm_scores): the squares of floats are exact in double, so whether a
  /// compiler fuses the multiply-add cannot change a sum, which runs in ascending c for each
  /// row; sqrt and the scaling then round once each.
  static void squared_norms(const float* rows, std::int64_t d, double* sums) noexcept {
    for (std::int64_t i = 0; i < rows_at_once; ++i) sums[i] = 0.0;
    for (std::int64_t c = 0; c < d; ++c)
      for (std::int64_t i = 0; i < rows_at_once; ++i) {
        const double x = static_cast<double>(rows[i * d + c]);
        sums[i] += x * x;
      }
  }

  knorm_config config_;
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_KNORM_HPP
