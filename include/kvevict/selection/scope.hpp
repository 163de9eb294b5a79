// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_SELECTION_SCOPE_HPP
#define KVEVICT_SELECTION_SCOPE_HPP

// Selection scope: which heads (and layers) share one keep set. Engines whose attention
// reads one set of rows for every head of a layer (TensorRT-LLM's "union" eviction mode,
// LMCache's token dropper) or for every layer of a sequence (llama.cpp's cells) cannot serve
// per-head keep-lists; they need one set, chosen from a combined score per token.
//
// The combining rule (design.md §14): each head's candidate scores are first divided by
// their total magnitude, so that every head weighs the same whatever its scale (attention
// mass sums to about 1 per observation, but a head that spreads it thin has small scores
// everywhere; the total is exact, so every device and rank agrees on it), then heads (and, for a sequence scope,
// layers) combine by max -- a token one head depends on is kept, as in the union of per-head sets -- or by mean. The
// protected tail stays +inf, NaN stays NaN (ranked last), and the shared keep set goes to every head.

#include <cmath>
#include <cstdint>
#include <limits>

#include "kvevict/config.hpp"
#include "kvevict/detail/exact_sum.hpp"
#include "kvevict/detail/pooling.hpp"
#include "kvevict/error.hpp"
#include "kvevict/views/matrix_view.hpp"

KVEVICT_NAMESPACE_BEGIN

/// Which heads share a keep set.
enum class selection_scope : std::int32_t {
  per_head,      ///< every KV head its own keep-list (the default)
  per_layer,     ///< one keep set per layer, shared by its heads
  per_sequence,  ///< one keep set for every head of every layer (llama.cpp cells)
};

/// How per-head (and per-layer) scores combine into one score per token.
enum class scope_combine : std::int32_t {
  normalized_max,   ///< each head's candidates / their total |score|, then max (the default)
  normalized_mean,  ///< the same, then mean
  max,              ///< raw scores, max
  mean,             ///< raw scores, mean
};

inline const char* to_string(selection_scope s) noexcept {
  switch (s) {
    case selection_scope::per_head:
      return "per_head";
    case selection_scope::per_layer:
      return "per_layer";
    case selection_scope::per_sequence:
      return "per_sequence";
  }
  return "unknown";
}

inline const char* to_string(scope_combine c) noexcept {
  switch (c) {
    case scope_combine::normalized_max:
      return "normalized_max";
    case scope_combine::normalized_mean:
      return "normalized_mean";
    case scope_combine::max:
      return "max";
    case scope_combine::mean:
      return "mean";
  }
  return "unknown";
}

namespace detail {

inline bool normalizes(scope_combine c) noexcept {
  return c == scope_combine::normalized_max || c == scope_combine::normalized_mean;
}
inline bool combines_by_max(scope_combine c) noexcept {
  return c == scope_combine::normalized_max || c == scope_combine::max;
}

/// 1 / (sum of |x| over the finite entries of x[0, n)), or 1 when that sum is 0 (a head with
/// no usable mass keeps its scores as they are). The sum is exact, rounded once to double
/// (detail/exact_sum.hpp): any order of additions -- the GPU's, another rank's -- gives it.
inline float normaliser_of(const float* x, std::int64_t n) noexcept {
  std::uint64_t bins[magnitude_bins] = {};
  for (std::int64_t j = 0; j < n; ++j) {
    int bin = 0;
    std::uint64_t significand = 0;
    if (magnitude_parts(x[j], &bin, &significand)) bins[bin] += significand;
  }
  return reciprocal_of_sum(bins_to_double(bins));
}

/// Folds one row into a combined row: the first row is copied (normalised), later rows
/// combine by nan_max or by sum. Candidates are [0, candidates); the tail is copied as is.
/// Out of line: the tensor-parallel mean (selection/scope_sharded.hpp) calls it on the same rows
/// in the same order and must get the same bits, FMA contraction or not.
/// Products and sums are not contracted: cuda/scope.cuh repeats them with __fmul_rn/__fadd_rn.
KVEVICT_NOINLINE KVEVICT_FP_CONTRACT_OFF void fold_row(float* acc, const float* row, std::int64_t tokens,
                                                       std::int64_t candidates, scope_combine c, bool first) noexcept {
  KVEVICT_FP_CONTRACT_OFF_BODY
  const float scale = normalizes(c) ? normaliser_of(row, candidates) : 1.0f;
  for (std::int64_t j = 0; j < tokens; ++j) {
    const float v = j < candidates ? row[j] * scale : row[j];
    if (first) {
      acc[j] = v;
    } else if (combines_by_max(c)) {
      acc[j] = nan_max(acc[j], v);
    } else {
      acc[j] += v;
    }
  }
}

/// Turns a sum of `rows` folded rows into their mean (candidates only; +inf tails stay).
inline void finish_mean(float* acc, std::int64_t candidates, std::int64_t rows, scope_combine c) noexcept {
  if (combines_by_max(c) || rows <= 1) return;
  const float inv = 1.0f / static_cast<float>(rows);
  for (std::int64_t j = 0; j < candidates; ++j) acc[j] *= inv;
}

}  // namespace detail

/// Combines a layer's scores [Hkv, L] into one row [L] by `rule`: candidates [0, L - tail)
/// per the rule above, the protected tail as it is (+inf).
///
///   scores:         [Hkv, L] float32
///   protected_tail: P (the last P tokens are not normalised: they are kept anyway)
///   out:            [L] out
inline status combine_head_scores(const_score_view scores, std::int64_t protected_tail, scope_combine rule,
                                  float* out) noexcept {
  static constexpr const char* fn = "kvevict::combine_head_scores";
  if (scores.rows < 1)
    return status::error(errc::invalid_shape, fn, "scores.rows", "expected >= 1 KV head, got %lld",
                         static_cast<long long>(scores.rows));
  if (scores.cols < 0 || (scores.rows > 1 && scores.row_stride < scores.cols))
    return status::error(errc::invalid_shape, fn, "scores", "expected [Hkv, L] with row_stride >= L");
  if (scores.cols > 0 && (scores.data == nullptr || out == nullptr))
    return status::error(errc::null_pointer, fn, scores.data == nullptr ? "scores.data" : "out", "expected non-null");
  if (protected_tail < 0)
    return status::error(errc::invalid_argument, fn, "protected_tail", "expected >= 0, got %lld",
                         static_cast<long long>(protected_tail));
  if (static_cast<unsigned>(rule) > 3u)
    return status::error(errc::invalid_argument, fn, "rule", "expected a scope_combine value, got %d",
                         static_cast<int>(rule));
  const std::int64_t candidates = scores.cols > protected_tail ? scores.cols - protected_tail : 0;
  for (std::int64_t h = 0; h < scores.rows; ++h)
    detail::fold_row(out, scores.row(h), scores.cols, candidates, rule, h == 0);
  detail::finish_mean(out, candidates, scores.rows, rule);
  return status();
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_SELECTION_SCOPE_HPP
