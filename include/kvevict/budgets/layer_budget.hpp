// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_BUDGETS_LAYER_BUDGET_HPP
#define KVEVICT_BUDGETS_LAYER_BUDGET_HPP

// How many tokens one layer keeps and how they spread over its KV heads: the budget part of
// a policy's evict() and of the compressor. It resolves to keep-lists through the shared
// selection (selection/select.hpp), optionally after AdaKV head budgets (budgets/adakv.hpp);
// PyramidKV (budgets/pyramidkv.hpp) sets `layer_candidates` per layer.
//
// The rule, with B the per-head budget resolved against the layer's L tokens and P the
// policy's protected tail (its selection_params):
//   uniform heads, no layer override:  kvevict::select(scores, B, the policy's selection)
//   otherwise the layer's mean candidates per head are
//        b = layer_candidates            when set (>= 0: a layer allocator chose it), else
//        b = candidates_kept(B, L, sel)  (B - P inside the budget, B on top of it),
//   uniform heads select b candidates per head, AdaKV heads adakv_head_budgets(b), and in both
//   cases the protected tail comes on top (protected_mode::on_top_of_budget).
// So a uniform layer keeps exactly what kvevict::select keeps with the policy's own
// selection, and an allocator moves candidates between layers or heads, never the protected
// tokens.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvevict/budgets/adakv.hpp"
#include "kvevict/config.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/error.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/selection/scope.hpp"
#include "kvevict/selection/select.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

/// How a layer's budget spreads over its KV heads.
enum class head_allocation : std::int32_t {
  uniform,  ///< every head keeps the same number of tokens
  adakv,    ///< AdaKV: heads compete for the layer's Hkv * b candidates (floor alpha * b each)
};

/// The budget of one layer.
struct layer_budget {
  budget per_head = budget::tokens(0);  ///< B: tokens per KV head, or a compression ratio of L
  head_allocation heads = head_allocation::uniform;
  adakv_params adakv;  ///< with head_allocation::adakv
  /// Mean candidates per head chosen by a layer allocator (PyramidKV), overriding what
  /// per_head leaves for candidates; -1: none. The protected tail comes on top.
  std::int64_t layer_candidates = -1;
  /// selection_scope::per_layer: one keep set for all heads, chosen from their scores
  /// combined by `combine` (selection/scope.hpp). per_sequence is the compressor's (it sees
  /// every layer); select_layer takes per_head and per_layer.
  selection_scope scope = selection_scope::per_head;
  scope_combine combine = scope_combine::normalized_max;
};

namespace detail {

/// Candidates per head the layer keeps on average (before AdaKV moves them between heads).
inline std::int64_t mean_candidates(const layer_budget& b, std::int64_t tokens, const selection_params& sel) noexcept {
  if (b.layer_candidates >= 0) {
    const std::int64_t protect = sel.protected_tail < tokens ? sel.protected_tail : tokens;
    const std::int64_t candidates = tokens - protect;
    return b.layer_candidates < candidates ? b.layer_candidates : candidates;
  }
  return candidates_kept(b.per_head.resolve(tokens), tokens, sel);
}

/// Whether selection takes the allocator route (candidates with the tail on top).
inline bool allocates(const layer_budget& b) noexcept {
  return b.heads != head_allocation::uniform || b.layer_candidates >= 0;
}

/// An upper bound on the keep-list entries of one layer of Hkv heads and up to `tokens`
/// tokens under this budget (every bound grows with L, so the largest L bounds them all).
inline std::int64_t layer_keep_capacity(std::int64_t heads, std::int64_t tokens, const selection_params& sel,
                                        const layer_budget& b) noexcept {
  if (heads < 1 || tokens < 1) return 0;
  const std::int64_t protect = sel.protected_tail < 0 ? 0 : (sel.protected_tail < tokens ? sel.protected_tail : tokens);
  const std::int64_t candidates = tokens - protect;
  const std::int64_t mean = mean_candidates(b, tokens, sel);
  std::int64_t kept = saturating_mul(heads, mean);
  if (b.heads == head_allocation::adakv) kept = saturating_add(kept, (heads + 1) / 2);  // rounding: < 1/2 per head
  const std::int64_t all = saturating_mul(heads, candidates);
  return saturating_add(kept < all ? kept : all, saturating_mul(heads, protect));
}

struct select_layer_layout {
  std::int64_t* head_budgets = nullptr;  ///< [Hkv] (AdaKV)
  float* shared_row = nullptr;           ///< [L] combined scores (per_layer scope)
  std::int64_t* shared_keep = nullptr;   ///< [2 + L] one head's CSR (per_layer scope)
  workspace_span adakv;
  workspace_span select;
};

inline void carve_select_layer(arena& a, std::int64_t heads, std::int64_t tokens, const layer_budget& b,
                               const executor& exec, select_layer_layout* out) noexcept {
  const bool ada = b.heads == head_allocation::adakv;
  const bool shared = b.scope == selection_scope::per_layer;
  out->head_budgets = ada ? a.take<std::int64_t>(heads) : nullptr;
  out->shared_row = shared ? a.take<float>(tokens) : nullptr;
  out->shared_keep = shared ? a.take<std::int64_t>(saturating_add(tokens, 2)) : nullptr;
  const std::size_t ada_bytes = ada ? adakv_workspace_size(heads, tokens) : 0;
  out->adakv = {ada ? a.take<unsigned char>(static_cast<std::int64_t>(ada_bytes)) : nullptr, ada_bytes};
  const std::size_t sel_bytes = select_workspace_size(tokens, exec);
  out->select = {a.take<unsigned char>(static_cast<std::int64_t>(sel_bytes)), sel_bytes};
}

inline status validate_layer_budget(const layer_budget& b, const char* fn) noexcept {
  if (b.per_head.type != budget::kind::tokens && b.per_head.type != budget::kind::ratio)
    return status::error(errc::invalid_argument, fn, "budget.per_head.type", "expected tokens or ratio, got %d",
                         static_cast<int>(b.per_head.type));
  if (b.per_head.type == budget::kind::ratio &&
      !(b.per_head.compression_ratio >= 0.0 && b.per_head.compression_ratio <= 1.0))
    return status::error(errc::invalid_argument, fn, "budget.per_head",
                         "expected a compression ratio in [0, 1], got %g", b.per_head.compression_ratio);
  if (b.per_head.type == budget::kind::tokens && b.per_head.count < 0)
    return status::error(errc::invalid_argument, fn, "budget.per_head", "expected >= 0 tokens, got %lld",
                         static_cast<long long>(b.per_head.count));
  if (static_cast<unsigned>(b.heads) > 1u)
    return status::error(errc::invalid_argument, fn, "budget.heads", "expected a head_allocation value, got %d",
                         static_cast<int>(b.heads));
  if (b.heads == head_allocation::adakv && !(b.adakv.alpha >= 0.0 && b.adakv.alpha <= 1.0))
    return status::error(errc::invalid_argument, fn, "budget.adakv.alpha", "expected alpha in [0, 1], got %g",
                         b.adakv.alpha);
  if (b.layer_candidates < -1)
    return status::error(errc::invalid_argument, fn, "budget.layer_candidates", "expected -1 (none) or >= 0, got %lld",
                         static_cast<long long>(b.layer_candidates));
  if (static_cast<unsigned>(b.scope) > 2u)
    return status::error(errc::invalid_argument, fn, "budget.scope", "expected a selection_scope value, got %d",
                         static_cast<int>(b.scope));
  if (static_cast<unsigned>(b.combine) > 3u)
    return status::error(errc::invalid_argument, fn, "budget.combine", "expected a scope_combine value, got %d",
                         static_cast<int>(b.combine));
  if (b.scope != selection_scope::per_head && b.heads == head_allocation::adakv)
    return status::error(errc::unsupported, fn, "budget.heads",
                         "AdaKV gives each head its own budget; heads that share one keep set have one budget");
  return status();
}

/// Writes one head's keep-list (ascending indices[0, n)) as every head's: CSR over `heads`.
inline void broadcast_keep(const std::int64_t* indices, std::int64_t n, const keep_list_view& out) noexcept {
  out.offsets[0] = 0;
  for (std::int64_t h = 0; h < out.num_heads; ++h) {
    for (std::int64_t i = 0; i < n; ++i) out.indices[h * n + i] = indices[i];
    out.offsets[h + 1] = (h + 1) * n;
  }
}

}  // namespace detail

/// Bytes of workspace `select_layer` needs for [Hkv, L] scores (L an upper bound).
inline std::size_t select_layer_workspace_size(std::int64_t num_kv_heads, std::int64_t num_tokens,
                                               const layer_budget& b, const executor& exec = {}) noexcept {
  detail::arena a;
  detail::select_layer_layout layout;
  detail::carve_select_layer(a, num_kv_heads, num_tokens, b, exec, &layout);
  return a.used();
}

/// Keep-list entries `select_layer` may write for Hkv heads and up to L tokens.
inline std::int64_t select_layer_capacity(std::int64_t num_kv_heads, std::int64_t num_tokens,
                                          const selection_params& sel, const layer_budget& b) noexcept {
  return detail::layer_keep_capacity(num_kv_heads, num_tokens, sel, b);
}

/// One keep set for every head of `out`, selected from a combined score row [1, L] under the
/// layer budget rule (uniform heads); `scratch` holds 2 + L indices, `ws` select's workspace.
inline status select_shared(const_score_view row, const selection_params& sel, const layer_budget& b,
                            const keep_list_view& out, std::int64_t* scratch, workspace_span ws,
                            const executor& exec = {}) {
  static constexpr const char* fn = "kvevict::select_layer";
  if (out.offsets == nullptr) return status::error(errc::null_pointer, fn, "out.offsets", "expected non-null");
  const keep_list_view one{1, scratch, scratch + 2, row.cols};
  if (detail::allocates(b)) {
    const selection_params on_top{sel.protected_tail, protected_mode::on_top_of_budget};
    KVEVICT_RETURN_IF_ERROR(
        select(row, budget::tokens(detail::mean_candidates(b, row.cols, sel)), on_top, one, ws, exec));
  } else {
    KVEVICT_RETURN_IF_ERROR(select(row, b.per_head, sel, one, ws, exec));
  }
  const std::int64_t n = one.size(0);
  std::int64_t total = 0;
  if (!detail::checked_mul(n, out.num_heads, &total) || total > out.capacity)
    return status::error(errc::invalid_keep_list, fn, "out.capacity", "expected >= %lld kept tokens, got %lld",
                         static_cast<long long>(total), static_cast<long long>(out.capacity));
  if (total > 0 && out.indices == nullptr)
    return status::error(errc::null_pointer, fn, "out.indices", "expected non-null");
  detail::broadcast_keep(one.indices, n, out);
  return status();
}

/// Keep-lists of one layer under a layer budget (see the rule at the top of this header).
///
///   scores: [Hkv, L] float32 (the policy's scores; protected tail +inf)
///   sel:    the policy's selection (protected tail, and how it counts for uniform heads)
///   out:    CSR keep-list, capacity >= select_layer_capacity(Hkv, L, sel, b)
///   ws:     at least select_layer_workspace_size(Hkv, L, b, exec) bytes
inline status select_layer(const_score_view scores, const selection_params& sel, const layer_budget& b,
                           keep_list_view out, workspace_span ws, const executor& exec = {}) {
  static constexpr const char* fn = "kvevict::select_layer";
  KVEVICT_RETURN_IF_ERROR(detail::validate_layer_budget(b, fn));
  if (scores.rows < 1)
    return status::error(errc::invalid_shape, fn, "scores.rows", "expected >= 1 KV head, got %lld",
                         static_cast<long long>(scores.rows));
  if (sel.protected_tail < 0)
    return status::error(errc::invalid_argument, fn, "sel.protected_tail", "expected >= 0, got %lld",
                         static_cast<long long>(sel.protected_tail));
  if (b.scope == selection_scope::per_sequence)
    return status::error(errc::unsupported, fn, "budget.scope",
                         "a keep set shared by every layer is chosen from every layer's scores: use the compressor");
  detail::arena a(ws);
  detail::select_layer_layout layout;
  detail::carve_select_layer(a, scores.rows, scores.cols, b, exec, &layout);
  if (a.overflowed())
    return status::error(errc::workspace_too_small, fn, "ws",
                         "expected at least %zu bytes (select_layer_workspace_size), got %zu", a.used(), ws.size);
  if (b.scope == selection_scope::per_layer) {
    KVEVICT_RETURN_IF_ERROR(combine_head_scores(scores, sel.protected_tail, b.combine, layout.shared_row));
    return select_shared(const_score_view{layout.shared_row, 1, scores.cols, scores.cols}, sel, b, out,
                         layout.shared_keep, layout.select, exec);
  }
  if (!detail::allocates(b)) return select(scores, b.per_head, sel, out, layout.select, exec);
  const selection_params on_top{sel.protected_tail, protected_mode::on_top_of_budget};
  const std::int64_t mean = detail::mean_candidates(b, scores.cols, sel);
  if (b.heads == head_allocation::uniform)
    return select(scores, budget::tokens(mean), on_top, out, layout.select, exec);
  KVEVICT_RETURN_IF_ERROR(
      adakv_head_budgets(scores, sel.protected_tail, mean, b.adakv, layout.head_budgets, layout.adakv));
  return select(scores, layout.head_budgets, on_top, out, layout.select, exec);
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_BUDGETS_LAYER_BUDGET_HPP
