// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_LAYER_INPUTS_HPP
#define KVEVICT_POLICIES_LAYER_INPUTS_HPP

// What an engine hands a policy for one layer. Policies read what they need: StreamingLLM
// and KNorm only the keys; SnapKV, H2O, DapQ the observation queries too; H2O may instead
// take attention rows the engine already computed.

#include "kvevict/config.hpp"
#include "kvevict/scoring/observation_scores.hpp"
#include "kvevict/views/attention_view.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/query_view.hpp"

KVEVICT_NAMESPACE_BEGIN

template <class T>
struct layer_inputs {
  cache_view<const T> keys;        ///< [Hkv, L, d]
  query_view<const T> queries;     ///< [Hq, W, d] observation queries with positions
  observation_inputs observation;  ///< optional key positions, window weights, engine LSE
  attention_view attention;        ///< optional precomputed attention rows [Hq, W, L]
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_LAYER_INPUTS_HPP
