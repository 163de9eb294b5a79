// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_CHUNKKV_HPP
#define KVEVICT_POLICIES_CHUNKKV_HPP

// ChunkKV: keep whole chunks of consecutive tokens instead of single tokens, the same
// chunks for every KV head. Wraps any scoring policy: its token scores are summed over KV
// heads, averaged per chunk of `chunk_length` candidates (the last chunk may be shorter),
// and every token of a chunk gets the chunk's score in every head. The shared selection
// then takes chunks in score order; when the budget ends inside a chunk, that chunk's
// earliest tokens are kept (kvevict's rule: budgets are exact in tokens, where kvpress
// keeps only whole chunks).

#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/policies/layer_inputs.hpp"
#include "kvevict/policies/scoring_policy.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

struct chunkkv_config {
  std::int64_t chunk_length = 20;  ///< kvpress's default
};

template <class Base>
class chunkkv : public scoring_policy<chunkkv<Base>, typename Base::storage_type, typename Base::query_type> {
 public:
  static constexpr const char* evict_name = "kvevict::chunkkv::evict";
  using storage_type = typename Base::storage_type;
  using query_type = typename Base::query_type;
  using config_type = chunkkv_config;

  explicit chunkkv(const Base& base, const chunkkv_config& config = {}) : base_(base), config_(config) {}
  const Base& base() const noexcept { return base_; }
  const chunkkv_config& config() const noexcept { return config_; }

  std::size_t workspace_size(const layer_shape& shape, const executor& exec = {}) const noexcept {
    return base_.workspace_size(shape, exec);
  }
  selection_params selection() const noexcept { return base_.selection(); }

  status score(const layer_inputs<storage_type, query_type>& in, score_view scores, workspace_span ws,
               const executor& exec = {}) const {
    if (config_.chunk_length < 1)
      return status::error(errc::invalid_argument, "kvevict::chunkkv::score", "config.chunk_length",
                           "expected >= 1, got %lld", static_cast<long long>(config_.chunk_length));
    KVEVICT_RETURN_IF_ERROR(base_.score(in, scores, ws, exec));
    const selection_params sel = base_.selection();
    const std::int64_t tokens = scores.cols;
    const std::int64_t candidates = tokens > sel.protected_tail ? tokens - sel.protected_tail : 0;
    for (std::int64_t c0 = 0; c0 < candidates; c0 += config_.chunk_length) {
      const std::int64_t c1 = c0 + config_.chunk_length < candidates ? c0 + config_.chunk_length : candidates;
      float sum = 0.0f;
      for (std::int64_t h = 0; h < scores.rows; ++h)
        for (std::int64_t j = c0; j < c1; ++j) sum += scores.at(h, j);
      const float chunk_score = sum / static_cast<float>(c1 - c0);
      for (std::int64_t h = 0; h < scores.rows; ++h)
        for (std::int64_t j = c0; j < c1; ++j) scores.at(h, j) = chunk_score;
    }
    return status();
  }

 private:
  Base base_;
  chunkkv_config config_;
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_CHUNKKV_HPP
