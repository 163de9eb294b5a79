// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_LAYER_INPUTS_HPP
#define KVEVICT_POLICIES_LAYER_INPUTS_HPP

// What an engine hands a policy for one layer. Policies read what they need: StreamingLLM
// and KNorm only the keys; SnapKV, H2O, DapQ the observation queries too; H2O may instead
// take attention rows the engine already computed; DeferKV also its running state.
//
// The policy contract (docs/adding-a-policy.md) has two calls per layer:
//   score(layer_inputs, scores, ws)                      keys + observations -> [Hkv, L] scores
//   evict(layer_cache, layer_observations, budget, ...)  score -> budgets -> select -> compact
// score() reads the keys through a read-only view; evict() gets the mutable K and V it
// compacts, and scores the keys it compacts.

#include <cstddef>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/scoring/observation_scores.hpp"
#include "kvevict/views/attention_view.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/query_view.hpp"

KVEVICT_NAMESPACE_BEGIN

/// Caller-owned memory of a stateful policy for one layer of one sequence (DeferKV's running
/// state; see policies/deferkv.hpp for its size and initialisation). Stateless policies
/// ignore it.
struct policy_state {
  void* data = nullptr;
  std::size_t size = 0;
};

/// Everything a policy observes of one layer except the keys themselves.
template <class T>
struct layer_observations {
  query_view<const T> queries;     ///< [Hq, W, d] observation queries with positions
  observation_inputs observation;  ///< optional key positions, window weights, engine LSE
  attention_view attention;        ///< optional precomputed attention rows [Hq, W, L]
  policy_state state;              ///< stateful policies only (DeferKV)
};

/// The keys a policy scores and what observes them.
template <class T>
struct layer_inputs : layer_observations<T> {
  cache_view<const T> keys;  ///< [Hkv, L, d]
};

/// The mutable K and V caches of one layer of one sequence, as evict() compacts them, and what
/// the engine says about their blocks.
template <class T>
struct layer_cache {
  layer_cache() = default;
  /// In-place compaction of K and V (the common case: `policy.evict({keys, values}, ...)`).
  layer_cache(cache_view<T> k, cache_view<T> v) noexcept : keys(k), values(v) {}

  cache_view<T> keys;    ///< [Hkv, L, dk]
  cache_view<T> values;  ///< [Hkv, L, dv]
  /// Out of place (prefix-shared blocks): the destination, fresh memory of the same layout
  /// (paged: a table of fresh blocks); kept rows are copied there and keys/values stay intact.
  /// Empty (null data): compaction in place.
  cache_view<T> dst_keys;
  cache_view<T> dst_values;
  /// Paged caches: references to each block of the pool (> 1: shared by prefix caching), or a
  /// bitmap of shared blocks; in place, a compaction that would write a shared block is refused.
  const std::int32_t* block_refcounts = nullptr;
  const std::uint32_t* shared_blocks = nullptr;
  /// false: report the keep set and move nothing (engines that apply keep-lists themselves,
  /// like llama.cpp freeing cells); the result still says what the compaction would leave.
  bool compact = true;

  bool out_of_place() const noexcept { return dst_keys.data != nullptr || dst_values.data != nullptr; }
};

/// The layer_inputs that score the keys of `cache` under `observed`.
template <class T>
layer_inputs<T> inputs_of(const layer_cache<T>& cache, const layer_observations<T>& observed) noexcept {
  layer_inputs<T> in;
  static_cast<layer_observations<T>&>(in) = observed;
  in.keys = cache.keys;
  return in;
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_LAYER_INPUTS_HPP
