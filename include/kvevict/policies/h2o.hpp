// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_H2O_HPP
#define KVEVICT_POLICIES_H2O_HPP

// H2O / accumulated attention: a key's score is the attention it received from the prompt's
// queries, summed and divided by how many of those queries could see it (so early keys,
// visible to more queries, are not favoured for that alone). The engine either hands the
// attention rows it computed (layer_inputs::attention) or the queries themselves
// (layer_inputs::queries, typically every prompt query), and kvevict computes the rows
// tile by tile.

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/policies/configs.hpp"
#include "kvevict/policies/layer_inputs.hpp"
#include "kvevict/policies/scoring_policy.hpp"
#include "kvevict/scoring/attention_scores.hpp"
#include "kvevict/scoring/observation_scores.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

template <class T, class Q = default_query_type_t<T>>
class h2o : public scoring_policy<h2o<T, Q>, T, Q> {
 public:
  static constexpr const char* evict_name = "kvevict::h2o::evict";
  using storage_type = T;
  using query_type = Q;
  using config_type = h2o_config;

  explicit h2o(const h2o_config& config = {}) noexcept : config_(config) {}
  const h2o_config& config() const noexcept { return config_; }

  std::size_t workspace_size(const layer_shape& shape, const executor& exec = {}) const noexcept {
    return std::max(observation_scores_workspace_size(shape, config_.params(), exec),
                    attention_scores_workspace_size(shape, config_.params()));
  }
  selection_params selection() const noexcept { return {config_.recent_window, config_.protect}; }

  /// From attention rows when in.attention.data is set (then in.attention is [Hq, W, L] with
  /// positions and in.keys gives Hkv), else from in.queries over in.keys. scores: [Hkv, L].
  status score(const layer_inputs<T, Q>& in, score_view scores, workspace_span ws, const executor& exec = {}) const {
    if (in.attention.data != nullptr)
      return attention_scores(in.attention, in.keys.num_heads, config_.params(), scores, ws,
                              in.observation.key_positions);
    return observation_scores(in.queries, in.keys, config_.params(), scores, ws, in.observation, exec);
  }

 private:
  h2o_config config_;
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_H2O_HPP
