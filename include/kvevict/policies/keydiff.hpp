// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_KEYDIFF_HPP
#define KVEVICT_POLICIES_KEYDIFF_HPP

// KeyDiff, kvpress's KeyDiffPress convention: per KV head, the anchor is the mean of the
// L2-normalised keys of every token (the protected tail included), and each key scores
// minus its cosine similarity to the anchor, so the most typical keys go first. No queries.
// docs/policies/keydiff.md. Products are summed with explicit fused multiply-adds (and the
// squares of floats, exact in double, plainly), so that no compiler's contraction changes a
// bit and cuda::keydiff_scores gives the same ones.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvevict/config.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/detail/widen.hpp"
#include "kvevict/error.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/policies/keydiff_traits.hpp"
#include "kvevict/policies/layer_inputs.hpp"
#include "kvevict/policies/scoring_policy.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

template <class T, class Q = default_query_type_t<T>>
class keydiff : public scoring_policy<keydiff<T, Q>, T, Q> {
 public:
  static constexpr const char* evict_name = "kvevict::keydiff::evict";
  using storage_type = T;
  using query_type = Q;
  using config_type = keydiff_config;

  static constexpr double normalize_eps = keydiff_arithmetic::normalize_eps;
  static constexpr double cosine_eps = keydiff_arithmetic::cosine_eps;
  static constexpr std::int64_t anchor_chunk = keydiff_arithmetic::anchor_chunk;

  explicit keydiff(const keydiff_config& config = {}) noexcept : config_(config) {}
  const keydiff_config& config() const noexcept { return config_; }

  std::size_t workspace_size(const layer_shape& shape, const executor& = {}) const noexcept {
    detail::arena a;
    (void)a.take<float>(shape.head_dim);
    (void)a.take<double>(shape.head_dim);
    (void)a.take<double>(shape.head_dim);
    return a.used();
  }
  selection_params selection() const noexcept { return {config_.protected_tail, config_.protect}; }

  /// keys: [Hkv, L, d]; scores: [Hkv, L] out. The cache's scale is left out: a cosine does
  /// not change under a positive scale.
  status score(const layer_inputs<T, Q>& in, score_view scores, workspace_span ws, const executor& = {}) const {
    static constexpr const char* fn = "kvevict::keydiff::score";
    if (config_.protected_tail < 0)
      return status::error(errc::invalid_argument, fn, "config.protected_tail", "expected >= 0, got %lld",
                           static_cast<long long>(config_.protected_tail));
    KVEVICT_RETURN_IF_ERROR(detail::validate_cache_view(in.keys, fn, "keys"));
    KVEVICT_RETURN_IF_ERROR(detail::validate_matrix_view(scores, in.keys.num_heads, in.keys.num_tokens, fn, "scores"));
    detail::arena a(ws);
    float* row_buf = a.take<float>(in.keys.head_dim);
    double* anchor = a.take<double>(in.keys.head_dim);
    double* chunk_sum = a.take<double>(in.keys.head_dim);
    if (a.overflowed())
      return status::error(errc::workspace_too_small, fn, "ws", "expected at least %zu bytes, got %zu", a.used(),
                           ws.size);
    const std::int64_t tokens = in.keys.num_tokens;
    const std::int64_t dim = in.keys.head_dim;
    const std::int64_t candidates = tokens > config_.protected_tail ? tokens - config_.protected_tail : 0;
    for (std::int64_t h = 0; h < in.keys.num_heads; ++h) {
      std::fill(anchor, anchor + dim, 0.0);
      for (std::int64_t first = 0; first < tokens; first += anchor_chunk) {
        std::fill(chunk_sum, chunk_sum + dim, 0.0);
        for (std::int64_t j = first; j < std::min(tokens, first + anchor_chunk); ++j) {
          detail::widen_row(in.keys.row(h, j), in.keys.dim_stride, row_buf, dim);
          const double inv = 1.0 / std::max(norm(row_buf, dim), normalize_eps);
          for (std::int64_t c = 0; c < dim; ++c)
            chunk_sum[c] = std::fma(static_cast<double>(row_buf[c]), inv, chunk_sum[c]);
        }
        for (std::int64_t c = 0; c < dim; ++c) anchor[c] += chunk_sum[c];
      }
      double anchor_sq = 0.0;
      for (std::int64_t c = 0; c < dim; ++c) {
        anchor[c] /= static_cast<double>(tokens);
        anchor_sq = std::fma(anchor[c], anchor[c], anchor_sq);
      }
      const double anchor_norm = std::sqrt(anchor_sq);
      float* out = scores.row(h);
      for (std::int64_t j = 0; j < candidates; ++j) {
        detail::widen_row(in.keys.row(h, j), in.keys.dim_stride, row_buf, dim);
        double dot = 0.0;
        for (std::int64_t c = 0; c < dim; ++c) dot = std::fma(static_cast<double>(row_buf[c]), anchor[c], dot);
        out[j] = static_cast<float>(-dot / std::max(norm(row_buf, dim) * anchor_norm, cosine_eps));
      }
      for (std::int64_t j = candidates; j < tokens; ++j) out[j] = std::numeric_limits<float>::infinity();
    }
    return status();
  }

 private:
  static double norm(const float* x, std::int64_t n) noexcept {
    double s = 0.0;
    for (std::int64_t c = 0; c < n; ++c) s += static_cast<double>(x[c]) * static_cast<double>(x[c]);
    return std::sqrt(s);
  }

  keydiff_config config_;
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_KEYDIFF_HPP
