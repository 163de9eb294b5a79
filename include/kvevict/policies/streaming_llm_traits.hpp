// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_STREAMING_LLM_TRAITS_HPP
#define KVEVICT_POLICIES_STREAMING_LLM_TRAITS_HPP

// StreamingLLM's place in the compressors (policies/policy_traits.hpp); the policy itself is
// policies/streaming_llm.hpp.

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policies/configs.hpp"
#include "kvevict/policies/policy_config.hpp"
#include "kvevict/policies/policy_traits.hpp"
#include "kvevict/selection/budget.hpp"

KVEVICT_NAMESPACE_BEGIN

template <class T, class Q>
class streaming_llm;

struct streaming_llm_traits : policy_traits_base {
  static constexpr const char* name = "streaming_llm";
  using config_type = streaming_llm_config;
  template <class T, class Q>
  using policy = streaming_llm<T, Q>;
  static constexpr bool chunkable = true;
  static constexpr bool reads_queries = false;
  static constexpr bool reads_keys = false;  // scores are token indices
  static constexpr bool on_gpu = true;       // cuda/detail/key_scorers.cuh

  static constexpr policy_kind kind = policy_kind::streaming_llm;  // its index in default_policies
  static const config_type& config(const policy_config& p) noexcept { return p.config<streaming_llm_traits>(); }
  template <class O>
  static status check(O* o, std::int64_t* window, const char* fn) noexcept {
    const config_type& c = config(o->policy);
    if (c.sinks < 0)
      return status::error(errc::invalid_argument, fn, "policy.streaming_llm.sinks", "expected >= 0, got %lld",
                           static_cast<long long>(c.sinks));
    if (o->limits.max_tokens > (std::int64_t{1} << 24))
      return status::error(errc::overflow, fn, "limits.max_tokens",
                           "StreamingLLM scores token indices as floats: expected at most 2^24 tokens, got %lld",
                           static_cast<long long>(o->limits.max_tokens));
    *window = 0;
    return status();
  }
  static selection_params largest_selection(const config_type&) noexcept { return {0, protected_mode::inside_budget}; }
};

namespace policy {
/// A compressor's policy: streaming_llm configured by `c`.
inline policy_config streaming_llm(const streaming_llm_config& c = {}) noexcept {
  return policy_config::of<streaming_llm_traits>(c);
}
}  // namespace policy

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_STREAMING_LLM_TRAITS_HPP
