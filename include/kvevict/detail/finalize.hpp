// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_FINALIZE_HPP
#define KVEVICT_DETAIL_FINALIZE_HPP

// Turns one KV head's aggregated rows acc[G][C] into its score row: window normalisation,
// GQA reduction and pooling in the configured order, +inf for the protected tail.

#include <cstdint>
#include <limits>

#include "kvevict/config.hpp"
#include "kvevict/detail/pooling.hpp"
#include "kvevict/scoring/params.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

/// Normalisation of the window aggregation: a scalar, or a per-key divisor (visible_mean).
struct window_normaliser {
  float scale = 1.0f;
  const float* per_key_count = nullptr;  ///< [C]; keys no observation sees score 0

  void apply(float* row, std::int64_t n) const noexcept {
    if (per_key_count != nullptr) {
      for (std::int64_t j = 0; j < n; ++j) row[j] = per_key_count[j] > 0.0f ? row[j] / per_key_count[j] : 0.0f;
    } else if (scale != 1.0f) {
      for (std::int64_t j = 0; j < n; ++j) row[j] *= scale;
    }
  }
};

/// Pools a KV head's GQA-reduced row into its score row: applies the window normalisation
/// and, for mean, 1/G, then pooling; writes +inf to the protected tail. row: [C] (modified);
/// out: [L]. Shared by window scoring and DeferKV's running state, so that DeferKV without
/// decode feedback reproduces SnapKV bit for bit.
inline void finalize_reduced_row(float* row, std::int64_t group, std::int64_t candidates, std::int64_t tokens,
                                 const scoring_params& params, const window_normaliser& norm, float* out) {
  norm.apply(row, candidates);
  if (params.gqa == gqa_reduction::mean && group > 1) {
    const float inv = 1.0f / static_cast<float>(group);
    for (std::int64_t j = 0; j < candidates; ++j) row[j] *= inv;
  }
  pool_row(row, candidates, params.pool, out);
  for (std::int64_t j = candidates; j < tokens; ++j) out[j] = std::numeric_limits<float>::infinity();
}

/// acc: [G, C] un-normalised aggregated rows (modified in place); tmp: [C] scratch; out: [L].
/// Before pooling, the raw rows are reduced first and normalised once (normalisation is a
/// positive per-key factor, so it commutes with sum, mean and max).
inline void finalize_head(float* acc, std::int64_t group, std::int64_t candidates, std::int64_t tokens,
                          const scoring_params& params, const window_normaliser& norm, float* tmp, float* out) {
  if (params.order == gqa_order::before_pooling) {
    for (std::int64_t g = 0; g < group; ++g) reduce_into(tmp, acc + g * candidates, candidates, params.gqa, g == 0);
    finalize_reduced_row(tmp, group, candidates, tokens, params, norm, out);
    return;
  }
  for (std::int64_t g = 0; g < group; ++g) {
    norm.apply(acc + g * candidates, candidates);
    pool_row(acc + g * candidates, candidates, params.pool, tmp);
    reduce_into(out, tmp, candidates, params.gqa, g == 0);
  }
  if (params.gqa == gqa_reduction::mean && group > 1) {
    const float inv = 1.0f / static_cast<float>(group);
    for (std::int64_t j = 0; j < candidates; ++j) out[j] *= inv;
  }
  for (std::int64_t j = candidates; j < tokens; ++j) out[j] = std::numeric_limits<float>::infinity();
}

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DETAIL_FINALIZE_HPP
