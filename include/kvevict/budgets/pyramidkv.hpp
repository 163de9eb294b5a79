// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_BUDGETS_PYRAMIDKV_HPP
#define KVEVICT_BUDGETS_PYRAMIDKV_HPP

// PyramidKV layer budgets: lower layers keep more, upper layers less, on a linear schedule
// whose mean is the uniform budget (design.md §5). With capacity C (including the
// observation window w), N layers and beta:
//   min = (C - w) / beta,  max = 2(C - w) - min;
//   if max >= L - w:  max = L - w,  min = 2(C - w) - max;
//   step = (max - min) / (N - 1);  layer l keeps max - l*step candidates plus the window.
// kvevict computes the schedule in real numbers and rounds it with largest remainders, so
// the budgets are integers whose mean is exactly C - w (KVCache-Factory floors `step`,
// which drifts above C). When every layer can keep all L - w candidates, or there is one
// layer, the schedule is uniform.

#include <cmath>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/error.hpp"

KVEVICT_NAMESPACE_BEGIN

/// out: [num_layers] candidate tokens each layer keeps (the window comes on top: select with
/// budget::tokens(out[l]) and selection_params{window, protected_mode::on_top_of_budget}).
inline status pyramidkv_layer_budgets(std::int64_t capacity, std::int64_t window, std::int64_t num_layers,
                                      std::int64_t num_tokens, std::int64_t* out, double beta = 20.0) {
  static constexpr const char* fn = "kvevict::pyramidkv_layer_budgets";
  if (window < 0)
    return status::error(errc::invalid_argument, fn, "window", "expected >= 0, got %lld",
                         static_cast<long long>(window));
  if (capacity < window)
    return status::error(errc::invalid_argument, fn, "capacity", "expected >= window = %lld, got %lld",
                         static_cast<long long>(window), static_cast<long long>(capacity));
  if (num_layers < 1)
    return status::error(errc::invalid_argument, fn, "num_layers", "expected >= 1, got %lld",
                         static_cast<long long>(num_layers));
  if (num_tokens < 0)
    return status::error(errc::invalid_argument, fn, "num_tokens", "expected >= 0, got %lld",
                         static_cast<long long>(num_tokens));
  if (!(beta >= 1.0) || std::isinf(beta))
    return status::error(errc::invalid_argument, fn, "beta", "expected a finite beta >= 1, got %g", beta);
  if (out == nullptr) return status::error(errc::null_pointer, fn, "out", "expected [num_layers] budgets");

  const std::int64_t mean = capacity - window;
  const std::int64_t available = num_tokens > window ? num_tokens - window : 0;
  if (mean >= available || num_layers == 1) {
    for (std::int64_t l = 0; l < num_layers; ++l) out[l] = mean < available ? mean : available;
    return status();
  }
  std::int64_t target = 0;  // num_layers * mean, the budgets' exact total
  if (!detail::checked_mul(num_layers, mean, &target))
    return status::error(errc::overflow, fn, "capacity",
                         "expected num_layers * (capacity - window) < 2^63, got %lld * %lld",
                         static_cast<long long>(num_layers), static_cast<long long>(mean));
  double lo = static_cast<double>(mean) / beta;
  double hi = 2.0 * static_cast<double>(mean) - lo;
  if (hi >= static_cast<double>(available)) {
    hi = static_cast<double>(available);
    lo = 2.0 * static_cast<double>(mean) - hi;
  }
  const double step = (hi - lo) / static_cast<double>(num_layers - 1);
  // Floors, then the remainder goes to the layers with the largest fractional parts (lower
  // layers first on ties), so the total is exactly num_layers * mean.
  std::int64_t total = 0;
  for (std::int64_t l = 0; l < num_layers; ++l) {
    // In [0, available] (clamped where double rounding could step past it: no UB cast).
    const double budget = std::floor(hi - static_cast<double>(l) * step);
    out[l] =
        budget <= 0.0 ? 0 : (budget >= static_cast<double>(available) ? available : static_cast<std::int64_t>(budget));
    total = detail::saturating_add(total, out[l]);
  }
  std::int64_t remainder = target - total;
  while (remainder > 0) {
    std::int64_t best = -1;
    double best_fraction = -1.0;
    for (std::int64_t l = 0; l < num_layers; ++l) {
      const double exact = hi - static_cast<double>(l) * step;
      const double fraction = exact - static_cast<double>(out[l]);
      if (out[l] < available && fraction > best_fraction) {
        best = l;
        best_fraction = fraction;
      }
    }
    if (best < 0) break;
    ++out[best];
    --remainder;
  }
  while (remainder < 0) {  // past 2^53 the doubles round, and the floors may overshoot
    std::int64_t best = -1;
    double best_fraction = 0.0;
    for (std::int64_t l = 0; l < num_layers; ++l) {
      const double fraction = hi - static_cast<double>(l) * step - static_cast<double>(out[l]);
      if (out[l] > 0 && (best < 0 || fraction <= best_fraction)) {
        best = l;
        best_fraction = fraction;
      }
    }
    if (best < 0) break;
    --out[best];
    ++remainder;
  }
  return status();
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_BUDGETS_PYRAMIDKV_HPP
