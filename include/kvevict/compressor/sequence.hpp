// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_COMPRESSOR_SEQUENCE_HPP
#define KVEVICT_COMPRESSOR_SEQUENCE_HPP

// One sequence's part of a compressor call at one layer's attention hook (what the engine
// hands in, sequence_io) and what the call did to it (sequence_report).

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/query_view.hpp"

KVEVICT_NAMESPACE_BEGIN

/// What just happened to a sequence at this step.
enum class sequence_event : std::int32_t {
  idle,         ///< nothing for kvevict (a prefill chunk that is not the last, a paused sequence)
  prefill_end,  ///< the cache now holds the whole prompt (DapQ: the prompt and its pseudo tokens)
  decode,       ///< the cache now holds one more decoded token
};

/// One sequence at one layer. The cache views describe the layer's K and V after this step's
/// tokens were written (the engine's attention has run on them); the queries are this step's
/// post-RoPE queries, in time order, with their positions:
///   prefill_end: at least the policy's observation window (compressor::observation_window():
///                SnapKV/DeferKV the last W prompt queries, DapQ the N pseudo queries or, for
///                its re-rotated variant, the last N prompt queries, H2O every prompt query it
///                should count); more rows are fine, the last ones are used. StreamingLLM and
///                KNorm read none.
///   decode:      the step's query (one per query head). Only DeferKV reads it.
template <class T>
struct sequence_io {
  sequence_event event = sequence_event::idle;
  cache_view<T> keys;           ///< [Hkv, L, d], mutable: eviction compacts it in place
  cache_view<T> values;         ///< [Hkv, L, dv]
  query_view<const T> queries;  ///< [Hq, W, d] with positions; see above
  /// [L] position of every cached token (llama.cpp cells), or null for position j.
  const std::int64_t* key_positions = nullptr;
  /// Optional flash-attention log-sum-exp of the queries ([Hq, W] natural log, rows
  /// lse_head_stride apart; 0 means W): one sweep over K instead of two (softmax over
  /// visible keys only; not for DeferKV, which normalises its own observations).
  const float* lse = nullptr;
  std::int64_t lse_head_stride = 0;
  /// The sequence's compressor state (compressor::sequence_state_size() bytes, set up by
  /// compressor::reset_sequence), for stateful policies (DeferKV); null when that size is 0.
  void* state = nullptr;
  /// Outputs, optional, written only when the call evicts the sequence:
  std::int64_t* head_lengths = nullptr;    ///< [Hkv]: tokens each head holds now
  std::int64_t* kept_positions = nullptr;  ///< [keep_capacity()]: see sequence_report::kept
};

/// What the call did to a sequence.
enum class sequence_action : std::int32_t {
  none,      ///< nothing (idle, or a decode step after eviction)
  observed,  ///< DeferKV folded this step's queries into the state; eviction comes later
  evicted,   ///< the cache was compacted
};

struct sequence_report {
  sequence_action action = sequence_action::none;
  /// Tokens the cache holds now: the longest head (every head, under uniform head budgets).
  std::int64_t length = 0;
  /// Where the next token's K/V row goes: `length`. After eviction this is NOT the next
  /// token's position.
  std::int64_t next_slot = 0;
  /// The RoPE position of the next token: one past the newest token's position (a decode
  /// step's query position; else the cache's last key position, or L), whatever was evicted
  /// (DapQ: the prompt length, as its pseudo tokens are taken back).
  std::int64_t next_position = 0;
  /// Paged caches: trailing block-table entries no head uses any more (return them to the
  /// allocator). 0 when strided or not evicted.
  std::int64_t freed_blocks = 0;
  /// Keep-list entries written to kept_positions when evicted: head h's kept tokens' original
  /// positions are the head_lengths[h] entries after those of heads 0 .. h-1.
  std::int64_t kept = 0;
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_COMPRESSOR_SEQUENCE_HPP
