// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DETAIL_KEY_SCORERS_CUH
#define KVEVICT_CUDA_DETAIL_KEY_SCORERS_CUH

// The GPU compressor's hookup of the policies that score without queries: one specialisation
// per policy's traits, naming the kernel that writes its scores (cuda/key_scores.cuh). A
// policy that reads no queries and states on_gpu in its traits needs one (the compressor
// asserts it); the compressor visits its list and calls it, with no switch over kinds. A
// scorer states the device workspace it needs for the largest layer (the compressor's plan
// reserves it; sequences are scored one after another on the stream, so they share it).

#include <cstddef>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/key_scores.cuh"
#include "kvevict/cuda/keydiff_scores.cuh"
#include "kvevict/error.hpp"
#include "kvevict/policies/keydiff_traits.hpp"
#include "kvevict/policies/knorm_traits.hpp"
#include "kvevict/policies/policy_list.hpp"
#include "kvevict/policies/streaming_llm_traits.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// Traits without a GPU scorer of their own.
template <class Traits>
struct key_scorer {
  static constexpr bool exists = false;
};

template <>
struct key_scorer<knorm_traits> {
  static constexpr bool exists = true;
  static std::size_t workspace_size(const layer_shape&) noexcept { return 0; }
  template <class T>
  static status enqueue(const knorm_config& c, const cache_view<const T>& keys, score_view scores, workspace_span,
                        const launch_options& opt) noexcept {
    return key_norm_scores(keys, c.protected_tail, scores, opt);
  }
};

template <>
struct key_scorer<streaming_llm_traits> {
  static constexpr bool exists = true;
  static std::size_t workspace_size(const layer_shape&) noexcept { return 0; }
  template <class T>
  static status enqueue(const streaming_llm_config& c, const cache_view<const T>&, score_view scores, workspace_span,
                        const launch_options& opt) noexcept {
    return streaming_scores(c.sinks, scores, opt);
  }
};

template <>
struct key_scorer<keydiff_traits> {
  static constexpr bool exists = true;
  static std::size_t workspace_size(const layer_shape& s) noexcept {
    return keydiff_scores_workspace_size(s.num_kv_heads, s.num_tokens, s.head_dim);
  }
  template <class T>
  static status enqueue(const keydiff_config& c, const cache_view<const T>& keys, score_view scores, workspace_span ws,
                        const launch_options& opt) noexcept {
    return keydiff_scores(keys, c.protected_tail, scores, ws, opt);
  }
};

/// Whether every policy of the list that the GPU serves without queries or state has a scorer.
template <class... Ts>
constexpr bool key_scorers_complete(policy_list<Ts...>) noexcept {
  return (true && ... && (!Ts::on_gpu || Ts::deferred || Ts::reads_queries || key_scorer<Ts>::exists));
}
static_assert(key_scorers_complete(default_policies{}),
              "a policy that states on_gpu and reads no queries needs a cuda::detail::key_scorer");

}  // namespace detail
}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_DETAIL_KEY_SCORERS_CUH
