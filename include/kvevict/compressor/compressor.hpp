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

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kvevict/budgets/layer_budget.hpp"
#include "kvevict/budgets/pyramidkv.hpp"
#include "kvevict/compressor/options.hpp"
#include "kvevict/compressor/sequence.hpp"
#include "kvevict/config.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/detail/validate_eviction.hpp"
#include "kvevict/dtype.hpp"
#include "kvevict/error.hpp"
#include "kvevict/eviction/evict.hpp"
#include "kvevict/eviction/evict_layer.hpp"
#include "kvevict/policies/chunkkv.hpp"
#include "kvevict/policies/dapq.hpp"
#include "kvevict/policies/deferkv.hpp"
#include "kvevict/policies/h2o.hpp"
#include "kvevict/policies/knorm.hpp"
#include "kvevict/policies/snapkv.hpp"
#include "kvevict/policies/streaming_llm.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

namespace detail {

/// The head of a sequence's compressor state; each layer's policy state follows it.
struct sequence_state_header {
  std::uint64_t magic = 0;
  std::int64_t layers = 0;
  std::uint64_t layer_bytes = 0;
  std::uint64_t reserved = 0;
};
constexpr std::uint64_t sequence_state_magic = 0x7173766576656b76ull;  // "vkevevsq"
constexpr std::size_t sequence_state_offset = 64;

inline std::size_t round_up_64(std::size_t n) noexcept {
  return n > std::numeric_limits<std::size_t>::max() - 63 ? std::numeric_limits<std::size_t>::max()
                                                          : (n + 63) / 64 * 64;
}

/// "seqs[3].keys" and the like.
struct io_name {
  char text[status::max_argument];
  io_name(std::int64_t s, const char* field) noexcept {
    std::snprintf(text, sizeof(text), "seqs[%lld].%s", static_cast<long long>(s), field);
  }
  operator const char*() const noexcept { return text; }
};

/// `st` (an error about one sequence's argument) renamed to that sequence: "keys.block_table[3]"
/// becomes "seqs[2].keys.block_table[3]", the message keeps its text.
inline status in_sequence(const status& st, std::int64_t s, const char* fn) noexcept {
  if (st.ok()) return st;
  const char* text = std::strstr(st.message(), ": ");
  text = text != nullptr ? std::strstr(text + 2, ": ") : nullptr;  // past "function: argument: "
  char name[2 * status::max_argument];                             // status::error truncates it to max_argument
  std::snprintf(name, sizeof(name), "seqs[%lld].%s", static_cast<long long>(s), st.argument());
  return status::error(st.code(), fn, name, "%s", text != nullptr ? text + 2 : st.message());
}

/// A query view of the last `keep` observations of `q` (all of them when it has fewer).
template <class T>
query_view<const T> last_queries(const query_view<const T>& q, std::int64_t keep) noexcept {
  if (q.num_queries <= keep) return q;
  query_view<const T> r = q;
  const std::int64_t skip = q.num_queries - keep;
  r.data = q.data + skip * q.query_stride;
  r.positions = q.positions + skip;
  r.num_queries = keep;
  return r;
}

}  // namespace detail

class compressor {
 public:
  compressor() = default;

  /// Plans a compressor from options (see compressor/options.hpp). Checks the model shape,
  /// the policy's configuration, the budget, the allocations and the limits, and computes
  /// every size; on error `out` is left as it was.
  static status plan(const compressor_options& options, compressor* out) noexcept {
    static constexpr const char* fn = "kvevict::compressor::plan";
    if (out == nullptr) return status::error(errc::null_pointer, fn, "out", "expected a compressor to plan");
    compressor c;
    c.options_ = options;
    KVEVICT_RETURN_IF_ERROR(c.check_options(fn));
    switch (options.model.storage) {
      case dtype::f32:
        c.size<float>();
        break;
      case dtype::f16:
        c.size<fp16>();
        break;
      case dtype::bf16:
        c.size<bf16>();
        break;
    }
    if (c.workspace_bytes_ == std::numeric_limits<std::size_t>::max() ||
        c.state_bytes_ == std::numeric_limits<std::size_t>::max() || c.keep_capacity_ == INT64_MAX)
      return status::error(errc::overflow, fn, "options.limits",
                           "the workspace, state or keep-list for %lld tokens and %lld queries does not fit in memory",
                           static_cast<long long>(options.limits.max_tokens),
                           static_cast<long long>(c.options_.limits.max_queries));
    c.planned_ = true;
    *out = c;
    return status();
  }

  bool planned() const noexcept { return planned_; }
  const compressor_options& options() const noexcept { return options_; }

  /// Bytes of workspace one run() needs (any layer, any batch within the limits).
  std::size_t workspace_size() const noexcept { return workspace_bytes_; }
  /// Bytes of state per sequence (0 for stateless policies: then sequence_io::state may be
  /// null). DeferKV: [layers, Hkv, max_tokens] floats plus small headers.
  std::size_t sequence_state_size() const noexcept { return state_bytes_; }
  /// Entries of sequence_io::kept_positions one eviction may write.
  std::int64_t keep_capacity() const noexcept { return keep_capacity_; }
  /// How many of its last queries a sequence must hand in at prefill_end (0: none needed).
  std::int64_t observation_window() const noexcept { return window_; }

  /// Sets up a sequence's state before its first call (and to reuse it for a new sequence).
  status reset_sequence(void* state, std::size_t bytes) const noexcept {
    static constexpr const char* fn = "kvevict::compressor::reset_sequence";
    KVEVICT_RETURN_IF_ERROR(check_planned(fn));
    if (state_bytes_ == 0) return status();
    if (state == nullptr) return status::error(errc::null_pointer, fn, "state", "expected non-null");
    if (reinterpret_cast<std::uintptr_t>(state) % 8 != 0)
      return status::error(errc::invalid_argument, fn, "state", "expected 8-byte alignment");
    if (bytes < state_bytes_)
      return status::error(errc::invalid_shape, fn, "bytes", "expected at least %zu (sequence_state_size), got %zu",
                           state_bytes_, bytes);
    const model_shape& m = options_.model;
    const deferkv<float> policy(options_.policy.deferkv);  // the state layout does not depend on the type
    for (std::int64_t l = 0; l < m.num_layers; ++l)
      KVEVICT_RETURN_IF_ERROR(policy.init_state(layer_state(state, l), m.num_kv_heads, options_.limits.max_tokens));
    detail::sequence_state_header h;
    h.magic = detail::sequence_state_magic;
    h.layers = m.num_layers;
    h.layer_bytes = layer_state_bytes_;
    std::memcpy(state, &h, sizeof(h));
    return status();
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
  template <class T>
  status run(std::int64_t layer, const sequence_io<T>* seqs, std::int64_t num_seqs, sequence_report* reports,
             workspace_span ws) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    KVEVICT_RETURN_IF_ERROR(check_planned(fn));
    static_assert(is_storage_type<T>::value && !std::is_const<T>::value, "run<T>: T is float, fp16 or bf16");
    if (dtype_of<T>::value != options_.model.storage)
      return status::error(errc::invalid_argument, fn, "seqs", "expected %s views (the plan's storage type), got %s",
                           to_string(options_.model.storage), to_string(dtype_of<T>::value));
    if (layer < 0 || layer >= options_.model.num_layers)
      return status::error(errc::out_of_range, fn, "layer", "expected a layer in [0, %lld), got %lld",
                           static_cast<long long>(options_.model.num_layers), static_cast<long long>(layer));
    if (num_seqs < 0 || num_seqs > options_.limits.max_sequences)
      return status::error(errc::invalid_shape, fn, "num_seqs", "expected 0 .. %lld (limits.max_sequences), got %lld",
                           static_cast<long long>(options_.limits.max_sequences), static_cast<long long>(num_seqs));
    if (num_seqs > 0 && seqs == nullptr) return status::error(errc::null_pointer, fn, "seqs", "expected non-null");
    if (num_seqs > 0 && reports == nullptr)
      return status::error(errc::null_pointer, fn, "reports", "expected non-null");
    detail::arena a(ws);
    run_layout lay;
    carve(a, &lay);
    if (a.overflowed())
      return status::error(errc::workspace_too_small, fn, "ws", "expected at least %zu bytes (workspace_size), got %zu",
                           a.used(), ws.size);

    // Everything that can fail is checked for the whole batch before anything changes.
    for (std::int64_t s = 0; s < num_seqs; ++s) KVEVICT_RETURN_IF_ERROR(check_sequence(layer, seqs[s], s, lay));
    if (state_bytes_ > 0)
      for (std::int64_t s = 1; s < num_seqs; ++s)
        for (std::int64_t t = 0; t < s; ++t)
          if (seqs[s].state == seqs[t].state && seqs[s].event != sequence_event::idle &&
              seqs[t].event != sequence_event::idle)
            return status::error(errc::invalid_argument, fn, detail::io_name(s, "state"),
                                 "expected one state per sequence, got the state of seqs[%lld] again",
                                 static_cast<long long>(t));

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
  struct run_layout {
    std::int64_t* layer_budgets = nullptr;  ///< [layers] (PyramidKV)
    std::int64_t* head_lengths = nullptr;   ///< [Hkv] when the caller asks for none
    workspace_span policy;                  ///< the policy's evict / observe workspace
  };

  void carve(detail::arena& a, run_layout* out) const noexcept {
    out->layer_budgets =
        options_.layers == layer_allocation::pyramidkv ? a.take<std::int64_t>(options_.model.num_layers) : nullptr;
    out->head_lengths = a.take<std::int64_t>(options_.model.num_kv_heads);
    out->policy = detail::take_span(a, policy_bytes_);
  }

  status check_planned(const char* fn) const noexcept {
    if (!planned_) return status::error(errc::invalid_state, fn, "compressor", "not planned: call compressor::plan");
    return status();
  }

  // ---- planning ----------------------------------------------------------------------

  static bool chunkable(policy_kind k) noexcept {
    return k == policy_kind::streaming_llm || k == policy_kind::knorm || k == policy_kind::h2o ||
           k == policy_kind::snapkv;
  }

  status check_options(const char* fn) noexcept {
    model_shape& m = options_.model;
    if (m.num_layers < 1)
      return status::error(errc::invalid_shape, fn, "model.num_layers", "expected >= 1, got %lld",
                           static_cast<long long>(m.num_layers));
    if (m.num_kv_heads < 1)
      return status::error(errc::invalid_shape, fn, "model.num_kv_heads", "expected >= 1, got %lld",
                           static_cast<long long>(m.num_kv_heads));
    if (m.num_query_heads < 1 || m.num_query_heads % m.num_kv_heads != 0)
      return status::error(errc::invalid_shape, fn, "model.num_query_heads",
                           "expected a positive multiple of num_kv_heads = %lld (GQA), got %lld",
                           static_cast<long long>(m.num_kv_heads), static_cast<long long>(m.num_query_heads));
    if (m.head_dim < 1)
      return status::error(errc::invalid_shape, fn, "model.head_dim", "expected >= 1, got %lld",
                           static_cast<long long>(m.head_dim));
    if (m.value_head_dim < 0)
      return status::error(errc::invalid_shape, fn, "model.value_head_dim", "expected >= 0 (0: head_dim), got %lld",
                           static_cast<long long>(m.value_head_dim));
    if (m.value_head_dim == 0) m.value_head_dim = m.head_dim;
    if (static_cast<unsigned>(m.storage) > 2u)
      return status::error(errc::invalid_argument, fn, "model.storage", "expected a dtype value, got %d",
                           static_cast<int>(m.storage));
    const compressor_limits& lim = options_.limits;
    if (lim.max_sequences < 1)
      return status::error(errc::invalid_shape, fn, "limits.max_sequences", "expected >= 1, got %lld",
                           static_cast<long long>(lim.max_sequences));
    // Selection indexes rows with 32-bit keys; AdaKV ranks a whole layer's candidates.
    const std::int64_t token_limit =
        options_.heads == head_allocation::adakv ? static_cast<std::int64_t>(UINT32_MAX) / m.num_kv_heads : UINT32_MAX;
    if (lim.max_tokens < 1 || lim.max_tokens > token_limit)
      return status::error(errc::invalid_shape, fn, "limits.max_tokens", "expected 1 .. %lld, got %lld",
                           static_cast<long long>(token_limit), static_cast<long long>(lim.max_tokens));
    if (lim.max_queries < 0)
      return status::error(errc::invalid_shape, fn, "limits.max_queries",
                           "expected >= 0 (0: the policy's window), got %lld", static_cast<long long>(lim.max_queries));
    if (options_.exec.workers() < 1)
      return status::error(errc::invalid_argument, fn, "exec.num_workers", "expected >= 1");

    KVEVICT_RETURN_IF_ERROR(check_policy(fn));
    layer_budget b;
    b.per_head = options_.per_head;
    b.heads = options_.heads;
    b.adakv = options_.adakv;
    KVEVICT_RETURN_IF_ERROR(detail::validate_layer_budget(b, fn));
    if (static_cast<unsigned>(options_.layers) > 1u)
      return status::error(errc::invalid_argument, fn, "layers", "expected a layer_allocation value, got %d",
                           static_cast<int>(options_.layers));
    if (options_.layers == layer_allocation::pyramidkv &&
        (!(options_.pyramid_beta >= 1.0) || options_.pyramid_beta == std::numeric_limits<double>::infinity()))
      return status::error(errc::invalid_argument, fn, "pyramid_beta", "expected a finite beta >= 1, got %g",
                           options_.pyramid_beta);
    if (options_.limits.max_queries == 0) options_.limits.max_queries = window_;
    if (window_ > options_.limits.max_queries)
      return status::error(errc::invalid_shape, fn, "limits.max_queries",
                           "expected at least the policy's observation window %lld, got %lld",
                           static_cast<long long>(window_), static_cast<long long>(options_.limits.max_queries));
    return status();
  }

  status check_policy(const char* fn) noexcept {
    const policy_config& p = options_.policy;
    const model_shape& m = options_.model;
    if (static_cast<unsigned>(p.kind) > 5u)
      return status::error(errc::invalid_argument, fn, "policy.kind", "expected a policy_kind value, got %d",
                           static_cast<int>(p.kind));
    if (p.chunk_length < 0)
      return status::error(errc::invalid_argument, fn, "policy.chunk_length", "expected >= 0 (0: no chunks), got %lld",
                           static_cast<long long>(p.chunk_length));
    if (p.chunk_length > 0 && !chunkable(p.kind))
      return status::error(errc::unsupported, fn, "policy.chunk_length",
                           "ChunkKV applies to StreamingLLM, KNorm, H2O and SnapKV scores, not to %s",
                           to_string(p.kind));
    switch (p.kind) {
      case policy_kind::streaming_llm:
        if (p.streaming_llm.sinks < 0)
          return status::error(errc::invalid_argument, fn, "policy.streaming_llm.sinks", "expected >= 0, got %lld",
                               static_cast<long long>(p.streaming_llm.sinks));
        if (options_.limits.max_tokens > (std::int64_t{1} << 24))
          return status::error(errc::overflow, fn, "limits.max_tokens",
                               "StreamingLLM scores token indices as floats: expected at most 2^24 tokens, got %lld",
                               static_cast<long long>(options_.limits.max_tokens));
        window_ = 0;
        break;
      case policy_kind::knorm:
        if (p.knorm.protected_tail < 0)
          return status::error(errc::invalid_argument, fn, "policy.knorm.protected_tail", "expected >= 0, got %lld",
                               static_cast<long long>(p.knorm.protected_tail));
        KVEVICT_RETURN_IF_ERROR(check_mode(p.knorm.protect, fn, "policy.knorm.protect"));
        window_ = 0;
        break;
      case policy_kind::h2o:
        if (p.h2o.recent_window < 0)
          return status::error(errc::invalid_argument, fn, "policy.h2o.recent_window", "expected >= 0, got %lld",
                               static_cast<long long>(p.h2o.recent_window));
        KVEVICT_RETURN_IF_ERROR(check_mode(p.h2o.protect, fn, "policy.h2o.protect"));
        KVEVICT_RETURN_IF_ERROR(detail::validate_scoring_params(p.h2o.params(), fn));
        window_ = 1;  // every prompt query observes; at least one is needed
        if (options_.limits.max_queries == 0) options_.limits.max_queries = options_.limits.max_tokens;
        break;
      case policy_kind::snapkv:
        if (p.snapkv.window < 1)
          return status::error(errc::invalid_argument, fn, "policy.snapkv.window", "expected >= 1, got %lld",
                               static_cast<long long>(p.snapkv.window));
        KVEVICT_RETURN_IF_ERROR(check_mode(p.snapkv.protect, fn, "policy.snapkv.protect"));
        KVEVICT_RETURN_IF_ERROR(detail::validate_scoring_params(p.snapkv.params(), fn));
        if (p.snapkv.scoring.window == window_aggregation::weighted)
          return status::error(errc::unsupported, fn, "policy.snapkv.scoring.window",
                               "weighted aggregation needs per-call weights; use the building blocks");
        window_ = p.snapkv.window;
        break;
      case policy_kind::deferkv: {
        const deferkv<float> d(p.deferkv);
        KVEVICT_RETURN_IF_ERROR(d.check_config(fn));
        KVEVICT_RETURN_IF_ERROR(check_mode(p.deferkv.protect, fn, "policy.deferkv.protect"));
        if (p.deferkv.window < 1)
          return status::error(errc::invalid_argument, fn, "policy.deferkv.window", "expected >= 1, got %lld",
                               static_cast<long long>(p.deferkv.window));
        window_ = p.deferkv.window;
        break;
      }
      case policy_kind::dapq:
        if (p.dapq.pseudo_tokens < 1)
          return status::error(errc::invalid_argument, fn, "policy.dapq.pseudo_tokens", "expected >= 1, got %lld",
                               static_cast<long long>(p.dapq.pseudo_tokens));
        KVEVICT_RETURN_IF_ERROR(check_mode(p.dapq.protect, fn, "policy.dapq.protect"));
        KVEVICT_RETURN_IF_ERROR(detail::validate_scoring_params(p.dapq.scoring, fn));
        if (p.dapq.scoring.window == window_aggregation::weighted)
          return status::error(errc::unsupported, fn, "policy.dapq.scoring.window",
                               "weighted aggregation needs per-call weights; use the building blocks");
        if (static_cast<unsigned>(p.dapq.source) > 1u)
          return status::error(errc::invalid_argument, fn, "policy.dapq.source", "expected a dapq_source value, got %d",
                               static_cast<int>(p.dapq.source));
        if (p.dapq.source == dapq_source::rerotated_window) {
          KVEVICT_RETURN_IF_ERROR(validate_rope_config(p.dapq.rope, fn));
          if (p.dapq.rope.head_dim != m.head_dim)
            return status::error(errc::invalid_shape, fn, "policy.dapq.rope.head_dim",
                                 "expected model.head_dim = %lld, got %lld", static_cast<long long>(m.head_dim),
                                 static_cast<long long>(p.dapq.rope.head_dim));
          if (m.head_dim > 1024)
            return status::error(errc::unsupported, fn, "model.head_dim",
                                 "re-rotation supports head_dim <= 1024, got %lld", static_cast<long long>(m.head_dim));
        }
        window_ = p.dapq.pseudo_tokens;
        break;
    }
    return status();
  }

  static status check_mode(protected_mode mode, const char* fn, const char* arg) noexcept {
    if (static_cast<unsigned>(mode) > 1u)
      return status::error(errc::invalid_argument, fn, arg, "expected a protected_mode value, got %d",
                           static_cast<int>(mode));
    return status();
  }

  /// The budget a layer call starts from (before PyramidKV sets layer_candidates).
  layer_budget base_budget() const noexcept {
    layer_budget b;
    b.per_head = options_.per_head;
    b.heads = options_.heads;
    b.adakv = options_.adakv;
    return b;
  }

  /// The largest protected tail any call may see (DeferKV adds its decoded tokens).
  selection_params largest_selection() const noexcept {
    const policy_config& p = options_.policy;
    switch (p.kind) {
      case policy_kind::streaming_llm:
        return {0, protected_mode::inside_budget};
      case policy_kind::knorm:
        return {p.knorm.protected_tail, p.knorm.protect};
      case policy_kind::h2o:
        return {p.h2o.recent_window, p.h2o.protect};
      case policy_kind::snapkv:
        return p.snapkv.selection();
      case policy_kind::deferkv:
        return {p.deferkv.window + p.deferkv.delay, p.deferkv.protect};
      case policy_kind::dapq:
        return {p.dapq.scoring.protected_tail, p.dapq.protect};
    }
    return {};
  }

  /// Calls f(policy) with the configured policy object for storage type T (stateless kinds).
  template <class T, class F>
  status with_scoring_policy(F&& f) const {
    const policy_config& p = options_.policy;
    const chunkkv_config chunks{p.chunk_length};
    switch (p.kind) {
      case policy_kind::streaming_llm: {
        const kvevict::streaming_llm<T> base(p.streaming_llm);
        return p.chunk_length > 0 ? f(kvevict::chunkkv<kvevict::streaming_llm<T>>(base, chunks)) : f(base);
      }
      case policy_kind::knorm: {
        const kvevict::knorm<T> base(p.knorm);
        return p.chunk_length > 0 ? f(kvevict::chunkkv<kvevict::knorm<T>>(base, chunks)) : f(base);
      }
      case policy_kind::h2o: {
        const kvevict::h2o<T> base(p.h2o);
        return p.chunk_length > 0 ? f(kvevict::chunkkv<kvevict::h2o<T>>(base, chunks)) : f(base);
      }
      case policy_kind::snapkv: {
        const kvevict::snapkv<T> base(p.snapkv);
        return p.chunk_length > 0 ? f(kvevict::chunkkv<kvevict::snapkv<T>>(base, chunks)) : f(base);
      }
      case policy_kind::dapq:
        return f(kvevict::dapq<T>(p.dapq));
      case policy_kind::deferkv:
        break;
    }
    return status::error(errc::invalid_state, "kvevict::compressor", "policy.kind", "not a scoring policy");
  }

  template <class T>
  void size() noexcept {
    const model_shape& m = options_.model;
    const compressor_limits& lim = options_.limits;
    const layer_shape shape{m.num_query_heads, m.num_kv_heads, m.head_dim, lim.max_tokens, lim.max_queries};
    layer_budget b = base_budget();
    // PyramidKV may give a layer any share of its candidates: size for all of them.
    if (options_.layers == layer_allocation::pyramidkv) b.layer_candidates = lim.max_tokens;
    const executor& exec = options_.exec;
    if (options_.policy.kind == policy_kind::deferkv) {
      const deferkv<T> d(options_.policy.deferkv);
      const std::size_t observe = d.workspace_size(shape, exec), evict = d.evict_workspace_size(shape, b, exec);
      policy_bytes_ = observe > evict ? observe : evict;
      layer_state_bytes_ = detail::round_up_64(deferkv<T>::state_size(m.num_kv_heads, lim.max_tokens));
      state_bytes_ =
          detail::saturating_add(detail::sequence_state_offset,
                                 detail::saturating_mul(static_cast<std::size_t>(m.num_layers), layer_state_bytes_));
    } else {
      (void)with_scoring_policy<T>([&](const auto& policy) {
        policy_bytes_ = policy.evict_workspace_size(shape, b, exec);
        return status();
      });
      layer_state_bytes_ = 0;
      state_bytes_ = 0;
    }
    keep_capacity_ = detail::layer_keep_capacity(m.num_kv_heads, lim.max_tokens, largest_selection(), b);
    detail::arena a;
    run_layout lay;
    carve(a, &lay);
    workspace_bytes_ = a.used();
  }

  // ---- running -----------------------------------------------------------------------

  policy_state layer_state(void* state, std::int64_t layer) const noexcept {
    return {static_cast<unsigned char*>(state) + detail::sequence_state_offset +
                static_cast<std::size_t>(layer) * layer_state_bytes_,
            layer_state_bytes_};
  }

  /// The queries a prefill_end observation uses: the policy's window (H2O: all).
  template <class T>
  query_view<const T> prefill_queries(const sequence_io<T>& io) const noexcept {
    return options_.policy.kind == policy_kind::h2o ? io.queries : detail::last_queries(io.queries, window_);
  }

  /// The observation inputs of a sequence for the queries `q` it observes with.
  template <class T>
  layer_observations<T> observations_of(const sequence_io<T>& io, const query_view<const T>& q,
                                        policy_state state) const noexcept {
    layer_observations<T> o;
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

  /// What a sequence's event will do at this layer (decided before anything changes).
  enum class plan_step { none, observe, evict, observe_and_evict };

  template <class T>
  status check_sequence(std::int64_t layer, const sequence_io<T>& io, std::int64_t s, const run_layout& lay) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    if (static_cast<unsigned>(io.event) > 2u)
      return status::error(errc::invalid_argument, fn, detail::io_name(s, "event"),
                           "expected a sequence_event value, got %d", static_cast<int>(io.event));
    plan_step what = plan_step::none;
    KVEVICT_RETURN_IF_ERROR(decide(layer, io, s, &what));
    if (what == plan_step::none) return status();
    const model_shape& m = options_.model;
    KVEVICT_RETURN_IF_ERROR(
        detail::validate_kv_views(io.keys, io.values, fn, detail::io_name(s, "keys"), detail::io_name(s, "values")));
    KVEVICT_RETURN_IF_ERROR(detail::check_kv_not_aliased(io.keys, io.values, fn, detail::io_name(s, "values")));
    if (io.keys.num_heads != m.num_kv_heads || io.keys.head_dim != m.head_dim)
      return status::error(errc::invalid_shape, fn, detail::io_name(s, "keys"),
                           "expected the model's [%lld heads, d = %lld], got [%lld, %lld]",
                           static_cast<long long>(m.num_kv_heads), static_cast<long long>(m.head_dim),
                           static_cast<long long>(io.keys.num_heads), static_cast<long long>(io.keys.head_dim));
    if (io.values.head_dim != m.value_head_dim)
      return status::error(errc::invalid_shape, fn, detail::io_name(s, "values.head_dim"),
                           "expected the model's %lld, got %lld", static_cast<long long>(m.value_head_dim),
                           static_cast<long long>(io.values.head_dim));
    if (io.keys.num_tokens > options_.limits.max_tokens)
      return status::error(errc::invalid_shape, fn, detail::io_name(s, "keys.num_tokens"),
                           "expected at most limits.max_tokens = %lld, got %lld",
                           static_cast<long long>(options_.limits.max_tokens),
                           static_cast<long long>(io.keys.num_tokens));
    KVEVICT_RETURN_IF_ERROR(check_queries(layer, io, s, what));
    if (what == plan_step::evict || what == plan_step::observe_and_evict) {
      // The block-table checks evict() runs, now, so that no sequence moves before all pass.
      const auto kseq = [&io](std::int64_t) { return io.keys; };
      const auto vseq = [&io](std::int64_t) { return io.values; };
      if (io.keys.is_paged() || io.values.is_paged()) {
        detail::arena a(lay.policy);
        std::int32_t* ids = a.take<std::int32_t>(detail::block_id_scratch(1, kseq, vseq));
        if (a.overflowed())
          return status::error(errc::workspace_too_small, fn, "ws", "block tables longer than limits.max_tokens");
        KVEVICT_RETURN_IF_ERROR(
            detail::in_sequence(detail::check_block_ids(1, kseq, vseq, detail::same_block_table(io.keys, io.values),
                                                        detail::same_block_pool(io.keys, io.values), ids, fn, false),
                                s, fn));
      }
    }
    return status();
  }

  /// Decides what the event does; for DeferKV also checks the state's phase.
  template <class T>
  status decide(std::int64_t layer, const sequence_io<T>& io, std::int64_t s, plan_step* out) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    *out = plan_step::none;
    if (io.event == sequence_event::idle) return status();
    if (options_.policy.kind != policy_kind::deferkv) {
      if (io.event == sequence_event::prefill_end) *out = plan_step::evict;
      return status();
    }
    KVEVICT_RETURN_IF_ERROR(check_state(io.state, s));
    const deferkv<T> d(options_.policy.deferkv);
    const policy_state st = layer_state(io.state, layer);
    const bool fed_back = options_.policy.deferkv.decode_feedback && options_.policy.deferkv.delay > 0;
    if (io.event == sequence_event::prefill_end) {
      if (d.started(st))
        return status::error(errc::invalid_state, fn, detail::io_name(s, "state"),
                             "layer %lld already observed this sequence's prefill; reset_sequence() for a new one",
                             static_cast<long long>(layer));
      *out = fed_back ? plan_step::observe : plan_step::observe_and_evict;
      return status();
    }
    if (d.evicted(st)) return status();  // decoding goes on after eviction
    if (d.ready(st)) {
      *out = plan_step::evict;
      return status();
    }
    if (!d.started(st))
      return status::error(errc::invalid_state, fn, detail::io_name(s, "event"),
                           "a decode step before this sequence's prefill_end at layer %lld",
                           static_cast<long long>(layer));
    *out =
        d.steps_observed(st) + 1 >= options_.policy.deferkv.delay ? plan_step::observe_and_evict : plan_step::observe;
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
        h.layer_bytes != layer_state_bytes_)
      return status::error(errc::invalid_state, fn, detail::io_name(s, "state"),
                           "not a state of this plan: call reset_sequence() when the sequence starts");
    return status();
  }

  template <class T>
  status check_queries(std::int64_t layer, const sequence_io<T>& io, std::int64_t s, plan_step what) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    const policy_kind kind = options_.policy.kind;
    if (kind == policy_kind::streaming_llm || kind == policy_kind::knorm) return status();
    if (kind == policy_kind::deferkv && what == plan_step::evict) return status();  // nothing is observed
    const model_shape& m = options_.model;
    KVEVICT_RETURN_IF_ERROR(detail::validate_query_view(io.queries, fn, detail::io_name(s, "queries")));
    if (io.queries.num_heads != m.num_query_heads || io.queries.head_dim != m.head_dim)
      return status::error(errc::invalid_shape, fn, detail::io_name(s, "queries"),
                           "expected the model's [%lld query heads, d = %lld], got [%lld, %lld]",
                           static_cast<long long>(m.num_query_heads), static_cast<long long>(m.head_dim),
                           static_cast<long long>(io.queries.num_heads), static_cast<long long>(io.queries.head_dim));
    const bool decode = io.event == sequence_event::decode;
    if (decode && io.queries.num_queries != 1)
      return status::error(errc::invalid_shape, fn, detail::io_name(s, "queries.num_queries"),
                           "expected the decode step's query (1 per head), got %lld",
                           static_cast<long long>(io.queries.num_queries));
    const query_view<const T> q = decode ? io.queries : prefill_queries(io);
    if (q.num_queries > options_.limits.max_queries)
      return status::error(errc::invalid_shape, fn, detail::io_name(s, "queries.num_queries"),
                           "expected at most limits.max_queries = %lld, got %lld",
                           static_cast<long long>(options_.limits.max_queries), static_cast<long long>(q.num_queries));
    if (io.lse != nullptr) {
      if (kind == policy_kind::deferkv)
        return status::error(errc::unsupported, fn, detail::io_name(s, "lse"),
                             "DeferKV normalises its own observations; pass no LSE");
      if (scoring_domain() != softmax_domain::visible)
        return status::error(errc::unsupported, fn, detail::io_name(s, "lse"),
                             "an engine log-sum-exp covers every visible key; the policy normalises over candidates");
      if (io.lse_head_stride != 0 && io.lse_head_stride < io.queries.num_queries)
        return status::error(errc::invalid_stride, fn, detail::io_name(s, "lse_head_stride"),
                             "expected 0 or >= %lld, got %lld", static_cast<long long>(io.queries.num_queries),
                             static_cast<long long>(io.lse_head_stride));
    }
    if (kind == policy_kind::dapq) {
      const std::int64_t prompt = dapq<T>(options_.policy.dapq).prompt_tokens(io.keys.num_tokens, q.num_queries);
      if (prompt < 0)
        return status::error(errc::invalid_shape, fn, detail::io_name(s, "keys.num_tokens"),
                             "expected the prompt and its %lld pseudo tokens, got %lld",
                             static_cast<long long>(q.num_queries), static_cast<long long>(io.keys.num_tokens));
      if (options_.policy.dapq.source == dapq_source::pseudo_tokens)
        for (std::int64_t t = 0; t < q.num_queries; ++t)
          if (q.positions[t] < prompt)
            return status::error(errc::out_of_range, fn, detail::io_name(s, "queries.positions"),
                                 "expected pseudo-token positions >= the prompt length %lld, got %lld",
                                 static_cast<long long>(prompt), static_cast<long long>(q.positions[t]));
    }
    if (kind == policy_kind::deferkv && decode) {
      const deferkv<T> d(options_.policy.deferkv);
      layer_inputs<T> in;
      in.keys = io.keys;
      in.queries = q;
      return detail::in_sequence(d.check_decode(layer_state(io.state, layer), in, fn), s, fn);
    }
    return status();
  }

  softmax_domain scoring_domain() const noexcept {
    const policy_config& p = options_.policy;
    switch (p.kind) {
      case policy_kind::h2o:
        return p.h2o.params().domain;
      case policy_kind::snapkv:
        return p.snapkv.scoring.domain;
      case policy_kind::dapq:
        return p.dapq.scoring.domain;
      case policy_kind::deferkv:
        return p.deferkv.domain;
      default:
        return softmax_domain::visible;
    }
  }

  /// The layer's budget for a sequence of `tokens` scored tokens under selection `sel`.
  layer_budget budget_for(std::int64_t layer, std::int64_t tokens, const selection_params& sel,
                          const run_layout& lay) const noexcept {
    layer_budget b = base_budget();
    if (options_.layers == layer_allocation::pyramidkv) {
      const std::int64_t protect = sel.protected_tail < tokens ? sel.protected_tail : tokens;
      const std::int64_t mean = candidates_kept(options_.per_head.resolve(tokens), tokens, sel);
      // Validated shapes: this cannot fail (capacity >= window, layers >= 1, beta >= 1).
      if (pyramidkv_layer_budgets(mean + protect, protect, options_.model.num_layers, tokens, lay.layer_budgets,
                                  options_.pyramid_beta)
              .ok())
        b.layer_candidates = lay.layer_budgets[layer];
    }
    return b;
  }

  /// One past the newest token's position: a decode step's query position, else the
  /// cache's last token (its key position, or its index).
  template <class T>
  static std::int64_t next_position_after(const sequence_io<T>& io) noexcept {
    if (io.event == sequence_event::decode && io.queries.positions != nullptr && io.queries.num_queries > 0)
      return io.queries.positions[io.queries.num_queries - 1] + 1;
    const std::int64_t l = io.keys.num_tokens;
    if (l <= 0) return 0;
    return (io.key_positions != nullptr ? io.key_positions[l - 1] : l - 1) + 1;
  }

  template <class T>
  status step(std::int64_t layer, const sequence_io<T>& io, const run_layout& lay, sequence_report* r) const {
    plan_step what = plan_step::none;
    KVEVICT_RETURN_IF_ERROR(decide(layer, io, 0, &what));
    r->length = io.keys.num_tokens;
    r->next_slot = io.keys.num_tokens;
    r->next_position = next_position_after(io);
    if (what == plan_step::none) return status();
    eviction_result result;
    result.head_lengths = io.head_lengths != nullptr ? io.head_lengths : lay.head_lengths;
    result.positions = io.kept_positions;
    const layer_cache<T> cache{io.keys, io.values};
    const executor& exec = options_.exec;
    if (options_.policy.kind == policy_kind::deferkv) {
      const deferkv<T> d(options_.policy.deferkv);
      const policy_state st = layer_state(io.state, layer);
      if (what != plan_step::evict) {
        layer_inputs<T> in;
        in.keys = io.keys;
        in.observation.key_positions = io.key_positions;
        in.state = st;
        if (io.event == sequence_event::prefill_end) {
          in.queries = prefill_queries(io);
          KVEVICT_RETURN_IF_ERROR(d.observe_prefill(in, lay.policy, exec));
        } else {
          in.queries = io.queries;
          KVEVICT_RETURN_IF_ERROR(d.observe_decode(in, lay.policy, exec));
        }
        r->action = sequence_action::observed;
        if (what == plan_step::observe) return status();
      }
      layer_observations<T> o;
      o.observation.key_positions = io.key_positions;
      o.state = st;
      KVEVICT_RETURN_IF_ERROR(
          d.evict(cache, o, budget_for(layer, io.keys.num_tokens, d.selection(st), lay), result, lay.policy, exec));
    } else {
      const query_view<const T> q = prefill_queries(io);
      const layer_observations<T> o = observations_of(io, q, policy_state{});
      KVEVICT_RETURN_IF_ERROR(with_scoring_policy<T>([&](const auto& policy) {
        using P = std::decay_t<decltype(policy)>;
        std::int64_t scored = io.keys.num_tokens;
        if constexpr (std::is_same<P, kvevict::dapq<T>>::value) {
          scored = policy.prompt_tokens(io.keys.num_tokens, q.num_queries);
          r->next_position = scored;  // pseudo positions are reused
        }
        return policy.evict(cache, o, budget_for(layer, scored, policy.selection(), lay), result, lay.policy, exec);
      }));
    }
    r->action = sequence_action::evicted;
    r->length = result.max_length;
    r->next_slot = result.max_length;
    r->freed_blocks = result.freed_blocks;
    r->kept = 0;
    for (std::int64_t h = 0; h < io.keys.num_heads; ++h) r->kept += result.head_lengths[h];
    return status();
  }

  compressor_options options_;
  bool planned_ = false;
  std::int64_t window_ = 0;
  std::size_t policy_bytes_ = 0;
  std::size_t workspace_bytes_ = 0;
  std::size_t layer_state_bytes_ = 0;
  std::size_t state_bytes_ = 0;
  std::int64_t keep_capacity_ = 0;
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_COMPRESSOR_COMPRESSOR_HPP
