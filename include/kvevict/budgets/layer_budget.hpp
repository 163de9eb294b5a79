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
// tokens. Under tensor parallelism (`shard`, design.md §15) the scores are this rank's heads
// and AdaKV and the per-layer scope run across the group, with the same results.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvevict/budgets/adakv.hpp"
#include "kvevict/budgets/adakv_sharded.hpp"
#include "kvevict/budgets/layer_budget_params.hpp"
#include "kvevict/config.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/error.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/parallel/agreement.hpp"
#include "kvevict/parallel/head_shard.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/selection/scope.hpp"
#include "kvevict/selection/scope_sharded.hpp"
#include "kvevict/selection/select.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

namespace detail {

struct select_layer_layout {
  std::int64_t* head_budgets = nullptr;  ///< [Hkv] (AdaKV)
  float* shared_row = nullptr;           ///< [L] combined scores (per_layer scope)
  std::int64_t* shared_keep = nullptr;   ///< [2 + L] one head's CSR (per_layer scope)
  workspace_span adakv;                  ///< AdaKV's, or its sharded form's
  workspace_span gather;                 ///< sharded per_layer scope: the rows the group exchanges
  workspace_span select;
};

inline void carve_select_layer(arena& a, std::int64_t heads, std::int64_t tokens, const layer_budget& b,
                               const executor& exec, select_layer_layout* out) noexcept {
  const bool ada = b.heads == head_allocation::adakv;
  const bool shared = b.scope == selection_scope::per_layer;
  const bool sharded = b.shard.sharded();
  out->head_budgets = ada ? a.take<std::int64_t>(heads) : nullptr;
  out->shared_row = shared ? a.take<float>(tokens) : nullptr;
  out->shared_keep = shared ? a.take<std::int64_t>(saturating_add(tokens, 2)) : nullptr;
  const std::size_t ada_bytes = !ada ? 0
                                     : (sharded ? sharded_adakv_workspace_size(heads, tokens, b.shard.total_heads)
                                                : adakv_workspace_size(heads, tokens));
  out->adakv = take_bytes(a, ada_bytes, ada);
  out->gather = take_bytes(a, shared && sharded ? sharded_combine_workspace_size(tokens, b.combine, b.shard) : 0,
                           shared && sharded);
  out->select = take_bytes(a, select_workspace_size(tokens, exec), true);
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

namespace detail {

/// Whether this layer's selection needs the other ranks (AdaKV, one keep set per layer).
inline bool selects_across_ranks(const layer_budget& b) noexcept {
  return b.shard.sharded() && (b.heads == head_allocation::adakv || b.scope == selection_scope::per_layer);
}

/// select_layer's agreement round (parallel/agreement.hpp): every value the rest of the call
/// depends on, from every rank.
inline status agree_layer_selection(const const_score_view& scores, const selection_params& sel, const layer_budget& b,
                                    const status& local, const char* fn) noexcept {
  std::uint64_t alpha_bits = 0;
  std::memcpy(&alpha_bits, &b.adakv.alpha, sizeof(alpha_bits));
  const agreement_field fields[] = {
      {"scores.cols", static_cast<std::uint64_t>(scores.cols)},
      {"sel.protected_tail", static_cast<std::uint64_t>(sel.protected_tail)},
      {"sel.mode", static_cast<std::uint64_t>(sel.mode)},
      {"budget.per_head", static_cast<std::uint64_t>(b.per_head.resolve(scores.cols))},
      {"budget.layer_candidates", static_cast<std::uint64_t>(b.layer_candidates)},
      {"budget.heads", static_cast<std::uint64_t>(b.heads)},
      {"budget.scope", static_cast<std::uint64_t>(b.scope)},
      {"budget.combine", static_cast<std::uint64_t>(b.combine)},
      {"budget.adakv.alpha", alpha_bits},
      {"budget.adakv.normalize", b.adakv.normalize ? 1u : 0u},
      {"budget.adakv.rule", static_cast<std::uint64_t>(b.adakv.rule)},
      {"budget.shard.total_heads", static_cast<std::uint64_t>(b.shard.total_heads)},
  };
  static_assert(sizeof(fields) / sizeof(fields[0]) <= max_agreement_fields, "one agreement round");
  return agree(*b.shard.group, fn, "budget.shard.group", local, fields,
               static_cast<int>(sizeof(fields) / sizeof(fields[0])));
}

/// select_layer, with `incoming` the caller's status so far (evict() passes its scoring's):
/// sharded, a failure is carried through the group's rounds so that every rank returns an
/// error at the same point (parallel/agreement.hpp); otherwise it is returned as is.
inline status select_layer_impl(const const_score_view& scores, const selection_params& sel, const layer_budget& b,
                                const keep_list_view& out, workspace_span ws, const executor& exec, status local) {
  static constexpr const char* fn = "kvevict::select_layer";
  if (b.shard.sharded()) KVEVICT_RETURN_IF_ERROR(validate_collective(*b.shard.group, fn, "budget.shard.group"));
  const bool across = selects_across_ranks(b);
  if (!across) KVEVICT_RETURN_IF_ERROR(local);  // nobody waits for this rank
  if (local.ok()) local = validate_layer_budget(b, fn);
  if (local.ok() && scores.rows < 1)
    local = status::error(errc::invalid_shape, fn, "scores.rows", "expected >= 1 KV head, got %lld",
                          static_cast<long long>(scores.rows));
  if (local.ok() && sel.protected_tail < 0)
    local = status::error(errc::invalid_argument, fn, "sel.protected_tail", "expected >= 0, got %lld",
                          static_cast<long long>(sel.protected_tail));
  if (local.ok() && b.scope == selection_scope::per_sequence)
    local = status::error(errc::unsupported, fn, "budget.scope",
                          "a keep set shared by every layer is chosen from every layer's scores: use the compressor");
  if (local.ok()) local = validate_head_shard(b.shard, scores.rows, fn);
  if (local.ok() && across) local = validate_matrix_view(scores, scores.rows, scores.cols, fn, "scores");
  if (local.ok() && across && b.heads == head_allocation::adakv) {
    // AdaKV ranks the whole layer's candidates with 32-bit counts and keys.
    std::int64_t layer_candidates = 0;
    if (!checked_mul(b.shard.total_heads, scores.cols, &layer_candidates) ||
        layer_candidates > static_cast<std::int64_t>(UINT32_MAX))
      local =
          status::error(errc::overflow, fn, "scores", "expected fewer than 2^32 candidates in a layer, got %lld x %lld",
                        static_cast<long long>(b.shard.total_heads), static_cast<long long>(scores.cols));
  }
  arena a(ws);
  select_layer_layout layout;
  if (local.ok() || across) carve_select_layer(a, scores.rows, scores.cols, b, exec, &layout);
  if (local.ok() && a.overflowed())
    local = status::error(errc::workspace_too_small, fn, "ws",
                          "expected at least %zu bytes (select_layer_workspace_size), got %zu", a.used(), ws.size);
  if (!across) {
    KVEVICT_RETURN_IF_ERROR(local);
  } else if (b.shard.agree_shapes) {
    KVEVICT_RETURN_IF_ERROR(agree_layer_selection(scores, sel, b, local, fn));
  }
  if (b.scope == selection_scope::per_layer) {
    if (across) {
      KVEVICT_RETURN_IF_ERROR(combine_head_scores_sharded(scores, sel.protected_tail, b.combine, b.shard,
                                                          layout.shared_row, layout.gather, local, fn));
    } else {
      KVEVICT_RETURN_IF_ERROR(combine_head_scores(scores, sel.protected_tail, b.combine, layout.shared_row));
    }
    return select_shared(const_score_view{layout.shared_row, 1, scores.cols, scores.cols}, sel, b, out,
                         layout.shared_keep, layout.select, exec);
  }
  if (!allocates(b)) return select(scores, b.per_head, sel, out, layout.select, exec);
  const selection_params on_top{sel.protected_tail, protected_mode::on_top_of_budget};
  const std::int64_t mean = mean_candidates(b, scores.cols, sel);
  if (b.heads == head_allocation::uniform)
    return select(scores, budget::tokens(mean), on_top, out, layout.select, exec);
  if (across) {
    KVEVICT_RETURN_IF_ERROR(adakv_head_budgets_sharded(scores, sel.protected_tail, mean, b.adakv, b.shard,
                                                       layout.head_budgets, layout.adakv, local, fn));
  } else {
    KVEVICT_RETURN_IF_ERROR(
        adakv_head_budgets(scores, sel.protected_tail, mean, b.adakv, layout.head_budgets, layout.adakv));
  }
  return select(scores, layout.head_budgets, on_top, out, layout.select, exec);
}

/// An error found before a selection, on a rank of a sharded layer: the group's agreement
/// round still runs (with this rank's failure), so that no other rank waits for it.
inline status fail_before_selection(const layer_budget& b, const status& st, const char* fn) noexcept {
  if (st.ok() || !selects_across_ranks(b) || !b.shard.agree_shapes ||
      !validate_collective(*b.shard.group, fn, "budget.shard.group").ok())
    return st;
  // The same round (same word count) the other ranks make in select_layer; with this rank's
  // failure in it, every rank returns there.
  const status agreed = agree_layer_selection(const_score_view{}, selection_params{}, b, st, fn);
  return agreed.ok() ? st : agreed;
}

}  // namespace detail

/// Keep-lists of one layer under a layer budget (see the rule at the top of this header).
///
///   scores: [Hkv, L] float32 (the policy's scores; protected tail +inf); sharded
///           (b.shard): this rank's heads
///   sel:    the policy's selection (protected tail, and how it counts for uniform heads)
///   out:    CSR keep-list, capacity >= select_layer_capacity(Hkv, L, sel, b)
///   ws:     at least select_layer_workspace_size(Hkv, L, b, exec) bytes
///
/// Sharded with AdaKV or the per-layer scope, every rank of b.shard.group must make this call
/// (design.md §15); each gets the keep-lists one process holding every head would give its
/// heads, or an error (every rank, when one rank fails or passes a different shape).
inline status select_layer(const_score_view scores, const selection_params& sel, const layer_budget& b,
                           keep_list_view out, workspace_span ws, const executor& exec = {}) {
  return detail::select_layer_impl(scores, sel, b, out, ws, exec, status());
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_BUDGETS_LAYER_BUDGET_HPP
