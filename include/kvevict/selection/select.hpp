// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_SELECTION_SELECT_HPP
#define KVEVICT_SELECTION_SELECT_HPP

// The one selection every policy shares (design.md §6): scores [Hkv, L] and a budget
// in, per-head ascending keep-lists out. Exact top-B per head; deterministic (equal scores:
// smaller index wins; NaN ranks below every number); the protected tail is always kept.

#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvevict/config.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/detail/topk.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

namespace detail {
inline void carve_select_layout(arena& a, std::int64_t num_tokens, int workers, topk_scratch** out) noexcept {
  *out = a.take<topk_scratch>(workers);
  for (int w = 0; w < workers; ++w) {
    topk_scratch s;
    carve_topk_scratch(a, num_tokens, &s);
    if (*out != nullptr) (*out)[w] = s;
  }
}

inline status select_impl(const const_score_view& scores, const std::int64_t* head_budgets, std::int64_t uniform,
                          const selection_params& params, const keep_list_view& out, workspace_span ws,
                          const executor& exec) {
  static constexpr const char* fn = "kvevict::select";
  if (scores.rows < 1)
    return status::error(errc::invalid_shape, fn, "scores.rows", "expected >= 1 KV head, got %lld",
                         static_cast<long long>(scores.rows));
  KVEVICT_RETURN_IF_ERROR(validate_matrix_view(scores, scores.rows, scores.cols, fn, "scores"));
  if (scores.cols < 0)
    return status::error(errc::invalid_shape, fn, "scores.cols", "expected >= 0, got %lld",
                         static_cast<long long>(scores.cols));
  if (scores.cols > static_cast<std::int64_t>(std::numeric_limits<std::uint32_t>::max()))
    return status::error(errc::overflow, fn, "scores.cols", "expected fewer than 2^32 tokens per row, got %lld",
                         static_cast<long long>(scores.cols));
  KVEVICT_RETURN_IF_ERROR(detail::check_selection_params(params, fn));
  const std::int64_t heads = scores.rows, tokens = scores.cols;
  if (out.num_heads != heads)
    return status::error(errc::invalid_shape, fn, "out.num_heads", "expected %lld (scores.rows), got %lld",
                         static_cast<long long>(heads), static_cast<long long>(out.num_heads));
  if (out.offsets == nullptr) return status::error(errc::null_pointer, fn, "out.offsets", "expected non-null");
  std::int64_t total = 0;
  for (std::int64_t h = 0; h < heads; ++h) {
    const std::int64_t b = head_budgets != nullptr ? head_budgets[h] : uniform;
    if (b < 0) {
      if (head_budgets != nullptr) {
        char name[status::max_argument];
        std::snprintf(name, sizeof(name), "head_budgets[%lld]", static_cast<long long>(h));
        return status::error(errc::invalid_argument, fn, name, "expected >= 0, got %lld", static_cast<long long>(b));
      }
      return status::error(errc::invalid_argument, fn, "budget", "expected >= 0 tokens, got %lld",
                           static_cast<long long>(b));
    }
    total += tokens_kept(b, tokens, params);
  }
  if (total > out.capacity)
    return status::error(errc::invalid_keep_list, fn, "out.capacity", "expected >= %lld kept tokens, got %lld",
                         static_cast<long long>(total), static_cast<long long>(out.capacity));
  if (total > 0 && out.indices == nullptr)
    return status::error(errc::null_pointer, fn, "out.indices", "expected non-null");

  const int workers = exec.workers();
  arena a(ws);
  topk_scratch* scratch = nullptr;
  carve_select_layout(a, tokens, workers, &scratch);
  if (a.overflowed())
    return status::error(errc::workspace_too_small, fn, "ws",
                         "expected at least %zu bytes (select_workspace_size), got %zu", a.used(), ws.size);

  // Offsets first (a prefix sum), so heads can be filled independently.
  out.offsets[0] = 0;
  for (std::int64_t h = 0; h < heads; ++h) {
    const std::int64_t b = head_budgets != nullptr ? head_budgets[h] : uniform;
    out.offsets[h + 1] = out.offsets[h] + tokens_kept(b, tokens, params);
  }
  struct task_context {
    const_score_view scores;
    const std::int64_t* head_budgets;
    std::int64_t uniform;
    selection_params params;
    keep_list_view out;
    topk_scratch* scratch;
  } ctx{scores, head_budgets, uniform, params, out, scratch};
  exec.run(
      heads,
      [](void* arg, std::int64_t h, int worker) {
        const auto& c = *static_cast<const task_context*>(arg);
        const std::int64_t n = c.scores.cols;
        const std::int64_t b = c.head_budgets != nullptr ? c.head_budgets[h] : c.uniform;
        const std::int64_t protect = c.params.protected_tail < n ? c.params.protected_tail : n;
        const std::int64_t candidates = n - protect;
        const std::int64_t k = candidates_kept(b, n, c.params);
        std::int64_t* dst = c.out.indices + c.out.offsets[h];
        if (k >= candidates) {
          for (std::int64_t j = 0; j < candidates; ++j) dst[j] = j;
        } else if (k > 0) {
          top_k_ascending(c.scores.row(h), candidates, k, dst, c.scratch[worker]);
        }
        for (std::int64_t j = 0; j < protect; ++j) dst[k + j] = candidates + j;
      },
      &ctx);
  return status();
}
}  // namespace detail

/// Bytes of workspace `select` needs for rows of up to `num_tokens` scores.
inline std::size_t select_workspace_size(std::int64_t num_tokens, const executor& exec = {}) noexcept {
  detail::arena a;
  detail::topk_scratch* unused = nullptr;
  detail::carve_select_layout(a, num_tokens, exec.workers(), &unused);
  return a.used();
}

/// Keep-list capacity (total indices) `select` needs for these budgets. Total: an invalid
/// budget (rejected by select) or shape gives a size, never undefined behaviour.
inline std::int64_t select_capacity(std::int64_t num_heads, std::int64_t num_tokens, budget b,
                                    const selection_params& params = {}) noexcept {
  const std::int64_t per_head = b.resolve(num_tokens);
  return detail::saturating_mul(num_heads < 0 ? 0 : num_heads,
                                tokens_kept(per_head < 0 ? 0 : per_head, num_tokens < 0 ? 0 : num_tokens, params));
}

/// Uniform budget: every KV head keeps the same number of tokens.
///
///   scores: [Hkv, L] float32 (+inf / NaN allowed; NaN ranks last)
///   out:    CSR keep-list, capacity >= select_capacity(...); head h's indices ascending
///   ws:     at least select_workspace_size(L) bytes
inline status select(const_score_view scores, budget b, const selection_params& params, keep_list_view out,
                     workspace_span ws, const executor& exec = {}) {
  if (b.type == budget::kind::ratio && !(b.compression_ratio >= 0.0 && b.compression_ratio <= 1.0))
    return status::error(errc::invalid_argument, "kvevict::select", "budget",
                         "expected a compression ratio in [0, 1], got %g", b.compression_ratio);
  return detail::select_impl(scores, nullptr, b.resolve(scores.cols), params, out, ws, exec);
}

/// Head-adaptive budgets (AdaKV): head h keeps head_budgets[h] tokens (under the same
/// protected-tail rule).
inline status select(const_score_view scores, const std::int64_t* head_budgets, const selection_params& params,
                     keep_list_view out, workspace_span ws, const executor& exec = {}) {
  if (head_budgets == nullptr)
    return status::error(errc::null_pointer, "kvevict::select", "head_budgets", "expected one budget per KV head");
  return detail::select_impl(scores, head_budgets, 0, params, out, ws, exec);
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_SELECTION_SELECT_HPP
