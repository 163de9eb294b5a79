// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_COMPRESSOR_DETAIL_COMPRESSOR_CORE_HPP
#define KVEVICT_COMPRESSOR_DETAIL_COMPRESSOR_CORE_HPP

// What a planned compressor knows (its options and every size) and what it derives from it
// per call: the workspace and state layout, the layer's budget, and the dispatch to the
// configured policy among the compressor's list (policies/policy_list.hpp). The layers above
// (prefill window, lifecycle, agreement, run checks, step executor) build on it; kvevict::basic_compressor
// (compressor/basic_compressor.hpp) is the public face.
//
// Members that depend on the policy list take it as their first template argument, so this
// class and those above it are not templates: one object layout for every list.

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kvevict/budgets/layer_budget.hpp"
#include "kvevict/compressor/detail/state_layout.hpp"
#include "kvevict/compressor/options.hpp"
#include "kvevict/compressor/plan.hpp"
#include "kvevict/compressor/sequence.hpp"
#include "kvevict/config.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/error.hpp"
#include "kvevict/eviction/evict.hpp"
#include "kvevict/parallel/head_shard.hpp"
#include "kvevict/policies/chunkkv.hpp"
#include "kvevict/policies/policy_list.hpp"
#include "kvevict/selection/scope_sharded.hpp"
#include "kvevict/selection/select.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

class compressor_core {
 protected:
  using act = step_act;

  /// A layer's caches as this plan compacts them: the destination views are read under
  /// compaction::out_of_place only. Under the other modes they are ignored, as cuda::compressor
  /// ignores them (handed in place, they used to send the rows there, past the destination
  /// checks that out_of_place makes before any sequence moves).
  template <class T>
  layer_cache<T> as_planned(layer_cache<T> c) const noexcept {
    if (options_.compact != compaction::out_of_place) {
      c.dst_keys = cache_view<T>{};
      c.dst_values = cache_view<T>{};
    }
    return c;
  }

  /// The most tokens one head may keep at a call whose cache holds `tokens` tokens.
  std::int64_t keep_capacity_per_head(std::int64_t tokens) const noexcept {
    if (!planned_) return 0;
    const std::int64_t t = tokens < options_.limits.max_tokens ? tokens : options_.limits.max_tokens;
    std::int64_t rows = head_keep_bound(options_, base_budget(), t);
    if (maintains()) {
      layer_budget b = base_layer_budget(decode_options_);
      b.shard = shard();
      const std::int64_t decoded = head_keep_bound(decode_options_, b, t);
      rows = decoded > rows ? decoded : rows;
    }
    return rows < head_capacity_ ? rows : head_capacity_;
  }

  /// Tensor parallelism: whether run() talks to the other ranks (AdaKV, or a keep set shared
  /// by heads).
  bool selects_across_ranks() const noexcept {
    return options_.tensor_parallel != nullptr &&
           (options_.heads == head_allocation::adakv || options_.scope != selection_scope::per_head);
  }

  void carve(arena& a, run_layout* out) const noexcept {
    out->layer_budgets =
        options_.layers == layer_allocation::pyramidkv ? a.take<std::int64_t>(options_.model.num_layers) : nullptr;
    out->head_lengths = a.take<std::int64_t>(options_.model.num_kv_heads);
    out->indices = a.take<std::int64_t>(keep_capacity_);
    out->policy = take_span(a, policy_bytes_);
    if (window_bytes_ > 0) {
      out->window_queries = a.take<unsigned char>(window_scratch_bytes_);
      out->window_positions = a.take<std::int64_t>(window_capacity_);
    }
  }

  void carve_shared(arena& a, std::size_t score_bytes, shared_layout* out) const noexcept {
    const std::int64_t heads = options_.model.num_kv_heads, tokens = options_.limits.max_tokens;
    out->scores = a.take<float>(saturating_mul(heads, tokens));
    out->row = a.take<float>(tokens);
    out->offsets = a.take<std::int64_t>(saturating_add(heads, 1));
    out->indices = a.take<std::int64_t>(keep_capacity_);
    out->one_head = a.take<std::int64_t>(saturating_add(tokens, 2));
    out->score = take_span(a, score_bytes);
    out->select = take_span(a, select_workspace_size(tokens, options_.exec));
    out->compact = take_span(a, compact_workspace_bound(heads, tokens));
    if (options_.tensor_parallel != nullptr)
      out->gather = take_span(a, sharded_combine_workspace_size(tokens, options_.combine, shard()));
  }
  status check_planned(const char* fn) const noexcept {
    if (!planned_) return status::error(errc::invalid_state, fn, "compressor", "not planned: call compressor::plan");
    return status();
  }
  status check_options(const char* fn) noexcept {
    return check_compressor_options(&options_, base_budget(), &window_, fn);
  }

  /// The largest protected tail any call may see (DeferKV adds its decoded tokens).
  selection_params largest_selection() const noexcept { return detail::largest_selection(options_); }

  /// The budget a layer call starts from (before PyramidKV sets layer_candidates). The layer
  /// scope is select_layer's; the sequence scope is the compressor's own.
  layer_budget base_budget() const noexcept {
    layer_budget b = base_layer_budget(options_);
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

  /// The list's deferred policy (policies/policy_list.hpp): the state lifecycle is its.
  /// Only code under `if constexpr (has_deferred_v<List>)` names these.
  template <class List>
  using deferred_traits = deferred_traits_t<List>;
  template <class List, class T, class Q>
  using deferred_policy = typename deferred_traits<List>::template policy<T, Q>;
  template <class List>
  const typename deferred_traits<List>::config_type& deferred_config() const noexcept {
    return deferred_traits<List>::config(options_.policy);
  }
  template <class List>
  bool defers() const noexcept {
    return has_deferred_v<List> && detail::defers(options_.policy.kind());
  }

  /// Calls f(traits, policy) with the configured policy's traits and object for storage type T
  /// (policies that score without state; ChunkKV on top where configured). The plan checked
  /// the kind.
  template <class List, class T, class Q, class F>
  status with_scoring_policy(F&& f) const {
    return with_scoring_policy<List, T, Q>(options_.policy, static_cast<F&&>(f));
  }
  /// The same for the policy of `p` (the decode scorer, compressor_options::decoding).
  template <class List, class T, class Q, class F>
  status with_scoring_policy(const policy_config& p, F&& f) const {
    return visit_listed(List{}, static_cast<std::size_t>(p.kind()), status(), [&](auto traits) -> status {
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

  // ---- decode-time budgets (compressor_options::decoding) ------------------------------

  bool maintains() const noexcept { return options_.decoding.enabled(); }
  /// The decode scorer's selection (its protected tail).
  template <class List, class T, class Q>
  selection_params decode_selection() const {
    selection_params sel;
    (void)with_scoring_policy<List, T, Q>(options_.decoding.policy, [&](auto, const auto& policy) {
      sel = policy.selection();
      return status();
    });
    return sel;
  }
  /// The budget of a decode-time compression of layer `layer` at `tokens` tokens: the plan's
  /// budget arithmetic with the decode target (layer_budgets: [num_layers] scratch, PyramidKV).
  layer_budget decode_budget_for(std::int64_t layer, std::int64_t tokens, const selection_params& sel,
                                 std::int64_t* layer_budgets) const noexcept {
    layer_budget b = base_layer_budget(decode_options_);
    b.shard = shard();
    return layer_budget_for(decode_options_, b, layer, tokens, sel, layer_budgets);
  }
  /// Whether a decode step that leaves layer `layer` holding `tokens` tokens per head compresses
  /// it: more than the rows a compression keeps there plus the interval N.
  bool decode_compresses(std::int64_t layer, std::int64_t tokens, const selection_params& sel,
                         std::int64_t* layer_budgets) const noexcept {
    const std::int64_t rows = layer_keep_capacity(1, tokens, sel, decode_budget_for(layer, tokens, sel, layer_budgets));
    return tokens - rows > options_.decoding.interval;
  }

  // ---- running -----------------------------------------------------------------------

  policy_state layer_state(void* state, std::int64_t layer) const noexcept {
    return {static_cast<unsigned char*>(state) + sequence_state_offset + scope_bytes_ +
                static_cast<std::size_t>(layer) * layer_state_bytes_,
            layer_state_bytes_};
  }
  scope_state* scope_header(void* state) const noexcept {
    return reinterpret_cast<scope_state*>(static_cast<unsigned char*>(state) + sequence_state_offset);
  }
  float* scope_row(void* state) const noexcept {
    return reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(scope_header(state)) + sizeof(scope_state));
  }

  /// The observation inputs of a sequence for the queries `q` it observes with (the engine's
  /// LSE only for a window of this call's queries: an assembled one is normalised here).
  template <class T, class Q>
  layer_observations<Q> observations_of(const sequence_io<T, Q>& io, const query_view<const Q>& q, policy_state state,
                                        bool assembled = false) const noexcept {
    layer_observations<Q> o;
    o.queries = q;
    o.observation.key_positions = io.key_positions;
    if (io.lse != nullptr && !assembled) {
      const std::int64_t stride = io.lse_head_stride != 0 ? io.lse_head_stride : io.queries.num_queries;
      o.observation.lse = io.lse + (io.queries.num_queries - q.num_queries);  // the rows of the last queries
      o.observation.lse_head_stride = stride;
    }
    o.state = state;
    return o;
  }

  bool sequence_scope() const noexcept { return options_.scope == selection_scope::per_sequence; }

  step_act scores_act(std::int64_t layer) const noexcept {
    if (!sequence_scope()) return step_act::evict;
    return layer == options_.model.num_layers - 1 ? step_act::fold_and_evict_all : step_act::fold;
  }

  softmax_domain scoring_domain() const noexcept {
    const policy_config& p = options_.policy;
    return with_policy_traits(p.kind(), softmax_domain::visible, [&](auto traits) {
      using Tr = decltype(traits);
      return Tr::domain(Tr::config(p));
    });
  }

  /// The layer's budget for a sequence of `tokens` scored tokens under selection `sel`.
  layer_budget budget_for(std::int64_t layer, std::int64_t tokens, const selection_params& sel,
                          const run_layout& lay) const noexcept {
    return layer_budget_for(options_, base_budget(), layer, tokens, sel, lay.layer_budgets);
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

  /// Every size, for storage T and queries Q (plan() calls it for the plan's types).
  template <class List, class T, class Q>
  void size() noexcept {
    const model_shape& m = options_.model;
    const compressor_limits& lim = options_.limits;
    const layer_shape shape{m.num_query_heads, m.num_kv_heads, m.head_dim, lim.max_tokens, lim.max_queries};
    layer_budget b = base_budget();
    // PyramidKV may give a layer any share of its candidates: size for all of them.
    if (options_.layers == layer_allocation::pyramidkv) b.layer_candidates = lim.max_tokens;
    const executor& exec = options_.exec;
    keep_capacities(options_, base_budget(), &keep_capacity_, &head_capacity_);
    decode_options_ = decoding_options(options_);
    decode_window_ = decoding_window(options_);
    std::size_t evict_bytes = 0, score_bytes = 0;
    layer_state_bytes_ = 0;
    if constexpr (has_deferred_v<List>) {
      if (defers<List>()) {
        const deferred_policy<List, T, Q> d(deferred_config<List>());
        const std::size_t observe = d.workspace_size(shape, exec);
        evict_bytes = std::max(observe, d.evict_workspace_size(shape, b, exec));
        score_bytes = observe;  // covers finalize's [C] row too
        layer_state_bytes_ = round_up_64(deferred_policy<List, T, Q>::state_size(m.num_kv_heads, lim.max_tokens));
      }
    }
    if (layer_state_bytes_ == 0) {
      (void)with_scoring_policy<List, T, Q>([&](auto traits, const auto& policy) {
        evict_bytes = policy.evict_workspace_size(shape, b, exec);
        score_bytes = decltype(traits)::score_workspace_size(policy, shape, exec);
        return status();
      });
    }
    if (maintains()) {  // the decode scorer's compressions, over its window of decode queries
      layer_budget db = base_layer_budget(decode_options_);
      db.shard = shard();
      if (options_.layers == layer_allocation::pyramidkv) db.layer_candidates = lim.max_tokens;
      const layer_shape dshape{m.num_query_heads, m.num_kv_heads, m.head_dim, lim.max_tokens, decode_window_};
      (void)with_scoring_policy<List, T, Q>(options_.decoding.policy, [&](auto traits, const auto& policy) {
        evict_bytes = std::max(evict_bytes, policy.evict_workspace_size(dshape, db, exec));
        score_bytes = std::max(score_bytes, decltype(traits)::score_workspace_size(policy, dshape, exec));
        return status();
      });
      std::int64_t keep = 0, per_head = 0;
      keep_capacities(decode_options_, db, &keep, &per_head);
      keep_capacity_ = std::max(keep_capacity_, keep);
      head_capacity_ = std::max(head_capacity_, per_head);
    }
    policy_bytes_ = evict_bytes;
    if (options_.scope == selection_scope::per_sequence) {
      arena a;
      shared_layout sl;
      carve_shared(a, score_bytes, &sl);
      policy_bytes_ = std::max(policy_bytes_, a.used());
      shared_score_bytes_ = score_bytes;
      scope_bytes_ = round_up_64(
          saturating_add(sizeof(scope_state), saturating_mul(static_cast<std::size_t>(lim.max_tokens), sizeof(float))));
    } else {
      scope_bytes_ = 0;
    }
    // chunked prefill: each layer keeps the window's rows (H2O: every prompt query it may see)
    window_bytes_ = 0;
    window_capacity_ = 0;
    chunk_rows_ = 0;
    window_scratch_bytes_ = 0;
    // (DapQ's pseudo queries come whole with prefill_end: its prompt chunks keep nothing)
    const bool chunks =
        options_.chunked_prefill && reads_queries(options_.policy.kind()) && !fixed_window(options_.policy);
    // decode-time budgets: the same rows hold the last decode queries after prefill_end (the
    // header alone, which marks prefill_end, when the decode scorer reads none)
    if (chunks || maintains()) {
      if (chunks) chunk_rows_ = every_prompt_query(options_.policy.kind()) ? lim.max_queries : window_;
      window_capacity_ = std::max(chunk_rows_, decode_window_);
      window_scratch_bytes_ = round_up_64(saturating_mul(
          saturating_mul(static_cast<std::size_t>(m.num_query_heads), static_cast<std::size_t>(window_capacity_)),
          saturating_mul(static_cast<std::size_t>(m.head_dim), sizeof(Q))));
      window_bytes_ = round_up_64(saturating_add(
          saturating_add(sizeof(window_state),
                         saturating_mul(static_cast<std::size_t>(window_capacity_), sizeof(std::int64_t))),
          window_scratch_bytes_));
    }
    const std::size_t per_layer = saturating_add(layer_state_bytes_, window_bytes_);
    state_bytes_ = per_layer == 0 && scope_bytes_ == 0
                       ? 0
                       : saturating_add(saturating_add(sequence_state_offset, scope_bytes_),
                                        saturating_mul(static_cast<std::size_t>(m.num_layers), per_layer));
    arena a;
    run_layout lay;
    carve(a, &lay);
    workspace_bytes_ = a.used();
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
  std::size_t window_bytes_ = 0;          ///< a layer's chunked-prefill window in the state
  std::size_t window_scratch_bytes_ = 0;  ///< its queries (and the workspace's assembled window)
  std::int64_t window_capacity_ = 0;      ///< rows it holds
  std::int64_t chunk_rows_ = 0;           ///< rows prompt chunks buffer (0: prefill_chunk keeps none)
  compressor_options decode_options_;     ///< decoding_options(options_): the decode scorer's plan
  std::int64_t decode_window_ = 0;        ///< decode queries the decode scorer observes with
  std::size_t state_bytes_ = 0;
  std::int64_t keep_capacity_ = 0;
  std::int64_t head_capacity_ = 0;
};

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_COMPRESSOR_DETAIL_COMPRESSOR_CORE_HPP
