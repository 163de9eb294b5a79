// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_COMPRESSOR_DETAIL_STEP_EXECUTOR_HPP
#define KVEVICT_COMPRESSOR_DETAIL_STEP_EXECUTOR_HPP

// One sequence's step at one layer, after run()'s checks passed: observe (a deferred policy),
// then score -> budget -> select -> compact through the policy's own evict() (so the result
// equals the building blocks' bit for bit), or fold the layer's scores into the sequence's
// shared row and, at the last layer, select one keep set and compact every layer with it.
// Fills the sequence's report.

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kvevict/compressor/detail/run_checks.hpp"
#include "kvevict/compressor/sequence.hpp"
#include "kvevict/config.hpp"
#include "kvevict/dtype.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policies/layer_inputs.hpp"
#include "kvevict/policies/scoring_policy.hpp"
#include "kvevict/selection/scope.hpp"
#include "kvevict/selection/scope_sharded.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

/// T's bit pattern as an unsigned integer, and the bits that are all ones exactly in T's
/// non-finite values (NaN and infinity; e4m3 has only NaN, S.1111.111).
template <class T>
using storage_word =
    std::conditional_t<sizeof(T) == 4, std::uint32_t, std::conditional_t<sizeof(T) == 2, std::uint16_t, std::uint8_t>>;
template <class T>
constexpr storage_word<T> nonfinite_mask() noexcept {
  if constexpr (std::is_same<T, float>::value) {
    return 0x7f800000u;
  } else if constexpr (std::is_same<T, fp16>::value) {
    return 0x7c00u;
  } else if constexpr (std::is_same<T, bf16>::value) {
    return 0x7f80u;
  } else if constexpr (std::is_same<T, fp8_e4m3>::value) {
    return 0x7fu;
  } else {
    static_assert(std::is_same<T, fp8_e5m2>::value, "a storage type");
    return 0x7cu;
  }
}

/// Elements of a row (n of them, `stride` apart) that are NaN or infinite. A test of the
/// exponent bits, not of the widened value: a decode-time compression counts every key of the
/// layer, and the bit test vectorises where widening each element did not.
template <class T>
std::int64_t count_nonfinite(const T* row, std::int64_t n, std::int64_t stride) noexcept {
  using word = storage_word<T>;
  constexpr word mask = nonfinite_mask<T>();
  static_assert(is_storage_type<T>::value && sizeof(word) == sizeof(T), "a storage type is its bits");
  const auto nonfinite = [](const T* x) -> word {
    word bits;
    std::memcpy(&bits, x, sizeof(word));
    return (bits & mask) == mask ? 1 : 0;
  };
  std::int64_t k = 0;
  if (stride == 1) {  // the usual layout: counts as wide as the elements, so every lane counts
    constexpr std::int64_t chunk = std::numeric_limits<word>::max();
    for (std::int64_t c0 = 0; c0 < n; c0 += chunk) {
      const std::int64_t end = n - c0 < chunk ? n : c0 + chunk;
      word part = 0;
      for (std::int64_t c = c0; c < end; ++c) part = static_cast<word>(part + nonfinite(row + c));
      k += part;
    }
    return k;
  }
  for (std::int64_t c = 0; c < n; ++c) k += nonfinite(row + c * stride);
  return k;
}

class compressor_steps : protected compressor_checks {
 protected:
  /// The layer's scores [Hkv, scored] for the sequence scope, from the policy's own scoring.
  template <class List, class T, class Q>
  status layer_scores(const sequence_io<T, Q>& io, std::int64_t layer, const query_view<const Q>& window,
                      policy_state st, const plan_step& what, const shared_layout& sh, score_view* out,
                      selection_params* sel) const {
    const layer_cache<T> cache = io.cache();
    const std::int64_t scored = what.decode_round ? io.keys.num_tokens : scored_tokens<List>(io, layer);
    *out = score_view{sh.scores, io.keys.num_heads, scored, scored};
    if (what.decode_round) {  // the decode scorer over its window of decode queries
      const layer_observations<Q> o = observations_of(io, window, policy_state{}, true);
      return with_scoring_policy<List, T, Q>(options_.decoding.policy, [&](auto traits, const auto& policy) {
        *sel = policy.selection();
        return decltype(traits)::score_layer(policy, cache, o, *out, sh.score, options_.exec);
      });
    }
    if constexpr (has_deferred_v<List>) {
      if (defers<List>()) {
        const deferred_policy<List, T, Q> d(deferred_config<List>());
        *sel = d.selection(st);
        layer_inputs<T, Q> in;
        in.state = st;
        return d.score(in, *out, sh.score, options_.exec);
      }
    }
    const layer_observations<Q> o = observations_of(io, window, policy_state{}, assembles_window(io, layer));
    return with_scoring_policy<List, T, Q>([&](auto traits, const auto& policy) {
      *sel = policy.selection();
      return decltype(traits)::score_layer(policy, cache, o, *out, sh.score, options_.exec);
    });
  }
  /// The report's counts of non-finite values in what the call scores with: the observation
  /// queries, and the keys (every key at prefill_end, the newest at an observed decode step).
  /// Scoring absorbs them by design; the counts tell the engine. Keys are counted per head
  /// through the executor into the layout's head_lengths (written again by the eviction).
  template <class T, class Q>
  void count_nonfinite(const sequence_io<T, Q>& io, const query_view<const Q>& q, const plan_step& what,
                       const run_layout& lay, sequence_report* r) const {
    const policy_kind kind = what.decode_round ? options_.decoding.policy.kind() : options_.policy.kind();
    const bool prefill = io.event == sequence_event::prefill_end || what.decode_round;  // every key scored
    if (!prefill && !what.observe) return;  // DeferKV evicting from its state: nothing read
    if (reads_queries(kind)) {
      std::int64_t n = 0;
      for (std::int64_t h = 0; h < q.num_heads; ++h)
        for (std::int64_t t = 0; t < q.num_queries; ++t)
          n += detail::count_nonfinite(q.row(h, t), q.head_dim, q.dim_stride);
      r->nonfinite_queries = n;
    }
    if (!reads_keys(kind)) return;
    struct task_context {
      cache_view<T> keys;
      std::int64_t first, last;
      std::int64_t* counts;
    } ctx{io.keys, prefill ? 0 : io.keys.num_tokens - io.queries.num_queries, io.keys.num_tokens, lay.head_lengths};
    options_.exec.run(
        io.keys.num_heads,
        [](void* arg, std::int64_t h, int) {
          const auto& c = *static_cast<const task_context*>(arg);
          std::int64_t n = 0;
          for (std::int64_t j = c.first < 0 ? 0 : c.first; j < c.last; ++j)
            n += detail::count_nonfinite(c.keys.row(h, j), c.keys.head_dim, c.keys.dim_stride);
          c.counts[h] = n;
        },
        &ctx);
    std::int64_t n = 0;
    for (std::int64_t h = 0; h < io.keys.num_heads; ++h) n += lay.head_lengths[h];
    r->nonfinite_keys = n;
  }

  template <class List, class T, class Q>
  status step(std::int64_t layer, const sequence_io<T, Q>& io, const run_layout& lay, sequence_report* r) const {
    plan_step what;
    KVEVICT_RETURN_IF_ERROR(decide<List>(layer, io, 0, &what, lay.layer_budgets));
    r->length = io.keys.num_tokens;
    r->next_slot = io.keys.num_tokens;
    r->next_position = next_position_after(io);
    if (what.buffer) {  // a prompt chunk: its last queries join the layer's window
      buffer_chunk(io, layer);
      r->action = sequence_action::observed;
      return status();
    }
    KVEVICT_RETURN_IF_ERROR(apply_step<List>(layer, io, lay, what, r));
    clear_window(io, layer);   // prefill_end used the chunks' window
    if (what.buffer_decode) {  // after a compression, which observed with the ring as it was
      buffer_decode(io, layer);
      if (r->action == sequence_action::none) r->action = sequence_action::observed;
    }
    return status();
  }

  /// What the step does at the end of prefill or a decode step, with the window of queries
  /// it observes with.
  template <class List, class T, class Q>
  status apply_step(std::int64_t layer, const sequence_io<T, Q>& io, const run_layout& lay, const plan_step& what,
                    sequence_report* r) const {
    if (!what.observe && what.action == act::none) return status();
    const bool prefill = io.event == sequence_event::prefill_end;
    const bool round = what.decode_round;  // a decode-time compression (compressor_options::decoding)
    const bool assembled = round || assembles_window(io, layer);
    const query_view<const Q> window = prefill ? prefill_queries(io, layer, lay)
                                       : round ? decode_queries(io, layer, lay)
                                               : io.queries;
    count_nonfinite(io, window, what, lay, r);
    eviction_result result;
    result.head_lengths = io.head_lengths != nullptr ? io.head_lengths : lay.head_lengths;
    result.positions = io.kept_positions;
    result.indices = lay.indices;
    result.changed_blocks = io.changed_blocks;
    result.head_freed_blocks = io.head_freed_blocks;
    layer_cache<T> cache = as_planned(io.cache());
    cache.compact = options_.compact != compaction::keep_list_only;
    const executor& exec = options_.exec;
    const bool defer = defers<List>();
    const bool from_state = defer && !round;  // DeferKV evicts from its state; a decode round scores anew
    const policy_state st = defer ? layer_state(io.state, layer) : policy_state{};
    if constexpr (has_deferred_v<List>) {
      if (what.observe) {
        const deferred_policy<List, T, Q> d(deferred_config<List>());
        layer_inputs<T, Q> in;
        in.keys = io.keys;
        in.observation.key_positions = io.key_positions;
        in.state = st;
        in.queries = window;
        if (prefill) {
          KVEVICT_RETURN_IF_ERROR(d.observe_prefill(in, lay.policy, exec));
        } else {
          KVEVICT_RETURN_IF_ERROR(d.observe_decode(in, lay.policy, exec));
        }
        r->action = sequence_action::observed;
      }
    }
    if (what.action == act::none) return status();
    std::int64_t scored = io.keys.num_tokens;
    if (what.action == act::evict) {
      bool evicted_from_state = false;
      if constexpr (has_deferred_v<List>) {
        if (from_state) {
          const deferred_policy<List, T, Q> d(deferred_config<List>());
          layer_observations<Q> o;
          o.observation.key_positions = io.key_positions;
          o.state = st;
          KVEVICT_RETURN_IF_ERROR(
              d.evict(cache, o, budget_for(layer, io.keys.num_tokens, d.selection(st), lay), result, lay.policy, exec));
          evicted_from_state = true;
        }
      }
      if (!evicted_from_state) {
        const query_view<const Q> q = window;
        const layer_observations<Q> o = observations_of(io, q, policy_state{}, assembled);
        const policy_config& scorer = round ? options_.decoding.policy : options_.policy;
        const status evicted = with_scoring_policy<List, T, Q>(scorer, [&](auto traits, const auto& policy) {
          scored = decltype(traits)::scored_tokens(policy, io.keys.num_tokens, q.num_queries);
          const layer_budget b = round ? decode_budget_for(layer, scored, policy.selection(), lay.layer_budgets)
                                       : budget_for(layer, scored, policy.selection(), lay);
          return policy.evict(cache, o, b, result, lay.policy, exec);
        });
        KVEVICT_RETURN_IF_ERROR(evicted);
      }
    } else {
      // The sequence scope: fold this layer's combined scores into the sequence's row; at the
      // last layer select one keep set from it and apply it to every layer.
      arena a(lay.policy);
      shared_layout sh;
      carve_shared(a, shared_score_bytes_, &sh);
      score_view scores;
      selection_params sel;
      const status scored_ok = layer_scores<List>(io, layer, window, st, what, sh, &scores, &sel);
      const bool sharded = options_.tensor_parallel != nullptr;
      if (!sharded) KVEVICT_RETURN_IF_ERROR(scored_ok);
      scored = scores.cols;
      if (scored_ok.ok()) r->nonfinite_scores = count_nonfinite_candidates(scores, sel.protected_tail);
      scope_state* sc = scope_header(io.state);
      float* row = scope_row(io.state);
      const std::int64_t candidates = scored > sel.protected_tail ? scored - sel.protected_tail : 0;
      if (sharded) {  // every head of the group, the same bits on every rank (a scoring failure ends it there)
        KVEVICT_RETURN_IF_ERROR(combine_head_scores_sharded(scores, sel.protected_tail, options_.combine, shard(),
                                                            sh.row, sh.gather, scored_ok, "kvevict::compressor::run"));
      } else {
        KVEVICT_RETURN_IF_ERROR(combine_head_scores(scores, sel.protected_tail, options_.combine, sh.row));
      }
      // Layers fold as more heads of the same combination: no second normalisation.
      const scope_combine across = combines_by_max(options_.combine) ? scope_combine::max : scope_combine::mean;
      fold_row(row, sh.row, scored, candidates, across, layer == 0);
      if (layer == 0) sc->done = 0;  // a decode-time round folds the layers anew
      sc->folded = layer + 1;
      sc->tokens = scored;
      if (what.action == act::fold) {
        r->action = sequence_action::observed;
        return status();
      }
      finish_mean(row, candidates, options_.model.num_layers, across);
      const keep_list_view keep{io.keys.num_heads, sh.offsets, sh.indices, keep_capacity_};
      layer_budget shared_budget = base_budget();
      if (round) {
        shared_budget = base_layer_budget(decode_options_);
        shared_budget.shard = shard();
      }
      KVEVICT_RETURN_IF_ERROR(select_shared(const_score_view{row, 1, scored, scored}, sel, shared_budget, keep,
                                            sh.one_head, sh.select, exec));
      if (options_.compact == compaction::keep_list_only) {
        KVEVICT_RETURN_IF_ERROR(
            compact_layer(cache, const_keep_list_view(keep), result, sh.compact, io.key_positions, exec));
      } else {
        for (std::int64_t l = 0; l < options_.model.num_layers; ++l) {
          eviction_result lr = result;
          if (l != layer) lr.changed_blocks = nullptr;  // one list for the call (the layer's own)
          KVEVICT_RETURN_IF_ERROR(compact_layer(as_planned(io.layers[l]), const_keep_list_view(keep), lr, sh.compact,
                                                io.key_positions, exec));
          if (l == layer) result = lr;
        }
      }
      if constexpr (has_deferred_v<List>) {
        if (from_state) {
          const deferred_policy<List, T, Q> d(deferred_config<List>());
          for (std::int64_t l = 0; l < options_.model.num_layers; ++l)
            KVEVICT_RETURN_IF_ERROR(d.mark_evicted(layer_state(io.state, l)));
        }
      }
      sc->done = 1;
    }
    r->action = sequence_action::evicted;
    r->length = result.max_length;
    r->next_slot = result.max_length;
    r->freed_blocks = result.freed_blocks;
    r->dropped = io.keys.num_tokens - result.max_length;
    r->num_changed_blocks = result.num_changed_blocks;
    if (what.action == act::evict) r->nonfinite_scores = result.nonfinite_scores;
    r->kept = 0;
    for (std::int64_t h = 0; h < io.keys.num_heads; ++h) r->kept += result.head_lengths[h];
    if (reuses_positions(options_.policy.kind()) && !round) r->next_position = scored;
    if (io.padded_indices != nullptr) {
      std::int64_t k = 0;
      for (std::int64_t h = 0; h < io.keys.num_heads; ++h) {
        std::int64_t* row = io.padded_indices + h * head_capacity_;
        const std::int64_t n = result.head_lengths[h];
        for (std::int64_t i = 0; i < head_capacity_; ++i) row[i] = i < n ? lay.indices[k + i] : -1;
        k += n;
      }
    }
    return status();
  }
};

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_COMPRESSOR_DETAIL_STEP_EXECUTOR_HPP
