// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_COMPRESSOR_BASIC_COMPRESSOR_HPP
#define KVEVICT_COMPRESSOR_BASIC_COMPRESSOR_HPP

// The compressor over a list of policies: planned once per model, called once per layer at the
// attention hook for a batch of sequences (design.md §13).
//
//   basic_compressor<policy_list<snapkv_traits>> c;     // or kvevict::compressor: every policy
//   status st = c.plan(options, &c);                    // validates everything it can, once
//   workspace ws(c.workspace_size());                   // one workspace per concurrent caller
//   per sequence: c.sequence_state_size() bytes, c.reset_sequence(state) when it starts
//   per step, per layer:  st = c.run(layer, seqs, n, reports, ws);
//
// The list is what the compressor can serve, and what it compiles: an engine that uses SnapKV
// only includes kvevict/policies/snapkv.hpp and this header and plans
// basic_compressor<policy_list<snapkv_traits>>; options name a policy by its kind as for
// every list, and a kind outside the list is refused at plan time. kvevict::compressor
// (compressor/compressor.hpp) serves every policy kvevict has.
//
// Each run() does what each sequence's event needs: at the end of prefill the scoring
// policies score and evict; a deferred policy (DeferKV) observes the prompt window, then each
// decode step, and evicts at step d. Eviction is the policy's own evict() (score ->
// PyramidKV/AdaKV budgets -> select -> compact), so the compressor's results equal the
// building blocks' bit for bit. The data path, in order: detail/run_checks.hpp (check),
// detail/step_executor.hpp (score, budget, select, compact); what each event does is
// detail/lifecycle.hpp, the window of queries prefill_end observes with (chunked prefill)
// detail/prefill_window.hpp, the plan's sizes and layouts detail/compressor_core.hpp.
//
// All or nothing per call: every sequence is validated (views, shapes against the plan,
// queries, states, block tables) before any cache or state changes, so a failed call leaves
// the whole batch as it was. Sequences are processed one after another; the heads of each go
// through the plan's executor. Concurrent run() calls on different layers (different caches,
// states' different layers, separate workspaces) are safe.
//
// Under tensor parallelism (compressor_options::tensor_parallel, design.md §15) each rank plans
// and runs with its own KV heads; plan() and run() are collective, agree on the configuration
// and on each batch first (a mismatch is an error on every rank; detail/agreement.hpp), and
// AdaKV and the shared scopes select across the group with the single-process results.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "kvevict/compressor/detail/step_executor.hpp"
#include "kvevict/compressor/options.hpp"
#include "kvevict/compressor/sequence.hpp"
#include "kvevict/config.hpp"
#include "kvevict/dtype.hpp"
#include "kvevict/error.hpp"
#include "kvevict/parallel/collective.hpp"
#include "kvevict/policies/policy_list.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

/// A compressor serving the policies of `Policies` (a policy_list of traits; each policy's
/// header must be included where run() is instantiated).
template <class Policies>
class basic_compressor : private detail::compressor_steps {
 public:
  using policies = Policies;
  basic_compressor() = default;

  /// Plans a compressor from options (see compressor/options.hpp). Checks the model shape,
  /// the policy's configuration (and that the list holds it), the budget, the allocations,
  /// scope, length mode, compaction and the limits, and computes every size; on error `out`
  /// is left as it was.
  static status plan(const compressor_options& options, basic_compressor* out) noexcept {
    static constexpr const char* fn = "kvevict::compressor::plan";
    const collective* group = options.tensor_parallel;
    // A rank that cannot reach the group cannot tell it it failed: these return at once.
    if (group != nullptr) KVEVICT_RETURN_IF_ERROR(detail::validate_collective(*group, fn, "tensor_parallel"));
    basic_compressor c;
    c.options_ = options;
    status st = out == nullptr ? status::error(errc::null_pointer, fn, "out", "expected a compressor to plan")
                               : c.check_options(fn);
    if (st.ok() && !detail::lists_kind(Policies{}, static_cast<std::size_t>(options.policy.kind())))
      st = status::error(errc::unsupported, fn, "policy.kind",
                         "%s is not in this compressor's policy list (plan a basic_compressor whose list holds it)",
                         to_string(options.policy.kind()));
    if (st.ok() && options.decoding.enabled() &&
        !detail::lists_kind(Policies{}, static_cast<std::size_t>(options.decoding.policy.kind())))
      st = status::error(errc::unsupported, fn, "decoding.policy.kind",
                         "%s is not in this compressor's policy list (plan a basic_compressor whose list holds it)",
                         to_string(options.decoding.policy.kind()));
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
        c.template size<Policies, typename decltype(t)::type, typename decltype(q)::type>();
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
    if (group != nullptr) KVEVICT_RETURN_IF_ERROR(c.template agree_plan<Policies>(st, fn));
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
  /// floats plus small headers; a per-sequence scope adds [max_tokens] floats; chunked_prefill
  /// adds each layer's window of chunk queries ([Hq, rows, d] of the query type and rows
  /// positions; rows: the observation window, H2O limits.max_queries).
  std::size_t sequence_state_size() const noexcept { return state_bytes_; }
  /// Entries of sequence_io::kept_positions one eviction may write.
  std::int64_t keep_capacity() const noexcept { return keep_capacity_; }
  /// Columns of sequence_io::padded_indices: the most tokens one head may keep.
  std::int64_t keep_capacity_per_head() const noexcept { return head_capacity_; }
  /// The most tokens one head may keep at a call whose cache holds `tokens` tokens (at most
  /// keep_capacity_per_head()): the rows an out-of-place destination needs for that sequence.
  std::int64_t keep_capacity_per_head(std::int64_t tokens) const noexcept {
    return compressor_core::keep_capacity_per_head(tokens);
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
  bool selects_across_ranks() const noexcept { return compressor_core::selects_across_ranks(); }
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
    return init_state<Policies>(state, bytes, fn);
  }

  /// The runtime-dtype entry: run() for views whose element types are the plan's
  /// model.storage and model.query_storage (tags checked at plan time). `ws`: at least
  /// any_workspace_size() bytes. Otherwise run()'s contract exactly (the typed call it makes).
  status run(std::int64_t layer, const any_sequence_io* seqs, std::int64_t num_seqs, sequence_report* reports,
             workspace_span ws) const;

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
             workspace_span ws) const;

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
};

// The two run() entries are defined out of the class, so they are not inline: an engine may
// compile them once per program (compressor/compile_once.hpp) and every other TU skips them.
template <class Policies>
status basic_compressor<Policies>::run(std::int64_t layer, const any_sequence_io* seqs, std::int64_t num_seqs,
                                       sequence_report* reports, workspace_span ws) const {
  static constexpr const char* fn = "kvevict::compressor::run";
  KVEVICT_RETURN_IF_ERROR(check_planned(fn));
  return detail::with_types(options_.model.storage, options_.model.query_storage, [&](auto t, auto q) {
    return run_typed<typename decltype(t)::type, typename decltype(q)::type>(layer, seqs, num_seqs, reports, ws);
  });
}

template <class Policies>
template <class T, class Q>
status basic_compressor<Policies>::run(std::int64_t layer, const sequence_io<T, Q>* seqs, std::int64_t num_seqs,
                                       sequence_report* reports, workspace_span ws) const {
  static constexpr const char* fn = "kvevict::compressor::run";
  KVEVICT_RETURN_IF_ERROR(check_planned(fn));
  static_assert(is_storage_type<T>::value && !std::is_const<T>::value,
                "run<T, Q>: T is float, fp16, bf16, fp8_e4m3 or fp8_e5m2");
  static_assert(is_query_type<Q>::value && !std::is_const<Q>::value, "run<T, Q>: Q is float, fp16 or bf16");
  detail::run_layout lay;
  const status checked = check_run<Policies>(layer, seqs, num_seqs, reports, ws, &lay);
  // Tensor parallelism: one agreement round for the batch, failed or not (design.md §15).
  if (selects_across_ranks())
    KVEVICT_RETURN_IF_ERROR(agree_run<Policies>(layer, seqs, num_seqs, checked, lay.layer_budgets));
  KVEVICT_RETURN_IF_ERROR(checked);

  run_trace trace;
  trace.layer = layer;
  trace.sequences = num_seqs;
  for (std::int64_t s = 0; s < num_seqs; ++s) {
    sequence_report r;
    KVEVICT_RETURN_IF_ERROR(step<Policies>(layer, seqs[s], lay, &r));
    trace.observed += r.action == sequence_action::observed ? 1 : 0;
    trace.evicted += r.action == sequence_action::evicted ? 1 : 0;
    reports[s] = r;
  }
  if (options_.tracer.on_run != nullptr) options_.tracer.on_run(options_.tracer.context, trace);
  return status();
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_COMPRESSOR_BASIC_COMPRESSOR_HPP
