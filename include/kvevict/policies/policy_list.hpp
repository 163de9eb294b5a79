// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_POLICY_LIST_HPP
#define KVEVICT_POLICIES_POLICY_LIST_HPP

// The policies a compressor serves, as a compile-time list of their traits
// (policies/policy_traits.hpp). A policy's kind (policy_config::kind) is its index in the
// list; the compressors dispatch by walking the list, so a new policy is its header, its
// traits and one entry here (docs/adding-a-policy.md). Light: traits only, no scoring code.

#include <cstddef>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/policies/dapq_traits.hpp"
#include "kvevict/policies/deferkv_traits.hpp"
#include "kvevict/policies/h2o_traits.hpp"
#include "kvevict/policies/keydiff_traits.hpp"
#include "kvevict/policies/knorm_traits.hpp"
#include "kvevict/policies/policy_config.hpp"
#include "kvevict/policies/policy_traits.hpp"
#include "kvevict/policies/snapkv_traits.hpp"
#include "kvevict/policies/streaming_llm_traits.hpp"
#include "kvevict/policies/tova_traits.hpp"

KVEVICT_NAMESPACE_BEGIN

template <class... Traits>
struct policy_list {
  static constexpr std::size_t size = sizeof...(Traits);
};

/// kvevict's policies, in the order of policy_kind (options.hpp asserts that they agree).
using default_policies = policy_list<streaming_llm_traits, knorm_traits, h2o_traits, snapkv_traits, deferkv_traits,
                                     dapq_traits, tova_traits, keydiff_traits>;

namespace detail {
template <class Traits, class... Ts>
constexpr std::size_t index_of(policy_list<Ts...>) noexcept {
  constexpr bool same[] = {std::is_same<Traits, Ts>::value..., false};
  std::size_t i = 0;
  while (i < sizeof...(Ts) && !same[i]) ++i;
  return i;
}

/// f(Traits{}) for the traits at index `kind` of the list; `fallback` for an index outside it
/// (an unchecked policy_config::kind).
template <class R, class... Ts, class F>
R visit_policy(policy_list<Ts...>, std::size_t kind, R fallback, F&& f) {
  std::size_t i = 0;
  (void)((i++ == kind ? (fallback = f(Ts{}), true) : false) || ...);
  return fallback;
}

/// f(Traits{}) for every policy of the list, in order.
template <class... Ts, class F>
void for_each_policy(policy_list<Ts...>, F&& f) {
  ((void)f(Ts{}), ...);  // a fold over the comma operator (clang 14 rejects (void)(f(Ts{}), ...))
}

template <class... Ts>
struct deferred_policy;
template <>
struct deferred_policy<> {
  using type = void;
};
template <class T, class... Ts>
struct deferred_policy<T, Ts...> {
  using type = std::conditional_t<T::deferred, T, typename deferred_policy<Ts...>::type>;
};
template <class List>
struct deferred_of;
/// The list's deferred policy (void if none): the compressors' state lifecycle serves one.
template <class... Ts>
struct deferred_of<policy_list<Ts...>> {
  static_assert((0 + ... + (Ts::deferred ? 1 : 0)) <= 1, "a policy list holds at most one deferred policy");
  using type = typename deferred_policy<Ts...>::type;
};
/// The list's deferred traits (void if it has none) and whether it has one.
template <class List>
using deferred_traits_t = typename deferred_of<List>::type;
template <class List>
constexpr bool has_deferred_v = !std::is_void<deferred_traits_t<List>>::value;

/// f(Traits{}) for the traits of `List` whose kind (index in default_policies) is `kind`;
/// `fallback` when the list does not hold it. An engine's own list (a subset, any order) is
/// visited by the kinds of policy_config, so options mean the same under every list.
template <class R, class... Ts, class F>
R visit_listed(policy_list<Ts...>, std::size_t kind, R fallback, F&& f) {
  (void)((index_of<Ts>(default_policies{}) == kind ? (fallback = f(Ts{}), true) : false) || ...);
  return fallback;
}

/// Whether `List` holds the policy of kind `kind`.
template <class... Ts>
constexpr bool lists_kind(policy_list<Ts...>, std::size_t kind) noexcept {
  return (false || ... || (index_of<Ts>(default_policies{}) == kind));
}
}  // namespace detail

/// A policy's index in a list.
template <class Traits, class List = default_policies>
constexpr std::size_t policy_index_v = detail::index_of<Traits>(List{});

/// A policy's kind (policy_config::kind()): its index in default_policies, which its traits state.
template <class Traits>
constexpr policy_kind policy_kind_of() noexcept {
  return Traits::kind;
}

namespace detail {
template <class... Ts>
constexpr bool kinds_are_indices(policy_list<Ts...> l) noexcept {
  return (true && ... && (static_cast<std::size_t>(Ts::kind) == index_of<Ts>(l)));
}
}  // namespace detail
static_assert(detail::kinds_are_indices(default_policies{}),
              "each policy's traits state its index in default_policies as its kind");

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_POLICY_LIST_HPP
