// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_TOVA_TRAITS_HPP
#define KVEVICT_POLICIES_TOVA_TRAITS_HPP

// TOVA's configuration and its place in the compressors (policies/policy_traits.hpp); the
// policy itself is policies/tova.hpp.

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policies/policy_config.hpp"
#include "kvevict/policies/policy_traits.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/selection/budget.hpp"

KVEVICT_NAMESPACE_BEGIN

struct tova_config {
  /// The last tokens always kept (scored +inf); at least the observing token itself, whose
  /// own attention kvpress drops before scoring.
  std::int64_t protected_tail = 1;
  protected_mode protect = protected_mode::inside_budget;

  /// Per KV head: the mean over its group of the one query's attention (visible softmax, no
  /// pooling). tova then averages the group means across KV heads, which is the mean over
  /// every query head because every group has the same size.
  scoring_params params() const noexcept {
    scoring_params p;
    p.domain = softmax_domain::visible;
    p.window = window_aggregation::mean;
    p.gqa = gqa_reduction::mean;
    p.order = gqa_order::before_pooling;
    p.pool = {pooling_kind::none, 1, true};
    p.protected_tail = protected_tail;
    return p;
  }
};

template <class T, class Q>
class tova;

struct tova_traits : policy_traits_base {
  static constexpr const char* name = "tova";
  using config_type = tova_config;
  template <class T, class Q>
  using policy = tova<T, Q>;
  static constexpr bool chunkable = true;
  static constexpr bool on_gpu = true;  // the batched scoring, then cuda::head_mean_scores

  static constexpr policy_kind kind = static_cast<policy_kind>(6);  // its index in default_policies
  static const config_type& config(const policy_config& p) noexcept { return p.config<tova_traits>(); }
  template <class O>
  static status check(O* o, std::int64_t* window, const char* fn) noexcept {
    const config_type& c = config(o->policy);
    if (c.protected_tail < 1)
      return status::error(errc::invalid_argument, fn, "policy.tova.protected_tail", "expected >= 1, got %lld",
                           static_cast<long long>(c.protected_tail));
    KVEVICT_RETURN_IF_ERROR(detail::check_protected_mode(c.protect, fn, "policy.tova.protect"));
    // The score averages every query head of the layer; a rank holding part of them would
    // average a different set than its peers and the ranks' keep sets would disagree.
    if (o->tensor_parallel != nullptr)
      return status::error(errc::unsupported, fn, "tensor_parallel",
                           "tova averages every query head of the layer, which no rank holds");
    *window = 1;  // the last prompt query
    return status();
  }
  static selection_params largest_selection(const config_type& c) noexcept { return {c.protected_tail, c.protect}; }
};

namespace policy {
/// A compressor's policy: tova configured by `c`.
inline policy_config tova(const tova_config& c = {}) noexcept {
  return policy_config::of<tova_traits>(c);
}
}  // namespace policy

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_TOVA_TRAITS_HPP
