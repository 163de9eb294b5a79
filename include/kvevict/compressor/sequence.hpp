// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_COMPRESSOR_SEQUENCE_HPP
#define KVEVICT_COMPRESSOR_SEQUENCE_HPP

// One sequence's part of a compressor call at one layer's attention hook (what the engine
// hands in, sequence_io) and what the call did to it (sequence_report).

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/dtype.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/index_ptr.hpp"
#include "kvevict/views/layer_cache.hpp"
#include "kvevict/views/query_view.hpp"

KVEVICT_NAMESPACE_BEGIN

/// What just happened to a sequence at this step.
enum class sequence_event : std::int32_t {
  idle,         ///< nothing for kvevict (a paused sequence; a prefill chunk, when the plan has no
                ///< chunked_prefill and the last chunk hands the whole window)
  prefill_end,  ///< the cache now holds the whole prompt (DapQ: the prompt and its pseudo tokens)
  decode,       ///< the cache now holds the step's decoded tokens (one, or k >= 1: see queries)
  /// a prompt chunk that is not the last (compressor_options::chunked_prefill): its queries'
  /// last rows go to the sequence's state; nothing is scored or evicted
  prefill_chunk,
};

/// One sequence at one layer. The cache views describe the layer's K and V after this step's
/// tokens were written (the engine's attention has run on them); the queries are this step's
/// post-RoPE queries, in time order, with their positions:
///   prefill_end: at least the policy's observation window (compressor::observation_window():
///                SnapKV/DeferKV the last W prompt queries, or all of a shorter prompt; DapQ the
///                N pseudo queries or, for its re-rotated variant, the last N prompt queries;
///                H2O every prompt query); more rows are fine, the last ones are used. Fewer are
///                refused (seqs[i].queries.num_queries): with chunked prefill, plan
///                chunked_prefill and hand the earlier chunks as prefill_chunk (their rows
///                count towards the window, before this call's), or keep the last W queries of
///                the earlier chunks and hand the whole window with the last chunk.
///                StreamingLLM, KNorm and KeyDiff read none.
///   prefill_chunk: the chunk's queries (any number; positions after the previous chunk's).
///   decode:      the step's queries, one per decoded token (k >= 1: speculative verification's
///                accepted tokens, multi-token prediction), in time order. Only DeferKV reads
///                them: its d counts decoded tokens, the k tokens are observed one after another
///                exactly as k one-token steps, and it evicts at the end of the step that brings
///                the count to d or past it (every token of that step observed and protected).
template <class T, class Q = default_query_type_t<T>>
struct sequence_io {
  sequence_event event = sequence_event::idle;
  cache_view<T> keys;           ///< [Hkv, L, d], mutable: eviction compacts it in place
  cache_view<T> values;         ///< [Hkv, L, dv]
  query_view<const Q> queries;  ///< [Hq, W, d] with positions (Q: the plan's query type); see above
  /// [L] position of every cached token (llama.cpp cells), or null for position j.
  index_ptr key_positions = nullptr;
  /// Optional flash-attention log-sum-exp of the queries ([Hq, W] natural log, rows
  /// lse_head_stride apart; 0 means W): one sweep over K instead of two (softmax over
  /// visible keys only; not for DeferKV, which normalises its own observations, nor for DapQ,
  /// which normalises over the prompt's keys for queries moved or unseen by the engine). Read only
  /// when this call's queries hold the whole window: a window assembled with the rows of
  /// earlier prefill chunks is normalised by kvevict.
  const float* lse = nullptr;
  std::int64_t lse_head_stride = 0;
  /// The sequence's compressor state (compressor::sequence_state_size() bytes, set up by
  /// compressor::reset_sequence), for DeferKV, selection_scope::per_sequence and chunked_prefill; null when
  /// that size is 0.
  void* state = nullptr;

  /// Blocks shared by prefix caching (paged caches): references to each block of the pool
  /// (> 1: shared) or a bitmap of shared blocks. In place, an eviction that would write a
  /// shared block is refused (the call fails, naming the block): use compaction::out_of_place.
  /// Required with every paged sequence compacted in place under block_sharing::marked
  /// (compressor_options::sharing). A block reached by two sequences of one call is refused in
  /// place whether marked or not.
  const std::int32_t* block_refcounts = nullptr;
  const std::uint32_t* shared_blocks = nullptr;
  /// compaction::out_of_place: where this layer's kept rows go (fresh blocks of the same layout;
  /// room for compressor::keep_capacity_per_head(keys.num_tokens) rows: what a head of this
  /// sequence may keep). keys and values stay as they were. Read under out_of_place only: the
  /// other modes ignore them, on the CPU as on the GPU.
  cache_view<T> dst_keys;
  cache_view<T> dst_values;
  /// selection_scope::per_sequence (unless compaction::keep_list_only): every layer's cache
  /// [num_layers], this one's included; the last layer's call compacts them all with the
  /// sequence's keep set.
  const layer_cache<T>* layers = nullptr;

  /// Outputs, optional, written only when the call evicts the sequence:
  std::int64_t* head_lengths = nullptr;    ///< [Hkv]: tokens each head holds now
  std::int64_t* kept_positions = nullptr;  ///< [keep_capacity()]: see sequence_report::kept
  /// [Hkv, keep_capacity_per_head()]: head h's kept token indices, ascending, then -1 padding
  /// (SGLang's selection format; the valid lengths are head_lengths).
  std::int64_t* padded_indices = nullptr;
  /// [changed_blocks_capacity()]: blocks the compaction wrote (see sequence_report).
  std::int32_t* changed_blocks = nullptr;
  /// [Hkv]: trailing block-table entries each head no longer uses (per-head block tables:
  /// paged_per_head; with one shared table every head reports freed_blocks).
  std::int64_t* head_freed_blocks = nullptr;

  /// This layer's cache as a policy's evict() takes it.
  layer_cache<T> cache() const noexcept {
    layer_cache<T> c(keys, values);
    c.dst_keys = dst_keys;
    c.dst_values = dst_values;
    c.block_refcounts = block_refcounts;
    c.shared_blocks = shared_blocks;
    return c;
  }
};

/// The runtime-dtype form of sequence_io: views with `void*`-like data (any_element), whose
/// element types are the plan's model.storage and model.query_storage tags. Engines that pick
/// the dtype at run time fill these and call compressor::run without naming a type.
using any_sequence_io = sequence_io<any_element, any_element>;
using any_cache_view = cache_view<any_element>;
using any_query_view = query_view<const any_element>;
using any_layer_cache = layer_cache<any_element>;

namespace detail {
/// A query view of the last `keep` observations of `q` (all of them when it has fewer).
template <class T>
query_view<const T> last_queries(const query_view<const T>& q, std::int64_t keep) noexcept {
  if (q.num_queries <= keep) return q;
  query_view<const T> r = q;
  const std::int64_t skip = q.num_queries - keep;
  // Policies that read no queries (StreamingLLM, KNorm) accept null data and positions.
  r.data = q.data != nullptr ? q.data + skip * q.query_stride : nullptr;
  r.positions = q.positions != nullptr ? q.positions + skip : nullptr;
  r.num_queries = keep;
  return r;
}

/// The typed views of an erased sequence (`layers`, when set, is rewritten to `typed_layers`,
/// [num_layers] filled here).
template <class T, class Q>
sequence_io<T, Q> typed_sequence(const any_sequence_io& in, layer_cache<T>* typed_layers,
                                 std::int64_t num_layers) noexcept {
  sequence_io<T, Q> out;
  out.event = in.event;
  out.keys = in.keys.with_element<T>();
  out.values = in.values.with_element<T>();
  out.queries = in.queries.with_element<const Q>();
  out.key_positions = in.key_positions;
  out.lse = in.lse;
  out.lse_head_stride = in.lse_head_stride;
  out.state = in.state;
  out.block_refcounts = in.block_refcounts;
  out.shared_blocks = in.shared_blocks;
  out.dst_keys = in.dst_keys.with_element<T>();
  out.dst_values = in.dst_values.with_element<T>();
  if (in.layers != nullptr && typed_layers != nullptr) {  // (only the per-sequence scope reads them)
    for (std::int64_t l = 0; l < num_layers; ++l) {
      const any_layer_cache& c = in.layers[l];
      layer_cache<T>& t = typed_layers[l];
      t.keys = c.keys.with_element<T>();
      t.values = c.values.with_element<T>();
      t.dst_keys = c.dst_keys.with_element<T>();
      t.dst_values = c.dst_values.with_element<T>();
      t.block_refcounts = c.block_refcounts;
      t.shared_blocks = c.shared_blocks;
      t.compact = c.compact;
    }
    out.layers = typed_layers;
  }
  out.head_lengths = in.head_lengths;
  out.kept_positions = in.kept_positions;
  out.padded_indices = in.padded_indices;
  out.changed_blocks = in.changed_blocks;
  out.head_freed_blocks = in.head_freed_blocks;
  return out;
}
}  // namespace detail

/// What the call did to a sequence.
enum class sequence_action : std::int32_t {
  none,      ///< nothing (idle, or a decode step after eviction)
  observed,  ///< the state took this layer's observation (DeferKV's queries, a per-sequence
             ///< scope's scores); eviction comes later
  evicted,   ///< the keep set was chosen and applied (compacted, or reported: keep_list_only)
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
  /// Tokens the sequence dropped at this call: L before minus `length` after (LMCache's
  /// kvLen = logicalLen - dropped under uniform lengths).
  std::int64_t dropped = 0;
  /// Entries written to changed_blocks: the physical blocks whose content changed (in place)
  /// or was written (out of place), once per call (the same blocks in every layer when layers
  /// share a block table). Drop their prefix-cache hashes.
  std::int64_t num_changed_blocks = 0;
  /// Non-finite values (NaN, +-inf) this call met in what it scores with: the observation
  /// queries it read, and the keys (every key at prefill_end; the step's new ones at a decode step
  /// DeferKV observes; none for StreamingLLM). Scoring absorbs them by design (such a key
  /// scores lowest, such a query observes nothing); these counts tell the engine it happened.
  std::int64_t nonfinite_queries = 0;
  std::int64_t nonfinite_keys = 0;
  /// Candidates (tokens the selection chose among, over every head; protected ones excluded)
  /// whose score was NaN or -inf at the eviction (+inf is the "always keep" score of sinks) (a keep set shared by every
  /// layer: this layer's scores, counted at each layer's fold). Non-finite inputs, or a score that overflowed;
  /// selection ranks them by design (NaN last).
  std::int64_t nonfinite_scores = 0;
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_COMPRESSOR_SEQUENCE_HPP
