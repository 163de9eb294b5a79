// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_CONFIGS_HPP
#define KVEVICT_POLICIES_CONFIGS_HPP

// Every policy's configuration as plain values, apart from the policies themselves: what
// compressor_options holds and what the CUDA header's compressor reads, without the CPU
// scoring code the policy headers bring (window_config, SnapKV's, is in scoring/presets.hpp).

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/rope/rope.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/selection/budget.hpp"

KVEVICT_NAMESPACE_BEGIN

struct streaming_llm_config {
  std::int64_t sinks = 4;  ///< kvpress's default
};

struct knorm_config {
  std::int64_t protected_tail = 0;  ///< last tokens always kept (scored +inf)
  protected_mode protect = protected_mode::inside_budget;
};

struct h2o_config {
  std::int64_t recent_window = 0;  ///< protected tail: the most recent tokens are always kept
  protected_mode protect = protected_mode::inside_budget;
  gqa_reduction gqa = gqa_reduction::mean;

  constexpr scoring_params params() const noexcept {
    scoring_params p;
    p.domain = softmax_domain::visible;
    p.window = window_aggregation::visible_mean;
    p.gqa = gqa;
    p.order = gqa_order::before_pooling;
    p.pool = {pooling_kind::none, 1, true};
    p.protected_tail = recent_window;
    return p;
  }
};

/// The largest DeferKV window (its prefill weights live on the stack); plan refuses more.
constexpr std::int64_t deferkv_max_window = 4096;

struct deferkv_config {
  std::int64_t window = 32;        ///< W prompt queries observed at the end of prefill (protected)
  std::int64_t delay = 1;          ///< d decode steps observed before eviction (the paper's 1..4)
  double eta = 0.9;                ///< temporal discount in (0, 1] (kvevict's default; see docs)
  bool decode_feedback = true;     ///< false: ready at the end of prefill (the paper's ablation)
  bool temporal_weighting = true;  ///< false: every observation weighs 1 (the paper's ablation)
  softmax_domain domain = softmax_domain::visible;
  gqa_reduction gqa = gqa_reduction::mean;  ///< mean or sum: the state is per KV head
  pooling pool = {pooling_kind::max, 7, true};
  protected_mode protect = protected_mode::on_top_of_budget;

  /// The scoring parameters the state applies (GQA is reduced per observation, i.e. before pooling).
  constexpr scoring_params params() const noexcept {
    scoring_params p;
    p.domain = domain;
    p.window = window_aggregation::weighted;
    p.gqa = gqa;
    p.order = gqa_order::before_pooling;
    p.pool = pool;
    p.protected_tail = window;
    return p;
  }
  constexpr double effective_eta() const noexcept { return temporal_weighting ? eta : 1.0; }
};

/// Where DapQ's observation window comes from.
enum class dapq_source : std::int32_t {
  pseudo_tokens,     ///< the paper: N pseudo tokens prefilled after the prompt; their queries observe
  rerotated_window,  ///< kvevict's variant: the last N post-RoPE prompt queries rotated N positions on
};

struct dapq_config {
  std::int64_t pseudo_tokens = 32;  ///< N
  std::int64_t first = 8;           ///< m: leading prompt tokens in the pseudo content (Llama)
  std::int64_t last = 24;           ///< n: trailing prompt tokens (m + n = N)
  /// Scoring of the pseudo window over prompt keys (no prompt tail is protected by default:
  /// the window is the pseudo tokens, which are all evicted).
  scoring_params scoring = {softmax_domain::visible,   window_aggregation::mean,     gqa_reduction::mean,
                            gqa_order::before_pooling, {pooling_kind::max, 7, true}, 0};
  protected_mode protect = protected_mode::inside_budget;
  /// evict()'s observation window: pseudo-token queries, or the prompt's last queries
  /// re-rotated (then `rope` describes the model's RoPE).
  dapq_source source = dapq_source::pseudo_tokens;
  rope_config rope;
};

namespace detail {
/// DeferKV's configuration checks (deferkv::check_config; the compressors' plans).
inline status check_deferkv_config(const deferkv_config& c, const char* fn) noexcept {
  if (c.window < 0)
    return status::error(errc::invalid_argument, fn, "config.window", "expected >= 0, got %lld",
                         static_cast<long long>(c.window));
  if (c.delay < 0)
    return status::error(errc::invalid_argument, fn, "config.delay", "expected >= 0, got %lld",
                         static_cast<long long>(c.delay));
  if (!(c.eta > 0.0 && c.eta <= 1.0))
    return status::error(errc::invalid_argument, fn, "config.eta", "expected eta in (0, 1], got %g", c.eta);
  if (c.gqa == gqa_reduction::max)
    return status::error(errc::unsupported, fn, "config.gqa",
                         "the running state is per KV head, so GQA must be reduced linearly (mean or sum)");
  return validate_scoring_params(c.params(), fn);
}
}  // namespace detail

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_CONFIGS_HPP
