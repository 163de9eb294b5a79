// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_TOPK_HPP
#define KVEVICT_DETAIL_TOPK_HPP

// Exact, deterministic top-k of one score row, emitted in ascending index order.
//
// Order: scores compare as numbers with -0 == +0; NaN ranks below every number; among equal
// scores the smaller index wins. Each score maps to a 32-bit key whose unsigned order is
// that order, so a threshold on keys decides membership.
//
// Long rows: a fixed, evenly spaced sample estimates a threshold a little below the k-th
// key; one (SIMD) sweep keeps the indices at or above it, in ascending order; an exact
// selection among those survivors finds the true k-th key; a last pass over the survivors
// emits the result. If the estimate was too high (fewer than k survivors) the exact path
// runs over the whole row. Short rows take the exact path directly.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvevict/config.hpp"
#include "kvevict/cpu_isa.hpp"
#include "kvevict/detail/isa/avx2.hpp"
#include "kvevict/detail/isa/avx512.hpp"
#include "kvevict/detail/isa/common.hpp"
#include "kvevict/detail/isa/scalar.hpp"
#include "kvevict/detail/isa/target.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

struct topk_scratch {
  std::uint32_t* index = nullptr;  ///< [n] survivor offsets
  std::uint32_t* key = nullptr;    ///< [n] survivor keys
  std::uint32_t* work = nullptr;   ///< [n] copy for nth_element
};

constexpr std::int64_t topk_sample_size = 1024;
constexpr std::int64_t topk_direct_below = 4096;  ///< rows shorter than this skip sampling

inline void carve_topk_scratch(arena& a, std::int64_t n, topk_scratch* s) noexcept {
  s->index = a.take<std::uint32_t>(n);
  s->key = a.take<std::uint32_t>(n);
  s->work = a.take<std::uint32_t>(std::max<std::int64_t>(n, topk_sample_size));
}

/// Keeps offsets j (ascending) with score_key(x[j]) >= threshold; returns how many. The
/// sweep runs on the process's CPU path; every path keeps the same offsets.
inline std::int64_t filter_at_least(const float* x, std::int64_t n, std::uint32_t threshold, std::uint32_t* index,
                                    std::uint32_t* key) noexcept {
#if KVEVICT_X86_DISPATCH
  switch (active_cpu_isa()) {
    case cpu_isa::scalar:
      break;
    case cpu_isa::avx2:
      return isa_avx2::filter_at_least(x, n, threshold, index, key);
    default:
      return isa_avx512::filter_at_least(x, n, threshold, index, key);
  }
#endif
  return isa_scalar::filter_at_least(x, n, threshold, index, key);
}

/// The order of nth_element's partition. kvevict's own type rather than std::greater, so
/// that the std::nth_element instantiation is named after kvevict's inline namespace and is
/// never shared with a translation unit of another -march (detail/abi.hpp).
struct descending_keys {
  bool operator()(std::uint32_t a, std::uint32_t b) const noexcept { return a > b; }
};

/// Writes the ascending offsets of the top k of x[0, n) to out (0 < k < n < 2^32).
inline void top_k_ascending(const float* x, std::int64_t n, std::int64_t k, std::int64_t* out, const topk_scratch& s) {
  std::int64_t m = 0;
  if (n >= topk_direct_below) {
    // Sample, and take a threshold at a rank with a generous margin above k/n.
    const std::int64_t samples = topk_sample_size;
    for (std::int64_t i = 0; i < samples; ++i) s.work[i] = score_key(x[(i * n) / samples + (n / samples) / 2]);
    const double expected = static_cast<double>(k) * static_cast<double>(samples) / static_cast<double>(n);
    const auto rank = static_cast<std::int64_t>(expected * 1.1 + 4.0 * std::sqrt(expected) + 8.0);
    if (rank < samples) {
      std::nth_element(s.work, s.work + rank, s.work + samples, descending_keys());
      m = filter_at_least(x, n, s.work[rank], s.index, s.key);
    }
  }
  if (m < k) m = filter_at_least(x, n, 0u, s.index, s.key);  // exact over the whole row

  std::memcpy(s.work, s.key, static_cast<std::size_t>(m) * sizeof(std::uint32_t));
  std::nth_element(s.work, s.work + (k - 1), s.work + m, descending_keys());
  const std::uint32_t kth = s.work[k - 1];
  std::int64_t above = 0;
  for (std::int64_t i = 0; i < m; ++i) above += s.key[i] > kth ? 1 : 0;
  std::int64_t ties_left = k - above, w = 0;
  for (std::int64_t i = 0; i < m; ++i) {
    const std::uint32_t key = s.key[i];
    if (key > kth || (key == kth && ties_left > 0)) {
      if (key == kth) --ties_left;
      out[w++] = static_cast<std::int64_t>(s.index[i]);
    }
  }
}

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DETAIL_TOPK_HPP
