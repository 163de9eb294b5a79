// Whether a reference score row leaves top-k membership undecidable at float precision.
// Catch2-free, so the fuzzers share it with the unit tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "reference/reference.hpp"

namespace test {

/// True when the reference's k-th and (k+1)-th best candidates are closer than `relative`
/// of their magnitude plus `of_max` of the row's best score (NaN ranks last).
inline bool near_tie_at(const ref::vec& row, std::int64_t candidates, std::int64_t k, double relative = 1e-4,
                        double of_max = 1e-6) {
  if (k <= 0 || k >= candidates) return false;
  ref::vec v(row.begin(), row.begin() + candidates);
  std::sort(v.begin(), v.end(), [](double a, double b) {
    if (std::isnan(a) != std::isnan(b)) return std::isnan(b);
    return a > b;
  });
  const double a = v[static_cast<std::size_t>(k - 1)], b = v[static_cast<std::size_t>(k)];
  if (std::isnan(a) || std::isnan(b)) return false;
  return std::fabs(a - b) <= relative * std::max(std::fabs(a), std::fabs(b)) + of_max * std::fabs(v[0]);
}

}  // namespace test
