// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_DAPQ_HPP
#define KVEVICT_POLICIES_DAPQ_HPP

// DapQ ("Decoding-aligned KV cache compression via position-aware pseudo queries"): N
// pseudo tokens are appended after the prompt at positions Lp .. Lp+N-1 and prefilled; their
// post-RoPE queries are the observation window, so the window carries the positions of the
// first N decode steps (the paper finds position dominates query similarity). Scores cover
// the prompt's keys only; every pseudo token's K/V is evicted and decoding resumes at Lp.
//
// Pseudo content (the paper's ablation): the first m and last n prompt tokens (appendix:
// 8 + 24 for Llama, 2 + 30 for Qwen), a fixed repeated phrase, or ids the caller gives.
//
// Beyond the paper (kvevict's re-rotation variant, no extra forward pass): RoPE rotations
// compose, so the SnapKV window's post-RoPE queries (positions Lp-N .. Lp-1) rotated by N
// more positions are queries at Lp .. Lp+N-1 -- the pseudo queries' positions with the
// window's content. dapq_rerotate does that; dapq_rotate_to does the same from pre-RoPE
// queries captured during prefill.

#include <cstddef>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/policies/configs.hpp"
#include "kvevict/policies/layer_inputs.hpp"
#include "kvevict/policies/scoring_policy.hpp"
#include "kvevict/rope/rope.hpp"
#include "kvevict/scoring/observation_scores.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/views/layouts.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

/// Pseudo content "first m + last n": out[0..m) = prompt[0..m), out[m..m+n) = the last n
/// prompt tokens. A prompt shorter than m (or n) repeats its ends (indices clamp).
inline status dapq_pseudo_tokens_first_last(const std::int32_t* prompt, std::int64_t prompt_tokens, std::int64_t first,
                                            std::int64_t last, std::int32_t* out) {
  static constexpr const char* fn = "kvevict::dapq_pseudo_tokens_first_last";
  if (prompt_tokens < 1)
    return status::error(errc::invalid_argument, fn, "prompt_tokens", "expected >= 1, got %lld",
                         static_cast<long long>(prompt_tokens));
  if (prompt == nullptr) return status::error(errc::null_pointer, fn, "prompt", "expected non-null");
  std::int64_t count = 0;
  if (first < 0 || last < 0 || !detail::checked_add(first, last, &count) || count < 1)
    return status::error(errc::invalid_argument, fn, "first",
                         "expected first, last >= 0 with 1 <= first + last < 2^63, got %lld + %lld",
                         static_cast<long long>(first), static_cast<long long>(last));
  if (out == nullptr) return status::error(errc::null_pointer, fn, "out", "expected [first + last] ids");
  for (std::int64_t i = 0; i < first; ++i) out[i] = prompt[i < prompt_tokens ? i : prompt_tokens - 1];
  for (std::int64_t i = 0; i < last; ++i) {
    const std::int64_t j = prompt_tokens - last + i;
    out[first + i] = prompt[j < 0 ? 0 : j];
  }
  return status();
}

/// Pseudo content "fixed phrase": `phrase` repeated and cut to `count` ids.
inline status dapq_pseudo_tokens_phrase(const std::int32_t* phrase, std::int64_t phrase_tokens, std::int64_t count,
                                        std::int32_t* out) {
  static constexpr const char* fn = "kvevict::dapq_pseudo_tokens_phrase";
  if (phrase_tokens < 1 || phrase == nullptr)
    return status::error(errc::invalid_argument, fn, "phrase", "expected a non-empty phrase");
  if (count < 1)
    return status::error(errc::invalid_argument, fn, "count", "expected >= 1, got %lld", static_cast<long long>(count));
  if (out == nullptr) return status::error(errc::null_pointer, fn, "out", "expected [count] ids");
  for (std::int64_t i = 0; i < count; ++i) out[i] = phrase[i % phrase_tokens];
  return status();
}

/// Positions of the pseudo tokens: Lp .. Lp+count-1.
inline void dapq_pseudo_positions(std::int64_t prompt_tokens, std::int64_t count, std::int64_t* out) noexcept {
  for (std::int64_t i = 0; i < count; ++i) out[i] = prompt_tokens + i;
}

namespace detail {
template <class QT, class OutT>
status rotate_queries(const char* fn, const query_view<QT>& in, const rope_config& rope, bool absolute,
                      std::int64_t offset, OutT* out, std::int64_t* out_positions, query_view<const OutT>* out_view) {
  const query_view<const std::remove_cv_t<QT>> q = in;
  KVEVICT_RETURN_IF_ERROR(validate_query_view(q, fn, "queries"));
  KVEVICT_RETURN_IF_ERROR(validate_rope_config(rope, fn));
  if (rope.head_dim != q.head_dim)
    return status::error(errc::invalid_shape, fn, "rope.head_dim", "expected queries.head_dim = %lld, got %lld",
                         static_cast<long long>(q.head_dim), static_cast<long long>(rope.head_dim));
  if (out == nullptr || out_positions == nullptr)
    return status::error(errc::null_pointer, fn, out == nullptr ? "out" : "out_positions", "expected non-null");
  float row[1024];
  if (q.head_dim > 1024)
    return status::error(errc::unsupported, fn, "queries.head_dim", "expected at most 1024, got %lld",
                         static_cast<long long>(q.head_dim));
  for (std::int64_t t = 0; t < q.num_queries; ++t) out_positions[t] = absolute ? offset + t : q.positions[t] + offset;
  for (std::int64_t h = 0; h < q.num_heads; ++h)
    for (std::int64_t t = 0; t < q.num_queries; ++t) {
      const double angle_position = absolute ? static_cast<double>(offset + t) : static_cast<double>(offset);
      rope_rotate(rope, q.row(h, t), q.dim_stride, angle_position, row);
      OutT* dst = out + (h * q.num_queries + t) * q.head_dim;
      for (std::int64_t c = 0; c < q.head_dim; ++c) dst[c] = from_float<OutT>(row[c]);
    }
  if (out_view != nullptr)
    *out_view = contiguous_queries<const OutT>(out, q.num_heads, q.num_queries, q.head_dim, out_positions);
  return status();
}
}  // namespace detail

/// Re-rotation variant: post-RoPE window queries [Hq, N, d] at positions p_t, rotated by
/// `delta` (= N for the SnapKV window Lp-N .. Lp-1), into out [Hq, N, d] (contiguous) with
/// positions p_t + delta. *out_view (optional) views the result.
template <class QT, class OutT>
status dapq_rerotate(const query_view<QT>& post_rope_window, const rope_config& rope, std::int64_t delta, OutT* out,
                     std::int64_t* out_positions, query_view<const OutT>* out_view = nullptr) {
  return detail::rotate_queries("kvevict::dapq_rerotate", post_rope_window, rope, false, delta, out, out_positions,
                                out_view);
}

/// Pre-RoPE variant: query t of pre-RoPE queries [Hq, N, d] rotated to absolute position
/// first_position + t (= Lp + t for DapQ), into out [Hq, N, d] (contiguous).
template <class QT, class OutT>
status dapq_rotate_to(const query_view<QT>& pre_rope, const rope_config& rope, std::int64_t first_position, OutT* out,
                      std::int64_t* out_positions, query_view<const OutT>* out_view = nullptr) {
  return detail::rotate_queries("kvevict::dapq_rotate_to", pre_rope, rope, true, first_position, out, out_positions,
                                out_view);
}

template <class T, class Q = default_query_type_t<T>>
class dapq {
 public:
  using storage_type = T;
  using query_type = Q;
  using config_type = dapq_config;
  static constexpr const char* evict_name = "kvevict::dapq::evict";

  explicit dapq(const dapq_config& config = {}) noexcept : config_(config) {}
  const dapq_config& config() const noexcept { return config_; }
  std::int64_t pseudo_tokens() const noexcept { return config_.pseudo_tokens; }

  std::size_t workspace_size(const layer_shape& shape, const executor& exec = {}) const noexcept {
    return observation_scores_workspace_size(shape, config_.scoring, exec);
  }
  selection_params selection() const noexcept { return {config_.scoring.protected_tail, config_.protect}; }

  /// in.keys: [Hkv, Lp + N, d] (or [Hkv, Lp, d]): the cache after the pseudo prefill;
  /// in.queries: [Hq, N, d] the pseudo queries, positions >= Lp; scores: [Hkv, Lp] out -- its
  /// column count is Lp, the prompt length: only prompt keys are scored and normalised over.
  status score(const layer_inputs<T, Q>& in, score_view scores, workspace_span ws, const executor& exec = {}) const {
    static constexpr const char* fn = "kvevict::dapq::score";
    const std::int64_t prompt = scores.cols;
    if (prompt < 0 || prompt > in.keys.num_tokens)
      return status::error(errc::invalid_shape, fn, "scores.cols",
                           "expected the prompt length Lp <= keys.num_tokens = %lld, got %lld",
                           static_cast<long long>(in.keys.num_tokens), static_cast<long long>(prompt));
    if (in.queries.positions != nullptr)
      for (std::int64_t t = 0; t < in.queries.num_queries; ++t)
        if (in.queries.positions[t] < prompt)
          return status::error(errc::out_of_range, fn, "queries.positions",
                               "expected pseudo-token positions >= Lp = %lld, got %lld at %lld",
                               static_cast<long long>(prompt), static_cast<long long>(in.queries.positions[t]),
                               static_cast<long long>(t));
    return observation_scores(in.queries, in.keys.first_tokens(prompt), config_.scoring, scores, ws, in.observation,
                              exec);
  }

  /// Where decoding resumes after eviction: the prompt length (pseudo positions are reused).
  static constexpr std::int64_t next_position(std::int64_t prompt_tokens) noexcept { return prompt_tokens; }

  /// Prompt tokens of a cache of `cache_tokens` observed by `queries` queries: pseudo tokens
  /// are the cache's last `queries` tokens; a re-rotated window adds none.
  std::int64_t prompt_tokens(std::int64_t cache_tokens, std::int64_t queries) const noexcept {
    return config_.source == dapq_source::pseudo_tokens ? cache_tokens - queries : cache_tokens;
  }

  std::size_t evict_workspace_size(const layer_shape& shape, const layer_budget& b,
                                   const executor& exec = {}) const noexcept {
    return detail::evict_layer_workspace_size(shape, shape.num_tokens, selection(),
                                              score_window_workspace_size(shape, exec), b, exec);
  }

  /// Bytes of workspace score_window needs for layers up to `shape`.
  std::size_t score_window_workspace_size(const layer_shape& shape, const executor& exec = {}) const noexcept {
    detail::arena a;
    carve_rotation(a, shape.num_query_heads, shape.num_queries, shape.head_dim);
    return detail::saturating_add(a.used(), workspace_size(shape, exec));
  }

  /// The scores evict() selects from: the prompt's keys [Hkv, Lp] observed by the window of
  /// config().source (re-rotated here when that is rerotated_window). cache and observed as
  /// for evict(); scores.cols must be the prompt length (prompt_tokens()).
  status score_window(const layer_cache<T>& cache, const layer_observations<Q>& observed, score_view scores,
                      workspace_span ws, const executor& exec = {}) const {
    static constexpr const char* fn = "kvevict::dapq::score_window";
    KVEVICT_RETURN_IF_ERROR(detail::validate_query_view(observed.queries, fn, "queries"));
    const query_view<const Q>& q = observed.queries;
    detail::arena a(ws);
    rotation r = carve_rotation(a, q.num_heads, q.num_queries, q.head_dim);
    if (a.overflowed())
      return status::error(errc::workspace_too_small, fn, "ws",
                           "expected at least %zu bytes (dapq::score_window_workspace_size), got %zu", a.used(),
                           ws.size);
    layer_observations<Q> window = observed;
    if (config_.source == dapq_source::rerotated_window)
      KVEVICT_RETURN_IF_ERROR(dapq_rerotate(q, config_.rope, q.num_queries, r.queries, r.positions, &window.queries));
    const workspace_span rest{static_cast<unsigned char*>(ws.data) + a.used(), ws.size - a.used()};
    return score(inputs_of(cache, window), scores, rest, exec);
  }

  /// Scores the prompt's keys with the observation window of config().source, selects under
  /// `b`, and compacts K and V in place: every pseudo token is dropped.
  ///
  ///   cache:    pseudo_tokens: [Hkv, Lp + N, d] after the pseudo prefill;
  ///             rerotated_window: [Hkv, Lp, d] after the prompt's prefill
  ///   observed: queries [Hq, N, d]: the pseudo tokens' queries (positions Lp ..), or the
  ///             prompt's last N post-RoPE queries (positions Lp - N ..), rotated here
  ///   result:   as kvevict::evict fills it; decoding resumes at position Lp
  status evict(const layer_cache<T>& cache, const layer_observations<Q>& observed, const layer_budget& b,
               eviction_result& result, workspace_span ws, const executor& exec = {}) const {
    static constexpr const char* fn = evict_name;
    // Sharded (b.shard), errors before the selection still reach the group (design.md §15).
    KVEVICT_RETURN_IF_ERROR(
        detail::fail_before_selection(b, detail::validate_query_view(observed.queries, fn, "queries"), fn));
    KVEVICT_RETURN_IF_ERROR(detail::fail_before_selection(b, detail::validate_layer_cache(cache, b, fn), fn));
    const query_view<const Q>& q = observed.queries;
    const std::int64_t prompt = prompt_tokens(cache.keys.num_tokens, q.num_queries);
    if (prompt < 0)
      return detail::fail_before_selection(
          b,
          status::error(errc::invalid_shape, fn, "cache.keys.num_tokens",
                        "expected the prompt and its %lld pseudo tokens, got %lld tokens",
                        static_cast<long long>(q.num_queries), static_cast<long long>(cache.keys.num_tokens)),
          fn);
    const layer_shape shape{q.num_heads, cache.keys.num_heads, cache.keys.head_dim, prompt, q.num_queries};
    return detail::evict_layer(
        fn, cache, observed, prompt, score_window_workspace_size(shape, exec), selection(), b, result, ws, exec,
        [&](score_view scores, workspace_span sws) { return score_window(cache, observed, scores, sws, exec); });
  }

  struct rotation {
    Q* queries = nullptr;
    std::int64_t* positions = nullptr;
  };
  rotation carve_rotation(detail::arena& a, std::int64_t heads, std::int64_t queries, std::int64_t dim) const noexcept {
    rotation r;
    if (config_.source != dapq_source::rerotated_window) return r;
    r.queries = a.take<Q>(detail::saturating_mul(detail::saturating_mul(heads, queries), dim));
    r.positions = a.take<std::int64_t>(queries);
    return r;
  }

  dapq_config config_;
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_DAPQ_HPP
