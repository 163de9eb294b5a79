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
#include "support/near_tie.hpp"

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

inline std::vector<std::int64_t> head_of(const kvevict::const_keep_list_view& k, std::int64_t h) {
  return {k.indices + k.offsets[h], k.indices + k.offsets[h + 1]};
}

}  // namespace test
