// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_SELECTION_BUDGET_HPP
#define KVEVICT_SELECTION_BUDGET_HPP

// Budgets: how many tokens a KV head keeps, and how the protected tail counts against it.

#include <cstdint>

#include "kvevict/config.hpp"

KVEVICT_NAMESPACE_BEGIN

/// Tokens kept per KV head: an absolute count, or a compression ratio r that keeps
/// int(L * (1 - r)) of L tokens (kvpress's convention).
struct budget {
  enum class kind : std::int32_t { tokens, ratio };
  kind type = kind::tokens;
  std::int64_t count = 0;
  double compression_ratio = 0.0;

  static constexpr budget tokens(std::int64_t n) noexcept { return {kind::tokens, n, 0.0}; }
  static constexpr budget ratio(double compression_ratio) noexcept { return {kind::ratio, 0, compression_ratio}; }

  /// Tokens to keep out of `num_tokens` (a token count may exceed num_tokens; selection
  /// clamps). Total for every input, so size queries can call it before validation: a ratio
  /// outside [0, 1] or NaN (which select() rejects) resolves to a count clamped to
  /// [0, num_tokens] instead of an out-of-range float-to-integer conversion.
  constexpr std::int64_t resolve(std::int64_t num_tokens) const noexcept {
    if (type == kind::tokens) return count;
    const double kept = static_cast<double>(num_tokens) * (1.0 - compression_ratio);
    if (!(kept > 0.0)) return 0;  // also NaN
    if (kept >= static_cast<double>(num_tokens)) return num_tokens < 0 ? 0 : num_tokens;
    return static_cast<std::int64_t>(kept);
  }
};

/// Whether protected tail tokens count against the budget.
enum class protected_mode : std::int32_t {
  inside_budget,     ///< B tokens in total, protected ones included (kvpress)
  on_top_of_budget,  ///< B candidates plus every protected token (SnapKV reference)
};

/// The protected tail: the last `protected_tail` tokens are always kept; candidates are
/// [0, L - protected_tail).
struct selection_params {
  std::int64_t protected_tail = 0;
  protected_mode mode = protected_mode::inside_budget;
};

/// Candidates a head with budget B keeps out of L tokens. Protected tokens are kept even
/// when they alone exceed B.
constexpr std::int64_t candidates_kept(std::int64_t budget_tokens, std::int64_t num_tokens,
                                       const selection_params& p) noexcept {
  const std::int64_t protect = p.protected_tail < num_tokens ? p.protected_tail : num_tokens;
  const std::int64_t candidates = num_tokens - protect;
  const std::int64_t want = p.mode == protected_mode::inside_budget ? budget_tokens - protect : budget_tokens;
  return want < 0 ? 0 : (want > candidates ? candidates : want);
}

/// Tokens a head with budget B keeps in total (candidates kept + protected).
constexpr std::int64_t tokens_kept(std::int64_t budget_tokens, std::int64_t num_tokens,
                                   const selection_params& p) noexcept {
  const std::int64_t protect = p.protected_tail < num_tokens ? p.protected_tail : num_tokens;
  return candidates_kept(budget_tokens, num_tokens, p) + protect;
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_SELECTION_BUDGET_HPP
