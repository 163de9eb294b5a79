// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_SCORING_PRESETS_HPP
#define KVEVICT_SCORING_PRESETS_HPP

// Named presets that pin peer implementations' conventions for prompt-window scoring
// (design.md §4; sources in docs/peer-conventions.md). Each returns a
// window_config: the observation window W the engine should collect (its last W prompt
// queries), the scoring parameters, and how the protected window counts in the budget.

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/selection/budget.hpp"

KVEVICT_NAMESPACE_BEGIN

/// Configuration of prompt-window scoring (SnapKV family). The last `window` tokens are
/// protected: always kept, inside or on top of the budget.
struct window_config {
  std::int64_t window = 64;
  scoring_params scoring;
  protected_mode protect = protected_mode::inside_budget;

  /// Scoring parameters with the protected tail set to the window.
  constexpr scoring_params params() const noexcept {
    scoring_params p = scoring;
    p.protected_tail = window;
    return p;
  }
  constexpr selection_params selection() const noexcept { return {window, protect}; }
};

namespace presets {

/// NVIDIA kvpress SnapKVPress: W = 64, avg pool k = 5 counting padding, mean over the window,
/// GQA mean after pooling, window kept inside the budget.
constexpr window_config kvpress_snapkv() noexcept {
  window_config c;
  c.window = 64;
  c.scoring.domain = softmax_domain::visible;
  c.scoring.window = window_aggregation::mean;
  c.scoring.gqa = gqa_reduction::mean;
  c.scoring.order = gqa_order::after_pooling;
  c.scoring.pool = {pooling_kind::avg, 5, true};
  c.protect = protected_mode::inside_budget;
  return c;
}

/// The SnapKV paper's reference: W = 32, max pool k = 7, sum over the window, pooled per
/// query head then averaged over the group, window kept on top of the budget.
constexpr window_config snapkv_paper() noexcept {
  window_config c;
  c.window = 32;
  c.scoring.domain = softmax_domain::visible;
  c.scoring.window = window_aggregation::sum;
  c.scoring.gqa = gqa_reduction::mean;
  c.scoring.order = gqa_order::after_pooling;
  c.scoring.pool = {pooling_kind::max, 7, true};
  c.protect = protected_mode::on_top_of_budget;
  return c;
}

/// KVCache-Factory (PyramidKV repository) LongBench setting: W = 8, max pool k = 7, sum over
/// the window, GQA mean before pooling, window on top of the budget.
constexpr window_config kvcache_factory_longbench() noexcept {
  window_config c;
  c.window = 8;
  c.scoring.domain = softmax_domain::visible;
  c.scoring.window = window_aggregation::sum;
  c.scoring.gqa = gqa_reduction::mean;
  c.scoring.order = gqa_order::before_pooling;
  c.scoring.pool = {pooling_kind::max, 7, true};
  c.protect = protected_mode::on_top_of_budget;
  return c;
}

/// AdaKV reference (GQA support): W = 32, max pool k = 7, mean over the window, GQA mean
/// before pooling, window on top of the (per-head) budget.
constexpr window_config adakv() noexcept {
  window_config c;
  c.window = 32;
  c.scoring.domain = softmax_domain::visible;
  c.scoring.window = window_aggregation::mean;
  c.scoring.gqa = gqa_reduction::mean;
  c.scoring.order = gqa_order::before_pooling;
  c.scoring.pool = {pooling_kind::max, 7, true};
  c.protect = protected_mode::on_top_of_budget;
  return c;
}

}  // namespace presets
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_SCORING_PRESETS_HPP
