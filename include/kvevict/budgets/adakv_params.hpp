// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_BUDGETS_ADAKV_PARAMS_HPP
#define KVEVICT_BUDGETS_ADAKV_PARAMS_HPP

// AdaKV's parameters and its per-head budget rule (step 3 of budgets/adakv.hpp), in a light
// header of host+device functions: the CPU allocator and the CUDA one (cuda/adakv.cuh) apply
// the same code, so their budgets agree bit for bit.

#include <cmath>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/views/matrix_view.hpp"

KVEVICT_NAMESPACE_BEGIN

/// How a head's picks become its budget (budgets/adakv.hpp).
enum class adakv_rule : std::int32_t {
  /// The AdaKV paper's: round(c_h*(1 - alpha) + floor(alpha*B)) of the global top's picks.
  paper,
  /// kvpress's AdaKVPress: every head first keeps its own top f = max(1, floor(alpha*(B + T)))
  /// - T candidates (T the protected tail, which the safeguard counts first, since kvpress's
  /// window sits inside the budget and at the top of every head), then the layer's top Hkv*(B - f)
  /// of the other candidates go to their heads; a head keeps f + its picks, Hkv*B in all.
  kvpress_safeguard,
};

struct adakv_params {
  double alpha = 0.2;                   ///< floor fraction (the AdaKV GQA script's value)
  bool normalize = false;               ///< per-head normalisation (off in AdaKV's GQA script)
  adakv_rule rule = adakv_rule::paper;  ///< picks -> budget
};

namespace detail {

KVEVICT_HOST_DEVICE inline std::int64_t round_half_even(double x) noexcept {
  const double f = std::floor(x);
  const double diff = x - f;
  if (diff > 0.5) return static_cast<std::int64_t>(f) + 1;
  if (diff < 0.5) return static_cast<std::int64_t>(f);
  const auto fi = static_cast<std::int64_t>(f);
  return (fi % 2 == 0) ? fi : fi + 1;
}

/// Step 3: a head's candidates from its `picks` of the global top Hkv*b (host and device:
/// kvevict::cuda::adakv_head_budgets applies the same function).
KVEVICT_HOST_DEVICE inline std::int64_t adakv_head_budget(std::int64_t picks, std::int64_t b, std::int64_t candidates,
                                                          const adakv_params& params) noexcept {
  const double floor_budget = std::floor(params.alpha * static_cast<double>(b));
  const std::int64_t v = round_half_even(static_cast<double>(picks) * (1.0 - params.alpha) + floor_budget);
  return v < 0 ? 0 : (v > candidates ? candidates : v);
}

/// kvpress_safeguard's candidates every head keeps before the global top: kvpress's
/// int(n_kept * alpha) (at least 1 of a non-empty budget) of n_kept = B + T tokens, less the
/// protected tail the safeguard takes first, at most B.
KVEVICT_HOST_DEVICE inline std::int64_t adakv_safeguard(std::int64_t b, std::int64_t protected_tail,
                                                        const adakv_params& params) noexcept {
  const std::int64_t kept = b + protected_tail;
  if (kept <= 0) return 0;
  std::int64_t safe = static_cast<std::int64_t>(static_cast<double>(kept) * params.alpha);
  if (params.alpha > 0.0 && safe < 1) safe = 1;
  const std::int64_t f = safe - protected_tail;
  return f < 0 ? 0 : (f > b ? b : f);
}

/// The argument checks of adakv_head_budgets, on the CPU and on the GPU: scores [Hkv >= 1, L],
/// a tail and a budget >= 0, alpha in [0, 1], somewhere to write.
inline status validate_adakv_inputs(const const_score_view& scores, std::int64_t protected_tail,
                                    std::int64_t per_head_budget, const adakv_params& params, const void* out,
                                    const char* fn) noexcept {
  if (scores.rows < 1)
    return status::error(errc::invalid_shape, fn, "scores.rows", "expected >= 1 KV head, got %lld",
                         static_cast<long long>(scores.rows));
  KVEVICT_RETURN_IF_ERROR(validate_matrix_view(scores, scores.rows, scores.cols, fn, "scores"));
  if (protected_tail < 0)
    return status::error(errc::invalid_argument, fn, "protected_tail", "expected >= 0, got %lld",
                         static_cast<long long>(protected_tail));
  if (per_head_budget < 0)
    return status::error(errc::invalid_argument, fn, "per_head_budget", "expected >= 0, got %lld",
                         static_cast<long long>(per_head_budget));
  if (!(params.alpha >= 0.0 && params.alpha <= 1.0))
    return status::error(errc::invalid_argument, fn, "params.alpha", "expected alpha in [0, 1], got %g", params.alpha);
  if (params.rule != adakv_rule::paper && params.rule != adakv_rule::kvpress_safeguard)
    return status::error(errc::invalid_argument, fn, "params.rule", "expected paper or kvpress_safeguard, got %d",
                         static_cast<int>(params.rule));
  if (params.rule == adakv_rule::kvpress_safeguard && params.normalize)
    return status::error(errc::invalid_argument, fn, "params.normalize",
                         "expected false with the kvpress_safeguard rule (AdaKVPress ranks raw scores)");
  if (out == nullptr) return status::error(errc::null_pointer, fn, "out", "expected [Hkv] budgets");
  return status();
}

}  // namespace detail

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_BUDGETS_ADAKV_PARAMS_HPP
