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
#include <functional>

#include "kvevict/config.hpp"
#include "kvevict/workspace.hpp"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

KVEVICT_NAMESPACE_BEGIN
namespace detail {

/// Unsigned key with the selection order: NaN -> 0, -0 -> key(+0).
KVEVICT_ALWAYS_INLINE std::uint32_t score_key(float x) noexcept {
  if (x != x) return 0u;
  x += 0.0f;  // -0 + 0 = +0
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

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

/// Keeps offsets j (ascending) with key(x[j]) >= threshold; returns how many.
inline std::int64_t filter_at_least(const float* x, std::int64_t n, std::uint32_t threshold, std::uint32_t* index,
                                    std::uint32_t* key) noexcept {
  std::int64_t m = 0, j = 0;
#if defined(__AVX512F__)
  const __m512i vthreshold = _mm512_set1_epi32(static_cast<int>(threshold));
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512i step = _mm512_set1_epi32(16);
  const __m512 zero = _mm512_setzero_ps();
  __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(x + j), zero);
    const __m512i bits = _mm512_castps_si512(v);
    __m512i k = _mm512_xor_si512(bits, _mm512_or_si512(_mm512_srai_epi32(bits, 31), sign));
    k = _mm512_mask_mov_epi32(k, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_setzero_si512());
    const __mmask16 keep = _mm512_cmp_epu32_mask(k, vthreshold, _MM_CMPINT_NLT);
    _mm512_mask_compressstoreu_epi32(index + m, keep, iota);
    _mm512_mask_compressstoreu_epi32(key + m, keep, k);
    m += __builtin_popcount(static_cast<unsigned>(keep));
    iota = _mm512_add_epi32(iota, step);
  }
#endif
  for (; j < n; ++j) {
    const std::uint32_t k = score_key(x[j]);
    if (k >= threshold) {
      index[m] = static_cast<std::uint32_t>(j);
      key[m] = k;
      ++m;
    }
  }
  return m;
}

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
      std::nth_element(s.work, s.work + rank, s.work + samples, std::greater<std::uint32_t>());
      m = filter_at_least(x, n, s.work[rank], s.index, s.key);
    }
  }
  if (m < k) m = filter_at_least(x, n, 0u, s.index, s.key);  // exact over the whole row

  std::memcpy(s.work, s.key, static_cast<std::size_t>(m) * sizeof(std::uint32_t));
  std::nth_element(s.work, s.work + (k - 1), s.work + m, std::greater<std::uint32_t>());
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
