// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_SCORING_PARAMS_HPP
#define KVEVICT_SCORING_PARAMS_HPP

// Every choice of the observation-scoring math (design.md §4). Peers disagree on
// each, so each is a parameter; scoring/presets.hpp pins the peers' conventions.
//
// For KV head h, query head q of its group, observation t at position p_t:
//   logit[q,t,j] = dot(Q[q,t], K[h,j]) / sqrt(d)         for keys j visible to t
//   A[q,t,j]     = softmax over the normalisation domain  (float32)
//   window aggregation over t, GQA reduction over the G query heads of h (before or after
//   pooling), 1-D pooling over the candidate keys [0, L - protected_tail).

#include <cstdint>

#include "kvevict/config.hpp"

KVEVICT_NAMESPACE_BEGIN

/// Which keys the softmax normalises over.
enum class softmax_domain : std::int32_t {
  visible,     ///< every key visible to the query (kvpress, SnapKV): the model's own attention
  candidates,  ///< only candidate keys [0, L - protected_tail) (TensorRT-LLM RocketKV)
};

/// How the W observations' attention rows combine into one row per query head.
enum class window_aggregation : std::int32_t {
  mean,          ///< (1/W) * sum_t A[t, j]
  sum,           ///< sum_t A[t, j]
  max,           ///< max_t A[t, j]
  weighted,      ///< sum_t w_t A[t, j] / sum_t w_t  (weights given per observation)
  visible_mean,  ///< sum_t A[t, j] / #{t : t sees j}   (H2O's accumulated attention)
};

/// How the G query heads of a KV head combine.
enum class gqa_reduction : std::int32_t { mean, max, sum };

/// Whether GQA reduction runs before pooling (one pooled row per KV head; AdaKV) or after
/// (pool every query head's row, then reduce; kvpress). Identical for avg pooling with
/// mean/sum; different for max pooling or max reduction.
enum class gqa_order : std::int32_t { before_pooling, after_pooling };

enum class pooling_kind : std::int32_t { none, avg, max };

/// 1-D pooling over candidate keys: odd kernel k, padding k/2 each side, stride 1. Max
/// pooling ignores padding; average pooling divides by k (count_padding, PyTorch's
/// default) or by the number of in-range keys.
struct pooling {
  pooling_kind kind = pooling_kind::none;
  std::int64_t kernel = 1;
  bool count_padding = true;
};

/// The full scoring configuration.
struct scoring_params {
  softmax_domain domain = softmax_domain::visible;
  window_aggregation window = window_aggregation::mean;
  gqa_reduction gqa = gqa_reduction::mean;
  gqa_order order = gqa_order::after_pooling;
  pooling pool = {pooling_kind::avg, 5, true};
  /// P: the last P tokens are protected (always kept, scored +inf); candidates are [0, L-P).
  std::int64_t protected_tail = 0;
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_SCORING_PARAMS_HPP
