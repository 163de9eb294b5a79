// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_SCORING_POLICY_HPP
#define KVEVICT_POLICIES_SCORING_POLICY_HPP

// The body of every policy's evict(): score -> budgets -> select -> compact one layer, in one
// status-checked call with one workspace. Policies that are a score() (StreamingLLM, KNorm,
// H2O, SnapKV, ChunkKV) inherit it from scoring_policy; DeferKV and DapQ call it with their
// own scoring step. Nothing moves before everything that can fail has been checked: the
// budget, the K and V views and the workspace up front, the scoring inputs by score(), the
// keep-list and block tables by evict(); a failed call leaves the cache as it was.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvevict/budgets/layer_budget.hpp"
#include "kvevict/config.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/detail/validate_eviction.hpp"
#include "kvevict/error.hpp"
#include "kvevict/eviction/evict.hpp"
#include "kvevict/eviction/evict_into.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/policies/layer_inputs.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/views/index_ptr.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

/// Scratch of one evict() call, carved in a fixed order.
struct evict_layer_layout {
  float* scores = nullptr;          ///< [Hkv, score_cols]
  std::int64_t* offsets = nullptr;  ///< [Hkv + 1]
  std::int64_t* indices = nullptr;  ///< [capacity]
  std::int64_t capacity = 0;
  workspace_span score;    ///< the policy's scoring workspace
  workspace_span select;   ///< select_layer's
  workspace_span compact;  ///< evict()'s (paged block-id check)
};

/// evict()'s paged block-id scratch for K and V caches of `heads` heads and up to `tokens`
/// tokens: at most one block per token of each head's table (per-head tables), so it is sized
/// without knowing the block size.
inline std::size_t compact_workspace_bound(std::int64_t heads, std::int64_t tokens) noexcept {
  arena a;
  std::int32_t* ids = nullptr;
  // Four views (source and destination K and V, out of place).
  carve_evict_layout(a, saturating_mul(saturating_mul(std::int64_t{4}, heads < 1 ? 1 : heads), tokens < 0 ? 0 : tokens),
                     &ids);
  return a.used();
}

inline workspace_span take_span(arena& a, std::size_t bytes) noexcept {
  return {
      a.take<unsigned char>(bytes > static_cast<std::size_t>(INT64_MAX) ? INT64_MAX : static_cast<std::int64_t>(bytes)),
      bytes};
}

inline void carve_evict_layer(arena& a, std::int64_t heads, std::int64_t score_cols, std::int64_t cache_tokens,
                              std::int64_t capacity, std::size_t score_bytes, const layer_budget& b,
                              const executor& exec, evict_layer_layout* out) noexcept {
  out->scores = a.take<float>(saturating_mul(heads, score_cols));
  out->offsets = a.take<std::int64_t>(saturating_add(heads, 1));
  out->indices = a.take<std::int64_t>(capacity);
  out->capacity = capacity;
  out->score = take_span(a, score_bytes);
  out->select = take_span(a, select_layer_workspace_size(heads, score_cols, b, exec));
  out->compact = take_span(a, compact_workspace_bound(heads, cache_tokens));
}

/// Bytes evict() needs: `shape` bounds the layer (L the most tokens a call sees), `sel` the
/// largest protected tail, `score_bytes` the policy's scoring workspace at that shape.
inline std::size_t evict_layer_workspace_size(const layer_shape& shape, std::int64_t score_cols,
                                              const selection_params& sel, std::size_t score_bytes,
                                              const layer_budget& b, const executor& exec) noexcept {
  arena a;
  evict_layer_layout layout;
  carve_evict_layer(a, shape.num_kv_heads, score_cols, shape.num_tokens,
                    layer_keep_capacity(shape.num_kv_heads, score_cols, sel, b), score_bytes, b, exec, &layout);
  return a.used();
}

/// The checks evict() runs before anything else: the budget, and K and V as one layer.
template <class T>
status validate_layer_cache(const layer_cache<T>& cache, const layer_budget& b, const char* fn) noexcept {
  KVEVICT_RETURN_IF_ERROR(validate_layer_budget(b, fn));
  KVEVICT_RETURN_IF_ERROR(validate_kv_views(cache.keys, cache.values, fn, "cache.keys", "cache.values"));
  if (!cache.out_of_place()) return check_kv_not_aliased(cache.keys, cache.values, fn, "cache.values");
  return validate_kv_views(cache.dst_keys, cache.dst_values, fn, "cache.dst_keys", "cache.dst_values");
}

/// The compaction step of evict(): in place, or into cache.dst_* when set.
template <class T>
status compact_layer(const layer_cache<T>& cache, const const_keep_list_view& keep, eviction_result& result,
                     workspace_span ws, index_ptr key_positions, const executor& exec) {
  eviction_options opt;
  opt.key_positions = key_positions;
  opt.block_refcounts = cache.block_refcounts;
  opt.shared_blocks = cache.shared_blocks;
  if (!cache.compact) {  // the keep set only: validated as evict() would, reported, nothing moves
    KVEVICT_RETURN_IF_ERROR(
        validate_eviction_sequence(cache.keys, cache.values, keep, "kvevict::evict", "keys", "values", "keep"));
    report_eviction(cache.keys, cache.values, keep, key_positions, result);
    result.num_changed_blocks = 0;
    return status();
  }
  if (cache.out_of_place())
    return evict_into(cache.keys, cache.values, cache.dst_keys, cache.dst_values, keep, result, ws, opt, exec);
  return evict(cache.keys, cache.values, keep, result, ws, opt, exec);
}

/// Candidates of `scores` (every column before the protected tail of each row) whose score is
/// NaN or -inf. +inf is kvevict's "always keep" score (StreamingLLM's sinks, protected
/// tokens), not a sign of bad data: it is not counted.
inline std::int64_t count_nonfinite_candidates(const const_score_view& scores, std::int64_t protected_tail) noexcept {
  const std::int64_t cand = scores.cols > protected_tail ? scores.cols - protected_tail : 0;
  std::int64_t n = 0;
  for (std::int64_t h = 0; h < scores.rows; ++h) {
    const float* row = scores.data + h * scores.row_stride;
    for (std::int64_t j = 0; j < cand; ++j) n += std::isnan(row[j]) || row[j] == -HUGE_VALF ? 1 : 0;
  }
  return n;
}

/// score -> select_layer -> evict for one layer. `score(scores, ws)` fills [Hkv, score_cols]
/// scores (score_cols <= L; keys past it are dropped: DapQ's pseudo tokens); `score_bytes`
/// is the scoring workspace it needs; `sel` is the policy's selection for this call.
template <class T, class Q, class ScoreFn>
status evict_layer(const char* fn, const layer_cache<T>& cache, const layer_observations<Q>& observed,
                   std::int64_t score_cols, std::size_t score_bytes, const selection_params& sel, const layer_budget& b,
                   eviction_result& result, workspace_span ws, const executor& exec, ScoreFn&& score) {
  static_assert(!std::is_const<T>::value, "evict() compacts the cache: pass views of mutable elements");
  // Sharded (b.shard), every rank reaches the selection's first collective, failed or not
  // (design.md §15): errors before it go through fail_before_selection, scoring's through it.
  KVEVICT_RETURN_IF_ERROR(fail_before_selection(b, validate_layer_cache(cache, b, fn), fn));
  const std::int64_t heads = cache.keys.num_heads, tokens = cache.keys.num_tokens;
  if (score_cols < 0 || score_cols > tokens)
    return fail_before_selection(
        b,
        status::error(errc::invalid_shape, fn, "cache.keys.num_tokens", "expected at least %lld tokens, got %lld",
                      static_cast<long long>(score_cols), static_cast<long long>(tokens)),
        fn);
  arena a(ws);
  evict_layer_layout layout;
  carve_evict_layer(a, heads, score_cols, tokens, layer_keep_capacity(heads, score_cols, sel, b), score_bytes, b, exec,
                    &layout);
  if (a.overflowed())
    return fail_before_selection(
        b,
        status::error(errc::workspace_too_small, fn, "ws",
                      "expected at least %zu bytes (the policy's evict_workspace_size), got %zu", a.used(), ws.size),
        fn);
  const status scored = score(score_view{layout.scores, heads, score_cols, score_cols}, layout.score);
  result.nonfinite_scores =
      scored.ok() ? count_nonfinite_candidates(const_score_view{layout.scores, heads, score_cols, score_cols},
                                               sel.protected_tail)
                  : 0;
  const keep_list_view keep{heads, layout.offsets, layout.indices, layout.capacity};
  KVEVICT_RETURN_IF_ERROR(select_layer_impl(const_score_view{layout.scores, heads, score_cols, score_cols}, sel, b,
                                            keep, layout.select, exec, scored));
  return compact_layer(cache, const_keep_list_view(keep), result, layout.compact, observed.observation.key_positions,
                       exec);
}

}  // namespace detail

/// The policy contract's evict() for policies that are a score(): Derived provides
/// score(layer_inputs, scores, ws, exec), workspace_size(shape, exec) and selection().
template <class Derived, class T, class Q = default_query_type_t<T>>
class scoring_policy {
 public:
  /// Bytes of workspace evict() needs for layers up to `shape` (L and W upper bounds).
  std::size_t evict_workspace_size(const layer_shape& shape, const layer_budget& b,
                                   const executor& exec = {}) const noexcept {
    const Derived& self = static_cast<const Derived&>(*this);
    return detail::evict_layer_workspace_size(shape, shape.num_tokens, self.selection(),
                                              self.workspace_size(shape, exec), b, exec);
  }

  /// Scores the keys of `cache` under `observed`, selects under `b`, compacts K and V in place.
  ///
  ///   cache:    the layer's mutable K [Hkv, L, dk] and V [Hkv, L, dv]
  ///   observed: what score() reads besides the keys (queries, key positions, LSE, rows)
  ///   b:        the layer's budget (per-head B, head allocation, layer override)
  ///   result:   as kvevict::evict fills it (lengths, positions, max_length, freed_blocks)
  ///   ws:       at least evict_workspace_size(shape, b, exec) bytes
  status evict(const layer_cache<T>& cache, const layer_observations<Q>& observed, const layer_budget& b,
               eviction_result& result, workspace_span ws, const executor& exec = {}) const {
    const Derived& self = static_cast<const Derived&>(*this);
    const layer_inputs<T, Q> in = inputs_of(cache, observed);
    const layer_shape shape{observed.queries.num_heads > 0 ? observed.queries.num_heads : cache.keys.num_heads,
                            cache.keys.num_heads, cache.keys.head_dim, cache.keys.num_tokens,
                            observed.queries.num_queries};
    return detail::evict_layer(
        Derived::evict_name, cache, observed, cache.keys.num_tokens, self.workspace_size(shape, exec), self.selection(),
        b, result, ws, exec, [&](score_view scores, workspace_span sws) { return self.score(in, scores, sws, exec); });
  }
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_SCORING_POLICY_HPP
