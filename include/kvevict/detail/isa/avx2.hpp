// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_ISA_AVX2_HPP
#define KVEVICT_DETAIL_ISA_AVX2_HPP

// The AVX2 + FMA + F16C kernel set (cpu_isa::avx2), compiled for that target in every build.
//
// Its results are bit-identical to the AVX-512 set's (detail/isa/avx512.hpp) for every
// storage type: both run the same IEEE float32 operations in the same order.
//   - logits: outer-product micro-kernels; each logit is one FMA chain over the channels in
//     order (acc = fma(q[c], k[c], acc), c = 0..d-1), whatever the vector width;
//   - exp: the same Cephes polynomial; AVX-512's scalef (y * 2^n, one rounding) is y * 2^n1 *
//     2^n2 here, the first product exact, so the same single rounding;
//   - sums across lanes (the softmax normaliser, decode dot products) emulate AVX-512's
//     16 lanes with two 8-lane halves and reduce them by the same trees;
//   - widening is exact on both (bf16: a shift; fp16: VCVTPH2PS).
// tests/unit/test_cpu_isa.cpp checks the identity; docs/cpu-dispatch.md says why it holds.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/detail/isa/common.hpp"
#include "kvevict/detail/isa/scalar.hpp"
#include "kvevict/detail/isa/target.hpp"
#include "kvevict/dtype.hpp"
#include "kvevict/views/cache_view.hpp"

#if KVEVICT_X86_DISPATCH
KVEVICT_NAMESPACE_BEGIN
namespace detail {

/// Packing panels of any width K (a multiple of 8) by 8 x 8 transposes, shared by the AVX2
/// and AVX-512 sets; strided rows and channel tails go through the portable packer.
template <int K, class KT>
void pack_panels_portable(const cache_view<const KT>& keys, std::int64_t h, std::int64_t j0, std::int64_t n,
                          std::int64_t dim, std::int64_t c0, float* panel) noexcept {
  const std::int64_t panels = (n + K - 1) / K;
  for (std::int64_t p = 0; p < panels; ++p) {
    float* dst = panel + p * dim * K;
    for (std::int64_t t = 0; t < K; ++t) {
      const std::int64_t j = p * K + t;
      const KT* row = j < n ? keys.row(h, j0 + j) : nullptr;
      for (std::int64_t c = c0; c < dim; ++c)
        dst[c * K + t] = row != nullptr ? to_float(row[c * keys.dim_stride]) : 0.0f;
    }
  }
}

KVEVICT_TARGET_AVX2_BEGIN
namespace isa_avx2 {

/// Whether narrow_logits reads keys straight from a cache with contiguous channels, so that
/// prompt windows can compute their logits once, in chunks of cached rows (observe_head.inl).
constexpr bool reads_keys_unpacked = true;

constexpr std::int64_t panel_keys = 16;

/// All-ones in the first min(max(n, 0), 8) lanes.
KVEVICT_ALWAYS_INLINE __m256i first_lanes8(std::int64_t n) noexcept {
  alignas(32) static constexpr std::int32_t table[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  const std::int64_t k = n <= 0 ? 0 : (n >= 8 ? 8 : n);
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(table + 8 - k));
}

/// exp(x) on 8 lanes, bit-identical to isa_avx512::exp16 (see the top of this file): -inf and
/// x < -104 give +0, NaN stays NaN.
KVEVICT_ALWAYS_INLINE __m256 exp8(__m256 x) noexcept {
  x = _mm256_min_ps(_mm256_set1_ps(88.7f), _mm256_max_ps(_mm256_set1_ps(-104.0f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // n in [-150, 128] (NaN: garbage, but y is NaN). Both halves of n lie in [-75, 64], so both
  // powers of two are normal and y * 2^n1 is exact: one rounding, as scalef's.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(y, p1), p2);
}

/// Sum of 16 lanes (lo = lanes 0-7, hi = 8-15) in lane order, as isa_avx512::hsum16.
KVEVICT_ALWAYS_INLINE float hsum16(__m256 lo, __m256 hi) noexcept {
  alignas(32) float lanes[16];
  _mm256_store_ps(lanes, lo);
  _mm256_store_ps(lanes + 8, hi);
  float s = 0.0f;
  for (float x : lanes) s += x;
  return s;
}
KVEVICT_ALWAYS_INLINE float hmax16(__m256 lo, __m256 hi) noexcept {
  alignas(32) float lanes[16];
  _mm256_store_ps(lanes, lo);
  _mm256_store_ps(lanes + 8, hi);
  float m = lanes[0];
  for (float x : lanes) m = x > m ? x : m;
  return m;
}

/// Online log-sum-exp update of one prepared row, in AVX-512's 16-lane order; NaN logits count
/// as -inf. Whole chunks of 16 use plain loads, the tail masked ones (the same values: AMD's
/// masked moves are slow).
inline void lse_update(const float* row, std::int64_t live, float* row_max, float* row_sum) noexcept {
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  if (live <= 0) return;
  const __m256 vneg_inf = _mm256_set1_ps(neg_inf);
  const std::int64_t full = live - live % 16;
  __m256 max_lo = vneg_inf, max_hi = vneg_inf;
  for (std::int64_t j = 0; j < full; j += 16) {
    max_lo = _mm256_max_ps(_mm256_loadu_ps(row + j), max_lo);  // the second operand wins over NaN
    max_hi = _mm256_max_ps(_mm256_loadu_ps(row + j + 8), max_hi);
  }
  const __m256i t_lo = first_lanes8(live - full), t_hi = first_lanes8(live - full - 8);
  if (full < live) {
    max_lo = _mm256_max_ps(_mm256_blendv_ps(vneg_inf, _mm256_maskload_ps(row + full, t_lo), _mm256_castsi256_ps(t_lo)),
                           max_lo);
    max_hi = _mm256_max_ps(
        _mm256_blendv_ps(vneg_inf, _mm256_maskload_ps(row + full + 8, t_hi), _mm256_castsi256_ps(t_hi)), max_hi);
  }
  const float tile_max = hmax16(max_lo, max_hi);
  if (tile_max == neg_inf) return;
  if (tile_max > *row_max) {
    *row_sum *= std::exp(*row_max - tile_max);
    *row_max = tile_max;
  }
  const __m256 vm = _mm256_set1_ps(*row_max);
  __m256 sum_lo = _mm256_setzero_ps(), sum_hi = _mm256_setzero_ps();
  // Lanes holding -inf or NaN, and (in the tail) lanes past `live`, keep their sums, as
  // AVX-512's masked add does.
  auto add = [&](__m256 sum, __m256 x, __m256 take) {
    take = _mm256_and_ps(take, _mm256_cmp_ps(x, vneg_inf, _CMP_GT_OQ));
    return _mm256_blendv_ps(sum, _mm256_add_ps(sum, exp8(_mm256_sub_ps(x, vm))), take);
  };
  const __m256 all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (std::int64_t j = 0; j < full; j += 16) {
    sum_lo = add(sum_lo, _mm256_loadu_ps(row + j), all);
    sum_hi = add(sum_hi, _mm256_loadu_ps(row + j + 8), all);
  }
  if (full < live) {
    sum_lo = add(sum_lo, _mm256_maskload_ps(row + full, t_lo), _mm256_castsi256_ps(t_lo));
    sum_hi = add(sum_hi, _mm256_maskload_ps(row + full + 8, t_hi), _mm256_castsi256_ps(t_hi));
  }
  *row_sum += hsum16(sum_lo, sum_hi);
}

/// acc[j] += weight * exp(row[j] - lse) (or the NaN-propagating max) for j < live; -inf and
/// NaN logits contribute exactly 0. Lane-wise, so any vector width gives the same bits.
inline void accumulate_row(bool max_over_window, const float* row, std::int64_t live, float lse, float weight,
                           float* acc) noexcept {
  const __m256 vlse = _mm256_set1_ps(lse), vw = _mm256_set1_ps(weight),
               vneg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  auto update = [&](__m256 x, __m256 a) {
    // A -inf or NaN logit is exactly 0 even when the row's LSE is NaN (a +inf logit elsewhere
    // in the row): an observation must not poison keys it does not see.
    const __m256 prob = _mm256_and_ps(_mm256_cmp_ps(x, vneg_inf, _CMP_GT_OQ), exp8(_mm256_sub_ps(x, vlse)));
    if (max_over_window) {  // nan_max: a NaN probability wins, as torch.max propagates it
      const __m256 take = _mm256_or_ps(_mm256_cmp_ps(prob, a, _CMP_GT_OQ), _mm256_cmp_ps(prob, prob, _CMP_UNORD_Q));
      return _mm256_blendv_ps(a, prob, take);
    }
    return _mm256_fmadd_ps(vw, prob, a);
  };
  std::int64_t j = 0;
  for (; live - j >= 8; j += 8) _mm256_storeu_ps(acc + j, update(_mm256_loadu_ps(row + j), _mm256_loadu_ps(acc + j)));
  if (j < live) {  // the tail under a mask (AMD's masked stores are slow: once per row)
    const __m256i m = first_lanes8(live - j);
    _mm256_maskstore_ps(acc + j, m, update(_mm256_maskload_ps(row + j, m), _mm256_maskload_ps(acc + j, m)));
  }
}

/// 8 channels of a row widened to float32 (exact).
KVEVICT_ALWAYS_INLINE __m256 widen8(const float* p) noexcept {
  return _mm256_loadu_ps(p);
}
KVEVICT_ALWAYS_INLINE __m256 widen8(const bf16* p) noexcept {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));  // bf16 is a float's top half
}
KVEVICT_ALWAYS_INLINE __m256 widen8(const fp16* p) noexcept {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

/// fp8 through F16C: an e5m2 byte is the top byte of an fp16; an e4m3 magnitude shifted into an
/// fp16's exponent and mantissa is its value times 2^-8 (subnormals too: no float32 denormal
/// appears, so DAZ cannot flush them), and its NaN code is patched in after.
KVEVICT_ALWAYS_INLINE __m256 widen8(const fp8_e5m2* p) noexcept {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), bytes));  // byte << 8 in each 16-bit lane
}
KVEVICT_ALWAYS_INLINE __m256 widen8(const fp8_e4m3* p) noexcept {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i mag = _mm_and_si128(w, _mm_set1_epi16(0x7f));
  const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8), _mm_slli_epi16(mag, 7));
  const __m256 value = _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0f));
  const __m256 nan_lanes = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f))));
  const __m256 signed_nan =
      _mm256_or_ps(_mm256_and_ps(value, _mm256_set1_ps(-0.0f)), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)));
  return _mm256_blendv_ps(value, signed_nan, nan_lanes);
}

inline void widen_row(const float* src, std::int64_t stride, float* dst, std::int64_t n) noexcept {
  isa_scalar::widen_row(src, stride, dst, n);
}
template <class T>
void widen_row_narrow(const T* src, std::int64_t stride, float* dst, std::int64_t n) noexcept {
  if (stride != 1) {
    isa_scalar::widen_row(src, stride, dst, n);
    return;
  }
  std::int64_t i = 0;
  for (; n - i >= 8; i += 8) _mm256_storeu_ps(dst + i, widen8(src + i));
  isa_scalar::widen_row(src + i, 1, dst + i, n - i);
}
inline void widen_row(const bf16* src, std::int64_t stride, float* dst, std::int64_t n) noexcept {
  widen_row_narrow(src, stride, dst, n);
}
inline void widen_row(const fp16* src, std::int64_t stride, float* dst, std::int64_t n) noexcept {
  widen_row_narrow(src, stride, dst, n);
}
inline void widen_row(const fp8_e4m3* src, std::int64_t stride, float* dst, std::int64_t n) noexcept {
  widen_row_narrow(src, stride, dst, n);
}
inline void widen_row(const fp8_e5m2* src, std::int64_t stride, float* dst, std::int64_t n) noexcept {
  widen_row_narrow(src, stride, dst, n);
}

/// In place: r[i] (8 rows of 8 floats) becomes its transpose, r[i][t] = old r[t][i].
KVEVICT_ALWAYS_INLINE void transpose8x8(__m256* r) noexcept {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/// Keys [j0, j0+n) of head h widened and transposed into panels of K keys (K a multiple of
/// 8): key t of channel c of panel p at panel[p*dim*K + c*K + t]; missing keys zero.
template <int K, class KT>
void pack_panels(const cache_view<const KT>& keys, std::int64_t h, std::int64_t j0, std::int64_t n, std::int64_t dim,
                 float* panel) noexcept {
  if (keys.dim_stride != 1) {
    pack_panels_portable<K>(keys, h, j0, n, dim, 0, panel);
    return;
  }
  const std::int64_t full = dim - dim % 8;
  const std::int64_t panels = (n + K - 1) / K;
  for (std::int64_t p = 0; p < panels; ++p) {
    float* dst = panel + p * dim * K;
    for (std::int64_t o = 0; o < K; o += 8) {  // eight keys at a time
      const KT* rows[8];
      KVEVICT_UNROLL
      for (std::int64_t t = 0; t < 8; ++t) {
        const std::int64_t j = p * K + o + t;
        rows[t] = j < n ? keys.row(h, j0 + j) : nullptr;
      }
      for (std::int64_t c = 0; c < full; c += 8) {
        __m256 r[8];
        KVEVICT_UNROLL
        for (int t = 0; t < 8; ++t) r[t] = rows[t] != nullptr ? widen8(rows[t] + c) : _mm256_setzero_ps();
        transpose8x8(r);
        KVEVICT_UNROLL
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + (c + i) * K + o, r[i]);
      }
    }
  }
  if (full < dim) pack_panels_portable<K>(keys, h, j0, n, dim, full, panel);
}

template <class KT>
void pack_key_panels(const cache_view<const KT>& keys, std::int64_t h, std::int64_t j0, std::int64_t n,
                     std::int64_t dim, float* panel) noexcept {
  pack_panels<static_cast<int>(panel_keys)>(keys, h, j0, n, dim, panel);
}

/// MR rows x 16 keys of logits: two accumulators per row, one FMA chain per logit.
template <int MR>
KVEVICT_ALWAYS_INLINE void logits_block(const float* q, std::int64_t dim, const float* panel, float* out,
                                        std::int64_t ld) noexcept {
  __m256 acc[MR][2];
  KVEVICT_UNROLL
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (std::int64_t c = 0; c < dim; ++c) {
    const __m256 k0 = _mm256_loadu_ps(panel + c * panel_keys), k1 = _mm256_loadu_ps(panel + c * panel_keys + 8);
    KVEVICT_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m256 qv = _mm256_broadcast_ss(q + i * dim + c);
      acc[i][0] = _mm256_fmadd_ps(qv, k0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(qv, k1, acc[i][1]);
    }
  }
  KVEVICT_UNROLL
  for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(out + i * ld, acc[i][0]);
    _mm256_storeu_ps(out + i * ld + 8, acc[i][1]);
  }
}

/// out[r * ld + j] = sum_c q[r * dim + c] * key_j[c] for r < rows, j < n rounded up to 16.
inline void logits_panels(const float* q, std::int64_t rows, std::int64_t dim, const float* panel, std::int64_t n,
                          float* out, std::int64_t ld) noexcept {
  const std::int64_t panels = (n + panel_keys - 1) / panel_keys;
  // Rows in chunks whose queries stay in L1 (about 12 KB) while every panel passes by; each
  // panel, read once per chunk, stays in L1 for the chunk's micro-kernels. Streaming all the
  // rows' queries from L2 for every panel ran at two thirds of the FMA peak.
  const std::int64_t chunk = std::max<std::int64_t>(6, 3072 / (dim > 0 ? dim : 1) / 6 * 6);
  for (std::int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const std::int64_t end = std::min(rows, r0 + chunk);
    for (std::int64_t p = 0; p < panels; ++p) {
      const float* kp = panel + p * dim * panel_keys;
      float* o = out + p * panel_keys;
      std::int64_t r = r0;
      for (; end - r >= 6; r += 6) logits_block<6>(q + r * dim, dim, kp, o + r * ld, ld);
      switch (end - r) {
        case 5:
          logits_block<5>(q + r * dim, dim, kp, o + r * ld, ld);
          break;
        case 4:
          logits_block<4>(q + r * dim, dim, kp, o + r * ld, ld);
          break;
        case 3:
          logits_block<3>(q + r * dim, dim, kp, o + r * ld, ld);
          break;
        case 2:
          logits_block<2>(q + r * dim, dim, kp, o + r * ld, ld);
          break;
        case 1:
          logits_block<1>(q + r * dim, dim, kp, o + r * ld, ld);
          break;
        default:
          break;
      }
    }
  }
}

/// Lane i of the result: the sum of the 16 lanes (lo, hi) of argument i by AVX-512's
/// isa_avx512::hsum4 tree: within each group of four lanes (x0 + x2) + (x1 + x3), then the
/// four group sums as (g0 + g2) + (g1 + g3).
KVEVICT_ALWAYS_INLINE __m128 hsum4(const __m256* lo, const __m256* hi) noexcept {
  __m256 part[2];
  KVEVICT_UNROLL
  for (int half = 0; half < 2; ++half) {
    const __m256* v = half == 0 ? lo : hi;
    const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(v[0], v[1]), _mm256_unpackhi_ps(v[0], v[1]));
    const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(v[2], v[3]), _mm256_unpackhi_ps(v[2], v[3]));
    part[half] = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m256 y = _mm256_add_ps(part[0], part[1]);  // groups (0 + 2), (1 + 3)
  return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}

/// 16 channels [c, c + 16) of a key row, widened, channels past `dim` zero (as AVX-512's
/// masked loads give them).
template <class KT>
KVEVICT_ALWAYS_INLINE void widen16(const KT* k, std::int64_t c, std::int64_t dim, __m256* lo, __m256* hi) noexcept {
  if (dim - c >= 16) {
    *lo = widen8(k + c);
    *hi = widen8(k + c + 8);
    return;
  }
  KT tail[16];
  std::memset(static_cast<void*>(tail), 0, sizeof(tail));
  std::memcpy(static_cast<void*>(tail), k + c, static_cast<std::size_t>(dim - c) * sizeof(KT));
  *lo = widen8(tail);
  *hi = widen8(tail + 8);
}

/// out[i * stride] = dot(q[i], k) for RB (<= 6) float32 query rows q[i] = q + i * dim and one
/// key row k (storage type, contiguous channels), each dot product accumulated in AVX-512's
/// 16 lanes (channel c in lane c mod 16) and reduced by its tree.
template <int RB, class KT>
KVEVICT_ALWAYS_INLINE void narrow_dots(const float* q, std::int64_t dim, const KT* k, float* out,
                                       std::int64_t stride) noexcept {
  static_assert(RB >= 1 && RB <= 6, "rows per pass");
  constexpr int R4 = RB > 4 ? 8 : 4;  // hsum4 reduces four rows at a time
  __m256 acc_lo[R4], acc_hi[R4];
  KVEVICT_UNROLL
  for (int i = 0; i < R4; ++i) acc_lo[i] = acc_hi[i] = _mm256_setzero_ps();
  const std::int64_t full = dim - dim % 16;
  for (std::int64_t c = 0; c < full; c += 16) {
    const __m256 k_lo = widen8(k + c), k_hi = widen8(k + c + 8);
    KVEVICT_UNROLL
    for (int i = 0; i < RB; ++i) {
      acc_lo[i] = _mm256_fmadd_ps(k_lo, _mm256_loadu_ps(q + i * dim + c), acc_lo[i]);
      acc_hi[i] = _mm256_fmadd_ps(k_hi, _mm256_loadu_ps(q + i * dim + c + 8), acc_hi[i]);
    }
  }
  if (full < dim) {  // channels past dim are zero, as AVX-512's masked loads give them
    __m256 k_lo, k_hi;
    widen16(k, full, dim, &k_lo, &k_hi);
    const __m256i m_lo = first_lanes8(dim - full), m_hi = first_lanes8(dim - full - 8);
    KVEVICT_UNROLL
    for (int i = 0; i < RB; ++i) {
      acc_lo[i] = _mm256_fmadd_ps(k_lo, _mm256_maskload_ps(q + i * dim + full, m_lo), acc_lo[i]);
      acc_hi[i] = _mm256_fmadd_ps(k_hi, _mm256_maskload_ps(q + i * dim + full + 8, m_hi), acc_hi[i]);
    }
  }
  alignas(16) float sums[8];
  _mm_store_ps(sums, hsum4(acc_lo, acc_hi));
  if (RB > 4) _mm_store_ps(sums + 4, hsum4(acc_lo + 4, acc_hi + 4));
  KVEVICT_UNROLL
  for (int i = 0; i < RB; ++i) out[i * stride] = sums[i];
}

/// Requests key row j + 16 (every cache line of it) while rows j.. are being computed: a
/// decode step is bound by DRAM, and the kernel alone does not keep enough loads in flight.
template <class KT>
KVEVICT_ALWAYS_INLINE void prefetch_key(const cache_view<const KT>& keys, std::int64_t h, std::int64_t j,
                                        std::int64_t end, std::int64_t dim) noexcept {
  constexpr std::int64_t ahead = 16;
  if (j + ahead >= end) return;
  const char* row = reinterpret_cast<const char*>(keys.row(h, j + ahead));
  for (std::int64_t b = 0; b < dim * static_cast<std::int64_t>(sizeof(KT)); b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
}

/// Logits of `rows` (<= 16) queries over keys [j0, j0+n) of head h, out[r * stride + (j - j0)],
/// straight from the cache (keys read once: each key row feeds every row pass while it is in
/// L1). False where channels are not contiguous.
template <class KT>
bool narrow_logits(const cache_view<const KT>& keys, std::int64_t h, std::int64_t j0, std::int64_t n,
                   const narrow_queries& nq, std::int64_t rows, std::int64_t dim, float* out,
                   std::int64_t stride) noexcept {
  if (keys.dim_stride != 1) return false;
  const std::int64_t end = keys.num_tokens;
  for (std::int64_t j = 0; j < n; ++j) {
    prefetch_key(keys, h, j0 + j, end, dim);
    const KT* k = keys.row(h, j0 + j);
    for (std::int64_t r0 = 0; r0 < rows; r0 += 6) {
      const float* q = nq.q + r0 * dim;
      float* o = out + r0 * stride + j;
      switch (rows - r0 < 6 ? rows - r0 : 6) {
        case 1:
          narrow_dots<1>(q, dim, k, o, stride);
          break;
        case 2:
          narrow_dots<2>(q, dim, k, o, stride);
          break;
        case 3:
          narrow_dots<3>(q, dim, k, o, stride);
          break;
        case 4:
          narrow_dots<4>(q, dim, k, o, stride);
          break;
        case 5:
          narrow_dots<5>(q, dim, k, o, stride);
          break;
        default:
          narrow_dots<6>(q, dim, k, o, stride);
          break;
      }
    }
  }
  return true;
}

/// For each 8-bit mask, the positions of its set bits in order, three bits each: the lane
/// permutation that packs the kept lanes to the front.
struct left_pack_table {
  std::uint32_t perm[256];
  constexpr left_pack_table() : perm() {
    for (int mask = 0; mask < 256; ++mask) {
      std::uint32_t packed = 0;
      int w = 0;
      for (int lane = 0; lane < 8; ++lane)
        if ((mask >> lane) & 1) packed |= static_cast<std::uint32_t>(lane) << (3 * w++);
      perm[mask] = packed;
    }
  }
};
inline constexpr left_pack_table left_pack{};

/// Keeps offsets j (ascending) with score_key(x[j]) >= threshold; returns how many. Whole
/// vectors are stored and the kept lanes packed to the front, so index/key need n entries.
inline std::int64_t filter_at_least(const float* x, std::int64_t n, std::uint32_t threshold, std::uint32_t* index,
                                    std::uint32_t* key) noexcept {
  std::int64_t m = 0, j = 0;
  const __m256i vthreshold = _mm256_set1_epi32(static_cast<int>(threshold));
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i step = _mm256_set1_epi32(8), shifts = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21),
                seven = _mm256_set1_epi32(7);
  __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (; n - j >= 8; j += 8) {
    const __m256 v = _mm256_add_ps(_mm256_loadu_ps(x + j), _mm256_setzero_ps());  // -0 -> +0
    const __m256i bits = _mm256_castps_si256(v);
    __m256i k = _mm256_xor_si256(bits, _mm256_or_si256(_mm256_srai_epi32(bits, 31), sign));
    k = _mm256_andnot_si256(_mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)), k);  // NaN -> 0
    const __m256i keep = _mm256_cmpeq_epi32(_mm256_max_epu32(k, vthreshold), k);         // k >= threshold
    const int mask = _mm256_movemask_ps(_mm256_castsi256_ps(keep));
    const __m256i perm =
        _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(left_pack.perm[mask])), shifts), seven);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(index + m), _mm256_permutevar8x32_epi32(iota, perm));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(key + m), _mm256_permutevar8x32_epi32(k, perm));
    m += __builtin_popcount(static_cast<unsigned>(mask));
    iota = _mm256_add_epi32(iota, step);
  }
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

}  // namespace isa_avx2
KVEVICT_TARGET_END

}  // namespace detail
KVEVICT_NAMESPACE_END
#endif  // KVEVICT_X86_DISPATCH

#endif  // KVEVICT_DETAIL_ISA_AVX2_HPP
