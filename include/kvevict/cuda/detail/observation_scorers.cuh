// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DETAIL_OBSERVATION_SCORERS_CUH
#define KVEVICT_CUDA_DETAIL_OBSERVATION_SCORERS_CUH

// The GPU compressor's hookup of the policies that score from queries: one specialisation per
// policy's traits, naming the observation parameters its kernels run with (the batched scoring
// for SnapKV, H2O and DapQ; DeferKV's observation and finalisation) and refusing, at plan, a
// configuration the GPU does not implement. A policy that reads
// queries and states on_gpu in its traits needs one (asserted below); the compressor visits
// its list, with no switch over kinds. `rerotation` names the RoPE that moves the window's
// queries before scoring (DapQ's re-rotated window: cuda/rerotate.cuh), or none; `finish`
// enqueues what follows the batched scoring (TOVA's mean across KV heads), or nothing;
// `checks_positions` says whether the query positions must lie at or after the scored prompt
// (DapQ's pseudo tokens and its re-rotated window: the CPU refuses them; positions are device
// data, so the device checks them with pseudo_positions_kernel). Policies that read no queries: key_scorers.cuh.

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/detail/launch.cuh"
#include "kvevict/cuda/device_flags.hpp"
#include "kvevict/cuda/head_mean_scores.cuh"
#include "kvevict/error.hpp"
#include "kvevict/policies/configs.hpp"
#include "kvevict/policies/dapq_traits.hpp"
#include "kvevict/policies/deferkv_traits.hpp"
#include "kvevict/policies/h2o_traits.hpp"
#include "kvevict/policies/policy_list.hpp"
#include "kvevict/policies/snapkv_traits.hpp"
#include "kvevict/policies/tova_traits.hpp"
#include "kvevict/rope/rope.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/views/index_ptr.hpp"
#include "kvevict/views/matrix_view.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// Positions of N queries below `prompt` raise flag_query_position in the call's cancel word
/// (which cancels the layer's keep-list outputs and compaction) and in the caller's flags.
template <int Unused = 0>
__global__ void pseudo_positions_kernel(index_ptr positions, std::int64_t n, std::int64_t prompt, std::uint32_t* cancel,
                                        std::uint32_t* flags) {
  for (std::int64_t t = threadIdx.x; t < n; t += blockDim.x)
    if (positions[t] < prompt) {
      atomicOr(cancel, flag_query_position);
      raise_flag(flags, flag_query_position);
    }
}

inline status enqueue_position_check(index_ptr positions, std::int64_t n, std::int64_t prompt, std::uint32_t* cancel,
                                     const launch_options& opt, const char* fn) {
  return launch(fn, "pseudo_positions_kernel", {dim3(1), dim3(128), 0, opt.stream}, pseudo_positions_kernel<>,
                positions, n, prompt, cancel, opt.device_flags);
}

/// Traits without a GPU observation scoring of their own.
template <class Traits>
struct observation_scorer {
  static constexpr bool exists = false;
};

template <>
struct observation_scorer<snapkv_traits> {
  static constexpr bool exists = true;
  static scoring_params params(const window_config& c) noexcept { return c.params(); }
  static status plan_check(const window_config&, const char*) noexcept { return status(); }
  static bool rerotation(const window_config&, rope_config*) noexcept { return false; }
  static bool checks_positions(const window_config&) noexcept { return false; }
  static status finish(const window_config&, score_view, std::int64_t, const launch_options&) { return status(); }
};

template <>
struct observation_scorer<h2o_traits> {  // every prompt query, visible_mean, the recent tokens protected
  static constexpr bool exists = true;
  static scoring_params params(const h2o_config& c) noexcept { return c.params(); }
  static status plan_check(const h2o_config&, const char*) noexcept { return status(); }
  static bool rerotation(const h2o_config&, rope_config*) noexcept { return false; }
  static bool checks_positions(const h2o_config&) noexcept { return false; }
  static status finish(const h2o_config&, score_view, std::int64_t, const launch_options&) { return status(); }
};

template <>
struct observation_scorer<dapq_traits> {  // pseudo tokens over the prompt before them, or the re-rotated window
  static constexpr bool exists = true;
  static scoring_params params(const dapq_config& c) noexcept { return c.scoring; }
  static status plan_check(const dapq_config&, const char*) noexcept { return status(); }
  static bool rerotation(const dapq_config& c, rope_config* rope) noexcept {
    if (c.source != dapq_source::rerotated_window) return false;
    *rope = c.rope;
    return true;
  }
  // Its queries' positions at or after the prompt: the pseudo tokens', or the window's once moved
  // N positions on (the CPU's dapq::score refuses either below the prompt).
  static bool checks_positions(const dapq_config&) noexcept { return true; }
  static status finish(const dapq_config&, score_view, std::int64_t, const launch_options&) { return status(); }
};

template <>
struct observation_scorer<deferkv_traits> {  // observation_state, decode_observation, finalize_state_scores
  static constexpr bool exists = true;
  static scoring_params params(const deferkv_config& c) noexcept { return c.params(); }
  static status plan_check(const deferkv_config&, const char*) noexcept { return status(); }
  static bool rerotation(const deferkv_config&, rope_config*) noexcept { return false; }
  static bool checks_positions(const deferkv_config&) noexcept { return false; }
  static status finish(const deferkv_config&, score_view, std::int64_t, const launch_options&) { return status(); }
};

template <>
struct observation_scorer<tova_traits> {  // the last prompt query, then the mean across KV heads
  static constexpr bool exists = true;
  static scoring_params params(const tova_config& c) noexcept { return c.params(); }
  static status plan_check(const tova_config&, const char*) noexcept { return status(); }
  static bool rerotation(const tova_config&, rope_config*) noexcept { return false; }
  static bool checks_positions(const tova_config&) noexcept { return false; }
  static status finish(const tova_config&, score_view scores, std::int64_t protected_tail, const launch_options& opt) {
    return cuda::head_mean_scores(scores, protected_tail, opt);
  }
};

/// Whether every policy of the list that the GPU serves from queries has its parameters here.
template <class... Ts>
constexpr bool observation_scorers_complete(policy_list<Ts...>) noexcept {
  return (true && ... && (!Ts::on_gpu || !Ts::reads_queries || observation_scorer<Ts>::exists));
}
static_assert(observation_scorers_complete(default_policies{}),
              "a policy that states on_gpu and reads queries needs a cuda::detail::observation_scorer");

}  // namespace detail
}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_DETAIL_OBSERVATION_SCORERS_CUH
