// Comparisons of library results with the reference.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvevict/selection/keep_list.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "reference/reference.hpp"

namespace test {

/// Score tolerance: float32 arithmetic against double: relative 1e-4 plus 1e-6 of the row's
/// largest finite score (probabilities far below the row's scale carry absolute error).
inline void require_scores_close(kvevict::const_score_view got, const std::vector<ref::vec>& want) {
  REQUIRE(got.rows == static_cast<std::int64_t>(want.size()));
  for (std::int64_t h = 0; h < got.rows; ++h) {
    const ref::vec& w = want[static_cast<std::size_t>(h)];
    REQUIRE(got.cols == static_cast<std::int64_t>(w.size()));
    double scale = 0;
    for (double x : w)
      if (std::isfinite(x)) scale = std::max(scale, std::fabs(x));
    for (std::int64_t j = 0; j < got.cols; ++j) {
      const double g = static_cast<double>(got.at(h, j)), e = w[static_cast<std::size_t>(j)];
      INFO("head " << h << " token " << j << " got " << g << " want " << e);
      if (std::isnan(e)) {
        REQUIRE(std::isnan(g));
      } else if (std::isinf(e)) {
        REQUIRE(g == e);
      } else {
        REQUIRE(std::fabs(g - e) <= 1e-4 * std::fabs(e) + 1e-6 * scale + 1e-30);
      }
    }
  }
}

/// True when the reference's k-th and (k+1)-th best candidates are too close to call.
inline bool near_tie_at(const ref::vec& row, std::int64_t candidates, std::int64_t k) {
  if (k <= 0 || k >= candidates) return false;
  ref::vec v(row.begin(), row.begin() + candidates);
  std::sort(v.begin(), v.end(), [](double a, double b) {
    if (std::isnan(a) != std::isnan(b)) return std::isnan(b);
    return a > b;
  });
  const double a = v[static_cast<std::size_t>(k - 1)], b = v[static_cast<std::size_t>(k)];
  if (std::isnan(a) || std::isnan(b)) return false;
  return std::fabs(a - b) <= 1e-4 * std::max(std::fabs(a), std::fabs(b)) + 1e-6 * std::fabs(v[0]);
}

inline std::vector<std::int64_t> head_of(const kvevict::const_keep_list_view& k, std::int64_t h) {
  return {k.indices + k.offsets[h], k.indices + k.offsets[h + 1]};
}

}  // namespace test
