// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DETAIL_COMPRESSOR_CHECKS_CUH
#define KVEVICT_CUDA_DETAIL_COMPRESSOR_CHECKS_CUH

// What cuda::compressor::run() checks on the host before anything is enqueued (cuda/compressor.cuh).

#include <cuda_runtime.h>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>

#include "kvevict/budgets/layer_budget_params.hpp"
#include "kvevict/budgets/pyramidkv.hpp"
#include "kvevict/compressor/options.hpp"
#include "kvevict/compressor/plan.hpp"
#include "kvevict/compressor/sequence.hpp"
#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/compact_batch.cuh"
#include "kvevict/cuda/decode_observation.cuh"
#include "kvevict/cuda/detail/compressor_layout.cuh"
#include "kvevict/cuda/detail/launch.cuh"
#include "kvevict/cuda/finalize.cuh"
#include "kvevict/cuda/observation_scores.cuh"
#include "kvevict/cuda/observation_scores_batch.cuh"
#include "kvevict/cuda/select_layer.cuh"
#include "kvevict/cuda/sequence.cuh"
#include "kvevict/detail/in_sequence.hpp"
#include "kvevict/detail/memory_ranges.hpp"
#include "kvevict/error.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/index_ptr.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/views/query_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {

namespace detail {

/// The host checks of cuda::compressor::run(): each sequence against the plan, what its event
/// does (DeferKV's lifecycle), and the pools and states the batch shares; nothing enqueued.
class compressor_checks : protected compressor_layout {
 protected:
  /// What the event does, as kvevict::compressor decides it, with every host check of the
  /// sequence against the plan.
  template <class T, class Q, class H>
  status check_sequence(std::int64_t layer, const sequence_io<T, Q>& io, std::int64_t s, const H& host,
                        const launch_options& opt, detail::sequence_step* out) const {
    static constexpr const char* fn = "kvevict::cuda::compressor::run";
    using kvevict::detail::io_name;
    if (static_cast<unsigned>(io.event) > 3u)
      return status::error(errc::invalid_argument, fn, io_name(s, "event"), "expected a sequence_event value, got %d",
                           static_cast<int>(io.event));
    if (io.event == sequence_event::idle) return status();
    const std::int64_t L = io.keys.num_tokens;
    detail::sequence_step& p = *out;
    p.tokens = L;
    if (keeps_host_state()) KVEVICT_RETURN_IF_ERROR(check_states(io, s, opt));
    if ((buffers_windows() && io.event != sequence_event::decode) || maintains()) {
      const detail::host_window_state w = *window_record(io.host_state, layer);
      const bool ring_bad = buffers_windows() && (w.count < 0 || w.count > window_capacity_ || w.start < 0 ||
                                                  w.start >= window_capacity_ || w.seen < w.count);
      if (ring_bad || (w.decoding != 0 && w.decoding != 1))
        return status::error(errc::invalid_state, fn, io_name(s, "host_state"),
                             "layer %lld's query window was overwritten: reset_sequence() when the sequence starts",
                             static_cast<long long>(layer));
    }
    if (io.event == sequence_event::prefill_chunk) return decide_chunk(layer, io, s, opt, &p);
    if (io.event == sequence_event::prefill_end) p.observed = prefill_queries(io, layer, &p.held);
    if (defers()) {
      KVEVICT_RETURN_IF_ERROR(decide_deferkv(layer, io, s, &p));
    } else {
      p.evict = io.event == sequence_event::prefill_end;
      p.sel = kvevict::detail::largest_selection(options_);  // a policy without state: its own
    }
    if (io.event == sequence_event::decode && maintains())
      KVEVICT_RETURN_IF_ERROR(decide_decode(layer, io, s, host, opt, &p));
    if (folds_layers() && p.evict) KVEVICT_RETURN_IF_ERROR(decide_fold(layer, io, s, &p));
    if (p.observe == detail::sequence_step::none && !p.scores()) return status();

    KVEVICT_RETURN_IF_ERROR(check_device_pointer(io.changed_blocks, opt, fn, io_name(s, "changed_blocks")));
    KVEVICT_RETURN_IF_ERROR(check_device_pointer(io.head_freed_blocks, opt, fn, io_name(s, "head_freed_blocks")));
    if (io.layers != nullptr && !folds_layers())
      return status::error(errc::unsupported, fn, io_name(s, "layers"),
                           "only the per-sequence scope reads them (compressor_options::scope)");
    // Both views, whatever the call does with them (as the CPU compressor: a keep-list-only
    // call still refuses a null or malformed values view).
    KVEVICT_RETURN_IF_ERROR(check_views(io.cache(), L, s, "", p.evict, opt));
    if (L < 0 || L > options_.limits.max_tokens)
      return status::error(errc::invalid_shape, fn, io_name(s, "keys.num_tokens"),
                           "expected 0 .. limits.max_tokens = %lld, got %lld",
                           static_cast<long long>(options_.limits.max_tokens), static_cast<long long>(L));

    // The queries the call reads for the plan's policy (none for KNorm and StreamingLLM; a
    // decode-time compression's were checked by decide_decode).
    const bool reads_queries =
        !p.round && (defers() ? p.observe != detail::sequence_step::none : p.scores() && scores_in_batch());
    if (reads_queries) {
      const bool decode = io.event == sequence_event::decode;
      // (decode-time budgets: a decode step's LSE is not read, and a step may carry k tokens)
      KVEVICT_RETURN_IF_ERROR(kvevict::detail::check_sequence_queries(
          options_, scoring_params_of().domain, io.queries, decode, p.round ? nullptr : io.lse, io.lse_head_stride, s,
          fn, /*multi_token_steps=*/p.round));
      // As on the CPU: a last chunk holding fewer than the window's queries (with the earlier
      // chunks' buffered rows, under chunked_prefill) is refused, never scored with fewer.
      const std::int64_t held = decode ? 0 : chunk_rows(io, layer);
      if (!decode && p.observed > options_.limits.max_queries) {
        if (held > 0)
          return status::error(errc::invalid_shape, fn, io_name(s, "queries.num_queries"),
                               "expected at most limits.max_queries = %lld with the earlier chunks' %lld, got %lld",
                               static_cast<long long>(options_.limits.max_queries), static_cast<long long>(held),
                               static_cast<long long>(io.queries.num_queries));
        return status::error(errc::invalid_shape, fn, io_name(s, "queries.num_queries"),
                             "expected at most limits.max_queries = %lld, got %lld",
                             static_cast<long long>(options_.limits.max_queries),
                             static_cast<long long>(io.queries.num_queries));
      }
      // SnapKV: the window (or every query of a shorter prompt); DapQ: exactly its N pseudo
      // tokens; H2O: every prompt query.
      const policy_kind kind = options_.policy.kind();
      const bool every = kvevict::detail::every_prompt_query(kind);
      const bool pseudo = kvevict::detail::fixed_window(options_.policy);
      const std::int64_t need = every ? L : pseudo ? window_ : (L < window_ ? L : window_);
      if (!decode && held > 0 && held + io.queries.num_queries < need)
        return status::error(errc::invalid_shape, fn, io_name(s, "queries.num_queries"),
                             "expected %lld queries at prefill_end with the earlier chunks' %lld buffered, got %lld "
                             "(the window holds the last %lld rows of the chunks)",
                             static_cast<long long>(need), static_cast<long long>(held),
                             static_cast<long long>(io.queries.num_queries), static_cast<long long>(window_capacity_));
      if (!decode && (io.queries.num_queries < need - held || io.queries.num_queries < 1))
        return status::error(errc::invalid_shape, fn, io_name(s, "queries.num_queries"),
                             every ? "expected every prompt query at prefill_end (H2O: keys.num_tokens = %lld), got "
                                     "%lld"
                                   : "expected observation_window() = %lld queries at prefill_end (or every prompt "
                                     "query of a shorter prompt), got %lld (chunked prefill: keep the earlier chunks' "
                                     "last queries, hand the whole window)",
                             static_cast<long long>(need), static_cast<long long>(io.queries.num_queries));
      // DapQ's pseudo tokens are the cache's last N rows: the prompt before them is scored.
      if (!decode && pseudo) {
        p.tokens = L - window_;
        if (p.tokens < 0)
          return status::error(errc::invalid_shape, fn, io_name(s, "keys.num_tokens"),
                               "expected the prompt and its %lld pseudo tokens, got %lld",
                               static_cast<long long>(window_), static_cast<long long>(L));
      }
    }
    KVEVICT_RETURN_IF_ERROR(check_marks(io.cache(), s, "", p.evict, opt));
    // The per-sequence scope's last layer compacts every layer's cache with the keep set.
    if (p.evict && p.fold && options_.compact != compaction::keep_list_only) {
      if (io.layers == nullptr)
        return status::error(errc::null_pointer, fn, io_name(s, "layers"),
                             "a keep set shared by every layer compacts every layer at the last one: expected "
                             "[num_layers] layer caches (host memory, device views)");
      for (std::int64_t l = 0; l < options_.model.num_layers; ++l) {
        char prefix[40];
        std::snprintf(prefix, sizeof(prefix), "layers[%lld].", static_cast<long long>(l));
        KVEVICT_RETURN_IF_ERROR(check_views(io.layers[l], L, s, prefix, true, opt));
        KVEVICT_RETURN_IF_ERROR(check_marks(io.layers[l], s, prefix, true, opt));
      }
    }
    // Every layer of a fold scores as many tokens as layer 0 did (the row it folds into).
    if (p.fold && layer > 0 && p.tokens != scope_record(io.host_state)->tokens)
      return status::error(errc::invalid_shape, fn, io_name(s, "keys.num_tokens"),
                           "expected the %lld scored tokens of layer 0, got %lld",
                           static_cast<long long>(scope_record(io.host_state)->tokens),
                           static_cast<long long>(p.tokens));
    if (p.scores())
      p.budget = p.round ? kvevict::detail::layer_budget_for(decode_options_, decode_base_budget(), layer, p.tokens,
                                                             p.sel, host.layer_budgets)
                         : kvevict::detail::layer_budget_for(options_, base_budget(), layer, p.tokens, p.sel,
                                                             host.layer_budgets);
    return status();
  }

  /// A decode step under decode-time budgets (kvevict::compressor's decide and
  /// check_decode_queries): after the layer's prefill_end, its queries join the ring (the
  /// decode scorer reads queries), and once the prompt's compression is done (DeferKV's at its
  /// step d: its steps before observe, that one evicts) the step that leaves the layer more than
  /// N tokens over the rows a compression keeps compresses it with the decode scorer, over the
  /// window of the ring's newest rows and its own.
  /// The queries' order is device data: checked on the device (window_append_kernel), a step
  /// out of order cancelling the compressions its rows feed.
  template <class T, class Q, class H>
  status decide_decode(std::int64_t layer, const sequence_io<T, Q>& io, std::int64_t s, const H& host,
                       const launch_options& opt, detail::sequence_step* p) const {
    static constexpr const char* fn = "kvevict::cuda::compressor::run";
    using kvevict::detail::io_name;
    const detail::host_window_state w = *window_record(io.host_state, layer);
    if (w.decoding != 1)
      return status::error(errc::invalid_state, fn, io_name(s, "event"),
                           "a decode step before this sequence's prefill_end at layer %lld (decode-time budgets "
                           "start after the prompt's compression)",
                           static_cast<long long>(layer));
    const std::int64_t n = io.queries.num_queries;
    if (decode_window_ > 0) {
      KVEVICT_RETURN_IF_ERROR(detail::validate_device_query_view(io.queries, opt, fn, io_name(s, "queries")));
      KVEVICT_RETURN_IF_ERROR(kvevict::detail::check_sequence_queries(
          options_, scoring_params_of(options_.decoding.policy).domain, io.queries, true, nullptr, 0, s, fn, true));
      if (n > options_.limits.max_queries)
        return status::error(errc::invalid_shape, fn, io_name(s, "queries.num_queries"),
                             "expected at most limits.max_queries = %lld, got %lld",
                             static_cast<long long>(options_.limits.max_queries), static_cast<long long>(n));
      p->buffer = true;
    }
    if (p->observe != detail::sequence_step::none || p->evict) return status();  // DeferKV's own step
    const std::int64_t L = io.keys.num_tokens;
    const selection_params sel = kvevict::detail::largest_selection(decode_options_);  // the decode scorer's
    const layer_budget b =
        kvevict::detail::layer_budget_for(decode_options_, decode_base_budget(), layer, L, sel, host.layer_budgets);
    if (L - kvevict::detail::layer_keep_capacity(1, L, sel, b) <= options_.decoding.interval) return status();
    p->sel = sel;
    p->evict = true;
    p->round = true;
    if (decode_window_ > 0) {
      p->observed = w.count + n < decode_window_ ? w.count + n : decode_window_;
      p->held = p->observed - (n < p->observed ? n : p->observed);
    }
    return status();
  }

  /// prefill_chunk (kvevict::compressor's decide_chunk): refused without chunked_prefill in the
  /// plan, and after DeferKV's prefill_end; the chunk's queries join the layer's window when the
  /// policy keeps one (nothing for DapQ's pseudo tokens and the policies that read no queries).
  template <class T, class Q>
  status decide_chunk(std::int64_t layer, const sequence_io<T, Q>& io, std::int64_t s, const launch_options& opt,
                      detail::sequence_step* p) const {
    static constexpr const char* fn = "kvevict::cuda::compressor::run";
    using kvevict::detail::io_name;
    if (!options_.chunked_prefill)
      return status::error(errc::invalid_argument, fn, io_name(s, "event"),
                           "prefill_chunk needs compressor_options::chunked_prefill in the plan (or hand the earlier "
                           "chunks as idle and the whole window at prefill_end)");
    if (defers()) {
      const std::int32_t phase = layer_record(io.host_state, layer)->phase;
      if (phase != detail::phase_empty)
        return status::error(errc::invalid_state, fn, io_name(s, "host_state"),
                             phase < detail::phase_empty || phase > detail::phase_evicted
                                 ? "layer %lld's record was overwritten: reset_sequence() when the sequence starts"
                                 : "a prefill chunk after this sequence's prefill_end at layer %lld: reset_sequence() "
                                   "for a new one",
                             static_cast<long long>(layer));
    }
    if (!buffers_chunks()) return status();
    KVEVICT_RETURN_IF_ERROR(detail::validate_device_query_view(io.queries, opt, fn, io_name(s, "queries")));
    KVEVICT_RETURN_IF_ERROR(kvevict::detail::check_sequence_queries(options_, scoring_params_of().domain, io.queries,
                                                                    false, nullptr, 0, s, fn));
    p->buffer = true;
    return status();
  }

  /// A layer cache's views against the plan (`prefix`: "" for the call's own, "layers[l]."),
  /// and, when it is compacted, its pools and out-of-place destination.
  template <class T>
  status check_views(const layer_cache<T>& c, std::int64_t L, std::int64_t s, const char* prefix, bool compacted,
                     const launch_options& opt) const {
    static constexpr const char* fn = "kvevict::cuda::compressor::run";
    using kvevict::detail::io_name;
    const model_shape& m = options_.model;
    KVEVICT_RETURN_IF_ERROR(detail::validate_device_cache_view(c.keys, opt, fn, io_name(s, field(prefix, "keys"))));
    KVEVICT_RETURN_IF_ERROR(detail::validate_device_cache_view(c.values, opt, fn, io_name(s, field(prefix, "values"))));
    if (c.keys.num_tokens != L)
      return status::error(errc::invalid_shape, fn, io_name(s, field(prefix, "keys.num_tokens")),
                           "expected every layer to hold this layer's %lld tokens, got %lld", static_cast<long long>(L),
                           static_cast<long long>(c.keys.num_tokens));
    if (c.keys.num_heads != m.num_kv_heads || c.keys.head_dim != m.head_dim)
      return status::error(errc::invalid_shape, fn, io_name(s, field(prefix, "keys")),
                           "expected the model's [%lld heads, d = %lld], got [%lld, %lld]",
                           static_cast<long long>(m.num_kv_heads), static_cast<long long>(m.head_dim),
                           static_cast<long long>(c.keys.num_heads), static_cast<long long>(c.keys.head_dim));
    if (c.values.num_heads != m.num_kv_heads || c.values.head_dim != m.value_head_dim || c.values.num_tokens != L)
      return status::error(errc::invalid_shape, fn, io_name(s, field(prefix, "values")),
                           "expected [%lld heads, %lld tokens, dv = %lld], got [%lld, %lld, %lld]",
                           static_cast<long long>(m.num_kv_heads), static_cast<long long>(L),
                           static_cast<long long>(m.value_head_dim), static_cast<long long>(c.values.num_heads),
                           static_cast<long long>(c.values.num_tokens), static_cast<long long>(c.values.head_dim));
    if (!compacted || options_.compact == compaction::keep_list_only) return status();
    // The pools' blocks are the bitmaps' bound (sources of an out-of-place compaction are marked too).
    KVEVICT_RETURN_IF_ERROR(check_pool(c.keys, s, field(prefix, "keys.num_pool_blocks")));
    KVEVICT_RETURN_IF_ERROR(check_pool(c.values, s, field(prefix, "values.num_pool_blocks")));
    if (options_.compact != compaction::out_of_place) return status();
    if (c.dst_keys.data == nullptr || c.dst_values.data == nullptr)
      return status::error(errc::null_pointer, fn,
                           io_name(s, field(prefix, c.dst_keys.data == nullptr ? "dst_keys" : "dst_values")),
                           "compaction::out_of_place: expected destination views (fresh blocks)");
    if (c.dst_keys.num_heads != m.num_kv_heads || c.dst_keys.head_dim != m.head_dim ||
        c.dst_values.num_heads != m.num_kv_heads || c.dst_values.head_dim != m.value_head_dim)
      return status::error(errc::invalid_shape, fn, io_name(s, field(prefix, "dst_keys")),
                           "expected the source's heads and head dims");
    const std::int64_t most = L < head_capacity_ ? L : head_capacity_;
    if (c.dst_keys.num_tokens < most || c.dst_values.num_tokens < most)
      return status::error(
          errc::invalid_shape, fn, io_name(s, field(prefix, "dst_keys.num_tokens")),
          "expected room for %lld rows (the most a head may keep), got %lld", static_cast<long long>(most),
          static_cast<long long>(c.dst_keys.num_tokens < c.dst_values.num_tokens ? c.dst_keys.num_tokens
                                                                                 : c.dst_values.num_tokens));
    KVEVICT_RETURN_IF_ERROR(check_pool(c.dst_keys, s, field(prefix, "dst_keys.num_pool_blocks")));
    return check_pool(c.dst_values, s, field(prefix, "dst_values.num_pool_blocks"));
  }

  /// A layer cache's prefix-shared block marks: in device memory, and given where the engine
  /// said it shares blocks. Prefix-shared blocks are read by the in-place compaction on the
  /// device (out of place and keep-lists only, the caches are only read: the marks change
  /// nothing, as on the CPU).
  template <class T>
  status check_marks(const layer_cache<T>& c, std::int64_t s, const char* prefix, bool compacted,
                     const launch_options& opt) const {
    static constexpr const char* fn = "kvevict::cuda::compressor::run";
    using kvevict::detail::io_name;
    KVEVICT_RETURN_IF_ERROR(
        check_device_pointer(c.block_refcounts, opt, fn, io_name(s, field(prefix, "block_refcounts"))));
    KVEVICT_RETURN_IF_ERROR(check_device_pointer(c.shared_blocks, opt, fn, io_name(s, field(prefix, "shared_blocks"))));
    // Blocks shared with sequences outside the call are invisible here: the engine says how it
    // shares them (compressor_options::sharing), and marks them on every call if it does; the
    // compaction refuses on the device (flag_shared_block) a sequence using a marked block, as
    // the CPU compressor refuses it.
    if (!compacted || options_.compact != compaction::in_place || !(c.keys.is_paged() || c.values.is_paged()))
      return status();
    if (options_.sharing == block_sharing::undeclared)
      return status::error(errc::invalid_argument, fn, "sharing",
                           "%s is paged, compacted in place: expected block_sharing::marked (refcounts at every "
                           "call) or block_sharing::none (no block shared), got block_sharing::undeclared",
                           static_cast<const char*>(io_name(s, field(prefix, "keys"))));
    if (options_.sharing == block_sharing::marked && c.block_refcounts == nullptr && c.shared_blocks == nullptr)
      return status::error(errc::null_pointer, fn, io_name(s, field(prefix, "block_refcounts")),
                           "block_sharing::marked: expected the pool's block references (or shared_blocks) at "
                           "every in-place call");
    return status();
  }

  /// "layers[2].keys" and the like: a field of a layer cache under `prefix`.
  struct field {
    char text[2 * status::max_argument];
    field(const char* prefix, const char* name) noexcept { std::snprintf(text, sizeof(text), "%s%s", prefix, name); }
    operator const char*() const noexcept { return text; }
  };

  /// The host bookkeeping (and, when the plan has one, the device state) of a sequence whose
  /// plan keeps them: DeferKV's layers, the per-sequence scope.
  template <class T, class Q>
  status check_states(const sequence_io<T, Q>& io, std::int64_t s, const launch_options& opt) const {
    static constexpr const char* fn = "kvevict::cuda::compressor::run";
    using kvevict::detail::io_name;
    if (io.host_state == nullptr)
      return status::error(errc::null_pointer, fn, io_name(s, "host_state"),
                           "expected host_state_size() = %zu bytes set up by reset_sequence()", host_state_bytes_);
    if (reinterpret_cast<std::uintptr_t>(io.host_state) % 8 != 0)
      return status::error(errc::invalid_argument, fn, io_name(s, "host_state"), "expected 8-byte alignment");
    detail::host_state_header h;
    std::memcpy(&h, io.host_state, sizeof(h));
    if (h.magic != detail::host_state_magic || h.layers != options_.model.num_layers)
      return status::error(errc::invalid_state, fn, io_name(s, "host_state"),
                           "not a state of this plan: call reset_sequence() when the sequence starts");
    if (io.state == nullptr)
      return status::error(errc::null_pointer, fn, io_name(s, "state"),
                           "expected sequence_state_size() = %zu bytes of device memory", state_bytes_);
    // Now, not when the first kernel that writes it is enqueued: other sequences' steps come first.
    return check_device_pointer(io.state, opt, fn, io_name(s, "state"));
  }

  /// The per-sequence scope's part of the decision (kvevict::compressor's): a layer that would
  /// evict folds its scores instead, the last one evicts every layer; nothing once the keep
  /// set was applied; the layers fold in order.
  template <class T, class Q>
  status decide_fold(std::int64_t layer, const sequence_io<T, Q>& io, std::int64_t s, detail::sequence_step* p) const {
    static constexpr const char* fn = "kvevict::cuda::compressor::run";
    using kvevict::detail::io_name;
    const std::int64_t layers = options_.model.num_layers;
    const detail::host_scope_state sc = *scope_record(io.host_state);
    if (sc.folded < 0 || sc.folded > layers || sc.tokens < 0 || sc.tokens > options_.limits.max_tokens ||
        (sc.done != 0 && sc.done != 1))
      return status::error(errc::invalid_state, fn, io_name(s, "host_state"),
                           "the per-sequence scope's record was overwritten: reset_sequence() when the sequence "
                           "starts");
    if (p->round) {  // a decode-time compression folds every layer again at one step: layer 0 starts it
      if (layer > 0 && (sc.done != 0 || sc.folded != layer))
        return status::error(errc::invalid_state, fn, io_name(s, "state"),
                             "a decode-time compression shared by every layer folds the layers in order at one step: "
                             "expected layer %lld, got %lld",
                             static_cast<long long>(sc.done != 0 ? 0 : sc.folded), static_cast<long long>(layer));
      p->fold = true;
      p->evict = layer == layers - 1;
      return status();
    }
    if (sc.done != 0) {  // the sequence's keep set was applied: nothing more to do
      const std::int64_t L = p->tokens;
      *p = detail::sequence_step{};
      p->tokens = L;
      return status();
    }
    if (sc.folded != layer)
      return status::error(errc::invalid_state, fn, io_name(s, "state"),
                           "a keep set shared by every layer folds the layers in order: expected layer %lld, got %lld",
                           static_cast<long long>(sc.folded), static_cast<long long>(layer));
    p->fold = true;
    p->evict = layer == layers - 1;
    if (!defers()) return status();
    if (!p->evict) {
      p->after.phase = detail::phase_ready;  // folded: marked evicted with the others at the last layer
      return status();
    }
    // Every layer's record is marked evicted with the sequence's keep set: the earlier layers
    // observed this step and are ready.
    for (std::int64_t l = 0; l < layer; ++l)
      if (layer_record(io.host_state, l)->phase != detail::phase_ready)
        return status::error(errc::invalid_state, fn, io_name(s, "state"),
                             "layer %lld's DeferKV state is not ready to evict (the layers run in order at every "
                             "step)",
                             static_cast<long long>(l));
    return status();
  }

  /// DeferKV's lifecycle at this layer (kvevict::compressor's decide), from the host state.
  template <class T, class Q>
  status decide_deferkv(std::int64_t layer, const sequence_io<T, Q>& io, std::int64_t s,
                        detail::sequence_step* p) const {
    static constexpr const char* fn = "kvevict::cuda::compressor::run";
    using kvevict::detail::io_name;
    const deferkv_config& cfg = options_.policy.config<deferkv_traits>();
    const detail::host_layer_state now = *layer_record(io.host_state, layer);
    const bool started = now.phase != detail::phase_empty;
    if (now.phase < detail::phase_empty || now.phase > detail::phase_evicted || now.prompt_tokens < 0 ||
        now.steps < 0 || now.prompt_tokens + now.steps > options_.limits.max_tokens ||
        (started && !(now.z > 0.0 && now.z <= std::numeric_limits<double>::max())))
      return status::error(errc::invalid_state, fn, io_name(s, "host_state"),
                           "layer %lld's record was overwritten: reset_sequence() when the sequence starts",
                           static_cast<long long>(layer));
    const bool fed_back = cfg.decode_feedback && cfg.delay > 0;
    const std::int64_t L = io.keys.num_tokens;
    p->after = now;
    if (io.event == sequence_event::prefill_end) {
      if (now.phase != detail::phase_empty)
        return status::error(errc::invalid_state, fn, io_name(s, "host_state"),
                             "layer %lld already observed this sequence's prefill; reset_sequence() for a new one",
                             static_cast<long long>(layer));
      const std::int64_t w = p->observed;  // the window's rows (with the earlier chunks')
      p->observe = detail::sequence_step::prefill;
      p->evict = !fed_back;
      p->after.prompt_tokens = L;
      p->after.steps = 0;
      double z = 0.0;
      for (std::int64_t t = 0; t < w; ++t)
        z += static_cast<double>(static_cast<float>(std::pow(cfg.effective_eta(), static_cast<double>(w - 1 - t))));
      p->after.z = z;
      p->after.phase = fed_back ? detail::phase_prefilled : detail::phase_ready;
    } else if (now.phase == detail::phase_evicted) {
      return status();                              // decoding goes on after eviction
    } else if (now.phase == detail::phase_ready) {  // (run() evicts in the call that makes a layer ready)
      if (L != now.prompt_tokens + now.steps)
        return status::error(errc::invalid_shape, fn, io_name(s, "keys.num_tokens"),
                             "expected prompt + decoded tokens = %lld, got %lld",
                             static_cast<long long>(now.prompt_tokens + now.steps), static_cast<long long>(L));
      p->evict = true;
    } else if (now.phase == detail::phase_empty) {
      return status::error(errc::invalid_state, fn, io_name(s, "event"),
                           "a decode step before this sequence's prefill_end at layer %lld",
                           static_cast<long long>(layer));
    } else {
      if (L != now.prompt_tokens + now.steps + 1)
        return status::error(errc::invalid_shape, fn, io_name(s, "keys.num_tokens"),
                             "expected prompt + decoded tokens = %lld, got %lld (wrong layer or step?)",
                             static_cast<long long>(now.prompt_tokens + now.steps + 1), static_cast<long long>(L));
      p->observe = detail::sequence_step::decode;
      p->after.z = cfg.effective_eta() * now.z + 1.0;
      p->after.steps = now.steps + 1;
      if (p->after.steps >= cfg.delay) p->after.phase = detail::phase_ready;
      p->evict = p->after.steps >= cfg.delay;
    }
    const std::int64_t prompt = p->after.prompt_tokens;
    const std::int64_t w = cfg.window < prompt ? cfg.window : prompt;
    p->candidates = prompt - w;
    p->sel = selection_params{w + p->after.steps, cfg.protect};
    if (p->evict) p->after.phase = detail::phase_evicted;
    return status();
  }

  template <class V>
  status check_pool(const cache_view<V>& v, std::int64_t s, const char* name) const noexcept {
    if (v.is_paged() && v.num_pool_blocks > options_.limits.max_pool_blocks)
      return status::error(errc::invalid_shape, "kvevict::cuda::compressor::run", kvevict::detail::io_name(s, name),
                           "expected at most limits.max_pool_blocks = %lld (the plan sizes its bitmaps by it), got "
                           "%lld",
                           static_cast<long long>(options_.limits.max_pool_blocks),
                           static_cast<long long>(v.num_pool_blocks));
    return status();
  }

  /// One sequence's device state and host state are its own (byte ranges, not only pointers).
  template <class T, class Q>
  status check_distinct_states(const sequence_io<T, Q>* seqs, std::int64_t n) const noexcept {
    if (!keeps_host_state()) return status();
    for (std::int64_t s = 1; s < n; ++s)
      for (std::int64_t t = 0; t < s; ++t) {
        if (seqs[s].event == sequence_event::idle || seqs[t].event == sequence_event::idle) continue;
        const auto overlap = [](const void* a, const void* b, std::size_t bytes) {  // null: refused later
          return a != nullptr && b != nullptr && kvevict::detail::byte_ranges_overlap(a, bytes, b, bytes);
        };
        const bool device = overlap(seqs[s].state, seqs[t].state, state_bytes_);
        if (device || overlap(seqs[s].host_state, seqs[t].host_state, host_state_bytes_))
          return status::error(errc::invalid_argument, "kvevict::cuda::compressor::run",
                               kvevict::detail::io_name(s, device ? "state" : "host_state"),
                               "expected one state per sequence, got memory that overlaps the state of seqs[%lld]",
                               static_cast<long long>(t));
      }
    return status();
  }
};

}  // namespace detail

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_DETAIL_COMPRESSOR_CHECKS_CUH
