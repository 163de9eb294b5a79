// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_VIEWS_ATTENTION_VIEW_HPP
#define KVEVICT_VIEWS_ATTENTION_VIEW_HPP

// Precomputed attention rows [Hq, W, L] (softmax probabilities, float32) for engines that
// materialise attention (eager attention) and want scores without kvevict recomputing it.

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/views/index_ptr.hpp"

KVEVICT_NAMESPACE_BEGIN

struct attention_view {
  const float* data = nullptr;
  std::int64_t num_heads = 0;    ///< Hq
  std::int64_t num_queries = 0;  ///< W
  std::int64_t num_tokens = 0;   ///< L
  std::int64_t head_stride = 0;
  std::int64_t query_stride = 0;  ///< key stride is 1
  /// [W] positions of the queries; needed for window_aggregation::visible_mean (H2O), which
  /// divides by how many queries could see each key.
  index_ptr positions = nullptr;

  KVEVICT_HOST_DEVICE const float* row(std::int64_t q, std::int64_t t) const noexcept {
    return data + q * head_stride + t * query_stride;
  }
};

/// Attention rows of one sequence stored contiguously as [Hq, W, L].
inline attention_view contiguous_attention(const float* data, std::int64_t num_heads, std::int64_t num_queries,
                                           std::int64_t num_tokens, index_ptr positions = nullptr) noexcept {
  return {data, num_heads, num_queries, num_tokens, num_queries * num_tokens, num_tokens, positions};
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_VIEWS_ATTENTION_VIEW_HPP
