// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_TOVA_HPP
#define KVEVICT_POLICIES_TOVA_HPP

// TOVA as one-shot prompt compression, kvpress's TOVAPress convention: the last prompt
// query's attention (softmax over every key it sees, itself included), averaged over every
// query head of the layer, is each key's score for every KV head; the protected tail (at
// least the observing token) is +inf. docs/policies/tova.md.

#include <cstddef>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/policies/layer_inputs.hpp"
#include "kvevict/policies/scoring_policy.hpp"
#include "kvevict/policies/tova_traits.hpp"
#include "kvevict/scoring/observation_scores.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

template <class T, class Q = default_query_type_t<T>>
class tova : public scoring_policy<tova<T, Q>, T, Q> {
 public:
  static constexpr const char* evict_name = "kvevict::tova::evict";
  using storage_type = T;
  using query_type = Q;
  using config_type = tova_config;

  explicit tova(const tova_config& config = {}) noexcept : config_(config) {}
  const tova_config& config() const noexcept { return config_; }
  /// How many of its last prompt queries the engine should hand in.
  static constexpr std::int64_t window() noexcept { return 1; }

  /// The observation scoring's parameters (tova_config::params).
  scoring_params params() const noexcept { return config_.params(); }

  std::size_t workspace_size(const layer_shape& shape, const executor& exec = {}) const noexcept {
    return observation_scores_workspace_size(shape, params(), exec);
  }
  selection_params selection() const noexcept { return {config_.protected_tail, config_.protect}; }

  /// in.queries: [Hq, 1, d] the last prompt query with its position; in.keys: [Hkv, L, d];
  /// scores: [Hkv, L] out, every row the same (the last protected_tail tokens +inf).
  status score(const layer_inputs<T, Q>& in, score_view scores, workspace_span ws, const executor& exec = {}) const {
    static constexpr const char* fn = "kvevict::tova::score";
    if (config_.protected_tail < 1)
      return status::error(errc::invalid_argument, fn, "config.protected_tail", "expected >= 1, got %lld",
                           static_cast<long long>(config_.protected_tail));
    KVEVICT_RETURN_IF_ERROR(detail::check_protected_mode(config_.protect, fn, "config.protect"));
    // Averaging several queries would be a different policy (SnapKV without pooling).
    if (in.queries.num_queries != 1)
      return status::error(errc::invalid_shape, fn, "queries.num_queries",
                           "expected the last prompt query (1), got %lld",
                           static_cast<long long>(in.queries.num_queries));
    KVEVICT_RETURN_IF_ERROR(observation_scores(in.queries, in.keys, params(), scores, ws, in.observation, exec));
    const std::int64_t heads = scores.rows;
    const std::int64_t tokens = scores.cols;
    const std::int64_t candidates = tokens > config_.protected_tail ? tokens - config_.protected_tail : 0;
    for (std::int64_t j = 0; j < candidates; ++j) {
      double sum = 0.0;
      for (std::int64_t h = 0; h < heads; ++h) sum += static_cast<double>(scores.row(h)[j]);
      const float mean = static_cast<float>(sum / static_cast<double>(heads));
      for (std::int64_t h = 0; h < heads; ++h) scores.row(h)[j] = mean;
    }
    return status();
  }

 private:
  tova_config config_;
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_TOVA_HPP
