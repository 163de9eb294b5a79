// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_BUDGETS_ADAKV_HPP
#define KVEVICT_BUDGETS_ADAKV_HPP

// AdaKV head budgets inside a layer (design.md §5): heads whose attention is spread
// out get more of the layer's Hkv*B tokens, concentrated heads fewer, every head at least
// floor(alpha*B).
//   1. optionally normalise: scale head h's scores by (sum of its top-B) / (sum of all), the
//      share of its mass a uniform budget would keep;
//   2. take the global top Hkv*B over all heads' candidates (ties: lower head, then lower
//      index), and count c_h picks per head;
//   3. head h keeps round(c_h*(1 - alpha) + floor(alpha*B)) candidates (round half to even,
//      as the Python reference does), clamped to [0, C].
// The sum is Hkv*B up to the floor and the rounding: floor(alpha*B) drops less than one token
// per head and rounding moves each head by at most half a token, so the sum lies in
// [Hkv*B - 1.5*Hkv, Hkv*B + Hkv/2] (e.g. Hkv = 1, B = 3, alpha = 0.5 gives 2).
// That is adakv_rule::paper. adakv_rule::kvpress_safeguard is kvpress's AdaKVPress instead: each
// head keeps its own top f first (adakv_safeguard), the global top Hkv*(B - f) of the remaining
// candidates is shared out, and the sum is exactly Hkv*B.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvevict/budgets/adakv_params.hpp"
#include "kvevict/config.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/detail/topk.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

namespace detail {
struct adakv_layout {
  float* flat = nullptr;           ///< [Hkv * C]
  std::int64_t* picked = nullptr;  ///< [Hkv * B] (at most Hkv * C)
  topk_scratch topk;
};
inline void carve_adakv_layout(arena& a, std::int64_t heads, std::int64_t candidates, adakv_layout* out) noexcept {
  const std::int64_t n = saturating_mul(heads, candidates);  // the size query sees unvalidated shapes
  out->flat = a.take<float>(n);
  out->picked = a.take<std::int64_t>(n);
  carve_topk_scratch(a, n, &out->topk);
}

/// Step 1 for one head: its candidates copied to `row` [C], scaled when normalising.
/// `picked` holds b indices. Shared with the sharded allocator (budgets/adakv_sharded.hpp),
/// which must produce the same floats.
inline void adakv_head_row(const const_score_view& scores, std::int64_t h, std::int64_t candidates, std::int64_t b,
                           const adakv_params& params, float* row, std::int64_t* picked, const topk_scratch& topk) {
  for (std::int64_t j = 0; j < candidates; ++j) row[j] = scores.at(h, j);
  if (params.normalize && b > 0) {
    top_k_ascending(row, candidates, b, picked, topk);
    double top = 0.0, total = 0.0;
    for (std::int64_t i = 0; i < b; ++i) top += static_cast<double>(row[picked[i]]);
    for (std::int64_t j = 0; j < candidates; ++j) total += static_cast<double>(row[j]);
    const double factor = (total > 0.0 && std::isfinite(total) && std::isfinite(top)) ? top / total : 1.0;
    for (std::int64_t j = 0; j < candidates; ++j) row[j] = static_cast<float>(static_cast<double>(row[j]) * factor);
  }
}

/// The kvpress_safeguard rule (0 <= f <= b < candidates): each head's top f leave its row, the
/// rest of every row is packed into `flat` [Hkv, C - f] in token order, and the global top
/// Hkv*(b - f) of that goes to the heads. Packing keeps the tie order (lower head, then lower
/// token) and lets the picks' head be a division, as in the paper rule.
inline void adakv_safeguard_budgets(const const_score_view& scores, std::int64_t candidates, std::int64_t b,
                                    std::int64_t f, std::int64_t* out, const adakv_layout& layout) {
  const std::int64_t heads = scores.rows, rest = candidates - f;
  for (std::int64_t h = 0; h < heads; ++h) {
    // Copied whole to where its packed form goes, then packed in place (the write position
    // never passes the read position); the forced picks are ascending, so one pass drops them.
    float* row = layout.flat + h * rest;
    for (std::int64_t j = 0; j < candidates; ++j) row[j] = scores.at(h, j);
    if (f == 0) continue;
    top_k_ascending(row, candidates, f, layout.picked, layout.topk);
    std::int64_t w = 0, p = 0;
    for (std::int64_t j = 0; j < candidates; ++j) {
      if (p < f && layout.picked[p] == j) {
        ++p;
        continue;
      }
      row[w++] = row[j];
    }
  }
  for (std::int64_t h = 0; h < heads; ++h) out[h] = f;
  const std::int64_t global = heads * (b - f);
  if (global > 0) {
    top_k_ascending(layout.flat, heads * rest, global, layout.picked, layout.topk);
    for (std::int64_t i = 0; i < global; ++i) ++out[layout.picked[i] / rest];
  }
}

}  // namespace detail

/// Bytes of workspace `adakv_head_budgets` needs for [num_kv_heads, num_tokens] scores.
inline std::size_t adakv_workspace_size(std::int64_t num_kv_heads, std::int64_t num_tokens) noexcept {
  detail::arena a;
  detail::adakv_layout layout;
  detail::carve_adakv_layout(a, num_kv_heads, num_tokens, &layout);
  return a.used();
}

/// scores: [Hkv, L] (candidates [0, L - protected_tail)); per_head_budget: B, the average
/// number of candidates a head keeps; out: [Hkv] candidates each head keeps (select them
/// with the per-head overload of kvevict::select and the same protected tail on top).
inline status adakv_head_budgets(const_score_view scores, std::int64_t protected_tail, std::int64_t per_head_budget,
                                 const adakv_params& params, std::int64_t* out, workspace_span ws) {
  static constexpr const char* fn = "kvevict::adakv_head_budgets";
  KVEVICT_RETURN_IF_ERROR(detail::validate_adakv_inputs(scores, protected_tail, per_head_budget, params, out, fn));
  const std::int64_t heads = scores.rows;
  const std::int64_t candidates = scores.cols > protected_tail ? scores.cols - protected_tail : 0;
  std::int64_t layer_candidates = 0;
  if (!detail::checked_mul(heads, candidates, &layer_candidates) ||
      layer_candidates > static_cast<std::int64_t>(std::numeric_limits<std::uint32_t>::max()))
    return status::error(errc::overflow, fn, "scores",
                         "expected fewer than 2^32 candidates in a layer, got %lld x %lld",
                         static_cast<long long>(heads), static_cast<long long>(candidates));
  detail::arena a(ws);
  detail::adakv_layout layout;
  detail::carve_adakv_layout(a, heads, candidates, &layout);
  if (a.overflowed())
    return status::error(errc::workspace_too_small, fn, "ws",
                         "expected at least %zu bytes (adakv_workspace_size), got %zu", a.used(), ws.size);

  if (per_head_budget >= candidates) {
    for (std::int64_t h = 0; h < heads; ++h) out[h] = candidates;
    return status();
  }
  const std::int64_t b = per_head_budget;
  if (params.rule == adakv_rule::kvpress_safeguard) {
    detail::adakv_safeguard_budgets(scores, candidates, b, detail::adakv_safeguard(b, protected_tail, params), out,
                                    layout);
    return status();
  }
  for (std::int64_t h = 0; h < heads; ++h)
    detail::adakv_head_row(scores, h, candidates, b, params, layout.flat + h * candidates, layout.picked, layout.topk);
  const std::int64_t global = heads * b;
  for (std::int64_t h = 0; h < heads; ++h) out[h] = 0;
  if (global > 0) {
    detail::top_k_ascending(layout.flat, heads * candidates, global, layout.picked, layout.topk);
    for (std::int64_t i = 0; i < global; ++i) ++out[layout.picked[i] / candidates];
  }
  for (std::int64_t h = 0; h < heads; ++h) out[h] = detail::adakv_head_budget(out[h], b, candidates, params);
  return status();
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_BUDGETS_ADAKV_HPP
