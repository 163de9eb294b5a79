// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_VIEWS_MATRIX_VIEW_HPP
#define KVEVICT_VIEWS_MATRIX_VIEW_HPP

// Row-major float32 matrices: scores [Hkv, L] and precomputed attention rows.

#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"

KVEVICT_NAMESPACE_BEGIN

/// A row-major float matrix [rows, cols] with a row stride: scores [Hkv, L], attention rows.
template <class T>
struct matrix_view {
  T* data = nullptr;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t row_stride = 0;

  /// Row r; for an empty matrix (cols == 0, any row_stride) `data`: no pointer is formed past it.
  KVEVICT_HOST_DEVICE T* row(std::int64_t r) const noexcept { return cols > 0 ? data + r * row_stride : data; }
  KVEVICT_HOST_DEVICE T& at(std::int64_t r, std::int64_t c) const noexcept { return data[r * row_stride + c]; }
  template <class U = T, std::enable_if_t<!std::is_const<U>::value, int> = 0>
  KVEVICT_HOST_DEVICE operator detail::const_view_t<T, matrix_view<const std::remove_cv_t<T>>>() const noexcept {
    return {data, rows, cols, row_stride};
  }
};

/// Scores of one layer: float32 [Hkv, L].
using score_view = matrix_view<float>;
using const_score_view = matrix_view<const float>;

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_VIEWS_MATRIX_VIEW_HPP
