// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_COMPRESSOR_DETAIL_LIFECYCLE_HPP
#define KVEVICT_COMPRESSOR_DETAIL_LIFECYCLE_HPP

// A sequence's lifecycle in the compressor: what each event does at a layer (observe, evict,
// fold into the sequence's shared scores), decided from the event and the sequence's state
// before anything changes, and the state's set-up. A deferred policy (DeferKV) observes the
// prompt and decode steps into its per-layer state and evicts at its step d.

#include <cstdint>
#include <cstring>

#include "kvevict/compressor/detail/prefill_window.hpp"
#include "kvevict/compressor/detail/state_layout.hpp"
#include "kvevict/compressor/sequence.hpp"
#include "kvevict/config.hpp"
#include "kvevict/detail/in_sequence.hpp"
#include "kvevict/detail/memory_ranges.hpp"
#include "kvevict/error.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

class compressor_lifecycle : protected compressor_window {
 protected:
  /// Sets up a sequence's state: each layer's policy state and the scope's header.
  template <class List>
  status init_state(void* state, std::size_t bytes, const char* fn) const noexcept {
    KVEVICT_RETURN_IF_ERROR(check_state_memory(state, bytes, state_bytes_, fn, "state", "sequence_state_size"));
    const model_shape& m = options_.model;
    if constexpr (has_deferred_v<List>) {
      if (layer_state_bytes_ > 0) {
        // the state layout does not depend on the type
        const deferred_policy<List, float, float> policy(deferred_config<List>());
        for (std::int64_t l = 0; l < m.num_layers; ++l)
          KVEVICT_RETURN_IF_ERROR(policy.init_state(layer_state(state, l), m.num_kv_heads, options_.limits.max_tokens));
      }
    }
    if (scope_bytes_ > 0) *scope_header(state) = scope_state{};
    if (window_bytes_ > 0)
      for (std::int64_t l = 0; l < m.num_layers; ++l) *window_header(state, l) = window_state{};
    sequence_state_header h;
    h.magic = sequence_state_magic;
    h.layers = m.num_layers;
    h.layer_bytes = layer_state_bytes_;
    h.scope_bytes = scope_bytes_;
    h.window_bytes = window_bytes_;
    std::memcpy(state, &h, sizeof(h));
    return status();
  }

  /// Decides what the event does; for a deferred policy and the sequence scope also checks
  /// the state. `layer_budgets`: [num_layers] scratch (PyramidKV's shares, decode-time budgets).
  template <class List, class T, class Q>
  status decide(std::int64_t layer, const sequence_io<T, Q>& io, std::int64_t s, plan_step* out,
                std::int64_t* layer_budgets) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    *out = plan_step{};
    if (io.event == sequence_event::idle) return status();
    if (state_bytes_ > 0) KVEVICT_RETURN_IF_ERROR(check_state(io.state, s));
    const bool decode = io.event == sequence_event::decode;
    if (window_bytes_ > 0 && (!decode || maintains()) && !window_intact(io.state, layer))
      return status::error(errc::invalid_state, fn, io_name(s, "state"),
                           "layer %lld's query window was overwritten: reset_sequence() when the sequence starts",
                           static_cast<long long>(layer));
    if (io.event == sequence_event::prefill_chunk) return decide_chunk<List>(layer, io, s, out);
    if (decode && maintains()) {
      if (!decoding_started(io.state, layer))
        return status::error(errc::invalid_state, fn, io_name(s, "event"),
                             "a decode step before this sequence's prefill_end at layer %lld (decode-time budgets "
                             "start after the prompt's compression)",
                             static_cast<long long>(layer));
      out->buffer_decode = decode_window_ > 0;
    }
    if (!defers<List>()) {
      if (io.event == sequence_event::prefill_end) out->action = scores_act(layer);
    } else if constexpr (has_deferred_v<List>) {
      KVEVICT_RETURN_IF_ERROR(decide_deferred<List>(layer, io, s, out));
    }
    // Decode-time budgets, once the prompt's compression is done (DeferKV's at its step d;
    // then its decode steps neither observe nor act).
    if (decode && maintains() && !out->observe && out->action == act::none &&
        decode_compresses(layer, io.keys.num_tokens, decode_selection<List, T, Q>(), layer_budgets)) {
      out->action = scores_act(layer);
      out->decode_round = true;
    }
    if ((out->action == act::fold || out->action == act::fold_and_evict_all) && out->decode_round) {
      // Every decode-time compression of a keep set shared by every layer folds the layers
      // again, at one step: layer 0 starts the round, the others continue it.
      const scope_state* sc = scope_header(io.state);
      if (layer > 0 && (sc->done != 0 || sc->folded != layer))
        return status::error(errc::invalid_state, fn, io_name(s, "state"),
                             "a decode-time compression shared by every layer folds the layers in order at one step: "
                             "expected layer %lld, got %lld",
                             static_cast<long long>(sc->done != 0 ? 0 : sc->folded), static_cast<long long>(layer));
    } else if (out->action == act::fold || out->action == act::fold_and_evict_all) {
      const scope_state* sc = scope_header(io.state);
      if (sc->done != 0) {  // the sequence's keep set was applied: nothing more to do
        *out = plan_step{};
        return status();
      }
      if (sc->folded != layer)
        return status::error(errc::invalid_state, fn, io_name(s, "state"),
                             "a keep set shared by every layer folds the layers in order: expected layer %lld, got "
                             "%lld",
                             static_cast<long long>(sc->folded), static_cast<long long>(layer));
      // Every layer's deferred state is marked evicted with the sequence's keep set: check them
      // now, before anything changes (the earlier layers observed this step and are ready).
      if constexpr (has_deferred_v<List>) {
        if (out->action == act::fold_and_evict_all && defers<List>()) {
          const deferred_policy<List, T, Q> d(deferred_config<List>());
          for (std::int64_t l = 0; l < layer; ++l)
            if (!d.intact(layer_state(io.state, l)) || !d.ready(layer_state(io.state, l)))
              return status::error(errc::invalid_state, fn, io_name(s, "state"),
                                   "layer %lld's DeferKV state is not ready to evict (the layers run in order at "
                                   "every step)",
                                   static_cast<long long>(l));
        }
      }
    }
    return status();
  }

  /// prefill_chunk: the chunk's queries join the layer's window (policies that read queries);
  /// nothing is scored. Refused without chunked_prefill in the plan, or after prefill_end.
  template <class List, class T, class Q>
  status decide_chunk(std::int64_t layer, const sequence_io<T, Q>& io, std::int64_t s, plan_step* out) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    if (!options_.chunked_prefill)
      return status::error(errc::invalid_argument, fn, io_name(s, "event"),
                           "prefill_chunk needs compressor_options::chunked_prefill in the plan (or hand the earlier "
                           "chunks as idle and the whole window at prefill_end)");
    if constexpr (has_deferred_v<List>) {
      if (defers<List>()) {
        const deferred_policy<List, T, Q> d(deferred_config<List>());
        const policy_state st = layer_state(io.state, layer);
        KVEVICT_RETURN_IF_ERROR(check_deferred_intact(d, st, layer, s));
        if (d.started(st))
          return status::error(errc::invalid_state, fn, io_name(s, "state"),
                               "a prefill chunk after this sequence's prefill_end at layer %lld: reset_sequence() for "
                               "a new one",
                               static_cast<long long>(layer));
      }
    }
    out->buffer = chunk_rows_ > 0;
    return status();
  }

  /// A layer's deferred state is one reset_sequence() set up and nothing overwrote since.
  template <class D>
  status check_deferred_intact(const D& d, policy_state st, std::int64_t layer, std::int64_t s) const {
    if (d.intact(st)) return status();
    return status::error(errc::invalid_state, "kvevict::compressor::run", io_name(s, "state"),
                         "layer %lld's DeferKV state was overwritten: reset_sequence() when the sequence starts",
                         static_cast<long long>(layer));
  }

  /// The deferred policy's part of decide(): observe the prompt window, then each decode step
  /// until step d, when the layer's scores are acted on.
  template <class List, class T, class Q>
  status decide_deferred(std::int64_t layer, const sequence_io<T, Q>& io, std::int64_t s, plan_step* out) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    const deferred_policy<List, T, Q> d(deferred_config<List>());
    const policy_state st = layer_state(io.state, layer);
    KVEVICT_RETURN_IF_ERROR(check_deferred_intact(d, st, layer, s));
    const bool fed_back = deferred_traits<List>::feeds_back(deferred_config<List>());
    if (io.event == sequence_event::prefill_end) {
      if (d.started(st))
        return status::error(errc::invalid_state, fn, io_name(s, "state"),
                             "layer %lld already observed this sequence's prefill; reset_sequence() for a new one",
                             static_cast<long long>(layer));
      out->observe = true;
      out->action = fed_back ? act::none : scores_act(layer);
    } else if (d.evicted(st)) {
      return status();  // decoding goes on after eviction
    } else if (d.ready(st)) {
      out->action = scores_act(layer);
    } else if (!d.started(st)) {
      return status::error(errc::invalid_state, fn, io_name(s, "event"),
                           "a decode step before this sequence's prefill_end at layer %lld",
                           static_cast<long long>(layer));
    } else {
      out->observe = true;
      // d counts decoded tokens: a step of n tokens observes all n, and evicts once d are in
      out->action =
          d.steps_observed(st) + io.queries.num_queries >= deferred_traits<List>::delay(deferred_config<List>())
              ? scores_act(layer)
              : act::none;
    }
    return status();
  }

  status check_state(const void* state, std::int64_t s) const noexcept {
    static constexpr const char* fn = "kvevict::compressor::run";
    if (state == nullptr)
      return status::error(errc::null_pointer, fn, io_name(s, "state"),
                           "expected sequence_state_size() = %zu bytes set up by reset_sequence()", state_bytes_);
    if (reinterpret_cast<std::uintptr_t>(state) % 8 != 0)
      return status::error(errc::invalid_argument, fn, io_name(s, "state"), "expected 8-byte alignment");
    sequence_state_header h;
    std::memcpy(&h, state, sizeof(h));
    if (h.magic != sequence_state_magic || h.layers != options_.model.num_layers ||
        h.layer_bytes != layer_state_bytes_ || h.scope_bytes != scope_bytes_ || h.window_bytes != window_bytes_)
      return status::error(errc::invalid_state, fn, io_name(s, "state"),
                           "not a state of this plan: call reset_sequence() when the sequence starts");
    return status();
  }
};

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_COMPRESSOR_DETAIL_LIFECYCLE_HPP
