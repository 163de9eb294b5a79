// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_POLICY_TRAITS_HPP
#define KVEVICT_POLICIES_POLICY_TRAITS_HPP

// What the compressors need to know about a policy besides its class: how its configuration is
// read from a policy_config and checked, what it observes, and the hooks of its lifecycle. A
// policy's traits (policies/<name>_traits.hpp) derive from policy_traits_base and hide the
// members that differ; the compressors read them through the list of policies they serve
// (policies/policy_list.hpp), never by naming a policy. Light: no scoring code, so the plan's
// checks (compressor/plan.hpp) and the CUDA compressor's host side include it freely.
//
// The hooks are templates over the options, the configuration holder and the policy object:
// a policy's traits need neither compressor_options nor the policy's (heavy) class to be
// complete where they are declared, only where the compressor calls them.

#include <cstddef>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policies/configs.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/selection/budget.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {
inline status check_protected_mode(protected_mode mode, const char* fn, const char* arg) noexcept {
  if (static_cast<unsigned>(mode) > 1u)
    return status::error(errc::invalid_argument, fn, arg, "expected a protected_mode value, got %d",
                         static_cast<int>(mode));
  return status();
}
}  // namespace detail

/// The defaults of a policy's traits: a stateless policy that scores with its score() and
/// observes the last queries of the prompt.
struct policy_traits_base {
  /// ChunkKV (policy_config::chunk_length) may average its scores per chunk.
  static constexpr bool chunkable = false;
  /// Whether scoring reads observation queries (false: the compressor checks none) and keys.
  static constexpr bool reads_queries = true;
  static constexpr bool reads_keys = true;
  /// The prefill observation is every prompt query rather than the last window of them.
  static constexpr bool every_prompt_query = false;
  /// A deferred policy observes into per-sequence state and evicts later (decide()'s
  /// lifecycle); its class offers deferkv's state calls. A list holds at most one.
  static constexpr bool deferred = false;
  /// An engine log-sum-exp may stand in for the policy's normaliser (not where the policy
  /// normalises its own observations, DeferKV, or over other keys or queries than the engine's
  /// attention, DapQ).
  static constexpr bool accepts_lse = true;
  /// After eviction the next position is the scored length, not past the cache's last token
  /// (DapQ's pseudo tokens are dropped, so their positions are used again).
  static constexpr bool reuses_positions = false;
  /// The CUDA compressor implements it (a policy that reads no queries through its
  /// cuda::detail::key_scorer, cuda/detail/key_scorers.cuh).
  static constexpr bool on_gpu = false;

  /// The softmax domain its scores normalise over (an engine LSE covers `visible`).
  template <class C>
  static softmax_domain domain(const C&) noexcept {
    return softmax_domain::visible;
  }
  /// prefill_end needs exactly observation_window() queries, however short the prompt.
  template <class C>
  static bool fixed_window(const C&) noexcept {
    return false;
  }
  /// Tokens the scores cover for a cache of `tokens` observed by `queries` queries.
  template <class P>
  static std::int64_t scored_tokens(const P&, std::int64_t tokens, std::int64_t) noexcept {
    return tokens;
  }
  /// The sequence scope's scoring: its workspace, and the layer's scores [Hkv, scored].
  template <class P, class Shape, class Exec>
  static std::size_t score_workspace_size(const P& policy, const Shape& shape, const Exec& exec) noexcept {
    return policy.workspace_size(shape, exec);
  }
  template <class P, class Cache, class Observations, class Out, class Span, class Exec>
  static status score_layer(const P& policy, const Cache& cache, const Observations& o, Out out, Span ws,
                            const Exec& exec) {
    return policy.score(inputs_of(cache, o), out, ws, exec);
  }
  /// Sequence s's prefill observation beyond the shapes every policy checks (`tokens`: the
  /// keys' count; `q`: the queries it observes with).
  template <class P, class QueryView>
  static status check_observation(const P&, std::int64_t, const QueryView&, std::int64_t, const char*) noexcept {
    return status();
  }
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_POLICY_TRAITS_HPP
