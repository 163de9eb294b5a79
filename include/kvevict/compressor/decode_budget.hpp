// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_COMPRESSOR_DECODE_BUDGET_HPP
#define KVEVICT_COMPRESSOR_DECODE_BUDGET_HPP

// Decode-time budget maintenance (compressor_options::decoding, design.md §13, "Long
// generation"): a long generation grows the cache by one row per token after the prompt was
// compressed once, so the compressor compresses each layer again, every N tokens, back to a
// target, with a scorer that observes the last decode queries.

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/policies/policy_config.hpp"
#include "kvevict/selection/budget.hpp"

KVEVICT_NAMESPACE_BEGIN

/// What the compressor keeps while a sequence decodes, after the prompt's one-shot
/// compression (compressor_options::policy at prefill_end; DeferKV's at its step d): prefill
/// policy + decode policy, as kvpress's PrefillDecodingPress. A prompt that should not be
/// compressed plans per_head = budget::ratio(0).
struct decode_budget {
  /// Tokens each KV head keeps after a decode-time compression, counting the decode policy's
  /// protected tail as its configuration says (inside the budget, or on top of it):
  /// budget::tokens(T), or budget::ratio(r), which compresses by r (keeps (1 - r) of the
  /// cache's length at that step). budget::tokens(0), the default, turns maintenance off.
  budget target = budget::tokens(0);
  /// N >= 1: a layer is compressed at the decode step that leaves it holding more than
  /// rows + N tokens per head, `rows` being what a compression keeps there (the target, and the
  /// protected tail when it comes on top; PyramidKV: the layer's share), so each compression
  /// serves N decoded tokens and the cache stays within rows + N after every decode call.
  std::int64_t interval = 64;
  /// The decode scorer, a scoring policy whose observations are the sequence's last decode
  /// queries (kept per layer in the sequence state): SnapKV-style attention over its window W
  /// (window_config's, protected as configured), TOVA (the newest query), H2O's accumulated
  /// attention over `window` queries, KNorm, StreamingLLM (its sinks and recent tokens),
  /// KeyDiff (key redundancy); ChunkKV on top of the chunkable ones. Not DeferKV or DapQ,
  /// which exist for the prompt.
  policy_config policy;
  /// H2O: the decode queries whose attention it accumulates (>= 1). Other scorers observe
  /// with their own configuration's window (0 here).
  std::int64_t window = 0;

  bool enabled() const noexcept { return !(target.type == budget::kind::tokens && target.count == 0); }
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_COMPRESSOR_DECODE_BUDGET_HPP
