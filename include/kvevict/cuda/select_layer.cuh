// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_SELECT_LAYER_CUH
#define KVEVICT_CUDA_SELECT_LAYER_CUH

// One layer's keep set under a layer_budget on the device: kvevict::select_layer's rule
// (budgets/layer_budget.hpp) composed from the device selections, with the same keep-lists.
//
//   uniform heads, no layer override:  cuda::select(scores, B, the policy's selection)
//   a layer allocator (PyramidKV) set layer_candidates, or AdaKV heads:
//        b = layer_candidates or candidates_kept(B, L, sel) (host arithmetic, as the CPU's)
//        uniform heads select b candidates per head, AdaKV heads adakv_head_budgets(b);
//        the protected tail comes on top
//   per_layer scope:  combine_head_scores, then select_shared (the allocator's b when set)
//
// Everything stays on the stream: no host round trip, no synchronisation, no allocation.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvevict/budgets/layer_budget_params.hpp"
#include "kvevict/config.hpp"
#include "kvevict/cuda/adakv.cuh"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/scope.cuh"
#include "kvevict/cuda/select.cuh"
#include "kvevict/error.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

struct select_layer_workspace {
  std::int64_t* head_budgets = nullptr;  ///< [Hkv] AdaKV's budgets
  float* row = nullptr;                  ///< [L] the combined row (per_layer scope)
  workspace_span step;                   ///< the inner call's workspace (AdaKV, combine, select)
};

inline void carve_select_layer_workspace(kvevict::detail::arena& a, std::int64_t heads, std::int64_t tokens,
                                         const layer_budget& b, select_layer_workspace* out) noexcept {
  const bool ada = b.heads == head_allocation::adakv;
  const bool shared = b.scope == selection_scope::per_layer;
  out->head_budgets = ada ? a.take<std::int64_t>(heads) : nullptr;
  out->row = shared ? a.take<float>(tokens) : nullptr;
  std::size_t step = select_workspace_size(heads);
  const auto at_least = [&step](std::size_t n) { step = n > step ? n : step; };
  if (ada) at_least(adakv_workspace_size(heads, tokens));
  if (shared) {
    at_least(combine_head_scores_workspace_size(heads));
    at_least(select_shared_workspace_size());
  }
  out->step = kvevict::detail::take_bytes(a, step, true);
}

}  // namespace detail

/// Bytes of device workspace `select_layer` needs for [num_kv_heads, num_tokens] scores (an
/// upper bound on L is fine) under budget `b`.
inline std::size_t select_layer_workspace_size(std::int64_t num_kv_heads, std::int64_t num_tokens,
                                               const layer_budget& b) noexcept {
  kvevict::detail::arena a;
  detail::select_layer_workspace w;
  detail::carve_select_layer_workspace(a, num_kv_heads, num_tokens, b, &w);
  return a.used();
}

/// kvevict::select_layer on the device, for one process (b.shard unset).
///
///   scores: [Hkv, L] float32 device (candidates [0, L - sel.protected_tail), the tail +inf)
///   sel:    the policy's protected tail and mode
///   b:      per-head budget, head allocation (uniform, AdaKV), a layer allocator's
///           layer_candidates, and the scope (per_head or per_layer)
///   out:    CSR keep-list, device offsets [Hkv + 1] and indices [capacity]; capacity (host)
///           >= detail::layer_keep_capacity(Hkv, L, sel, b)
///   ws:     device memory, >= select_layer_workspace_size(Hkv, L, b)
///
/// Writes the keep-lists kvevict::select_layer writes. Up to eight kernels (AdaKV: up to six
/// plus select's two; per_layer with a normalised rule: a memset, three, then select_shared's).
/// The per_sequence scope is refused (the compressor's: it folds every layer first).
inline status select_layer(const_score_view scores, const selection_params& sel, const layer_budget& b,
                           keep_list_view out, workspace_span ws, const launch_options& opt = {}) {
  static constexpr const char* fn = "kvevict::cuda::select_layer";
  KVEVICT_RETURN_IF_ERROR(kvevict::detail::validate_layer_budget(b, fn));
  if (b.shard.sharded())
    return status::error(errc::unsupported, fn, "budget.shard",
                         "selection across tensor-parallel ranks is not implemented on the GPU");
  if (b.scope == selection_scope::per_sequence)
    return status::error(errc::unsupported, fn, "budget.scope",
                         "a keep set shared by every layer is chosen from every layer's scores: fold them with "
                         "fold_layer_scores, then select_shared");
  if (scores.rows < 1)
    return status::error(errc::invalid_shape, fn, "scores.rows", "expected >= 1 KV head, got %lld",
                         static_cast<long long>(scores.rows));
  KVEVICT_RETURN_IF_ERROR(detail::check_selection_params(sel, fn));
  kvevict::detail::arena a(ws);
  detail::select_layer_workspace w;
  detail::carve_select_layer_workspace(a, scores.rows, scores.cols, b, &w);
  KVEVICT_RETURN_IF_ERROR(detail::check_workspace(a, ws, opt, fn, "select_layer_workspace_size"));

  const bool allocates = kvevict::detail::allocates(b);
  const selection_params on_top{sel.protected_tail, protected_mode::on_top_of_budget};
  const std::int64_t mean = allocates ? kvevict::detail::mean_candidates(b, scores.cols, sel) : 0;
  if (b.scope == selection_scope::per_layer) {
    KVEVICT_RETURN_IF_ERROR(combine_head_scores(scores, sel.protected_tail, b.combine, w.row, w.step, opt));
    const const_score_view row{w.row, 1, scores.cols, scores.cols};
    return allocates ? select_shared(row, budget::tokens(mean), on_top, out, w.step, opt)
                     : select_shared(row, b.per_head, sel, out, w.step, opt);
  }
  if (!allocates) return select(scores, b.per_head, sel, out, w.step, opt);
  if (b.heads == head_allocation::uniform) return select(scores, budget::tokens(mean), on_top, out, w.step, opt);
  KVEVICT_RETURN_IF_ERROR(adakv_head_budgets(scores, sel.protected_tail, mean, b.adakv, w.head_budgets, w.step, opt));
  return select(scores, w.head_budgets, on_top, out, w.step, opt);
}

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_SELECT_LAYER_CUH
