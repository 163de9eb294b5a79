// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_COMPRESSOR_DETAIL_RUN_CHECKS_HPP
#define KVEVICT_COMPRESSOR_DETAIL_RUN_CHECKS_HPP

// Everything run() checks before it changes anything, for the whole batch: the call, each
// sequence's views against the plan, its queries and state, the out-of-place destinations
// and the block tables (in place, no block a compacted sequence uses may be reached by
// another sequence or be shared unmarked). A failed check leaves every cache and state as
// it was.

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "kvevict/compressor/detail/agreement.hpp"
#include "kvevict/compressor/sequence.hpp"
#include "kvevict/config.hpp"
#include "kvevict/detail/in_sequence.hpp"
#include "kvevict/detail/memory_ranges.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/detail/validate_eviction.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policies/layer_inputs.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

class compressor_checks : protected compressor_agreement {
 protected:
  /// Everything run() can check before it changes anything, for the whole batch.
  template <class List, class T, class Q>
  status check_run(std::int64_t layer, const sequence_io<T, Q>* seqs, std::int64_t num_seqs,
                   const sequence_report* reports, workspace_span ws, run_layout* lay) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    KVEVICT_RETURN_IF_ERROR(
        check_run_call(options_, dtype_of<T>::value, dtype_of<Q>::value, layer, num_seqs, seqs, reports, fn));
    arena a(ws);
    carve(a, lay);
    if (a.overflowed())
      return status::error(errc::workspace_too_small, fn, "ws",
                           "expected at least workspace_size() = %zu bytes, got %zu", workspace_bytes_, ws.size);

    // Everything that can fail is checked for the whole batch before anything changes. States
    // first: one sequence's step must never write into another's (overlapping byte ranges,
    // not only equal pointers).
    if (state_bytes_ > 0)
      for (std::int64_t s = 1; s < num_seqs; ++s)
        for (std::int64_t t = 0; t < s; ++t)
          if (seqs[s].state != nullptr && seqs[t].state != nullptr && seqs[s].event != sequence_event::idle &&
              seqs[t].event != sequence_event::idle &&
              byte_ranges_overlap(seqs[s].state, state_bytes_, seqs[t].state, state_bytes_))
            return status::error(errc::invalid_argument, fn, io_name(s, "state"),
                                 "expected one state per sequence, got memory that overlaps the state of seqs[%lld]",
                                 static_cast<long long>(t));
    for (std::int64_t s = 0; s < num_seqs; ++s) KVEVICT_RETURN_IF_ERROR(check_sequence<List>(layer, seqs[s], s, *lay));
    if (options_.compact == compaction::in_place && num_seqs > 1)
      KVEVICT_RETURN_IF_ERROR(check_blocks_across<List>(layer, seqs, num_seqs, *lay));
    return status();
  }
  /// In place, no block a compacted sequence uses may be reached by another sequence of the
  /// call, marked or not (evict_batch's rule, check_blocks_not_reached). Every sequence
  /// that holds paged views is compared (idle ones too: a prefill chunk may share a prefix),
  /// so those views must be valid. Compares this layer's views (under the per-sequence scope
  /// the last layer's call compacts every layer: engines whose layers share one block table).
  template <class List, class T, class Q>
  status check_blocks_across(std::int64_t layer, const sequence_io<T, Q>* seqs, std::int64_t num_seqs,
                             const run_layout& lay) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    const auto written = [&](std::int64_t s) {
      const sequence_io<T, Q>& io = seqs[s];
      if (!io.keys.is_paged() && !io.values.is_paged()) return false;
      plan_step what;
      (void)decide<List>(layer, io, s, &what, lay.layer_budgets);  // checked: cannot fail
      return what.action == act::evict || what.action == act::fold_and_evict_all;
    };
    std::int64_t ids = 0;
    for (std::int64_t s = 0; s < num_seqs; ++s) {
      if (!written(s)) continue;
      const auto kseq = [&](std::int64_t) { return seqs[s].keys; };
      const auto vseq = [&](std::int64_t) { return seqs[s].values; };
      ids = std::max(ids, block_id_scratch(1, kseq, vseq));
    }
    if (ids == 0) return status();  // no paged sequence compacts: nothing to compare
    for (std::int64_t s = 0; s < num_seqs; ++s) {
      const sequence_io<T, Q>& io = seqs[s];
      if (io.keys.is_paged() || io.values.is_paged())
        KVEVICT_RETURN_IF_ERROR(validate_kv_views(io.keys, io.values, fn, io_name(s, "keys"), io_name(s, "values")));
    }
    arena a(lay.policy);
    std::int32_t* scratch = a.take<std::int32_t>(ids);
    if (a.overflowed())
      return status::error(errc::workspace_too_small, fn, "ws", "block tables longer than limits.max_tokens");
    const auto kseq = [seqs](std::int64_t s) { return seqs[s].keys; };
    const auto vseq = [seqs](std::int64_t s) { return seqs[s].values; };
    return check_blocks_not_reached(num_seqs, kseq, vseq, written, scratch, fn, block_naming::seqs);
  }
  template <class List, class T, class Q>
  status check_sequence(std::int64_t layer, const sequence_io<T, Q>& io, std::int64_t s, const run_layout& lay) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    if (static_cast<unsigned>(io.event) > 3u)
      return status::error(errc::invalid_argument, fn, io_name(s, "event"), "expected a sequence_event value, got %d",
                           static_cast<int>(io.event));
    plan_step what;
    KVEVICT_RETURN_IF_ERROR(decide<List>(layer, io, s, &what, lay.layer_budgets));
    if (what.buffer) return check_chunk(layer, io, s);
    if (what.buffer_decode) KVEVICT_RETURN_IF_ERROR(check_decode_queries(layer, io, s));
    if (!what.observe && what.action == act::none) return status();
    KVEVICT_RETURN_IF_ERROR(check_layer_cache(as_planned(io.cache()), s, "",
                                              what.action != act::none && what.action != act::fold, lay.policy));
    if (io.keys.num_tokens > options_.limits.max_tokens)
      return status::error(
          errc::invalid_shape, fn, io_name(s, "keys.num_tokens"), "expected at most limits.max_tokens = %lld, got %lld",
          static_cast<long long>(options_.limits.max_tokens), static_cast<long long>(io.keys.num_tokens));
    KVEVICT_RETURN_IF_ERROR(what.decode_round ? check_decode_round<List>(layer, io, s, what, lay)
                                              : check_queries<List>(layer, io, s, what, lay));
    if (what.action == act::fold_and_evict_all && options_.compact != compaction::keep_list_only) {
      if (io.layers == nullptr)
        return status::error(errc::null_pointer, fn, io_name(s, "layers"),
                             "a keep set shared by every layer compacts every layer at the last one: expected "
                             "[num_layers] layer caches");
      for (std::int64_t l = 0; l < options_.model.num_layers; ++l) {
        char prefix[40];
        std::snprintf(prefix, sizeof(prefix), "layers[%lld].", static_cast<long long>(l));
        const layer_cache<T> c = as_planned(io.layers[l]);
        KVEVICT_RETURN_IF_ERROR(check_layer_cache(c, s, prefix, true, lay.policy));
        if (c.keys.num_tokens != io.keys.num_tokens)
          return status::error(errc::invalid_shape, fn, io_name(s, "layers"),
                               "expected every layer to hold this layer's %lld tokens, got %lld at layer %lld",
                               static_cast<long long>(io.keys.num_tokens), static_cast<long long>(c.keys.num_tokens),
                               static_cast<long long>(l));
      }
    }
    return status();
  }
  /// A layer's cache against the plan: views, shapes, the out-of-place destination and, when
  /// it will be compacted, the block checks evict() runs (so nothing moves before all pass).
  template <class T>
  status check_layer_cache(const layer_cache<T>& c, std::int64_t s, const char* prefix, bool compacted,
                           workspace_span scratch) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    char kname[2 * status::max_argument], vname[2 * status::max_argument], vdim[2 * status::max_argument];
    std::snprintf(kname, sizeof(kname), "%skeys", prefix);
    std::snprintf(vname, sizeof(vname), "%svalues", prefix);
    std::snprintf(vdim, sizeof(vdim), "%svalues.head_dim", prefix);
    const model_shape& m = options_.model;
    KVEVICT_RETURN_IF_ERROR(validate_kv_views(c.keys, c.values, fn, io_name(s, kname), io_name(s, vname)));
    if (c.keys.num_heads != m.num_kv_heads || c.keys.head_dim != m.head_dim)
      return status::error(errc::invalid_shape, fn, io_name(s, kname),
                           "expected the model's [%lld heads, d = %lld], got [%lld, %lld]",
                           static_cast<long long>(m.num_kv_heads), static_cast<long long>(m.head_dim),
                           static_cast<long long>(c.keys.num_heads), static_cast<long long>(c.keys.head_dim));
    if (c.values.head_dim != m.value_head_dim)
      return status::error(errc::invalid_shape, fn, io_name(s, vdim), "expected the model's head_dim %lld, got %lld",
                           static_cast<long long>(m.value_head_dim), static_cast<long long>(c.values.head_dim));
    if (!compacted || options_.compact == compaction::keep_list_only) return status();
    if (options_.compact == compaction::out_of_place) {
      char dkname[2 * status::max_argument], dvname[2 * status::max_argument];
      std::snprintf(dkname, sizeof(dkname), "%sdst_keys", prefix);
      std::snprintf(dvname, sizeof(dvname), "%sdst_values", prefix);
      if (!c.out_of_place())
        return status::error(errc::null_pointer, fn, io_name(s, dkname),
                             "compaction::out_of_place: expected destination views (fresh blocks)");
      KVEVICT_RETURN_IF_ERROR(
          in_sequence(validate_kv_views(c.dst_keys, c.dst_values, fn, "dst_keys", "dst_values"), s, fn, prefix));
      if (c.dst_keys.num_heads != c.keys.num_heads || c.dst_keys.head_dim != c.keys.head_dim ||
          c.dst_values.head_dim != c.values.head_dim)
        return status::error(errc::invalid_shape, fn, io_name(s, dkname), "expected the source's heads and head dims");
      // evict_into's destination checks, now, for the longest keep set possible for this
      // sequence's length (a superset of the rows it will write), so that no sequence moves
      // before all pass.
      const std::int64_t most = keep_capacity_per_head(c.keys.num_tokens);
      std::snprintf(dkname, sizeof(dkname), "%sdst_keys.num_tokens", prefix);
      if (c.dst_keys.num_tokens < most)
        return status::error(errc::invalid_shape, fn, io_name(s, dkname),
                             "expected room for %lld rows (keep_capacity_per_head(num_tokens)), got %lld",
                             static_cast<long long>(most), static_cast<long long>(c.dst_keys.num_tokens));
      const cache_view<T> dk = c.dst_keys.first_tokens(most), dv = c.dst_values.first_tokens(most);
      arena a(scratch);
      std::int32_t* ids = a.take<std::int32_t>(destination_scratch_ids(c.keys, c.values, dk, dv));
      if (a.overflowed())
        return status::error(errc::workspace_too_small, fn, "ws", "block tables longer than limits.max_tokens");
      eviction_options opt;
      opt.block_refcounts = c.block_refcounts;
      opt.shared_blocks = c.shared_blocks;
      return in_sequence(check_destination(c.keys, c.values, dk, dv, opt, ids, fn), s, fn, prefix);
    }
    KVEVICT_RETURN_IF_ERROR(check_kv_not_aliased(c.keys, c.values, fn, io_name(s, vname)));
    if (c.keys.is_paged() || c.values.is_paged()) {
      const auto kseq = [&c](std::int64_t) { return c.keys; };
      const auto vseq = [&c](std::int64_t) { return c.values; };
      arena a(scratch);
      std::int32_t* ids = a.take<std::int32_t>(block_id_scratch(1, kseq, vseq));
      if (ids == nullptr)
        return status::error(errc::workspace_too_small, fn, "ws", "block tables longer than limits.max_tokens");
      KVEVICT_RETURN_IF_ERROR(in_sequence(check_block_ids(1, kseq, vseq, same_block_table(c.keys, c.values),
                                                          same_block_pool(c.keys, c.values), ids, fn, false),
                                          s, fn, prefix));
      // Blocks shared with sequences outside the call are invisible here: the engine says how
      // it shares them (compressor_options::sharing), and marks them on every call if it does.
      if (options_.sharing == block_sharing::undeclared)
        return status::error(errc::invalid_argument, fn, "sharing",
                             "%s is paged, compacted in place: expected block_sharing::marked (refcounts at "
                             "every call) or block_sharing::none (no block shared), got block_sharing::undeclared",
                             static_cast<const char*>(io_name(s, kname)));
      if (options_.sharing == block_sharing::marked && c.block_refcounts == nullptr && c.shared_blocks == nullptr) {
        char rname[2 * status::max_argument];
        std::snprintf(rname, sizeof(rname), "%sblock_refcounts", prefix);
        return status::error(errc::null_pointer, fn, io_name(s, rname),
                             "block_sharing::marked: expected the pool's block references (or shared_blocks) at "
                             "every in-place call");
      }
      // In place, a batch cannot learn which rows move before it moves some: every used block
      // marked shared is refused here (evict() alone refuses only the blocks it would write).
      eviction_options opt;
      opt.block_refcounts = c.block_refcounts;
      opt.shared_blocks = c.shared_blocks;
      const written_per_table all{nullptr, {0, c.keys.num_tokens}, false};
      KVEVICT_RETURN_IF_ERROR(in_sequence(check_shared_writes(c.keys, all, opt, fn, "keys"), s, fn, prefix));
      KVEVICT_RETURN_IF_ERROR(in_sequence(check_shared_writes(c.values, all, opt, fn, "values"), s, fn, prefix));
    }
    return status();
  }
  /// A decode step's queries for the layer's ring of decode queries (decode-time budgets): the
  /// model's heads, at most limits.max_queries, in time order after the ring's newest.
  template <class T, class Q>
  status check_decode_queries(std::int64_t layer, const sequence_io<T, Q>& io, std::int64_t s) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    KVEVICT_RETURN_IF_ERROR(validate_query_view(io.queries, fn, io_name(s, "queries")));
    KVEVICT_RETURN_IF_ERROR(check_sequence_queries(options_, scoring_domain(), io.queries, true, nullptr, 0, s, fn,
                                                   /*multi_token_steps=*/true));
    if (io.queries.num_queries > options_.limits.max_queries)
      return status::error(errc::invalid_shape, fn, io_name(s, "queries.num_queries"),
                           "expected at most limits.max_queries = %lld, got %lld",
                           static_cast<long long>(options_.limits.max_queries),
                           static_cast<long long>(io.queries.num_queries));
    const window_state* w = window_header(io.state, layer);
    for (std::int64_t t = 0; t < io.queries.num_queries; ++t) {
      const std::int64_t before = t > 0 ? io.queries.positions[t - 1] : w->last_position;
      if ((t > 0 || w->seen > 0) && io.queries.positions[t] <= before) {
        char name[status::max_argument];
        std::snprintf(name, sizeof(name), "queries.positions[%lld]", static_cast<long long>(t));
        return status::error(errc::invalid_argument, fn, io_name(s, name),
                             "expected a position after the previous decode query's (%lld), got %lld: each step once, "
                             "in order",
                             static_cast<long long>(before), static_cast<long long>(io.queries.positions[t]));
      }
    }
    return status();
  }
  /// A decode-time compression: the decode scorer's checks of its window (the ring's newest rows
  /// and the step's), and under the per-sequence scope every layer of the round at one length.
  template <class List, class T, class Q>
  status check_decode_round(std::int64_t layer, const sequence_io<T, Q>& io, std::int64_t s, const plan_step& what,
                            const run_layout& lay) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    const query_view<const Q> q = decode_queries(io, layer, lay);
    const policy_config& p = options_.decoding.policy;
    KVEVICT_RETURN_IF_ERROR(
        visit_listed(List{}, static_cast<std::size_t>(p.kind()), status(), [&](auto traits) -> status {
          using Tr = decltype(traits);
          if constexpr (Tr::deferred) {
            return status();
          } else {
            using P = typename Tr::template policy<T, Q>;
            return Tr::check_observation(P(Tr::config(p)), io.keys.num_tokens, q, s, fn);
          }
        }));
    if ((what.action == act::fold || what.action == act::fold_and_evict_all) && layer > 0 &&
        io.keys.num_tokens != scope_header(io.state)->tokens)
      return status::error(errc::invalid_shape, fn, io_name(s, "keys.num_tokens"),
                           "expected layer 0's %lld tokens at this decode-time compression, got %lld",
                           static_cast<long long>(scope_header(io.state)->tokens),
                           static_cast<long long>(io.keys.num_tokens));
    return status();
  }
  /// prefill_chunk: the chunk's queries, after the window's newest (a chunk handed twice, or
  /// chunks out of order, would observe with the wrong queries).
  template <class T, class Q>
  status check_chunk(std::int64_t layer, const sequence_io<T, Q>& io, std::int64_t s) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    KVEVICT_RETURN_IF_ERROR(validate_query_view(io.queries, fn, io_name(s, "queries")));
    KVEVICT_RETURN_IF_ERROR(check_sequence_queries(options_, scoring_domain(), io.queries, false, nullptr, 0, s, fn));
    return check_after_window(io, layer, s);
  }
  /// With rows buffered by earlier chunks, this call's queries come after the newest of them.
  template <class T, class Q>
  status check_after_window(const sequence_io<T, Q>& io, std::int64_t layer, std::int64_t s) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    if (window_bytes_ == 0) return status();
    const window_state* w = window_header(io.state, layer);
    if (w->seen == 0 || io.queries.positions[0] > w->last_position) return status();
    return status::error(errc::invalid_argument, fn, io_name(s, "queries.positions[0]"),
                         "expected a position after the earlier chunks' last query (%lld), got %lld: each chunk once, "
                         "in order",
                         static_cast<long long>(w->last_position), static_cast<long long>(io.queries.positions[0]));
  }
  template <class List, class T, class Q>
  status check_queries(std::int64_t layer, const sequence_io<T, Q>& io, std::int64_t s, const plan_step& what,
                       const run_layout& lay) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    const policy_kind kind = options_.policy.kind();
    if (!reads_queries(kind)) return status();
    const bool defer = defers<List>();
    if (defer && !what.observe) return status();  // scored from the state
    KVEVICT_RETURN_IF_ERROR(validate_query_view(io.queries, fn, io_name(s, "queries")));
    const bool decode = io.event == sequence_event::decode;
    KVEVICT_RETURN_IF_ERROR(check_sequence_queries(options_, scoring_domain(), io.queries, decode, io.lse,
                                                   io.lse_head_stride, s, fn,
                                                   /*multi_token_steps=*/true));
    const std::int64_t held = decode ? 0 : buffered_rows(io, layer);
    const std::int64_t used = decode ? io.queries.num_queries : prefill_query_count(io, layer);
    if (used > options_.limits.max_queries && held > 0)
      return status::error(errc::invalid_shape, fn, io_name(s, "queries.num_queries"),
                           "expected at most limits.max_queries = %lld with the earlier chunks' %lld, got %lld",
                           static_cast<long long>(options_.limits.max_queries), static_cast<long long>(held),
                           static_cast<long long>(io.queries.num_queries));
    if (used > options_.limits.max_queries)
      return status::error(errc::invalid_shape, fn, io_name(s, "queries.num_queries"),
                           "expected at most limits.max_queries = %lld, got %lld",
                           static_cast<long long>(options_.limits.max_queries), static_cast<long long>(used));
    if (!decode) {
      KVEVICT_RETURN_IF_ERROR(check_after_window(io, layer, s));
      KVEVICT_RETURN_IF_ERROR(check_window<List>(io, layer, s));
    }
    const query_view<const Q> q = decode ? io.queries : prefill_queries(io, layer, lay);
    KVEVICT_RETURN_IF_ERROR(visit_listed(List{}, static_cast<std::size_t>(kind), status(), [&](auto traits) -> status {
      using Tr = decltype(traits);
      if constexpr (Tr::deferred) {
        return status();
      } else {
        using P = typename Tr::template policy<T, Q>;
        return Tr::check_observation(P(Tr::config(options_.policy)), io.keys.num_tokens, q, s, fn);
      }
    }));
    if constexpr (has_deferred_v<List>) {
      if (defer && decode) {
        const deferred_policy<List, T, Q> d(deferred_config<List>());
        layer_inputs<T, Q> in;
        in.keys = io.keys;
        in.queries = q;
        return in_sequence(d.check_decode(layer_state(io.state, layer), in, fn), s, fn);
      }
    }
    // every layer of the fold scores as many tokens (the last one too: it folds before it selects)
    if ((what.action == act::fold || what.action == act::fold_and_evict_all) && layer > 0) {
      const scope_state* sc = scope_header(io.state);
      if (scored_tokens<List>(io, layer) != sc->tokens)
        return status::error(errc::invalid_shape, fn, io_name(s, "keys.num_tokens"),
                             "expected the %lld scored tokens of layer 0, got %lld", static_cast<long long>(sc->tokens),
                             static_cast<long long>(scored_tokens<List>(io, layer)));
    }
    return status();
  }
  /// prefill_end: as many queries as the policy observes, never fewer: observation_window()
  /// of them (or every prompt query of a shorter prompt; DapQ's pseudo tokens: exactly its N),
  /// H2O every prompt query. With chunked prefill the last chunk may hold fewer; scoring with
  /// them would choose another keep set, so the call is refused (the engine keeps the last W
  /// prompt queries across chunks and hands them all).
  template <class List, class T, class Q>
  status check_window(const sequence_io<T, Q>& io, std::int64_t layer, std::int64_t s) const noexcept {
    static constexpr const char* fn = "kvevict::compressor::run";
    const policy_config& p = options_.policy;
    const bool h2o = every_prompt_query(p.kind());
    const bool pseudo = fixed_window(p);
    const std::int64_t need = h2o ? io.keys.num_tokens : pseudo ? window_ : std::min(window_, io.keys.num_tokens);
    const std::int64_t held = buffered_rows(io, layer);
    if (held + io.queries.num_queries >= need) return status();
    if (held > 0)
      return status::error(errc::invalid_shape, fn, io_name(s, "queries.num_queries"),
                           "expected %lld queries at prefill_end with the earlier chunks' %lld buffered, got %lld "
                           "(the window holds the last %lld rows of the chunks)",
                           static_cast<long long>(need), static_cast<long long>(held),
                           static_cast<long long>(io.queries.num_queries), static_cast<long long>(window_capacity_));
    return status::error(errc::invalid_shape, fn, io_name(s, "queries.num_queries"),
                         h2o ? "expected every prompt query at prefill_end (H2O: keys.num_tokens = %lld), got %lld "
                               "(chunked prefill: keep the earlier chunks' queries)"
                             : "expected observation_window() = %lld queries at prefill_end, got %lld (chunked "
                               "prefill: keep the earlier chunks' last queries, hand the whole window)",
                         static_cast<long long>(need), static_cast<long long>(io.queries.num_queries));
  }
};

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_COMPRESSOR_DETAIL_RUN_CHECKS_HPP
