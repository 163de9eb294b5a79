// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_SELECTION_SCOPE_SHARDED_HPP
#define KVEVICT_SELECTION_SCOPE_SHARDED_HPP

// One combined score per token when the layer's heads are spread over ranks: the shared
// selection scopes (per layer, per sequence) of design.md §14 under tensor parallelism (§15).
//
// The single-process rule folds the heads in head order (selection/scope.hpp): normalise each
// head, then nan_max or a float sum. A float sum depends on its order, so the ranks' partial
// sums could not be added by the transport and stay bit-exact. Instead the rows travel as their
// bit patterns in one u32 sum all-reduce (each rank writes its slots, the others add 0) and
// every rank folds them in the single-process order itself:
//   max rules:  each rank folds its own heads (the single-process code), and the rank rows
//               are folded in rank order. This equals the fold over all heads bit for bit:
//               nan_max's fold is the last NaN if there is one, else the first of the largest
//               values, and that composes over consecutive runs of heads.
//   mean rules: every head's raw row travels, and every rank runs the single-process fold
//               (detail::fold_row, then finish_mean) over the global heads in order. Raw rows,
//               not normalised ones, and fold_row out of line: both paths then run one copy of
//               the same machine code, so FMA contraction (GCC's default) cannot differ.
// Words per layer: world_size * L (max rules) or total_heads * L (mean rules), plus one that
// counts failed ranks, in one round.

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvevict/config.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/detail/pooling.hpp"
#include "kvevict/error.hpp"
#include "kvevict/parallel/agreement.hpp"
#include "kvevict/parallel/collective.hpp"
#include "kvevict/parallel/head_shard.hpp"
#include "kvevict/selection/scope.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

/// Rows the gather carries under `rule`.
inline std::int64_t sharded_combine_rows(scope_combine rule, const head_shard& s) noexcept {
  if (s.group == nullptr) return 0;
  return combines_by_max(rule) ? s.group->world_size : s.total_heads;
}

/// The gathered rows [rows * L + 1 words] and, for the mean rules, one row decoded [L].
inline void carve_sharded_combine(arena& a, std::int64_t tokens, scope_combine rule, const head_shard& s,
                                  std::uint32_t** words, float** row) noexcept {
  *words = a.take<std::uint32_t>(saturating_add(saturating_mul(sharded_combine_rows(rule, s), tokens), 1));
  *row = combines_by_max(rule) ? nullptr : a.take<float>(tokens);
}

/// Bytes of workspace combine_head_scores_sharded needs for rows of up to `tokens` tokens.
inline std::size_t sharded_combine_workspace_size(std::int64_t tokens, scope_combine rule,
                                                  const head_shard& s) noexcept {
  arena a;
  std::uint32_t* words = nullptr;
  float* row = nullptr;
  carve_sharded_combine(a, tokens, rule, s, &words, &row);
  return a.used();
}

inline std::uint32_t float_bits(float x) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}
inline float bits_float(std::uint32_t u) noexcept {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

/// combine_head_scores over the whole group: `scores` [H, L] are this rank's heads (global
/// shard.first_head ..), `out` [L] receives the combination of every rank's heads, the same
/// bits on every rank and the same as one process would compute. L and the tail must be the
/// same on every rank (agreed before); `local` is this rank's status so far.
inline status combine_head_scores_sharded(const_score_view scores, std::int64_t protected_tail, scope_combine rule,
                                          const head_shard& shard, float* out, workspace_span ws, status local,
                                          const char* fn) {
  const collective& group = *shard.group;
  const std::int64_t tokens = scores.cols;
  const std::int64_t candidates = tokens > protected_tail ? tokens - protected_tail : 0;
  const std::int64_t rows = sharded_combine_rows(rule, shard);
  const std::int64_t count = saturating_add(saturating_mul(rows, tokens), 1);
  arena a(ws);
  std::uint32_t* words = nullptr;
  float* decoded = nullptr;
  carve_sharded_combine(a, tokens, rule, shard, &words, &decoded);
  if (a.overflowed()) {
    // Without the buffer this rank cannot take part in the round: the others would wait. Only a
    // caller that skipped the workspace-size query gets here; compressor::run checks it first.
    return local.ok() ? status::error(errc::workspace_too_small, fn, "ws", "expected at least %zu bytes, got %zu",
                                      a.used(), ws.size)
                      : local;
  }
  for (std::int64_t i = 0; i < count; ++i) words[i] = 0;
  if (local.ok()) local = combine_head_scores(scores, protected_tail, rule, out);  // checks the view
  if (local.ok()) {
    if (combines_by_max(rule)) {
      std::uint32_t* slot = words + group.rank * tokens;
      for (std::int64_t j = 0; j < tokens; ++j) slot[j] = float_bits(out[j]);
    } else {
      for (std::int64_t h = 0; h < scores.rows; ++h) {
        const float* row = scores.row(h);
        std::uint32_t* slot = words + (shard.first_head + h) * tokens;
        for (std::int64_t j = 0; j < tokens; ++j) slot[j] = float_bits(row[j]);
      }
    }
  }
  words[count - 1] = local.ok() ? 0u : 1u;
  KVEVICT_RETURN_IF_ERROR(all_reduce(group, words, count, reduce_op::sum, fn, "budget.shard.group"));
  KVEVICT_RETURN_IF_ERROR(after_round(group, fn, "budget.shard.group", local, words[count - 1]));
  if (combines_by_max(rule)) {
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::uint32_t* slot = words + r * tokens;
      if (r == 0) {
        for (std::int64_t j = 0; j < tokens; ++j) out[j] = bits_float(slot[j]);
      } else {
        for (std::int64_t j = 0; j < tokens; ++j) out[j] = nan_max(out[j], bits_float(slot[j]));
      }
    }
    return status();
  }
  for (std::int64_t g = 0; g < rows; ++g) {
    const std::uint32_t* slot = words + g * tokens;
    for (std::int64_t j = 0; j < tokens; ++j) decoded[j] = bits_float(slot[j]);
    fold_row(out, decoded, tokens, candidates, rule, g == 0);
  }
  finish_mean(out, candidates, rows, rule);
  return status();
}

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_SELECTION_SCOPE_SHARDED_HPP
