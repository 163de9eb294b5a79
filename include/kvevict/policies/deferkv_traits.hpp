// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_DEFERKV_TRAITS_HPP
#define KVEVICT_POLICIES_DEFERKV_TRAITS_HPP

// DeferKV's place in the compressors (policies/policy_traits.hpp); the policy itself is
// policies/deferkv.hpp. It is the deferred policy: the compressors keep its state per layer
// and sequence, observe the prefill and `delay` decode steps, then evict from the state.

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policies/configs.hpp"
#include "kvevict/policies/policy_config.hpp"
#include "kvevict/policies/policy_traits.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/selection/budget.hpp"

KVEVICT_NAMESPACE_BEGIN

template <class T, class Q>
class deferkv;

struct deferkv_traits : policy_traits_base {
  static constexpr const char* name = "deferkv";
  using config_type = deferkv_config;
  template <class T, class Q>
  using policy = deferkv<T, Q>;
  static constexpr bool deferred = true;
  static constexpr bool accepts_lse = false;
  static constexpr bool on_gpu = true;

  static constexpr policy_kind kind = policy_kind::deferkv;  // its index in default_policies
  static const config_type& config(const policy_config& p) noexcept { return p.config<deferkv_traits>(); }
  template <class O>
  static status check(O* o, std::int64_t* window, const char* fn) noexcept {
    const config_type& c = config(o->policy);
    KVEVICT_RETURN_IF_ERROR(detail::check_deferkv_config(c, fn));
    KVEVICT_RETURN_IF_ERROR(detail::check_protected_mode(c.protect, fn, "policy.deferkv.protect"));
    if (c.window < 1 || c.window > deferkv_max_window)
      return status::error(errc::invalid_argument, fn, "policy.deferkv.window", "expected 1 .. %lld, got %lld",
                           static_cast<long long>(deferkv_max_window), static_cast<long long>(c.window));
    *window = c.window;
    return status();
  }
  /// The protected tail grows by the decode steps observed before eviction.
  static selection_params largest_selection(const config_type& c) noexcept { return {c.window + c.delay, c.protect}; }
  static softmax_domain domain(const config_type& c) noexcept { return c.domain; }
  /// Decode steps observed before eviction, and whether any is (else it evicts at prefill_end).
  static std::int64_t delay(const config_type& c) noexcept { return c.delay; }
  static bool feeds_back(const config_type& c) noexcept { return c.decode_feedback && c.delay > 0; }
};

namespace policy {
/// A compressor's policy: deferkv configured by `c`.
inline policy_config deferkv(const deferkv_config& c = {}) noexcept {
  return policy_config::of<deferkv_traits>(c);
}
}  // namespace policy

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_DEFERKV_TRAITS_HPP
