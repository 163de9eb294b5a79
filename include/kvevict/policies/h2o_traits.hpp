// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_H2O_TRAITS_HPP
#define KVEVICT_POLICIES_H2O_TRAITS_HPP

// H2O's place in the compressors (policies/policy_traits.hpp); the policy itself is
// policies/h2o.hpp.

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policies/configs.hpp"
#include "kvevict/policies/policy_config.hpp"
#include "kvevict/policies/policy_traits.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/selection/budget.hpp"

KVEVICT_NAMESPACE_BEGIN

template <class T, class Q>
class h2o;

struct h2o_traits : policy_traits_base {
  static constexpr const char* name = "h2o";
  using config_type = h2o_config;
  template <class T, class Q>
  using policy = h2o<T, Q>;
  static constexpr bool chunkable = true;
  static constexpr bool every_prompt_query = true;  // accumulated attention of the whole prompt
  static constexpr bool on_gpu = true;              // the GPU compressor's batched observation scoring

  static constexpr policy_kind kind = policy_kind::h2o;  // its index in default_policies
  static const config_type& config(const policy_config& p) noexcept { return p.config<h2o_traits>(); }
  template <class O>
  static status check(O* o, std::int64_t* window, const char* fn) noexcept {
    const config_type& c = config(o->policy);
    if (c.recent_window < 0)
      return status::error(errc::invalid_argument, fn, "policy.h2o.recent_window", "expected >= 0, got %lld",
                           static_cast<long long>(c.recent_window));
    KVEVICT_RETURN_IF_ERROR(detail::check_protected_mode(c.protect, fn, "policy.h2o.protect"));
    KVEVICT_RETURN_IF_ERROR(detail::validate_scoring_params(c.params(), fn));
    *window = 1;  // every prompt query observes; at least one is needed
    if (o->limits.max_queries == 0) o->limits.max_queries = o->limits.max_tokens;
    return status();
  }
  static selection_params largest_selection(const config_type& c) noexcept { return {c.recent_window, c.protect}; }
  static softmax_domain domain(const config_type& c) noexcept { return c.params().domain; }
};

namespace policy {
/// A compressor's policy: h2o configured by `c`.
inline policy_config h2o(const h2o_config& c = {}) noexcept {
  return policy_config::of<h2o_traits>(c);
}
}  // namespace policy

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_H2O_TRAITS_HPP
