// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_KNORM_TRAITS_HPP
#define KVEVICT_POLICIES_KNORM_TRAITS_HPP

// KNorm's place in the compressors (policies/policy_traits.hpp); the policy itself is
// policies/knorm.hpp.

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policies/configs.hpp"
#include "kvevict/policies/policy_config.hpp"
#include "kvevict/policies/policy_traits.hpp"
#include "kvevict/selection/budget.hpp"

KVEVICT_NAMESPACE_BEGIN

template <class T, class Q>
class knorm;

struct knorm_traits : policy_traits_base {
  static constexpr const char* name = "knorm";
  using config_type = knorm_config;
  template <class T, class Q>
  using policy = knorm<T, Q>;
  static constexpr bool chunkable = true;
  static constexpr bool reads_queries = false;  // scores are key norms
  static constexpr bool on_gpu = true;          // cuda/detail/key_scorers.cuh

  static constexpr policy_kind kind = policy_kind::knorm;  // its index in default_policies
  static const config_type& config(const policy_config& p) noexcept { return p.config<knorm_traits>(); }
  template <class O>
  static status check(O* o, std::int64_t* window, const char* fn) noexcept {
    const config_type& c = config(o->policy);
    if (c.protected_tail < 0)
      return status::error(errc::invalid_argument, fn, "policy.knorm.protected_tail", "expected >= 0, got %lld",
                           static_cast<long long>(c.protected_tail));
    KVEVICT_RETURN_IF_ERROR(detail::check_protected_mode(c.protect, fn, "policy.knorm.protect"));
    *window = 0;
    return status();
  }
  static selection_params largest_selection(const config_type& c) noexcept { return {c.protected_tail, c.protect}; }
};

namespace policy {
/// A compressor's policy: knorm configured by `c`.
inline policy_config knorm(const knorm_config& c = {}) noexcept {
  return policy_config::of<knorm_traits>(c);
}
}  // namespace policy

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_KNORM_TRAITS_HPP
