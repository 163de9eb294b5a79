// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_POOLING_HPP
#define KVEVICT_DETAIL_POOLING_HPP

// 1-D pooling and NaN-propagating reductions over score rows. Max operations propagate
// NaN (as torch.max / max_pool1d do), so a NaN score is never silently dropped.

#include <cstdint>
#include <cstring>
#include <limits>

#include "kvevict/config.hpp"
#include "kvevict/scoring/params.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

KVEVICT_ALWAYS_INLINE float nan_max(float a, float b) noexcept {
  return (b != b || b > a) ? b : a;  // NaN in b wins; NaN in a stays (b > NaN is false)
}

/// y[j] = pool(x[j - k/2 .. j + k/2]) over x[0, n); y must not alias x.
inline void pool_row(const float* KVEVICT_RESTRICT x, std::int64_t n, const pooling& p,
                     float* KVEVICT_RESTRICT y) noexcept {
  if (n <= 0) return;
  const std::int64_t radius = p.kernel / 2;
  if (p.kind == pooling_kind::none || radius == 0) {
    std::memcpy(y, x, static_cast<std::size_t>(n) * sizeof(float));
    return;
  }
  if (p.kind == pooling_kind::max) {
    for (std::int64_t j = 0; j < n; ++j) y[j] = -std::numeric_limits<float>::infinity();
    for (std::int64_t o = -radius; o <= radius; ++o) {
      const std::int64_t lo = o < 0 ? -o : 0, hi = o > 0 ? n - o : n;
      for (std::int64_t j = lo; j < hi; ++j) y[j] = nan_max(y[j], x[j + o]);
    }
    return;
  }
  for (std::int64_t j = 0; j < n; ++j) y[j] = 0.0f;
  for (std::int64_t o = -radius; o <= radius; ++o) {
    const std::int64_t lo = o < 0 ? -o : 0, hi = o > 0 ? n - o : n;
    for (std::int64_t j = lo; j < hi; ++j) y[j] += x[j + o];
  }
  if (p.count_padding) {
    const float inv = 1.0f / static_cast<float>(p.kernel);
    for (std::int64_t j = 0; j < n; ++j) y[j] *= inv;
  } else {
    for (std::int64_t j = 0; j < n; ++j) {
      const std::int64_t lo = j - radius < 0 ? 0 : j - radius;
      const std::int64_t hi = j + radius >= n ? n - 1 : j + radius;
      y[j] /= static_cast<float>(hi - lo + 1);
    }
  }
}

/// out[j] = reduce(out[j], x[j]) for the GQA reductions (mean accumulates a sum).
inline void reduce_into(float* KVEVICT_RESTRICT out, const float* KVEVICT_RESTRICT x, std::int64_t n, gqa_reduction r,
                        bool first) noexcept {
  if (first) {
    std::memcpy(out, x, static_cast<std::size_t>(n) * sizeof(float));
    return;
  }
  if (r == gqa_reduction::max) {
    for (std::int64_t j = 0; j < n; ++j) out[j] = nan_max(out[j], x[j]);
  } else {
    for (std::int64_t j = 0; j < n; ++j) out[j] += x[j];
  }
}

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DETAIL_POOLING_HPP
