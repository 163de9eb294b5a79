// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_SNAPKV_TRAITS_HPP
#define KVEVICT_POLICIES_SNAPKV_TRAITS_HPP

// SnapKV's place in the compressors (policies/policy_traits.hpp); the policy itself is
// policies/snapkv.hpp.

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policies/policy_config.hpp"
#include "kvevict/policies/policy_traits.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/scoring/presets.hpp"
#include "kvevict/selection/budget.hpp"

KVEVICT_NAMESPACE_BEGIN

template <class T, class Q>
class snapkv;

struct snapkv_traits : policy_traits_base {
  static constexpr const char* name = "snapkv";
  using config_type = window_config;
  template <class T, class Q>
  using policy = snapkv<T, Q>;
  static constexpr bool chunkable = true;
  static constexpr bool on_gpu = true;

  static constexpr policy_kind kind = policy_kind::snapkv;  // its index in default_policies
  static const config_type& config(const policy_config& p) noexcept { return p.config<snapkv_traits>(); }
  template <class O>
  static status check(O* o, std::int64_t* window, const char* fn) noexcept {
    const config_type& c = config(o->policy);
    if (c.window < 1)
      return status::error(errc::invalid_argument, fn, "policy.snapkv.window", "expected >= 1, got %lld",
                           static_cast<long long>(c.window));
    KVEVICT_RETURN_IF_ERROR(detail::check_protected_mode(c.protect, fn, "policy.snapkv.protect"));
    KVEVICT_RETURN_IF_ERROR(detail::validate_scoring_params(c.params(), fn));
    if (c.scoring.window == window_aggregation::weighted)
      return status::error(errc::unsupported, fn, "policy.snapkv.scoring.window",
                           "weighted aggregation needs per-call weights; use the building blocks");
    *window = c.window;
    return status();
  }
  static selection_params largest_selection(const config_type& c) noexcept { return c.selection(); }
  static softmax_domain domain(const config_type& c) noexcept { return c.scoring.domain; }
};

namespace policy {
/// A compressor's policy: snapkv configured by `c`.
inline policy_config snapkv(const window_config& c = presets::kvpress_snapkv()) noexcept {
  return policy_config::of<snapkv_traits>(c);
}
}  // namespace policy

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_SNAPKV_TRAITS_HPP
