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
#include "kvevict/views/layer_cache.hpp"
#include "kvevict/views/query_view.hpp"

KVEVICT_NAMESPACE_BEGIN

/// Caller-owned memory of a stateful policy for one layer of one sequence (DeferKV's running
/// state; see policies/deferkv.hpp for its size and initialisation). Stateless policies
/// ignore it.
struct policy_state {
  void* data = nullptr;
  std::size_t size = 0;
};

/// Everything a policy observes of one layer except the keys themselves; Q is the queries'
/// storage type.
template <class Q>
struct layer_observations {
  query_view<const Q> queries;     ///< [Hq, W, d] observation queries with positions
  observation_inputs observation;  ///< optional key positions, window weights, engine LSE
  attention_view attention;        ///< optional precomputed attention rows [Hq, W, L]
  policy_state state;              ///< stateful policies only (DeferKV)
};

/// The keys a policy scores (stored as T) and what observes them (queries stored as Q: the
/// cache's type, or the model's for fp8 caches).
template <class T, class Q = default_query_type_t<T>>
struct layer_inputs : layer_observations<Q> {
  cache_view<const T> keys;  ///< [Hkv, L, d]
};

/// The layer_inputs that score the keys of `cache` under `observed`.
template <class T, class Q>
layer_inputs<T, Q> inputs_of(const layer_cache<T>& cache, const layer_observations<Q>& observed) noexcept {
  layer_inputs<T, Q> in;
  static_cast<layer_observations<Q>&>(in) = observed;
  in.keys = cache.keys;
  return in;
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_LAYER_INPUTS_HPP
