// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_STREAMING_LLM_HPP
#define KVEVICT_POLICIES_STREAMING_LLM_HPP

// StreamingLLM: keep the first `sinks` tokens (attention sinks) and the most recent ones.
// Expressed as scores so it shares selection and eviction with every other policy: sinks
// score +inf, every other token scores its index, so a budget of B keeps the sinks and the
// B - sinks most recent tokens. No queries needed.

#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvevict/config.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/policies/configs.hpp"
#include "kvevict/policies/layer_inputs.hpp"
#include "kvevict/policies/scoring_policy.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

template <class T, class Q = default_query_type_t<T>>
class streaming_llm : public scoring_policy<streaming_llm<T, Q>, T, Q> {
 public:
  static constexpr const char* evict_name = "kvevict::streaming_llm::evict";
  using storage_type = T;
  using query_type = Q;
  using config_type = streaming_llm_config;

  explicit streaming_llm(const streaming_llm_config& config = {}) noexcept : config_(config) {}
  const streaming_llm_config& config() const noexcept { return config_; }

  std::size_t workspace_size(const layer_shape&, const executor& = {}) const noexcept { return 0; }
  selection_params selection() const noexcept { return {0, protected_mode::inside_budget}; }

  /// keys: [Hkv, L, d] (only its shape is read); scores: [Hkv, L] out.
  status score(const layer_inputs<T, Q>& in, score_view scores, workspace_span = {}, const executor& = {}) const {
    static constexpr const char* fn = "kvevict::streaming_llm::score";
    if (config_.sinks < 0)
      return status::error(errc::invalid_argument, fn, "config.sinks", "expected >= 0, got %lld",
                           static_cast<long long>(config_.sinks));
    KVEVICT_RETURN_IF_ERROR(detail::validate_cache_view(in.keys, fn, "keys"));
    // Indices as float scores are exact below 2^24.
    if (in.keys.num_tokens > (std::int64_t{1} << 24))
      return status::error(errc::overflow, fn, "keys.num_tokens", "expected at most 2^24 tokens, got %lld",
                           static_cast<long long>(in.keys.num_tokens));
    KVEVICT_RETURN_IF_ERROR(detail::validate_matrix_view(scores, in.keys.num_heads, in.keys.num_tokens, fn, "scores"));
    for (std::int64_t h = 0; h < in.keys.num_heads; ++h) {
      float* row = scores.row(h);
      for (std::int64_t j = 0; j < in.keys.num_tokens; ++j)
        row[j] = j < config_.sinks ? std::numeric_limits<float>::infinity() : static_cast<float>(j);
    }
    return status();
  }

 private:
  streaming_llm_config config_;
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_STREAMING_LLM_HPP
