// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_COMPRESSOR_PLAN_HPP
#define KVEVICT_COMPRESSOR_PLAN_HPP

// The checks a compressor plan makes of its options, and what it derives from them alone,
// shared by kvevict::compressor and kvevict::cuda::compressor (so both refuse the same
// options with the same errors). Light: no scoring code.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>

#include "kvevict/budgets/layer_budget_params.hpp"
#include "kvevict/budgets/pyramidkv.hpp"
#include "kvevict/compressor/options.hpp"
#include "kvevict/config.hpp"
#include "kvevict/detail/in_sequence.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policies/configs.hpp"
#include "kvevict/policies/policy_list.hpp"
#include "kvevict/rope/rope.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/views/query_view.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

/// The traits of the options' policy as a value for f (policies/policy_list.hpp); `fallback`
/// for a kind outside the list.
template <class R, class F>
R with_policy_traits(policy_kind kind, R fallback, F&& f) {
  return visit_policy(default_policies{}, static_cast<std::size_t>(kind), fallback, static_cast<F&&>(f));
}

inline bool chunkable(policy_kind k) noexcept {
  return with_policy_traits(k, false, [](auto traits) { return decltype(traits)::chunkable; });
}
inline bool accepts_lse(policy_kind k) noexcept {
  return with_policy_traits(k, true, [](auto traits) { return decltype(traits)::accepts_lse; });
}
/// Whether the policy observes into per-sequence state before it evicts (DeferKV).
inline bool defers(policy_kind k) noexcept {
  return with_policy_traits(k, false, [](auto traits) { return decltype(traits)::deferred; });
}
inline bool reads_queries(policy_kind k) noexcept {
  return with_policy_traits(k, false, [](auto traits) { return decltype(traits)::reads_queries; });
}
inline bool reads_keys(policy_kind k) noexcept {
  return with_policy_traits(k, false, [](auto traits) { return decltype(traits)::reads_keys; });
}
inline bool every_prompt_query(policy_kind k) noexcept {
  return with_policy_traits(k, false, [](auto traits) { return decltype(traits)::every_prompt_query; });
}
/// Whether prefill_end needs exactly observation_window() queries of its own call (DapQ's
/// pseudo tokens), however short the prompt.
inline bool fixed_window(const policy_config& p) noexcept {
  return with_policy_traits(p.kind(), false, [&](auto traits) {
    using Tr = decltype(traits);
    return Tr::fixed_window(Tr::config(p));
  });
}
inline bool reuses_positions(policy_kind k) noexcept {
  return with_policy_traits(k, false, [](auto traits) { return decltype(traits)::reuses_positions; });
}

/// Scope, length mode and compaction, and the combinations no kernel could serve.
inline status check_contracts(const compressor_options& o, const char* fn) noexcept {
  if (static_cast<unsigned>(o.scope) > 2u)
    return status::error(errc::invalid_argument, fn, "scope", "expected a selection_scope value, got %d",
                         static_cast<int>(o.scope));
  if (static_cast<unsigned>(o.combine) > 3u)
    return status::error(errc::invalid_argument, fn, "combine", "expected a scope_combine value, got %d",
                         static_cast<int>(o.combine));
  if (static_cast<unsigned>(o.lengths) > 1u)
    return status::error(errc::invalid_argument, fn, "lengths", "expected a length_mode value, got %d",
                         static_cast<int>(o.lengths));
  if (static_cast<unsigned>(o.compact) > 2u)
    return status::error(errc::invalid_argument, fn, "compact", "expected a compaction value, got %d",
                         static_cast<int>(o.compact));
  if (static_cast<unsigned>(o.sharing) > 2u)
    return status::error(errc::invalid_argument, fn, "sharing", "expected a block_sharing value, got %d",
                         static_cast<int>(o.sharing));
  if (o.lengths == length_mode::uniform && o.heads == head_allocation::adakv)
    return status::error(errc::unsupported, fn, "heads",
                         "AdaKV keeps different counts per head; length_mode::uniform serves one length per sequence "
                         "(use length_mode::per_head with a varlen or per-head paged kernel)");
  if (o.lengths == length_mode::uniform && o.layers == layer_allocation::pyramidkv)
    return status::error(errc::unsupported, fn, "layers",
                         "PyramidKV keeps different counts per layer; length_mode::uniform serves one length per "
                         "sequence");
  if (o.scope == selection_scope::per_sequence && o.layers == layer_allocation::pyramidkv)
    return status::error(errc::unsupported, fn, "layers",
                         "a keep set shared by every layer has one count; PyramidKV gives layers different ones");
  return status();
}

inline status check_policy(compressor_options* options, std::int64_t* window, const char* fn) noexcept {
  compressor_options& o = *options;
  const policy_config& p = o.policy;
  if (static_cast<unsigned>(p.kind()) >= default_policies::size)
    return status::error(errc::invalid_argument, fn, "policy.kind", "expected a policy_kind value, got %d",
                         static_cast<int>(p.kind()));
  if (p.chunk_length < 0)
    return status::error(errc::invalid_argument, fn, "policy.chunk_length", "expected >= 0 (0: no chunks), got %lld",
                         static_cast<long long>(p.chunk_length));
  if (p.chunk_length > 0 && !chunkable(p.kind()))
    return status::error(errc::unsupported, fn, "policy.chunk_length",
                         "ChunkKV applies to the scores of a chunkable policy, not to %s", to_string(p.kind()));
  if (p.chunk_length > 0 && o.tensor_parallel != nullptr)
    return status::error(errc::unsupported, fn, "policy.chunk_length",
                         "ChunkKV sums its scores over every KV head of the layer; with the heads split over ranks "
                         "(tensor_parallel) that sum is not implemented");
  return with_policy_traits(p.kind(), status(),
                            [&](auto traits) { return decltype(traits)::check(options, window, fn); });
}

/// An error about the decode scorer's configuration, named under `decoding.` (a check of the
/// options' policy names "policy.x"; here it is "decoding.policy.x").
inline status decoding_named(const status& st, const char* fn) noexcept {
  if (st.ok()) return st;
  char name[2 * status::max_argument];  // (the status keeps its first max_argument bytes)
  std::snprintf(name, sizeof(name), "decoding.%s", st.argument());
  const char* text = std::strstr(st.message(), ": ");
  text = text != nullptr ? std::strstr(text + 2, ": ") : nullptr;  // past "function: argument: "
  return status::error(st.code(), fn, name, "%s", text != nullptr ? text + 2 : st.message());
}

/// The options a decode-time compression runs under: the plan's, with the decode scorer as the
/// policy and the decode target as the per-head budget (so the budget arithmetic, PyramidKV's
/// shares and the keep capacities are the prefill's functions).
inline compressor_options decoding_options(const compressor_options& o) noexcept {
  compressor_options d = o;
  d.policy = o.decoding.policy;
  d.per_head = o.decoding.target;
  d.chunked_prefill = false;
  d.decoding = decode_budget{};
  return d;
}

/// Whether two policies are the same policy with the same configuration, byte for byte (a copy
/// of one value is; two values built apart may differ in padding and compare unequal).
inline bool same_policy(const policy_config& a, const policy_config& b) noexcept {
  if (a.kind() != b.kind() || a.chunk_length != b.chunk_length) return false;
  return with_policy_traits(a.kind(), false, [&](auto traits) {
    using Tr = decltype(traits);
    return std::memcmp(&Tr::config(a), &Tr::config(b), sizeof(typename Tr::config_type)) == 0;
  });
}

/// The decode queries each layer keeps for the decode scorer: H2O's `window`, else the
/// scorer's own observation window (0 when it reads none, or maintenance is off). `o` is
/// validated.
inline std::int64_t decoding_window(const compressor_options& o) noexcept {
  if (!o.decoding.enabled() || !reads_queries(o.decoding.policy.kind())) return 0;
  if (every_prompt_query(o.decoding.policy.kind())) return o.decoding.window;
  compressor_options d = decoding_options(o);
  std::int64_t window = 0;
  (void)check_policy(&d, &window, "");
  return window;
}

/// The plan's checks of compressor_options::decoding.
inline status check_decoding(const compressor_options& o, const char* fn) noexcept {
  const decode_budget& dec = o.decoding;
  const budget& t = dec.target;
  if (t.type != budget::kind::tokens && t.type != budget::kind::ratio)
    return status::error(errc::invalid_argument, fn, "decoding.target.type", "expected tokens or ratio, got %d",
                         static_cast<int>(t.type));
  if (!dec.enabled()) return status();
  if (t.type == budget::kind::tokens && t.count < 0)
    return status::error(errc::invalid_argument, fn, "decoding.target",
                         "expected a token count >= 1 (0: no decode-time compression), got %lld",
                         static_cast<long long>(t.count));
  if (t.type == budget::kind::ratio && !(t.compression_ratio > 0.0 && t.compression_ratio <= 1.0))
    return status::error(errc::invalid_argument, fn, "decoding.target",
                         "expected a compression ratio in (0, 1], got %g", t.compression_ratio);
  if (dec.interval < 1)
    return status::error(errc::invalid_argument, fn, "decoding.interval",
                         "expected N >= 1 (a layer is compressed when it holds more than target + N tokens), got %lld",
                         static_cast<long long>(dec.interval));
  const policy_kind k = dec.policy.kind();
  if (static_cast<unsigned>(k) >= default_policies::size)
    return status::error(errc::invalid_argument, fn, "decoding.policy.kind", "expected a policy_kind value, got %d",
                         static_cast<int>(k));
  if (defers(k) || reuses_positions(k) || fixed_window(dec.policy))
    return status::error(errc::unsupported, fn, "decoding.policy.kind",
                         "%s observes the prompt (deferred eviction, pseudo queries): a decode scorer scores the "
                         "cache from the last decode queries (SnapKV, TOVA, H2O, KNorm, StreamingLLM, KeyDiff)",
                         to_string(k));
  const bool h2o = every_prompt_query(k);
  if (h2o && dec.window < 1)
    return status::error(errc::invalid_argument, fn, "decoding.window",
                         "expected the decode queries H2O accumulates over (>= 1), got %lld",
                         static_cast<long long>(dec.window));
  if (!h2o && dec.window != 0)
    return status::error(errc::invalid_argument, fn, "decoding.window",
                         "expected 0: %s observes with its configuration's window (decoding.window is H2O's), got %lld",
                         to_string(k), static_cast<long long>(dec.window));
  if (o.heads == head_allocation::adakv)
    return status::error(errc::unsupported, fn, "decoding",
                         "AdaKV leaves the heads of a layer with different lengths, which a cache view (one "
                         "num_tokens per layer) cannot describe at the next compression: use uniform heads");
  if (o.tensor_parallel != nullptr && o.scope != selection_scope::per_head)
    return status::error(errc::unsupported, fn, "decoding",
                         "decode-time compression of a keep set shared by heads across tensor-parallel ranks is not "
                         "implemented (per-head keep sets need no exchange)");
  compressor_options d = decoding_options(o);
  std::int64_t window = 0;
  KVEVICT_RETURN_IF_ERROR(decoding_named(check_policy(&d, &window, fn), fn));
  if (t.type == budget::kind::tokens && t.count > o.limits.max_tokens)
    return status::error(errc::invalid_argument, fn, "decoding.target",
                         "expected at most limits.max_tokens = %lld tokens, got %lld",
                         static_cast<long long>(o.limits.max_tokens), static_cast<long long>(t.count));
  return status();
}

/// An error of validate_layer_budget about the budget built from the options, named by the
/// options' own fields ("budget.heads" becomes "heads", "budget.adakv.alpha" "adakv.alpha").
inline status options_named(const status& st, const char* fn) noexcept {
  static constexpr const char prefix[] = "budget.";
  if (st.ok() || std::strncmp(st.argument(), prefix, sizeof(prefix) - 1) != 0) return st;
  const char* text = std::strstr(st.message(), ": ");
  text = text != nullptr ? std::strstr(text + 2, ": ") : nullptr;  // past "function: argument: "
  return status::error(st.code(), fn, st.argument() + sizeof(prefix) - 1, "%s",
                       text != nullptr ? text + 2 : st.message());
}

/// The plan's checks of its options, normalising them on the way (value_head_dim, the
/// default query type, max_queries); *window: the policy's observation window. `base`: the
/// budget a layer call starts from.
inline status check_compressor_options(compressor_options* options, const layer_budget& base, std::int64_t* window,
                                       const char* fn) noexcept {
  compressor_options& o = *options;
  model_shape& m = o.model;
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
  if (static_cast<unsigned>(m.storage) > static_cast<unsigned>(dtype::f8_e5m2))
    return status::error(errc::invalid_argument, fn, "model.storage", "expected a dtype value, got %d",
                         static_cast<int>(m.storage));
  const bool fp8 = m.storage == dtype::f8_e4m3 || m.storage == dtype::f8_e5m2;
  if (m.query_storage == dtype_query_default) m.query_storage = fp8 ? dtype::bf16 : m.storage;
  if (fp8 ? static_cast<unsigned>(m.query_storage) > static_cast<unsigned>(dtype::bf16) : m.query_storage != m.storage)
    return status::error(errc::invalid_argument, fn, "model.query_storage",
                         "expected %s for %s storage (or dtype_query_default), got %s (%d)",
                         fp8 ? "f32, f16 or bf16" : to_string(m.storage), to_string(m.storage),
                         to_string(m.query_storage), static_cast<int>(m.query_storage));
  const compressor_limits& lim = o.limits;
  if (lim.max_sequences < 1)
    return status::error(errc::invalid_shape, fn, "limits.max_sequences", "expected >= 1, got %lld",
                         static_cast<long long>(lim.max_sequences));
  // Selection indexes rows with 32-bit keys; AdaKV ranks a whole layer's candidates.
  const std::int64_t token_limit = o.heads == head_allocation::adakv
                                       ? static_cast<std::int64_t>(UINT32_MAX) / m.num_kv_heads
                                       : static_cast<std::int64_t>(UINT32_MAX);
  if (lim.max_tokens < 1 || lim.max_tokens > token_limit)
    return status::error(errc::invalid_shape, fn, "limits.max_tokens", "expected 1 .. %lld, got %lld",
                         static_cast<long long>(token_limit), static_cast<long long>(lim.max_tokens));
  if (lim.max_queries < 0)
    return status::error(errc::invalid_shape, fn, "limits.max_queries",
                         "expected >= 0 (0: the policy's window), got %lld", static_cast<long long>(lim.max_queries));
  if (o.exec.workers() < 1) return status::error(errc::invalid_argument, fn, "exec.num_workers", "expected >= 1");

  KVEVICT_RETURN_IF_ERROR(check_policy(&o, window, fn));
  KVEVICT_RETURN_IF_ERROR(options_named(validate_layer_budget(base, fn), fn));
  if (static_cast<unsigned>(o.layers) > 1u)
    return status::error(errc::invalid_argument, fn, "layers", "expected a layer_allocation value, got %d",
                         static_cast<int>(o.layers));
  if (o.layers == layer_allocation::pyramidkv &&
      (!(o.pyramid_beta >= 1.0) || o.pyramid_beta == std::numeric_limits<double>::infinity()))
    return status::error(errc::invalid_argument, fn, "pyramid_beta", "expected a finite beta >= 1, got %g",
                         o.pyramid_beta);
  KVEVICT_RETURN_IF_ERROR(check_contracts(o, fn));
  KVEVICT_RETURN_IF_ERROR(check_decoding(o, fn));
  if (o.limits.max_queries == 0) {
    o.limits.max_queries = *window;
    // decode-time budgets: every decode step hands its queries (at least one; the decode
    // scorer's window, which a prompt policy that reads none would leave at 0)
    if (o.decoding.enabled()) {
      const std::int64_t decoded = decoding_window(o) > 1 ? decoding_window(o) : 1;
      o.limits.max_queries = decoded > o.limits.max_queries ? decoded : o.limits.max_queries;
    }
  }
  if (*window > o.limits.max_queries)
    return status::error(errc::invalid_shape, fn, "limits.max_queries",
                         "expected at least the policy's observation window %lld, got %lld",
                         static_cast<long long>(*window), static_cast<long long>(o.limits.max_queries));
  return status();
}

/// The largest protected tail any call may see (DeferKV adds its decoded tokens: up to
/// delay - 1 before its last step, and a step of up to limits.max_queries tokens).
inline selection_params largest_selection(const compressor_options& o) noexcept {
  const policy_config& p = o.policy;
  return with_policy_traits(p.kind(), selection_params{}, [&](auto traits) {
    using Tr = decltype(traits);
    selection_params sel = Tr::largest_selection(Tr::config(p));
    if (Tr::deferred && o.limits.max_queries > 1) sel.protected_tail += o.limits.max_queries - 1;
    return sel;
  });
}

/// Keep-list entries one eviction may write (compressor::keep_capacity) and the most tokens
/// one head may keep (keep_capacity_per_head), for the limits and the budget a layer call
/// starts from (PyramidKV may give a layer any share of its candidates: sized for all).
inline void keep_capacities(const compressor_options& o, layer_budget b, std::int64_t* keep,
                            std::int64_t* per_head) noexcept {
  const std::int64_t heads = o.model.num_kv_heads, tokens = o.limits.max_tokens;
  if (o.layers == layer_allocation::pyramidkv) b.layer_candidates = tokens;
  *keep = layer_keep_capacity(heads, tokens, largest_selection(o), b);
  *per_head = o.heads == head_allocation::adakv || b.layer_candidates >= 0 ? tokens : (*keep + heads - 1) / heads;
}

/// The most rows one head may keep at a call whose cache holds `tokens` tokens (any layer):
/// the room an out-of-place destination needs for that sequence. keep_capacities' bound for
/// one length instead of limits.max_tokens (AdaKV: the layer's kept total, at most `tokens`).
inline std::int64_t head_keep_bound(const compressor_options& o, layer_budget b, std::int64_t tokens) noexcept {
  if (tokens < 1) return 0;
  const std::int64_t heads = o.model.num_kv_heads;
  if (o.layers == layer_allocation::pyramidkv) b.layer_candidates = tokens;
  const std::int64_t keep = layer_keep_capacity(heads, tokens, largest_selection(o), b);
  const std::int64_t per_head =
      o.heads == head_allocation::adakv || b.layer_candidates >= 0 ? keep : (keep + heads - 1) / heads;
  return per_head < tokens ? per_head : tokens;
}

/// run()'s checks of its call: the element types against the plan's, the layer, the batch.
inline status check_run_call(const compressor_options& o, dtype storage, dtype queries, std::int64_t layer,
                             std::int64_t n, const void* seqs, const void* reports, const char* fn) noexcept {
  if (storage != o.model.storage)
    return status::error(errc::invalid_argument, fn, "seqs", "expected %s views (the plan's storage type), got %s",
                         to_string(o.model.storage), to_string(storage));
  if (queries != o.model.query_storage)
    return status::error(errc::invalid_argument, fn, "seqs", "expected %s queries (the plan's query_storage), got %s",
                         to_string(o.model.query_storage), to_string(queries));
  if (layer < 0 || layer >= o.model.num_layers)
    return status::error(errc::out_of_range, fn, "layer", "expected a layer in [0, %lld), got %lld",
                         static_cast<long long>(o.model.num_layers), static_cast<long long>(layer));
  if (n < 0 || n > o.limits.max_sequences)
    return status::error(errc::invalid_shape, fn, "num_seqs", "expected 0 .. %lld (limits.max_sequences), got %lld",
                         static_cast<long long>(o.limits.max_sequences), static_cast<long long>(n));
  if (n > 0 && seqs == nullptr) return status::error(errc::null_pointer, fn, "seqs", "expected non-null");
  if (n > 0 && reports == nullptr) return status::error(errc::null_pointer, fn, "reports", "expected non-null");
  return status();
}

/// A sequence's observation queries against the model (its query heads and d; one query at a
/// decode step) and its engine LSE against the policy (`domain`: the one it normalises over).
template <class Q>
status check_sequence_queries(const compressor_options& o, softmax_domain domain, const query_view<const Q>& q,
                              bool decode, const float* lse, std::int64_t lse_head_stride, std::int64_t s,
                              const char* fn, bool multi_token_steps = false) noexcept {
  const model_shape& m = o.model;
  if (q.num_heads != m.num_query_heads || q.head_dim != m.head_dim)
    return status::error(errc::invalid_shape, fn, io_name(s, "queries"),
                         "expected the model's [%lld query heads, d = %lld], got [%lld, %lld]",
                         static_cast<long long>(m.num_query_heads), static_cast<long long>(m.head_dim),
                         static_cast<long long>(q.num_heads), static_cast<long long>(q.head_dim));
  if (decode && q.num_queries != 1 && !multi_token_steps)
    return status::error(errc::invalid_shape, fn, io_name(s, "queries.num_queries"),
                         "expected the decode step's query (1 per head), got %lld",
                         static_cast<long long>(q.num_queries));
  if (lse == nullptr) return status();
  if (!accepts_lse(o.policy.kind()))
    return status::error(errc::unsupported, fn, io_name(s, "lse"),
                         "%s normalises its observations itself (DeferKV its running state, DapQ over the prompt's "
                         "keys); pass no LSE",
                         with_policy_traits(o.policy.kind(), "", [](auto traits) { return decltype(traits)::name; }));
  if (domain != softmax_domain::visible)
    return status::error(errc::unsupported, fn, io_name(s, "lse"),
                         "an engine log-sum-exp covers every visible key; the policy normalises over candidates");
  if (lse_head_stride != 0 && lse_head_stride < q.num_queries)
    return status::error(errc::invalid_stride, fn, io_name(s, "lse_head_stride"), "expected 0 or >= %lld, got %lld",
                         static_cast<long long>(q.num_queries), static_cast<long long>(lse_head_stride));
  return status();
}

/// The budget of layer `layer` for a call scoring `tokens` tokens under `sel`, from the budget
/// every layer starts from: PyramidKV's share of the layers' candidates (layer_budgets:
/// [num_layers] scratch), as both compressors give it.
inline layer_budget layer_budget_for(const compressor_options& o, layer_budget b, std::int64_t layer,
                                     std::int64_t tokens, const selection_params& sel,
                                     std::int64_t* layer_budgets) noexcept {
  if (o.layers != layer_allocation::pyramidkv) return b;
  const std::int64_t protect = sel.protected_tail < tokens ? sel.protected_tail : tokens;
  const std::int64_t mean = candidates_kept(o.per_head.resolve(tokens), tokens, sel);
  // Validated shapes: this cannot fail (capacity >= window, layers >= 1, beta >= 1).
  if (pyramidkv_layer_budgets(mean + protect, protect, o.model.num_layers, tokens, layer_budgets, o.pyramid_beta).ok())
    b.layer_candidates = layer_budgets[layer];
  return b;
}

/// reset_sequence's checks of the caller's state memory: non-null, 8-byte aligned, at least
/// `need` bytes (`size_fn` names the size query).
inline status check_state_memory(const void* state, std::size_t bytes, std::size_t need, const char* fn,
                                 const char* arg, const char* size_fn) noexcept {
  if (state == nullptr) return status::error(errc::null_pointer, fn, arg, "expected non-null");
  if (reinterpret_cast<std::uintptr_t>(state) % 8 != 0)
    return status::error(errc::invalid_argument, fn, arg, "expected 8-byte alignment");
  if (bytes < need)
    return status::error(errc::invalid_shape, fn, "bytes", "expected at least %zu (%s), got %zu", need, size_fn, bytes);
  return status();
}

/// The budget a layer call starts from (before PyramidKV sets layer_candidates): the options'
/// per-head budget, head allocation and combine rule. The per-layer scope is select_layer's;
/// the per-sequence scope is the compressor's own, so its layers select per head.
inline layer_budget base_layer_budget(const compressor_options& o) noexcept {
  layer_budget b;
  b.per_head = o.per_head;
  b.heads = o.heads;
  b.adakv = o.adakv;
  b.scope = o.scope == selection_scope::per_layer ? selection_scope::per_layer : selection_scope::per_head;
  b.combine = o.combine;
  return b;
}
}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_COMPRESSOR_PLAN_HPP
