// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_BUDGETS_ADAKV_SHARDED_HPP
#define KVEVICT_BUDGETS_ADAKV_SHARDED_HPP

// AdaKV head budgets when the layer's heads are spread over ranks (design.md §15). AdaKV
// counts, per head, how many of its candidates are among the layer's top Hkv*b (ties: smaller
// head, then smaller token; NaN last; -0 == +0). Sharded, no rank sees every score, so the
// threshold is found by a radix select over the selection keys (budgets/adakv.hpp's floats,
// through detail::score_key, whose unsigned order is the selection order): four rounds, one per
// key byte from the top, each an all-reduced 256-bin histogram of the keys that still match
// the prefix chosen so far. When the bin holding the k-th key is taken whole the search stops
// early; otherwise, after the last byte, the keys equal to the k-th are ties, and one more
// all-reduce of each head's tie count lets every rank give its heads the ties a single process
// would: the first ones in (global head, token) order. Counts are exact integers, so every
// rank's budgets equal the single-process budgets of its heads bit for bit.
//
// Per layer: at most 4 rounds of 257 words and 1 of total_heads + 1 words (the last word of
// each counts failed ranks, design.md §15). The kvpress_safeguard rule ranks what is left of each
// head after its own top f (budgets/adakv.hpp), k = total_heads*(b - f).

#include <cstddef>
#include <cstdint>

#include "kvevict/budgets/adakv.hpp"
#include "kvevict/config.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/detail/topk.hpp"
#include "kvevict/error.hpp"
#include "kvevict/parallel/agreement.hpp"
#include "kvevict/parallel/collective.hpp"
#include "kvevict/parallel/head_shard.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

constexpr std::int64_t radix_bins = 256;

struct sharded_adakv_layout {
  float* row = nullptr;            ///< [C] one head's candidates (normalised when asked)
  std::uint32_t* keys = nullptr;   ///< [H, C] their selection keys; each round keeps its survivors in front
  std::int64_t* alive = nullptr;   ///< [H] keys per head still matching the prefix chosen so far
  std::int64_t* picked = nullptr;  ///< [C] one head's top b (normalisation)
  std::uint32_t* words = nullptr;  ///< [max(256, total_heads) + 1] one round's payload
  topk_scratch topk;               ///< for rows of C
};

inline void carve_sharded_adakv(arena& a, std::int64_t heads, std::int64_t candidates, std::int64_t total_heads,
                                sharded_adakv_layout* out) noexcept {
  out->row = a.take<float>(candidates);
  out->keys = a.take<std::uint32_t>(saturating_mul(heads, candidates));
  out->alive = a.take<std::int64_t>(heads);
  out->picked = a.take<std::int64_t>(candidates);
  out->words = a.take<std::uint32_t>(saturating_add(total_heads > radix_bins ? total_heads : radix_bins, 1));
  carve_topk_scratch(a, candidates, &out->topk);
}

/// Bytes of workspace for `heads` local heads of up to `tokens` tokens, `total_heads` in all.
inline std::size_t sharded_adakv_workspace_size(std::int64_t heads, std::int64_t tokens,
                                                std::int64_t total_heads) noexcept {
  arena a;
  sharded_adakv_layout layout;
  carve_sharded_adakv(a, heads, tokens, total_heads, &layout);
  return a.used();
}

/// adakv_head_budgets for this rank's heads of a sharded layer. `scores` [H, L] are this
/// rank's heads (global heads shard.first_head ..); `b` and L must be the same on every rank
/// (agreed before: select_layer's agreement round or compressor::run's). `local` is this
/// rank's status so far: a failure rides on the first round so that every rank stops there.
inline status adakv_head_budgets_sharded(const_score_view scores, std::int64_t protected_tail, std::int64_t b,
                                         const adakv_params& params, const head_shard& shard, std::int64_t* out,
                                         workspace_span ws, status local, const char* fn) {
  const collective& group = *shard.group;
  const std::int64_t heads = scores.rows;
  const std::int64_t candidates = scores.cols > protected_tail ? scores.cols - protected_tail : 0;
  // kvpress_safeguard's forced picks per head (0 under the paper rule), which leave the ranking.
  const bool safeguard = params.rule == adakv_rule::kvpress_safeguard;
  const std::int64_t forced = safeguard && b < candidates ? adakv_safeguard(b, protected_tail, params) : 0;
  // Every rank takes these exits together: b, L, the tail and the parameters are agreed.
  if (b >= candidates || b == forced) {
    if (!local.ok()) return local;
    for (std::int64_t h = 0; h < heads; ++h)
      out[h] = b >= candidates ? candidates : (safeguard ? forced : adakv_head_budget(0, b, candidates, params));
    return status();
  }
  arena a(ws);
  sharded_adakv_layout lay;
  carve_sharded_adakv(a, heads, candidates, shard.total_heads, &lay);
  if (local.ok() && a.overflowed())
    local =
        status::error(errc::workspace_too_small, fn, "ws", "expected at least %zu bytes, got %zu", a.used(), ws.size);
  // Each head's keys once; the rounds then scan only the keys still in the running, and count
  // per head those a round puts above the threshold.
  if (local.ok())
    for (std::int64_t h = 0; h < heads; ++h) {
      adakv_head_row(scores, h, candidates, b, params, lay.row, lay.picked, lay.topk);
      if (forced > 0) top_k_ascending(lay.row, candidates, forced, lay.picked, lay.topk);
      std::uint32_t* keys = lay.keys + h * candidates;
      std::int64_t n = 0, p = 0;
      for (std::int64_t j = 0; j < candidates; ++j) {
        if (p < forced && lay.picked[p] == j) {
          ++p;
          continue;
        }
        keys[n++] = score_key(lay.row[j]);
      }
      lay.alive[h] = n;
      out[h] = 0;
    }
  const std::int64_t local_heads = local.ok() ? heads : 0;

  // Radix select of the k-th largest key, k = total_heads * (b - f) (< 2^32: plan and select_layer
  // check the layer's candidates), one byte per round from the top.
  std::uint32_t histogram[radix_bins + 1];
  std::uint64_t need = static_cast<std::uint64_t>(shard.total_heads) * static_cast<std::uint64_t>(b - forced);
  bool whole_bin = false;
  for (int shift = 24; shift >= 0 && !whole_bin; shift -= 8) {
    for (std::int64_t i = 0; i < radix_bins; ++i) histogram[i] = 0;
    histogram[radix_bins] = local.ok() ? 0u : 1u;
    for (std::int64_t h = 0; h < local_heads; ++h) {
      const std::uint32_t* keys = lay.keys + h * candidates;
      for (std::int64_t i = 0; i < lay.alive[h]; ++i) ++histogram[(keys[i] >> shift) & 0xffu];
    }
    KVEVICT_RETURN_IF_ERROR(all_reduce(group, histogram, radix_bins + 1, reduce_op::sum, fn, "budget.shard.group"));
    KVEVICT_RETURN_IF_ERROR(after_round(group, fn, "budget.shard.group", local, histogram[radix_bins]));
    std::uint64_t above = 0;
    std::uint32_t bin = radix_bins - 1;
    while (bin > 0 && above + histogram[bin] < need) above += histogram[bin--];
    need -= above;
    whole_bin = histogram[bin] == need;  // every key left in this bin is in: no ties to break
    for (std::int64_t h = 0; h < local_heads; ++h) {
      std::uint32_t* keys = lay.keys + h * candidates;
      std::int64_t kept = 0, picks = 0;
      for (std::int64_t i = 0; i < lay.alive[h]; ++i) {
        const std::uint32_t key = keys[i], digit = (key >> shift) & 0xffu;
        picks += digit > bin;
        if (digit == bin) keys[kept++] = key;
      }
      out[h] += picks + (whole_bin ? kept : 0);
      lay.alive[h] = kept;
    }
  }

  // The last bin split after the fourth byte: the keys left equal the k-th exactly. Every rank
  // gives its heads the first `need` of them in (global head, token) order.
  if (!whole_bin) {
    std::uint32_t* ties = lay.words;
    const std::int64_t total = shard.total_heads;
    for (std::int64_t g = 0; g <= total; ++g) ties[g] = 0;
    for (std::int64_t h = 0; h < heads; ++h) ties[shard.first_head + h] = static_cast<std::uint32_t>(lay.alive[h]);
    KVEVICT_RETURN_IF_ERROR(all_reduce(group, ties, total + 1, reduce_op::sum, fn, "budget.shard.group"));
    KVEVICT_RETURN_IF_ERROR(after_round(group, fn, "budget.shard.group", local, ties[total]));
    std::uint64_t before = 0;
    for (std::int64_t g = 0; g < shard.first_head; ++g) before += ties[g];
    for (std::int64_t h = 0; h < heads; ++h) {
      const std::uint64_t mine = ties[shard.first_head + h];
      const std::uint64_t left = need > before ? need - before : 0;
      out[h] += static_cast<std::int64_t>(left < mine ? left : mine);
      before += mine;
    }
  }
  for (std::int64_t h = 0; h < heads; ++h)
    out[h] = safeguard ? forced + out[h] : adakv_head_budget(out[h], b, candidates, params);
  return status();
}

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_BUDGETS_ADAKV_SHARDED_HPP
