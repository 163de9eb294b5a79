// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_BUDGETS_LAYER_BUDGET_PARAMS_HPP
#define KVEVICT_BUDGETS_LAYER_BUDGET_PARAMS_HPP

// A layer's budget as plain values, with the arithmetic and checks that need no scores
// (budgets/layer_budget.hpp selects with it; the CUDA header's select_layer includes only this).

#include <cstdint>

#include "kvevict/budgets/adakv_params.hpp"
#include "kvevict/config.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/error.hpp"
#include "kvevict/parallel/head_shard.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/selection/scope.hpp"

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
  /// Tensor parallelism: which of the layer's KV heads the scores are (none set: all of them).
  head_shard shard;
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
  // AdaKV moves candidates between heads; sharded, this rank's heads may take the candidates of
  // the whole layer's heads (capped below at every candidate of its own).
  const std::int64_t competing = b.heads == head_allocation::adakv && b.shard.sharded() ? b.shard.total_heads : heads;
  std::int64_t kept = saturating_mul(competing, mean);
  if (b.heads == head_allocation::adakv) kept = saturating_add(kept, (competing + 1) / 2);  // rounding: < 1/2 per head
  const std::int64_t all = saturating_mul(heads, candidates);
  return saturating_add(kept < all ? kept : all, saturating_mul(heads, protect));
}

inline status validate_layer_budget(const layer_budget& b, const char* fn) noexcept {
  if (b.shard.sharded() && b.scope == selection_scope::per_sequence)
    return status::error(errc::unsupported, fn, "budget.scope",
                         "a keep set shared by every layer is chosen from every layer's scores: use the compressor");
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

}  // namespace detail

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_BUDGETS_LAYER_BUDGET_PARAMS_HPP
