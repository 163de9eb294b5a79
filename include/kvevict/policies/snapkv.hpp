// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_SNAPKV_HPP
#define KVEVICT_POLICIES_SNAPKV_HPP

// SnapKV / prompt-window scoring: the last W prompt queries observe every key; their
// aggregated, pooled attention is the score; the window itself is protected. Every
// convention is a parameter (scoring/params.hpp); scoring/presets.hpp pins the peers'.

#include <cstddef>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/policies/layer_inputs.hpp"
#include "kvevict/policies/scoring_policy.hpp"
#include "kvevict/scoring/observation_scores.hpp"
#include "kvevict/scoring/presets.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

template <class T, class Q = default_query_type_t<T>>
class snapkv : public scoring_policy<snapkv<T, Q>, T, Q> {
 public:
  static constexpr const char* evict_name = "kvevict::snapkv::evict";
  using storage_type = T;
  using query_type = Q;
  using config_type = window_config;

  explicit snapkv(const window_config& config = presets::kvpress_snapkv()) noexcept : config_(config) {}
  const window_config& config() const noexcept { return config_; }
  /// W: how many of its last prompt queries the engine should hand in.
  std::int64_t window() const noexcept { return config_.window; }

  std::size_t workspace_size(const layer_shape& shape, const executor& exec = {}) const noexcept {
    return observation_scores_workspace_size(shape, config_.params(), exec);
  }
  selection_params selection() const noexcept { return config_.selection(); }

  /// in.queries: [Hq, W', d] the last W' <= W prompt queries with positions; in.keys:
  /// [Hkv, L, d]; scores: [Hkv, L] out (the last W tokens +inf).
  status score(const layer_inputs<T, Q>& in, score_view scores, workspace_span ws, const executor& exec = {}) const {
    static constexpr const char* fn = "kvevict::snapkv::score";
    if (config_.window < 0)
      return status::error(errc::invalid_argument, fn, "config.window", "expected >= 0, got %lld",
                           static_cast<long long>(config_.window));
    // More observations than W would score with queries the protected window does not cover.
    if (in.queries.num_queries > config_.window)
      return status::error(errc::invalid_shape, fn, "queries.num_queries", "expected at most W = %lld, got %lld",
                           static_cast<long long>(config_.window), static_cast<long long>(in.queries.num_queries));
    return observation_scores(in.queries, in.keys, config_.params(), scores, ws, in.observation, exec);
  }

 private:
  window_config config_;
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_SNAPKV_HPP
