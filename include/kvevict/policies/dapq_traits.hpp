// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_DAPQ_TRAITS_HPP
#define KVEVICT_POLICIES_DAPQ_TRAITS_HPP

// DapQ's place in the compressors (policies/policy_traits.hpp); the policy itself is
// policies/dapq.hpp. Its observation window is N pseudo tokens after the prompt (or the
// prompt's last N queries re-rotated): the scores cover the prompt only, the pseudo tokens are
// evicted and their positions used again.

#include <cstddef>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/detail/in_sequence.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policies/configs.hpp"
#include "kvevict/policies/policy_config.hpp"
#include "kvevict/policies/policy_traits.hpp"
#include "kvevict/rope/rope.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/selection/budget.hpp"

KVEVICT_NAMESPACE_BEGIN

template <class T, class Q>
class dapq;

struct dapq_traits : policy_traits_base {
  static constexpr const char* name = "dapq";
  using config_type = dapq_config;
  template <class T, class Q>
  using policy = dapq<T, Q>;
  static constexpr bool reuses_positions = true;
  static constexpr bool on_gpu = true;  // both sources (the re-rotated window by cuda::dapq_rerotate)
  /// Its softmax covers the prompt's keys only, for queries the engine's attention did not
  /// normalise that way (the pseudo tokens also see each other; the re-rotated window is moved):
  /// an engine LSE would be another normaliser, so it is refused.
  static constexpr bool accepts_lse = false;

  static constexpr policy_kind kind = policy_kind::dapq;  // its index in default_policies
  static const config_type& config(const policy_config& p) noexcept { return p.config<dapq_traits>(); }
  template <class O>
  static status check(O* o, std::int64_t* window, const char* fn) noexcept {
    const config_type& c = config(o->policy);
    const auto& m = o->model;
    if (c.pseudo_tokens < 1)
      return status::error(errc::invalid_argument, fn, "policy.dapq.pseudo_tokens", "expected >= 1, got %lld",
                           static_cast<long long>(c.pseudo_tokens));
    KVEVICT_RETURN_IF_ERROR(detail::check_protected_mode(c.protect, fn, "policy.dapq.protect"));
    KVEVICT_RETURN_IF_ERROR(detail::validate_scoring_params(c.scoring, fn));
    if (c.scoring.window == window_aggregation::weighted)
      return status::error(errc::unsupported, fn, "policy.dapq.scoring.window",
                           "weighted aggregation needs per-call weights; use the building blocks");
    if (static_cast<unsigned>(c.source) > 1u)
      return status::error(errc::invalid_argument, fn, "policy.dapq.source", "expected a dapq_source value, got %d",
                           static_cast<int>(c.source));
    if (c.source == dapq_source::rerotated_window) {
      KVEVICT_RETURN_IF_ERROR(validate_rope_config(c.rope, fn));
      if (c.rope.head_dim != m.head_dim)
        return status::error(errc::invalid_shape, fn, "policy.dapq.rope.head_dim",
                             "expected model.head_dim = %lld, got %lld", static_cast<long long>(m.head_dim),
                             static_cast<long long>(c.rope.head_dim));
      if (m.head_dim > 1024)
        return status::error(errc::unsupported, fn, "model.head_dim", "re-rotation supports head_dim <= 1024, got %lld",
                             static_cast<long long>(m.head_dim));
    }
    *window = c.pseudo_tokens;
    return status();
  }
  static selection_params largest_selection(const config_type& c) noexcept {
    return {c.scoring.protected_tail, c.protect};
  }
  static softmax_domain domain(const config_type& c) noexcept { return c.scoring.domain; }
  /// The pseudo tokens are the window: all N of them, whatever the prompt's length.
  static bool fixed_window(const config_type& c) noexcept { return c.source == dapq_source::pseudo_tokens; }

  template <class P>
  static std::int64_t scored_tokens(const P& policy, std::int64_t tokens, std::int64_t queries) noexcept {
    return policy.prompt_tokens(tokens, queries);
  }
  template <class P, class Shape, class Exec>
  static std::size_t score_workspace_size(const P& policy, const Shape& shape, const Exec& exec) noexcept {
    return policy.score_window_workspace_size(shape, exec);
  }
  /// Its score() takes no cache: the window's queries are rotated or read from it first.
  template <class P, class Cache, class Observations, class Out, class Span, class Exec>
  static status score_layer(const P& policy, const Cache& cache, const Observations& o, Out out, Span ws,
                            const Exec& exec) {
    return policy.score_window(cache, o, out, ws, exec);
  }
  template <class P, class QueryView>
  static status check_observation(const P& policy, std::int64_t tokens, const QueryView& q, std::int64_t s,
                                  const char* fn) noexcept {
    const std::int64_t prompt = policy.prompt_tokens(tokens, q.num_queries);
    if (prompt < 0)
      return status::error(errc::invalid_shape, fn, detail::io_name(s, "keys.num_tokens"),
                           "expected the prompt and its %lld pseudo tokens, got %lld",
                           static_cast<long long>(q.num_queries), static_cast<long long>(tokens));
    if (policy.config().source == dapq_source::pseudo_tokens)
      for (std::int64_t t = 0; t < q.num_queries; ++t)
        if (q.positions[t] < prompt)
          return status::error(errc::out_of_range, fn, detail::io_name(s, "queries.positions"),
                               "expected pseudo-token positions >= the prompt length %lld, got %lld",
                               static_cast<long long>(prompt), static_cast<long long>(q.positions[t]));
    return status();
  }
};

namespace policy {
/// A compressor's policy: dapq configured by `c`.
inline policy_config dapq(const dapq_config& c = {}) noexcept {
  return policy_config::of<dapq_traits>(c);
}
}  // namespace policy

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_DAPQ_TRAITS_HPP
