// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_COMPRESSOR_COMPRESSOR_HPP
#define KVEVICT_COMPRESSOR_COMPRESSOR_HPP

// The compressor: planned once per model, called once per layer at the attention hook for a
// batch of sequences (design.md §13).
//
//   compressor c;
//   status st = compressor::plan(options, &c);         // validates everything it can, once
//   workspace ws(c.workspace_size());                  // one workspace per concurrent caller
//   per sequence: c.sequence_state_size() bytes, c.reset_sequence(state) when it starts
//   per step, per layer:  st = c.run(layer, seqs, n, reports, ws);
//
// Each run() does what each sequence's event needs: at the end of prefill SnapKV-family
// policies (and DapQ, KNorm, StreamingLLM, H2O) score and evict; DeferKV observes the prompt
// window, then observes each decode step and evicts at step d. Eviction is the policy's own
// evict() (score -> PyramidKV/AdaKV budgets -> select -> compact), so the compressor's
// results equal the building blocks' bit for bit.
//
// All or nothing per call: every sequence is validated (views, shapes against the plan,
// queries, states, block tables) before any cache or state changes, so a failed call leaves
// the whole batch as it was. Sequences are processed one after another; the heads of each go
// through the plan's executor. Concurrent run() calls on different layers (different caches,
// states' different layers, separate workspaces) are safe.
//
// Under tensor parallelism (compressor_options::tensor_parallel, design.md §15) each rank plans
// and runs with its own KV heads; plan() and run() are collective, agree on the configuration
// and on each batch first (a mismatch is an error on every rank), and AdaKV and the shared
// scopes select across the group with the single-process results.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kvevict/budgets/layer_budget.hpp"
#include "kvevict/budgets/pyramidkv.hpp"
#include "kvevict/compressor/options.hpp"
#include "kvevict/compressor/plan.hpp"
#include "kvevict/compressor/sequence.hpp"
#include "kvevict/config.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/detail/in_sequence.hpp"
#include "kvevict/detail/memory_ranges.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/detail/validate_eviction.hpp"
#include "kvevict/dtype.hpp"
#include "kvevict/error.hpp"
#include "kvevict/eviction/evict.hpp"
#include "kvevict/eviction/evict_layer.hpp"
#include "kvevict/parallel/agreement.hpp"
#include "kvevict/parallel/collective.hpp"
#include "kvevict/parallel/head_shard.hpp"
#include "kvevict/parallel/sharded_adakv.hpp"
#include "kvevict/parallel/sharded_scope.hpp"
#include "kvevict/policies/chunkkv.hpp"
#include "kvevict/policies/dapq.hpp"
#include "kvevict/policies/deferkv.hpp"
#include "kvevict/policies/h2o.hpp"
#include "kvevict/policies/keydiff.hpp"
#include "kvevict/policies/knorm.hpp"
#include "kvevict/policies/snapkv.hpp"
#include "kvevict/policies/streaming_llm.hpp"
#include "kvevict/policies/tova.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

namespace detail {

/// The head of a sequence's compressor state; each layer's policy state follows it.
struct sequence_state_header {
  std::uint64_t magic = 0;
  std::int64_t layers = 0;
  std::uint64_t layer_bytes = 0;
  std::uint64_t scope_bytes = 0;
};
/// The per-sequence scope's part of the state: layers folded so far, the tokens they scored,
/// whether the keep set was applied; the combined row [max_tokens] follows.
struct scope_state {
  std::int64_t folded = 0;
  std::int64_t tokens = 0;
  std::int64_t done = 0;
  std::int64_t reserved[5] = {};
};
constexpr std::uint64_t sequence_state_magic = 0x7173766576656b76ull;  // "vkevevsq"
constexpr std::size_t sequence_state_offset = 64;

/// Elements of a row (n of them, `stride` apart) that are NaN or infinite.
template <class T>
std::int64_t count_nonfinite(const T* row, std::int64_t n, std::int64_t stride) noexcept {
  std::int64_t k = 0;
  for (std::int64_t c = 0; c < n; ++c) k += std::isfinite(to_float(row[c * stride])) ? 0 : 1;
  return k;
}

inline std::size_t round_up_64(std::size_t n) noexcept {
  return n > std::numeric_limits<std::size_t>::max() - 63 ? std::numeric_limits<std::size_t>::max()
                                                          : (n + 63) / 64 * 64;
}

}  // namespace detail

class compressor {
 public:
  compressor() = default;

  /// Plans a compressor from options (see compressor/options.hpp). Checks the model shape,
  /// the policy's configuration, the budget, the allocations, scope, length mode, compaction
  /// and the limits, and computes every size; on error `out` is left as it was.
  static status plan(const compressor_options& options, compressor* out) noexcept {
    static constexpr const char* fn = "kvevict::compressor::plan";
    const collective* group = options.tensor_parallel;
    // A rank that cannot reach the group cannot tell it it failed: these return at once.
    if (group != nullptr) KVEVICT_RETURN_IF_ERROR(detail::validate_collective(*group, fn, "tensor_parallel"));
    compressor c;
    c.options_ = options;
    status st = out == nullptr ? status::error(errc::null_pointer, fn, "out", "expected a compressor to plan")
                               : c.check_options(fn);
    if (group != nullptr) KVEVICT_RETURN_IF_ERROR(c.learn_heads(st, fn));  // all ranks fail here together
    KVEVICT_RETURN_IF_ERROR(st);
    c.total_heads_ = group != nullptr ? c.total_heads_ : options.model.num_kv_heads;
    if (group != nullptr && options.heads == head_allocation::adakv &&
        c.options_.limits.max_tokens > static_cast<std::int64_t>(UINT32_MAX) / c.total_heads_)
      st = status::error(errc::invalid_shape, fn, "limits.max_tokens",
                         "expected 1 .. %lld (AdaKV ranks the %lld KV heads of the group), got %lld",
                         static_cast<long long>(UINT32_MAX / static_cast<std::uint64_t>(c.total_heads_)),
                         static_cast<long long>(c.total_heads_), static_cast<long long>(c.options_.limits.max_tokens));
    if (st.ok()) {
      (void)detail::with_types(c.options_.model.storage, c.options_.model.query_storage, [&](auto t, auto q) {
        c.size<typename decltype(t)::type, typename decltype(q)::type>();
        return status();
      });
      if (c.workspace_bytes_ == std::numeric_limits<std::size_t>::max() ||
          c.state_bytes_ == std::numeric_limits<std::size_t>::max() ||
          c.keep_capacity_ == std::numeric_limits<std::int64_t>::max())
        st = status::error(errc::overflow, fn, "options.limits",
                           "the workspace, state or keep-list for %lld tokens and %lld queries does not fit in memory",
                           static_cast<long long>(options.limits.max_tokens),
                           static_cast<long long>(c.options_.limits.max_queries));
    }
    if (group != nullptr) KVEVICT_RETURN_IF_ERROR(c.agree_plan(st, fn));
    KVEVICT_RETURN_IF_ERROR(st);
    c.planned_ = true;
    *out = c;
    return status();
  }

  bool planned() const noexcept { return planned_; }
  const compressor_options& options() const noexcept { return options_; }

  /// Bytes of workspace one run() needs (any layer, any batch within the limits).
  std::size_t workspace_size() const noexcept { return workspace_bytes_; }
  /// Bytes of workspace one run() over any_sequence_io needs: workspace_size() and room for
  /// the batch's typed views (limits.max_sequences of them, with every layer's under the
  /// per-sequence scope). 0 before plan().
  std::size_t any_workspace_size() const noexcept {
    if (!planned_) return 0;
    detail::arena a;
    carve_typed_batch<float, float>(a, options_.limits.max_sequences, nullptr, nullptr);
    return detail::saturating_add(a.used(), workspace_bytes_);
  }
  /// Bytes of state per sequence (0 when the policy is stateless and the scope is not
  /// per_sequence: then sequence_io::state may be null). DeferKV: [layers, Hkv, max_tokens]
  /// floats plus small headers; a per-sequence scope adds [max_tokens] floats.
  std::size_t sequence_state_size() const noexcept { return state_bytes_; }
  /// Entries of sequence_io::kept_positions one eviction may write.
  std::int64_t keep_capacity() const noexcept { return keep_capacity_; }
  /// Columns of sequence_io::padded_indices: the most tokens one head may keep.
  std::int64_t keep_capacity_per_head() const noexcept { return head_capacity_; }
  /// The most tokens one head may keep at a call whose cache holds `tokens` tokens (at most
  /// keep_capacity_per_head()): the rows an out-of-place destination needs for that sequence.
  std::int64_t keep_capacity_per_head(std::int64_t tokens) const noexcept {
    if (!planned_) return 0;
    const std::int64_t t = tokens < options_.limits.max_tokens ? tokens : options_.limits.max_tokens;
    const std::int64_t rows = detail::head_keep_bound(options_, base_budget(), t);
    return rows < head_capacity_ ? rows : head_capacity_;
  }
  /// Entries of sequence_io::changed_blocks one eviction may write (K's and V's used blocks).
  std::int64_t changed_blocks_capacity() const noexcept {
    // K and V, one block per token at most, per head with per-head block tables.
    return detail::saturating_mul(detail::saturating_mul(std::int64_t{2}, options_.model.num_kv_heads),
                                  options_.limits.max_tokens);
  }
  /// How many of its last queries a sequence must hand in at prefill_end (0: none needed).
  std::int64_t observation_window() const noexcept { return window_; }
  /// Tensor parallelism: the global index of this rank's first KV head, and the KV heads of a
  /// layer over the group (0 and model.num_kv_heads in one process).
  std::int64_t first_kv_head() const noexcept { return first_head_; }
  std::int64_t total_kv_heads() const noexcept { return total_heads_; }
  /// Tensor parallelism: whether run() talks to the other ranks (AdaKV, or a keep set shared by
  /// heads). Per-head budgets need nothing from them: run() then makes no collective at all.
  bool selects_across_ranks() const noexcept {
    return options_.tensor_parallel != nullptr &&
           (options_.heads == head_allocation::adakv || options_.scope != selection_scope::per_head);
  }
  /// Tensor parallelism: the most words one all-reduce of this plan's run() passes (to size an
  /// adapter's staging or device buffer; design.md §15 has the count per layer); 0 when run()
  /// makes none.
  std::int64_t collective_words() const noexcept {
    if (!selects_across_ranks()) return 0;
    std::int64_t most = 1 + 4 * detail::max_agreement_fields;
    const auto at_least = [&most](std::int64_t n) { most = n > most ? n : most; };
    if (options_.heads == head_allocation::adakv) {
      at_least(detail::radix_bins + 1);
      at_least(total_heads_ + 1);
    }
    if (options_.scope != selection_scope::per_head)
      at_least(detail::saturating_add(
          detail::saturating_mul(detail::sharded_combine_rows(options_.combine, shard()), options_.limits.max_tokens),
          1));
    return most;
  }

  /// Sets up a sequence's state before its first call (and to reuse it for a new sequence).
  status reset_sequence(void* state, std::size_t bytes) const noexcept {
    static constexpr const char* fn = "kvevict::compressor::reset_sequence";
    KVEVICT_RETURN_IF_ERROR(check_planned(fn));
    if (state_bytes_ == 0) return status();
    KVEVICT_RETURN_IF_ERROR(detail::check_state_memory(state, bytes, state_bytes_, fn, "state", "sequence_state_size"));
    const model_shape& m = options_.model;
    if (layer_state_bytes_ > 0) {
      const deferred_policy<float, float> policy(deferred_config());  // the state layout does not depend on the type
      for (std::int64_t l = 0; l < m.num_layers; ++l)
        KVEVICT_RETURN_IF_ERROR(policy.init_state(layer_state(state, l), m.num_kv_heads, options_.limits.max_tokens));
    }
    if (scope_bytes_ > 0) *scope_header(state) = detail::scope_state{};
    detail::sequence_state_header h;
    h.magic = detail::sequence_state_magic;
    h.layers = m.num_layers;
    h.layer_bytes = layer_state_bytes_;
    h.scope_bytes = scope_bytes_;
    std::memcpy(state, &h, sizeof(h));
    return status();
  }

  /// The runtime-dtype entry: run() for views whose element types are the plan's
  /// model.storage and model.query_storage (tags checked at plan time). `ws`: at least
  /// any_workspace_size() bytes. Otherwise run()'s contract exactly (the typed call it makes).
  status run(std::int64_t layer, const any_sequence_io* seqs, std::int64_t num_seqs, sequence_report* reports,
             workspace_span ws) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    KVEVICT_RETURN_IF_ERROR(check_planned(fn));
    return detail::with_types(options_.model.storage, options_.model.query_storage, [&](auto t, auto q) {
      return run_typed<typename decltype(t)::type, typename decltype(q)::type>(layer, seqs, num_seqs, reports, ws);
    });
  }

  /// One layer's hook for a batch of sequences.
  ///
  ///   layer:   0 .. num_layers - 1
  ///   seqs:    [num_seqs] (num_seqs <= limits.max_sequences); see compressor/sequence.hpp
  ///   reports: [num_seqs] out
  ///   ws:      at least workspace_size() bytes (scratch: any contents)
  ///
  /// T must be the plan's storage type. On error nothing was changed: no cache, state,
  /// report or output buffer.
  ///
  /// Tensor parallelism (selects_across_ranks()): collective. Every rank of the group calls it
  /// for the same layer with the same batch (the same sequences, events and token counts; its
  /// own heads' views), and gets for its heads what one process holding every head would; a
  /// rank that fails or disagrees makes it fail on every rank (design.md §15). Reports and
  /// outputs describe this rank's heads (report.length: its longest head).
  template <class T, class Q = default_query_type_t<T>>
  status run(std::int64_t layer, const sequence_io<T, Q>* seqs, std::int64_t num_seqs, sequence_report* reports,
             workspace_span ws) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    KVEVICT_RETURN_IF_ERROR(check_planned(fn));
    static_assert(is_storage_type<T>::value && !std::is_const<T>::value,
                  "run<T, Q>: T is float, fp16, bf16, fp8_e4m3 or fp8_e5m2");
    static_assert(is_query_type<Q>::value && !std::is_const<Q>::value, "run<T, Q>: Q is float, fp16 or bf16");
    run_layout lay;
    const status checked = check_run(layer, seqs, num_seqs, reports, ws, &lay);
    // Tensor parallelism: one agreement round for the batch, failed or not (design.md §15).
    if (selects_across_ranks()) KVEVICT_RETURN_IF_ERROR(agree_run(layer, seqs, num_seqs, checked));
    KVEVICT_RETURN_IF_ERROR(checked);

    run_trace trace;
    trace.layer = layer;
    trace.sequences = num_seqs;
    for (std::int64_t s = 0; s < num_seqs; ++s) {
      sequence_report r;
      KVEVICT_RETURN_IF_ERROR(step(layer, seqs[s], lay, &r));
      trace.observed += r.action == sequence_action::observed ? 1 : 0;
      trace.evicted += r.action == sequence_action::evicted ? 1 : 0;
      reports[s] = r;
    }
    if (options_.tracer.on_run != nullptr) options_.tracer.on_run(options_.tracer.context, trace);
    return status();
  }

 private:
  /// The typed views of a batch of n erased sequences, carved from the front of the workspace
  /// (views are trivially copyable: the arena holds them like any scratch).
  template <class T = float, class Q = float>
  void carve_typed_batch(detail::arena& a, std::int64_t n, sequence_io<T, Q>** seqs,
                         layer_cache<T>** layers) const noexcept {
    static_assert(sizeof(sequence_io<T, Q>) == sizeof(sequence_io<float, float>), "views of any type are alike");
    sequence_io<T, Q>* s = a.take<sequence_io<T, Q>>(n);
    layer_cache<T>* l =
        sequence_scope() ? a.take<layer_cache<T>>(detail::saturating_mul(n, options_.model.num_layers)) : nullptr;
    if (seqs != nullptr) *seqs = s;
    if (layers != nullptr) *layers = l;
  }

  template <class T, class Q>
  status run_typed(std::int64_t layer, const any_sequence_io* seqs, std::int64_t num_seqs, sequence_report* reports,
                   workspace_span ws) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    if (num_seqs < 0 || num_seqs > options_.limits.max_sequences)
      return status::error(errc::invalid_shape, fn, "num_seqs", "expected 0 .. %lld (limits.max_sequences), got %lld",
                           static_cast<long long>(options_.limits.max_sequences), static_cast<long long>(num_seqs));
    if (num_seqs > 0 && seqs == nullptr) return status::error(errc::null_pointer, fn, "seqs", "expected non-null");
    if (ws.size > 0 && ws.data == nullptr) return status::error(errc::null_pointer, fn, "ws.data", "expected non-null");
    detail::arena a(ws);
    sequence_io<T, Q>* typed = nullptr;
    layer_cache<T>* layers = nullptr;
    carve_typed_batch(a, num_seqs, &typed, &layers);
    if (a.overflowed() || a.used() > ws.size)
      return status::error(errc::workspace_too_small, fn, "ws",
                           "expected at least %zu bytes (any_workspace_size()), got %zu", any_workspace_size(),
                           ws.size);
    for (std::int64_t s = 0; s < num_seqs; ++s)
      typed[s] = detail::typed_sequence<T, Q>(
          seqs[s], layers != nullptr ? layers + s * options_.model.num_layers : nullptr, options_.model.num_layers);
    const workspace_span rest{static_cast<unsigned char*>(ws.data) + a.used(), ws.size - a.used()};
    return run(layer, typed, num_seqs, reports, rest);
  }

  struct run_layout {
    std::int64_t* layer_budgets = nullptr;  ///< [layers] (PyramidKV)
    std::int64_t* head_lengths = nullptr;   ///< [Hkv] when the caller asks for none
    std::int64_t* indices = nullptr;        ///< [keep capacity] the keep-list (padded output)
    workspace_span policy;                  ///< the policy's evict / observe / scoring workspace
  };

  /// The per-sequence scope's scratch, carved from run_layout::policy.
  struct shared_layout {
    float* scores = nullptr;           ///< [Hkv, L]
    float* row = nullptr;              ///< [L] this layer's combined scores
    std::int64_t* offsets = nullptr;   ///< [Hkv + 1]
    std::int64_t* indices = nullptr;   ///< [keep capacity]
    std::int64_t* one_head = nullptr;  ///< [L + 2]
    workspace_span score, select, compact;
    workspace_span gather;  ///< tensor parallelism: the rows the group exchanges
  };

  /// Everything run() can check before it changes anything, for the whole batch.
  template <class T, class Q>
  status check_run(std::int64_t layer, const sequence_io<T, Q>* seqs, std::int64_t num_seqs,
                   const sequence_report* reports, workspace_span ws, run_layout* lay) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    KVEVICT_RETURN_IF_ERROR(
        detail::check_run_call(options_, dtype_of<T>::value, dtype_of<Q>::value, layer, num_seqs, seqs, reports, fn));
    detail::arena a(ws);
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
              detail::byte_ranges_overlap(seqs[s].state, state_bytes_, seqs[t].state, state_bytes_))
            return status::error(errc::invalid_argument, fn, detail::io_name(s, "state"),
                                 "expected one state per sequence, got memory that overlaps the state of seqs[%lld]",
                                 static_cast<long long>(t));
    for (std::int64_t s = 0; s < num_seqs; ++s) KVEVICT_RETURN_IF_ERROR(check_sequence(layer, seqs[s], s, *lay));
    if (options_.compact == compaction::in_place && num_seqs > 1)
      KVEVICT_RETURN_IF_ERROR(check_blocks_across(layer, seqs, num_seqs, *lay));
    return status();
  }

  /// In place, no block a compacted sequence uses may be reached by another sequence of the
  /// call, marked or not (evict_batch's rule, detail::check_blocks_not_reached). Every sequence
  /// that holds paged views is compared (idle ones too: a prefill chunk may share a prefix),
  /// so those views must be valid. Compares this layer's views (under the per-sequence scope
  /// the last layer's call compacts every layer: engines whose layers share one block table).
  template <class T, class Q>
  status check_blocks_across(std::int64_t layer, const sequence_io<T, Q>* seqs, std::int64_t num_seqs,
                             const run_layout& lay) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    const auto written = [&](std::int64_t s) {
      const sequence_io<T, Q>& io = seqs[s];
      if (!io.keys.is_paged() && !io.values.is_paged()) return false;
      plan_step what;
      (void)decide(layer, io, s, &what);  // checked: cannot fail
      return what.action == act::evict || what.action == act::fold_and_evict_all;
    };
    std::int64_t ids = 0;
    for (std::int64_t s = 0; s < num_seqs; ++s) {
      if (!written(s)) continue;
      const auto kseq = [&](std::int64_t) { return seqs[s].keys; };
      const auto vseq = [&](std::int64_t) { return seqs[s].values; };
      ids = std::max(ids, detail::block_id_scratch(1, kseq, vseq));
    }
    if (ids == 0) return status();  // no paged sequence compacts: nothing to compare
    for (std::int64_t s = 0; s < num_seqs; ++s) {
      const sequence_io<T, Q>& io = seqs[s];
      if (io.keys.is_paged() || io.values.is_paged())
        KVEVICT_RETURN_IF_ERROR(detail::validate_kv_views(io.keys, io.values, fn, detail::io_name(s, "keys"),
                                                          detail::io_name(s, "values")));
    }
    detail::arena a(lay.policy);
    std::int32_t* scratch = a.take<std::int32_t>(ids);
    if (a.overflowed())
      return status::error(errc::workspace_too_small, fn, "ws", "block tables longer than limits.max_tokens");
    const auto kseq = [seqs](std::int64_t s) { return seqs[s].keys; };
    const auto vseq = [seqs](std::int64_t s) { return seqs[s].values; };
    return detail::check_blocks_not_reached(num_seqs, kseq, vseq, written, scratch, fn, detail::block_naming::seqs);
  }

  /// Tensor parallelism: run()'s agreement round. Every rank passes the same layer, batch size
  /// and, per sequence, the same event, action, token counts and protected tail, or every rank
  /// gets the same error; a rank whose checks failed makes every rank return.
  template <class T, class Q>
  status agree_run(std::int64_t layer, const sequence_io<T, Q>* seqs, std::int64_t num_seqs,
                   const status& local) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    detail::digest batch;
    std::uint64_t tokens = 0;
    if (local.ok()) {
      for (std::int64_t s = 0; s < num_seqs; ++s) {
        const sequence_io<T, Q>& io = seqs[s];
        plan_step what;
        (void)decide(layer, io, s, &what);  // checked: cannot fail
        batch.add(static_cast<std::uint64_t>(io.event));
        batch.add(what.observe ? 1u : 0u);
        batch.add(static_cast<std::uint64_t>(what.action));
        if (!what.observe && what.action == act::none) continue;
        tokens += static_cast<std::uint64_t>(io.keys.num_tokens);
        batch.add(static_cast<std::uint64_t>(io.keys.num_tokens));
        if (defers()) {
          const policy_state st = layer_state(io.state, layer);
          const deferred_policy<T, Q> d(deferred_config());
          batch.add(static_cast<std::uint64_t>(d.prompt_tokens(st)));
          batch.add(static_cast<std::uint64_t>(d.steps_observed(st)));
        } else if (what.action != act::none) {
          batch.add(static_cast<std::uint64_t>(scored_tokens(io)));
        }
      }
    }
    const detail::agreement_field fields[] = {
        {"layer", static_cast<std::uint64_t>(layer)},
        {"num_seqs", static_cast<std::uint64_t>(num_seqs)},
        {"seqs[].keys.num_tokens", tokens},
        {"seqs", batch.h, true},
    };
    return detail::agree(*options_.tensor_parallel, fn, "tensor_parallel", local, fields,
                         static_cast<int>(sizeof(fields) / sizeof(fields[0])));
  }

  void carve(detail::arena& a, run_layout* out) const noexcept {
    out->layer_budgets =
        options_.layers == layer_allocation::pyramidkv ? a.take<std::int64_t>(options_.model.num_layers) : nullptr;
    out->head_lengths = a.take<std::int64_t>(options_.model.num_kv_heads);
    out->indices = a.take<std::int64_t>(keep_capacity_);
    out->policy = detail::take_span(a, policy_bytes_);
  }

  void carve_shared(detail::arena& a, std::size_t score_bytes, shared_layout* out) const noexcept {
    using detail::saturating_add;
    using detail::saturating_mul;
    const std::int64_t heads = options_.model.num_kv_heads, tokens = options_.limits.max_tokens;
    out->scores = a.take<float>(saturating_mul(heads, tokens));
    out->row = a.take<float>(tokens);
    out->offsets = a.take<std::int64_t>(saturating_add(heads, 1));
    out->indices = a.take<std::int64_t>(keep_capacity_);
    out->one_head = a.take<std::int64_t>(saturating_add(tokens, 2));
    out->score = detail::take_span(a, score_bytes);
    out->select = detail::take_span(a, select_workspace_size(tokens, options_.exec));
    out->compact = detail::take_span(a, detail::compact_workspace_bound(heads, tokens));
    if (options_.tensor_parallel != nullptr)
      out->gather = detail::take_span(a, detail::sharded_combine_workspace_size(tokens, options_.combine, shard()));
  }

  status check_planned(const char* fn) const noexcept {
    if (!planned_) return status::error(errc::invalid_state, fn, "compressor", "not planned: call compressor::plan");
    return status();
  }

  // ---- planning ----------------------------------------------------------------------

  /// Tensor parallelism, plan round 1 (u32 sum): every rank's KV head count in its slot, and
  /// whether it failed so far. Each rank learns where its heads start and how many there are.
  status learn_heads(const status& local, const char* fn) noexcept {
    const collective& g = *options_.tensor_parallel;
    std::uint32_t words[detail::max_world_size + 1] = {};
    const std::int64_t heads = options_.model.num_kv_heads;
    if (local.ok()) words[g.rank] = static_cast<std::uint32_t>(heads > 0xffff ? 0xffff : heads);
    words[g.world_size] = local.ok() ? 0u : 1u;
    KVEVICT_RETURN_IF_ERROR(detail::all_reduce(g, words, g.world_size + 1, reduce_op::sum, fn, "tensor_parallel"));
    KVEVICT_RETURN_IF_ERROR(detail::after_round(g, fn, "tensor_parallel", local, words[g.world_size]));
    first_head_ = 0;
    total_heads_ = 0;
    for (std::int32_t r = 0; r < g.world_size; ++r) {
      if (r == g.rank) first_head_ = total_heads_;
      total_heads_ += words[r];
    }
    return status();
  }

  /// Tensor parallelism, plan round 2 (max): every rank planned the same configuration.
  status agree_plan(const status& local, const char* fn) const noexcept {
    const compressor_options& o = options_;
    const model_shape& m = o.model;
    const auto bits = [](double x) {
      std::uint64_t u = 0;
      std::memcpy(&u, &x, sizeof(u));
      return u;
    };
    detail::digest budget, policy;
    budget.add(static_cast<std::uint64_t>(o.per_head.type));
    budget.add(static_cast<std::uint64_t>(o.per_head.count));
    budget.add(bits(o.per_head.compression_ratio));
    const selection_params tail = largest_selection();
    policy.add(static_cast<std::uint64_t>(window_));
    policy.add(static_cast<std::uint64_t>(tail.protected_tail));
    policy.add(static_cast<std::uint64_t>(tail.mode));
    policy.add(static_cast<std::uint64_t>(deferred_traits::config(o.policy).delay));
    policy.add(deferred_traits::config(o.policy).decode_feedback ? 1u : 0u);
    const detail::agreement_field fields[] = {
        {"model.num_layers", static_cast<std::uint64_t>(m.num_layers)},
        {"model.num_query_heads",
         static_cast<std::uint64_t>(m.num_kv_heads > 0 ? m.num_query_heads / m.num_kv_heads : 0)},
        {"model.head_dim", static_cast<std::uint64_t>(m.head_dim)},
        {"model.value_head_dim", static_cast<std::uint64_t>(m.value_head_dim)},
        {"model.storage", static_cast<std::uint64_t>(m.storage)},
        {"model.query_storage", static_cast<std::uint64_t>(m.query_storage)},
        {"policy.kind", static_cast<std::uint64_t>(o.policy.kind)},
        {"policy", policy.h, true},
        {"per_head", budget.h, true},
        {"heads", static_cast<std::uint64_t>(o.heads)},
        {"adakv.alpha", bits(o.adakv.alpha)},
        {"adakv.normalize", o.adakv.normalize ? 1u : 0u},
        {"layers", static_cast<std::uint64_t>(o.layers)},
        {"pyramid_beta", bits(o.pyramid_beta)},
        {"scope", static_cast<std::uint64_t>(o.scope)},
        {"combine", static_cast<std::uint64_t>(o.combine)},
        {"lengths", static_cast<std::uint64_t>(o.lengths)},
        {"compact", static_cast<std::uint64_t>(o.compact)},
        {"limits.max_sequences", static_cast<std::uint64_t>(o.limits.max_sequences)},
        {"limits.max_tokens", static_cast<std::uint64_t>(o.limits.max_tokens)},
        {"limits.max_queries", static_cast<std::uint64_t>(o.limits.max_queries)},
    };
    return detail::agree(*o.tensor_parallel, fn, "tensor_parallel", local, fields,
                         static_cast<int>(sizeof(fields) / sizeof(fields[0])));
  }

  status check_options(const char* fn) noexcept {
    return detail::check_compressor_options(&options_, base_budget(), &window_, fn);
  }

  /// The largest protected tail any call may see (DeferKV adds its decoded tokens).
  selection_params largest_selection() const noexcept { return detail::largest_selection(options_.policy); }

  /// The budget a layer call starts from (before PyramidKV sets layer_candidates). The layer
  /// scope is select_layer's; the sequence scope is the compressor's own.
  layer_budget base_budget() const noexcept {
    layer_budget b = detail::base_layer_budget(options_);
    b.shard = shard();
    return b;
  }

  /// This rank's heads; run() agrees on each batch itself, so selections skip their round.
  head_shard shard() const noexcept {
    head_shard s;
    if (options_.tensor_parallel == nullptr) return s;
    s.group = options_.tensor_parallel;
    s.first_head = first_head_;
    s.total_heads = total_heads_;
    s.agree_shapes = false;
    return s;
  }

  /// The list's deferred policy (policies/policy_list.hpp): the state lifecycle below is its.
  using deferred_traits = typename detail::deferred_of<default_policies>::type;
  template <class T, class Q>
  using deferred_policy = typename deferred_traits::template policy<T, Q>;
  const typename deferred_traits::config_type& deferred_config() const noexcept {
    return deferred_traits::config(options_.policy);
  }
  bool defers() const noexcept { return detail::defers(options_.policy.kind); }

  /// Calls f(traits, policy) with the configured policy's traits and object for storage type T
  /// (policies that score without state; ChunkKV on top where configured). The plan checked
  /// the kind.
  template <class T, class Q, class F>
  status with_scoring_policy(F&& f) const {
    const policy_config& p = options_.policy;
    return detail::with_policy_traits(p.kind, status(), [&](auto traits) -> status {
      using Tr = decltype(traits);
      if constexpr (Tr::deferred) {
        return status::error(errc::invalid_state, "kvevict::compressor", "policy.kind", "not a scoring policy");
      } else {
        using P = typename Tr::template policy<T, Q>;
        const P base(Tr::config(p));
        if constexpr (Tr::chunkable) {
          if (p.chunk_length > 0) return f(traits, kvevict::chunkkv<P>(base, chunkkv_config{p.chunk_length}));
        }
        return f(traits, base);
      }
    });
  }

  template <class T, class Q>
  void size() noexcept {
    const model_shape& m = options_.model;
    const compressor_limits& lim = options_.limits;
    const layer_shape shape{m.num_query_heads, m.num_kv_heads, m.head_dim, lim.max_tokens, lim.max_queries};
    layer_budget b = base_budget();
    // PyramidKV may give a layer any share of its candidates: size for all of them.
    if (options_.layers == layer_allocation::pyramidkv) b.layer_candidates = lim.max_tokens;
    const executor& exec = options_.exec;
    detail::keep_capacities(options_, base_budget(), &keep_capacity_, &head_capacity_);
    std::size_t evict_bytes = 0, score_bytes = 0;
    if (defers()) {
      const deferred_policy<T, Q> d(deferred_config());
      const std::size_t observe = d.workspace_size(shape, exec);
      evict_bytes = std::max(observe, d.evict_workspace_size(shape, b, exec));
      score_bytes = observe;  // covers finalize's [C] row too
      layer_state_bytes_ = detail::round_up_64(deferred_policy<T, Q>::state_size(m.num_kv_heads, lim.max_tokens));
    } else {
      (void)with_scoring_policy<T, Q>([&](auto traits, const auto& policy) {
        evict_bytes = policy.evict_workspace_size(shape, b, exec);
        score_bytes = decltype(traits)::score_workspace_size(policy, shape, exec);
        return status();
      });
      layer_state_bytes_ = 0;
    }
    policy_bytes_ = evict_bytes;
    if (options_.scope == selection_scope::per_sequence) {
      detail::arena a;
      shared_layout sl;
      carve_shared(a, score_bytes, &sl);
      policy_bytes_ = std::max(policy_bytes_, a.used());
      shared_score_bytes_ = score_bytes;
      scope_bytes_ = detail::round_up_64(
          detail::saturating_add(sizeof(detail::scope_state),
                                 detail::saturating_mul(static_cast<std::size_t>(lim.max_tokens), sizeof(float))));
    } else {
      scope_bytes_ = 0;
    }
    state_bytes_ = layer_state_bytes_ == 0 && scope_bytes_ == 0
                       ? 0
                       : detail::saturating_add(
                             detail::saturating_add(detail::sequence_state_offset, scope_bytes_),
                             detail::saturating_mul(static_cast<std::size_t>(m.num_layers), layer_state_bytes_));
    detail::arena a;
    run_layout lay;
    carve(a, &lay);
    workspace_bytes_ = a.used();
  }

  // ---- running -----------------------------------------------------------------------

  policy_state layer_state(void* state, std::int64_t layer) const noexcept {
    return {static_cast<unsigned char*>(state) + detail::sequence_state_offset + scope_bytes_ +
                static_cast<std::size_t>(layer) * layer_state_bytes_,
            layer_state_bytes_};
  }
  detail::scope_state* scope_header(void* state) const noexcept {
    return reinterpret_cast<detail::scope_state*>(static_cast<unsigned char*>(state) + detail::sequence_state_offset);
  }
  float* scope_row(void* state) const noexcept {
    return reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(scope_header(state)) +
                                    sizeof(detail::scope_state));
  }

  /// The queries a prefill_end observation uses: the policy's window (H2O: all).
  template <class T, class Q>
  query_view<const Q> prefill_queries(const sequence_io<T, Q>& io) const noexcept {
    return detail::every_prompt_query(options_.policy.kind) ? io.queries : detail::last_queries(io.queries, window_);
  }

  /// The observation inputs of a sequence for the queries `q` it observes with.
  template <class T, class Q>
  layer_observations<Q> observations_of(const sequence_io<T, Q>& io, const query_view<const Q>& q,
                                        policy_state state) const noexcept {
    layer_observations<Q> o;
    o.queries = q;
    o.observation.key_positions = io.key_positions;
    if (io.lse != nullptr) {
      const std::int64_t stride = io.lse_head_stride != 0 ? io.lse_head_stride : io.queries.num_queries;
      o.observation.lse = io.lse + (io.queries.num_queries - q.num_queries);  // the rows of the last queries
      o.observation.lse_head_stride = stride;
    }
    o.state = state;
    return o;
  }

  /// What a sequence's event does at this layer (decided before anything changes):
  /// observe (DeferKV's queries into its state), then act on the layer's scores: evict this
  /// layer, fold them into the sequence's combined scores, or fold and evict every layer.
  enum class act { none, evict, fold, fold_and_evict_all };
  struct plan_step {
    bool observe = false;
    act action = act::none;
  };

  bool sequence_scope() const noexcept { return options_.scope == selection_scope::per_sequence; }

  act scores_act(std::int64_t layer) const noexcept {
    if (!sequence_scope()) return act::evict;
    return layer == options_.model.num_layers - 1 ? act::fold_and_evict_all : act::fold;
  }

  template <class T, class Q>
  status check_sequence(std::int64_t layer, const sequence_io<T, Q>& io, std::int64_t s, const run_layout& lay) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    if (static_cast<unsigned>(io.event) > 2u)
      return status::error(errc::invalid_argument, fn, detail::io_name(s, "event"),
                           "expected a sequence_event value, got %d", static_cast<int>(io.event));
    plan_step what;
    KVEVICT_RETURN_IF_ERROR(decide(layer, io, s, &what));
    if (!what.observe && what.action == act::none) return status();
    KVEVICT_RETURN_IF_ERROR(
        check_layer_cache(io.cache(), s, "", what.action != act::none && what.action != act::fold, lay.policy));
    if (io.keys.num_tokens > options_.limits.max_tokens)
      return status::error(errc::invalid_shape, fn, detail::io_name(s, "keys.num_tokens"),
                           "expected at most limits.max_tokens = %lld, got %lld",
                           static_cast<long long>(options_.limits.max_tokens),
                           static_cast<long long>(io.keys.num_tokens));
    KVEVICT_RETURN_IF_ERROR(check_queries(layer, io, s, what));
    if (what.action == act::fold_and_evict_all && options_.compact != compaction::keep_list_only) {
      if (io.layers == nullptr)
        return status::error(errc::null_pointer, fn, detail::io_name(s, "layers"),
                             "a keep set shared by every layer compacts every layer at the last one: expected "
                             "[num_layers] layer caches");
      for (std::int64_t l = 0; l < options_.model.num_layers; ++l) {
        char prefix[40];
        std::snprintf(prefix, sizeof(prefix), "layers[%lld].", static_cast<long long>(l));
        const layer_cache<T>& c = io.layers[l];
        KVEVICT_RETURN_IF_ERROR(check_layer_cache(c, s, prefix, true, lay.policy));
        if (c.keys.num_tokens != io.keys.num_tokens)
          return status::error(errc::invalid_shape, fn, detail::io_name(s, "layers"),
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
    KVEVICT_RETURN_IF_ERROR(
        detail::validate_kv_views(c.keys, c.values, fn, detail::io_name(s, kname), detail::io_name(s, vname)));
    if (c.keys.num_heads != m.num_kv_heads || c.keys.head_dim != m.head_dim)
      return status::error(errc::invalid_shape, fn, detail::io_name(s, kname),
                           "expected the model's [%lld heads, d = %lld], got [%lld, %lld]",
                           static_cast<long long>(m.num_kv_heads), static_cast<long long>(m.head_dim),
                           static_cast<long long>(c.keys.num_heads), static_cast<long long>(c.keys.head_dim));
    if (c.values.head_dim != m.value_head_dim)
      return status::error(errc::invalid_shape, fn, detail::io_name(s, vdim),
                           "expected the model's head_dim %lld, got %lld", static_cast<long long>(m.value_head_dim),
                           static_cast<long long>(c.values.head_dim));
    if (!compacted || options_.compact == compaction::keep_list_only) return status();
    if (options_.compact == compaction::out_of_place) {
      char dkname[2 * status::max_argument], dvname[2 * status::max_argument];
      std::snprintf(dkname, sizeof(dkname), "%sdst_keys", prefix);
      std::snprintf(dvname, sizeof(dvname), "%sdst_values", prefix);
      if (!c.out_of_place())
        return status::error(errc::null_pointer, fn, detail::io_name(s, dkname),
                             "compaction::out_of_place: expected destination views (fresh blocks)");
      KVEVICT_RETURN_IF_ERROR(detail::in_sequence(
          detail::validate_kv_views(c.dst_keys, c.dst_values, fn, "dst_keys", "dst_values"), s, fn, prefix));
      if (c.dst_keys.num_heads != c.keys.num_heads || c.dst_keys.head_dim != c.keys.head_dim ||
          c.dst_values.head_dim != c.values.head_dim)
        return status::error(errc::invalid_shape, fn, detail::io_name(s, dkname),
                             "expected the source's heads and head dims");
      // evict_into's destination checks, now, for the longest keep set possible for this
      // sequence's length (a superset of the rows it will write), so that no sequence moves
      // before all pass.
      const std::int64_t most = keep_capacity_per_head(c.keys.num_tokens);
      std::snprintf(dkname, sizeof(dkname), "%sdst_keys.num_tokens", prefix);
      if (c.dst_keys.num_tokens < most)
        return status::error(errc::invalid_shape, fn, detail::io_name(s, dkname),
                             "expected room for %lld rows (keep_capacity_per_head(num_tokens)), got %lld",
                             static_cast<long long>(most), static_cast<long long>(c.dst_keys.num_tokens));
      const cache_view<T> dk = c.dst_keys.first_tokens(most), dv = c.dst_values.first_tokens(most);
      detail::arena a(scratch);
      std::int32_t* ids = a.take<std::int32_t>(detail::destination_scratch_ids(c.keys, c.values, dk, dv));
      if (a.overflowed())
        return status::error(errc::workspace_too_small, fn, "ws", "block tables longer than limits.max_tokens");
      eviction_options opt;
      opt.block_refcounts = c.block_refcounts;
      opt.shared_blocks = c.shared_blocks;
      return detail::in_sequence(detail::check_destination(c.keys, c.values, dk, dv, opt, ids, fn), s, fn, prefix);
    }
    KVEVICT_RETURN_IF_ERROR(detail::check_kv_not_aliased(c.keys, c.values, fn, detail::io_name(s, vname)));
    if (c.keys.is_paged() || c.values.is_paged()) {
      const auto kseq = [&c](std::int64_t) { return c.keys; };
      const auto vseq = [&c](std::int64_t) { return c.values; };
      detail::arena a(scratch);
      std::int32_t* ids = a.take<std::int32_t>(detail::block_id_scratch(1, kseq, vseq));
      if (ids == nullptr)
        return status::error(errc::workspace_too_small, fn, "ws", "block tables longer than limits.max_tokens");
      KVEVICT_RETURN_IF_ERROR(
          detail::in_sequence(detail::check_block_ids(1, kseq, vseq, detail::same_block_table(c.keys, c.values),
                                                      detail::same_block_pool(c.keys, c.values), ids, fn, false),
                              s, fn, prefix));
      // Blocks shared with sequences outside the call are invisible here: the engine says how
      // it shares them (compressor_options::sharing), and marks them on every call if it does.
      if (options_.sharing == block_sharing::undeclared)
        return status::error(errc::invalid_argument, fn, "sharing",
                             "%s is paged, compacted in place: expected block_sharing::marked (refcounts at "
                             "every call) or block_sharing::none (no block shared), got block_sharing::undeclared",
                             static_cast<const char*>(detail::io_name(s, kname)));
      if (options_.sharing == block_sharing::marked && c.block_refcounts == nullptr && c.shared_blocks == nullptr) {
        char rname[2 * status::max_argument];
        std::snprintf(rname, sizeof(rname), "%sblock_refcounts", prefix);
        return status::error(errc::null_pointer, fn, detail::io_name(s, rname),
                             "block_sharing::marked: expected the pool's block references (or shared_blocks) at "
                             "every in-place call");
      }
      // In place, a batch cannot learn which rows move before it moves some: every used block
      // marked shared is refused here (evict() alone refuses only the blocks it would write).
      eviction_options opt;
      opt.block_refcounts = c.block_refcounts;
      opt.shared_blocks = c.shared_blocks;
      const detail::written_per_table all{nullptr, {0, c.keys.num_tokens}, false};
      KVEVICT_RETURN_IF_ERROR(
          detail::in_sequence(detail::check_shared_writes(c.keys, all, opt, fn, "keys"), s, fn, prefix));
      KVEVICT_RETURN_IF_ERROR(
          detail::in_sequence(detail::check_shared_writes(c.values, all, opt, fn, "values"), s, fn, prefix));
    }
    return status();
  }

  /// Decides what the event does; for DeferKV and the sequence scope also checks the state.
  template <class T, class Q>
  status decide(std::int64_t layer, const sequence_io<T, Q>& io, std::int64_t s, plan_step* out) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    *out = plan_step{};
    if (io.event == sequence_event::idle) return status();
    if (state_bytes_ > 0) KVEVICT_RETURN_IF_ERROR(check_state(io.state, s));
    if (!defers()) {
      if (io.event == sequence_event::prefill_end) out->action = scores_act(layer);
    } else {
      const deferred_policy<T, Q> d(deferred_config());
      const policy_state st = layer_state(io.state, layer);
      if (!d.intact(st))
        return status::error(errc::invalid_state, fn, detail::io_name(s, "state"),
                             "layer %lld's DeferKV state was overwritten: reset_sequence() when the sequence starts",
                             static_cast<long long>(layer));
      const bool fed_back = deferred_traits::feeds_back(deferred_config());
      if (io.event == sequence_event::prefill_end) {
        if (d.started(st))
          return status::error(errc::invalid_state, fn, detail::io_name(s, "state"),
                               "layer %lld already observed this sequence's prefill; reset_sequence() for a new one",
                               static_cast<long long>(layer));
        out->observe = true;
        out->action = fed_back ? act::none : scores_act(layer);
      } else if (d.evicted(st)) {
        return status();  // decoding goes on after eviction
      } else if (d.ready(st)) {
        out->action = scores_act(layer);
      } else if (!d.started(st)) {
        return status::error(errc::invalid_state, fn, detail::io_name(s, "event"),
                             "a decode step before this sequence's prefill_end at layer %lld",
                             static_cast<long long>(layer));
      } else {
        out->observe = true;
        out->action =
            d.steps_observed(st) + 1 >= deferred_traits::delay(deferred_config()) ? scores_act(layer) : act::none;
      }
    }
    if (out->action == act::fold || out->action == act::fold_and_evict_all) {
      const detail::scope_state* sc = scope_header(io.state);
      if (sc->done != 0) {  // the sequence's keep set was applied: nothing more to do
        *out = plan_step{};
        return status();
      }
      if (sc->folded != layer)
        return status::error(errc::invalid_state, fn, detail::io_name(s, "state"),
                             "a keep set shared by every layer folds the layers in order: expected layer %lld, got "
                             "%lld",
                             static_cast<long long>(sc->folded), static_cast<long long>(layer));
      // Every layer's DeferKV state is marked evicted with the sequence's keep set: check them
      // now, before anything changes (the earlier layers observed this step and are ready).
      if (out->action == act::fold_and_evict_all && defers()) {
        const deferred_policy<T, Q> d(deferred_config());
        for (std::int64_t l = 0; l < layer; ++l)
          if (!d.intact(layer_state(io.state, l)) || !d.ready(layer_state(io.state, l)))
            return status::error(errc::invalid_state, fn, detail::io_name(s, "state"),
                                 "layer %lld's DeferKV state is not ready to evict (the layers run in order at "
                                 "every step)",
                                 static_cast<long long>(l));
      }
    }
    return status();
  }

  status check_state(const void* state, std::int64_t s) const noexcept {
    static constexpr const char* fn = "kvevict::compressor::run";
    if (state == nullptr)
      return status::error(errc::null_pointer, fn, detail::io_name(s, "state"),
                           "expected sequence_state_size() = %zu bytes set up by reset_sequence()", state_bytes_);
    if (reinterpret_cast<std::uintptr_t>(state) % 8 != 0)
      return status::error(errc::invalid_argument, fn, detail::io_name(s, "state"), "expected 8-byte alignment");
    detail::sequence_state_header h;
    std::memcpy(&h, state, sizeof(h));
    if (h.magic != detail::sequence_state_magic || h.layers != options_.model.num_layers ||
        h.layer_bytes != layer_state_bytes_ || h.scope_bytes != scope_bytes_)
      return status::error(errc::invalid_state, fn, detail::io_name(s, "state"),
                           "not a state of this plan: call reset_sequence() when the sequence starts");
    return status();
  }

  template <class T, class Q>
  status check_queries(std::int64_t layer, const sequence_io<T, Q>& io, std::int64_t s, const plan_step& what) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    const policy_kind kind = options_.policy.kind;
    if (!detail::reads_queries(kind)) return status();
    const bool defer = defers();
    if (defer && !what.observe) return status();  // scored from the state
    KVEVICT_RETURN_IF_ERROR(detail::validate_query_view(io.queries, fn, detail::io_name(s, "queries")));
    const bool decode = io.event == sequence_event::decode;
    KVEVICT_RETURN_IF_ERROR(detail::check_sequence_queries(options_, scoring_domain(), io.queries, decode, io.lse,
                                                           io.lse_head_stride, s, fn));
    const query_view<const Q> q = decode ? io.queries : prefill_queries(io);
    if (q.num_queries > options_.limits.max_queries)
      return status::error(errc::invalid_shape, fn, detail::io_name(s, "queries.num_queries"),
                           "expected at most limits.max_queries = %lld, got %lld",
                           static_cast<long long>(options_.limits.max_queries), static_cast<long long>(q.num_queries));
    if (!decode) KVEVICT_RETURN_IF_ERROR(check_window(io, s));
    KVEVICT_RETURN_IF_ERROR(detail::with_policy_traits(kind, status(), [&](auto traits) -> status {
      using Tr = decltype(traits);
      if constexpr (Tr::deferred) {
        return status();
      } else {
        using P = typename Tr::template policy<T, Q>;
        return Tr::check_observation(P(Tr::config(options_.policy)), io.keys.num_tokens, q, s, fn);
      }
    }));
    if (defer && decode) {
      const deferred_policy<T, Q> d(deferred_config());
      layer_inputs<T, Q> in;
      in.keys = io.keys;
      in.queries = q;
      return detail::in_sequence(d.check_decode(layer_state(io.state, layer), in, fn), s, fn);
    }
    if (what.action == act::fold && layer > 0) {  // every layer of the fold scores as many tokens
      const detail::scope_state* sc = scope_header(io.state);
      if (scored_tokens(io) != sc->tokens)
        return status::error(errc::invalid_shape, fn, detail::io_name(s, "keys.num_tokens"),
                             "expected the %lld scored tokens of layer 0, got %lld", static_cast<long long>(sc->tokens),
                             static_cast<long long>(scored_tokens(io)));
    }
    return status();
  }

  /// prefill_end: as many queries as the policy observes, never fewer: observation_window()
  /// of them (or every prompt query of a shorter prompt; DapQ's pseudo tokens: exactly its N),
  /// H2O every prompt query. With chunked prefill the last chunk may hold fewer; scoring with
  /// them would choose another keep set, so the call is refused (the engine keeps the last W
  /// prompt queries across chunks and hands them all).
  template <class T, class Q>
  status check_window(const sequence_io<T, Q>& io, std::int64_t s) const noexcept {
    static constexpr const char* fn = "kvevict::compressor::run";
    const policy_config& p = options_.policy;
    const bool h2o = detail::every_prompt_query(p.kind);
    const bool pseudo = detail::with_policy_traits(p.kind, false, [&](auto traits) {
      using Tr = decltype(traits);
      return Tr::fixed_window(Tr::config(p));
    });
    const std::int64_t need = h2o ? io.keys.num_tokens : pseudo ? window_ : std::min(window_, io.keys.num_tokens);
    if (io.queries.num_queries >= need) return status();
    return status::error(errc::invalid_shape, fn, detail::io_name(s, "queries.num_queries"),
                         h2o ? "expected every prompt query at prefill_end (H2O: keys.num_tokens = %lld), got %lld "
                               "(chunked prefill: keep the earlier chunks' queries)"
                             : "expected observation_window() = %lld queries at prefill_end, got %lld (chunked "
                               "prefill: keep the earlier chunks' last queries, hand the whole window)",
                         static_cast<long long>(need), static_cast<long long>(io.queries.num_queries));
  }

  softmax_domain scoring_domain() const noexcept {
    const policy_config& p = options_.policy;
    return detail::with_policy_traits(p.kind, softmax_domain::visible, [&](auto traits) {
      using Tr = decltype(traits);
      return Tr::domain(Tr::config(p));
    });
  }

  /// Tokens the layer's scores cover: L, or DapQ's prompt length.
  template <class T, class Q>
  std::int64_t scored_tokens(const sequence_io<T, Q>& io) const noexcept {
    const std::int64_t tokens = io.keys.num_tokens;
    return detail::with_policy_traits(options_.policy.kind, tokens, [&](auto traits) -> std::int64_t {
      using Tr = decltype(traits);
      if constexpr (Tr::deferred) {
        return tokens;
      } else {
        using P = typename Tr::template policy<T, Q>;
        return Tr::scored_tokens(P(Tr::config(options_.policy)), tokens, prefill_queries(io).num_queries);
      }
    });
  }

  /// The layer's budget for a sequence of `tokens` scored tokens under selection `sel`.
  layer_budget budget_for(std::int64_t layer, std::int64_t tokens, const selection_params& sel,
                          const run_layout& lay) const noexcept {
    return detail::layer_budget_for(options_, base_budget(), layer, tokens, sel, lay.layer_budgets);
  }

  /// One past the newest token's position: a decode step's query position, else the
  /// cache's last token (its key position, or its index).
  template <class T, class Q>
  static std::int64_t next_position_after(const sequence_io<T, Q>& io) noexcept {
    if (io.event == sequence_event::decode && io.queries.positions != nullptr && io.queries.num_queries > 0)
      return io.queries.positions[io.queries.num_queries - 1] + 1;
    const std::int64_t l = io.keys.num_tokens;
    if (l <= 0) return 0;
    return (io.key_positions != nullptr ? io.key_positions[l - 1] : l - 1) + 1;
  }

  /// The layer's scores [Hkv, scored] for the sequence scope, from the policy's own scoring.
  template <class T, class Q>
  status layer_scores(const sequence_io<T, Q>& io, policy_state st, const shared_layout& sh, score_view* out,
                      selection_params* sel) const {
    const layer_cache<T> cache = io.cache();
    const std::int64_t scored = scored_tokens(io);
    *out = score_view{sh.scores, io.keys.num_heads, scored, scored};
    if (defers()) {
      const deferred_policy<T, Q> d(deferred_config());
      *sel = d.selection(st);
      layer_inputs<T, Q> in;
      in.state = st;
      return d.score(in, *out, sh.score, options_.exec);
    }
    const layer_observations<Q> o = observations_of(io, prefill_queries(io), policy_state{});
    return with_scoring_policy<T, Q>([&](auto traits, const auto& policy) {
      *sel = policy.selection();
      return decltype(traits)::score_layer(policy, cache, o, *out, sh.score, options_.exec);
    });
  }

  /// The report's counts of non-finite values in what the call scores with: the observation
  /// queries, and the keys (every key at prefill_end, the newest at an observed decode step).
  /// Scoring absorbs them by design; the counts tell the engine. Keys are counted per head
  /// through the executor into the layout's head_lengths (written again by the eviction).
  template <class T, class Q>
  void count_nonfinite(const sequence_io<T, Q>& io, const plan_step& what, const run_layout& lay,
                       sequence_report* r) const {
    const policy_kind kind = options_.policy.kind;
    const bool prefill = io.event == sequence_event::prefill_end;
    if (!prefill && !what.observe) return;  // DeferKV evicting from its state: nothing read
    if (detail::reads_queries(kind)) {
      const query_view<const Q> q = prefill ? prefill_queries(io) : io.queries;
      std::int64_t n = 0;
      for (std::int64_t h = 0; h < q.num_heads; ++h)
        for (std::int64_t t = 0; t < q.num_queries; ++t)
          for (std::int64_t c = 0; c < q.head_dim; ++c) n += std::isfinite(to_float(q.at(h, t, c))) ? 0 : 1;
      r->nonfinite_queries = n;
    }
    if (!detail::reads_keys(kind)) return;
    struct task_context {
      cache_view<T> keys;
      std::int64_t first, last;
      std::int64_t* counts;
    } ctx{io.keys, prefill ? 0 : io.keys.num_tokens - 1, io.keys.num_tokens, lay.head_lengths};
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

  template <class T, class Q>
  status step(std::int64_t layer, const sequence_io<T, Q>& io, const run_layout& lay, sequence_report* r) const {
    plan_step what;
    KVEVICT_RETURN_IF_ERROR(decide(layer, io, 0, &what));
    r->length = io.keys.num_tokens;
    r->next_slot = io.keys.num_tokens;
    r->next_position = next_position_after(io);
    if (!what.observe && what.action == act::none) return status();
    count_nonfinite(io, what, lay, r);
    eviction_result result;
    result.head_lengths = io.head_lengths != nullptr ? io.head_lengths : lay.head_lengths;
    result.positions = io.kept_positions;
    result.indices = lay.indices;
    result.changed_blocks = io.changed_blocks;
    result.head_freed_blocks = io.head_freed_blocks;
    layer_cache<T> cache = io.cache();
    cache.compact = options_.compact != compaction::keep_list_only;
    const executor& exec = options_.exec;
    const bool defer = defers();
    const policy_state st = defer ? layer_state(io.state, layer) : policy_state{};
    if (what.observe) {
      const deferred_policy<T, Q> d(deferred_config());
      layer_inputs<T, Q> in;
      in.keys = io.keys;
      in.observation.key_positions = io.key_positions;
      in.state = st;
      in.queries = io.event == sequence_event::prefill_end ? prefill_queries(io) : io.queries;
      if (io.event == sequence_event::prefill_end) {
        KVEVICT_RETURN_IF_ERROR(d.observe_prefill(in, lay.policy, exec));
      } else {
        KVEVICT_RETURN_IF_ERROR(d.observe_decode(in, lay.policy, exec));
      }
      r->action = sequence_action::observed;
    }
    if (what.action == act::none) return status();
    std::int64_t scored = io.keys.num_tokens;
    if (what.action == act::evict) {
      if (defer) {
        const deferred_policy<T, Q> d(deferred_config());
        layer_observations<Q> o;
        o.observation.key_positions = io.key_positions;
        o.state = st;
        KVEVICT_RETURN_IF_ERROR(
            d.evict(cache, o, budget_for(layer, io.keys.num_tokens, d.selection(st), lay), result, lay.policy, exec));
      } else {
        const query_view<const Q> q = prefill_queries(io);
        const layer_observations<Q> o = observations_of(io, q, policy_state{});
        const status evicted = with_scoring_policy<T, Q>([&](auto traits, const auto& policy) {
          scored = decltype(traits)::scored_tokens(policy, io.keys.num_tokens, q.num_queries);
          return policy.evict(cache, o, budget_for(layer, scored, policy.selection(), lay), result, lay.policy, exec);
        });
        KVEVICT_RETURN_IF_ERROR(evicted);
      }
    } else {
      // The sequence scope: fold this layer's combined scores into the sequence's row; at the
      // last layer select one keep set from it and apply it to every layer.
      detail::arena a(lay.policy);
      shared_layout sh;
      carve_shared(a, shared_score_bytes_, &sh);
      score_view scores;
      selection_params sel;
      const status scored_ok = layer_scores(io, st, sh, &scores, &sel);
      const bool sharded = options_.tensor_parallel != nullptr;
      if (!sharded) KVEVICT_RETURN_IF_ERROR(scored_ok);
      scored = scores.cols;
      detail::scope_state* sc = scope_header(io.state);
      float* row = scope_row(io.state);
      const std::int64_t candidates = scored > sel.protected_tail ? scored - sel.protected_tail : 0;
      if (sharded) {  // every head of the group, the same bits on every rank (a scoring failure ends it there)
        KVEVICT_RETURN_IF_ERROR(detail::combine_head_scores_sharded(scores, sel.protected_tail, options_.combine,
                                                                    shard(), sh.row, sh.gather, scored_ok,
                                                                    "kvevict::compressor::run"));
      } else {
        KVEVICT_RETURN_IF_ERROR(combine_head_scores(scores, sel.protected_tail, options_.combine, sh.row));
      }
      // Layers fold as more heads of the same combination: no second normalisation.
      const scope_combine across = detail::combines_by_max(options_.combine) ? scope_combine::max : scope_combine::mean;
      detail::fold_row(row, sh.row, scored, candidates, across, layer == 0);
      sc->folded = layer + 1;
      sc->tokens = scored;
      if (what.action == act::fold) {
        r->action = sequence_action::observed;
        return status();
      }
      detail::finish_mean(row, candidates, options_.model.num_layers, across);
      const keep_list_view keep{io.keys.num_heads, sh.offsets, sh.indices, keep_capacity_};
      KVEVICT_RETURN_IF_ERROR(select_shared(const_score_view{row, 1, scored, scored}, sel, base_budget(), keep,
                                            sh.one_head, sh.select, exec));
      if (options_.compact == compaction::keep_list_only) {
        KVEVICT_RETURN_IF_ERROR(
            detail::compact_layer(cache, const_keep_list_view(keep), result, sh.compact, io.key_positions, exec));
      } else {
        for (std::int64_t l = 0; l < options_.model.num_layers; ++l) {
          eviction_result lr = result;
          if (l != layer) lr.changed_blocks = nullptr;  // one list for the call (the layer's own)
          KVEVICT_RETURN_IF_ERROR(
              detail::compact_layer(io.layers[l], const_keep_list_view(keep), lr, sh.compact, io.key_positions, exec));
          if (l == layer) result = lr;
        }
      }
      if (defer) {
        const deferred_policy<T, Q> d(deferred_config());
        for (std::int64_t l = 0; l < options_.model.num_layers; ++l)
          KVEVICT_RETURN_IF_ERROR(d.mark_evicted(layer_state(io.state, l)));
      }
      sc->done = 1;
    }
    r->action = sequence_action::evicted;
    r->length = result.max_length;
    r->next_slot = result.max_length;
    r->freed_blocks = result.freed_blocks;
    r->dropped = io.keys.num_tokens - result.max_length;
    r->num_changed_blocks = result.num_changed_blocks;
    r->kept = 0;
    for (std::int64_t h = 0; h < io.keys.num_heads; ++h) r->kept += result.head_lengths[h];
    if (detail::reuses_positions(options_.policy.kind)) r->next_position = scored;
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

  compressor_options options_;
  bool planned_ = false;
  std::int64_t window_ = 0;
  std::int64_t first_head_ = 0;
  std::int64_t total_heads_ = 0;
  std::size_t policy_bytes_ = 0;
  std::size_t workspace_bytes_ = 0;
  std::size_t layer_state_bytes_ = 0;
  std::size_t scope_bytes_ = 0;
  std::size_t shared_score_bytes_ = 0;
  std::size_t state_bytes_ = 0;
  std::int64_t keep_capacity_ = 0;
  std::int64_t head_capacity_ = 0;
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_COMPRESSOR_COMPRESSOR_HPP
