// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_ISA_AVX512_HPP
#define KVEVICT_DETAIL_ISA_AVX512_HPP

// The AVX-512 kernel set (cpu_isa::avx512: F, BW, VL, DQ, CD), compiled for that target in
// every build; its bf16 x bf16 kernels (cpu_isa::avx512bf16) and narrow_logits, which picks
// them, are detail/isa/avx512_bf16.hpp. Float32 results are bit-identical to the AVX2 set's
// (detail/isa/avx2.hpp says how).
//
// GCC 12 implements many AVX-512 intrinsics with an "undefined" pass-through operand and then
// reports -Wmaybe-uninitialized wherever they are inlined (GCC bug 105593; 1254 reports in
// an engine's -O3 -march=native build of kvevict 0.1). The masked forms below, with every
// lane selected and a defined pass-through, compile to the same instructions and are clean.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvevict/config.hpp"
#include "kvevict/detail/isa/avx2.hpp"
#include "kvevict/detail/isa/common.hpp"
#include "kvevict/detail/isa/scalar.hpp"
#include "kvevict/detail/isa/target.hpp"
#include "kvevict/dtype.hpp"
#include "kvevict/views/cache_view.hpp"

#if KVEVICT_X86_DISPATCH
KVEVICT_NAMESPACE_BEGIN
namespace detail {

KVEVICT_TARGET_AVX512_BEGIN
namespace isa_avx512 {

constexpr __mmask16 all16 = 0xffff;

// ---- intrinsics without GCC 12's undefined pass-through (see the top of this file) ----------
KVEVICT_ALWAYS_INLINE __m512 max_ps(__m512 a, __m512 b) noexcept {
  return _mm512_mask_max_ps(a, all16, a, b);
}
KVEVICT_ALWAYS_INLINE __m512 min_ps(__m512 a, __m512 b) noexcept {
  return _mm512_mask_min_ps(a, all16, a, b);
}
KVEVICT_ALWAYS_INLINE __m512 round_nearest_ps(__m512 a) noexcept {
  return _mm512_mask_roundscale_ps(a, all16, a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
KVEVICT_ALWAYS_INLINE __m512 scalef_ps(__m512 a, __m512 b) noexcept {
  return _mm512_mask_scalef_ps(a, all16, a, b);
}
KVEVICT_ALWAYS_INLINE __m512 cvtph_ps(__m256i h) noexcept {
  return _mm512_mask_cvtph_ps(_mm512_setzero_ps(), all16, h);
}
KVEVICT_ALWAYS_INLINE __m512i cvtepu16_epi32(__m256i h) noexcept {
  return _mm512_mask_cvtepu16_epi32(_mm512_setzero_si512(), all16, h);
}
KVEVICT_ALWAYS_INLINE __m512i slli16_epi32(__m512i a) noexcept {
  return _mm512_mask_slli_epi32(a, all16, a, 16);
}
KVEVICT_ALWAYS_INLINE __m512 unpacklo_ps(__m512 a, __m512 b) noexcept {
  return _mm512_mask_unpacklo_ps(a, all16, a, b);
}
KVEVICT_ALWAYS_INLINE __m512 unpackhi_ps(__m512 a, __m512 b) noexcept {
  return _mm512_mask_unpackhi_ps(a, all16, a, b);
}
template <int imm>
KVEVICT_ALWAYS_INLINE __m512 shuffle_ps(__m512 a, __m512 b) noexcept {
  return _mm512_mask_shuffle_ps(a, all16, a, b, imm);
}
template <int imm>
KVEVICT_ALWAYS_INLINE __m512 shuffle_f32x4(__m512 a, __m512 b) noexcept {
  return _mm512_mask_shuffle_f32x4(a, all16, a, b, imm);
}

/// Mask of the first min(max(n, 0), 16) lanes.
KVEVICT_ALWAYS_INLINE __mmask16 first_lanes(std::int64_t n) noexcept {
  return n >= 16 ? all16 : (n <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << n) - 1u));
}

/// exp(x) on 16 lanes (Cephes' expf polynomial after a two-constant ln 2 reduction, within
/// 2 ulp of expf). -inf and x < -104 give +0 exactly, so masked logits contribute nothing;
/// NaN stays NaN (max/min return their second operand when one is NaN).
KVEVICT_ALWAYS_INLINE __m512 exp16(__m512 x) noexcept {
  x = min_ps(_mm512_set1_ps(88.7f), max_ps(_mm512_set1_ps(-104.0f), x));
  const __m512 n = round_nearest_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)));
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return scalef_ps(y, n);  // y * 2^n, rounding correctly into the subnormals
}

/// Horizontal sum and max through memory, in lane order.
KVEVICT_ALWAYS_INLINE float hsum16(__m512 v) noexcept {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  float s = 0.0f;
  for (float x : lanes) s += x;
  return s;
}
KVEVICT_ALWAYS_INLINE float hmax16(__m512 v) noexcept {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  float m = lanes[0];
  for (float x : lanes) m = x > m ? x : m;
  return m;
}

/// acc[j] += weight * exp(row[j] - lse) (or max) for the first `live` entries of a prepared
/// row; -inf and NaN logits (masked keys; NaN keys or queries) contribute exactly 0.
inline void accumulate_row(bool max_over_window, const float* row, std::int64_t live, float lse, float weight,
                           float* acc) noexcept {
  const __m512 vlse = _mm512_set1_ps(lse), vw = _mm512_set1_ps(weight),
               vneg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (std::int64_t j = 0; j < live; j += 16) {
    const __mmask16 m = first_lanes(live - j);
    const __m512 x = _mm512_maskz_loadu_ps(m, row + j);
    // A -inf or NaN logit is exactly 0 even when the row's LSE is NaN (a +inf logit elsewhere
    // in the row): an observation must not poison keys it does not see.
    const __m512 prob = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vneg_inf, _CMP_GT_OQ), exp16(_mm512_sub_ps(x, vlse)));
    const __m512 a = _mm512_maskz_loadu_ps(m, acc + j);
    if (max_over_window) {  // nan_max: a NaN probability wins, as torch.max propagates it
      const __mmask16 take = _mm512_cmp_ps_mask(prob, a, _CMP_GT_OQ) | _mm512_cmp_ps_mask(prob, prob, _CMP_UNORD_Q);
      _mm512_mask_storeu_ps(acc + j, m, _mm512_mask_blend_ps(take, a, prob));
    } else {
      _mm512_mask_storeu_ps(acc + j, m, _mm512_fmadd_ps(vw, prob, a));
    }
  }
}

/// Online log-sum-exp update of one row with a prepared tile row; NaN logits count as -inf.
inline void lse_update(const float* row, std::int64_t live, float* row_max, float* row_sum) noexcept {
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  if (live <= 0) return;
  __m512 vmax = _mm512_set1_ps(neg_inf);
  for (std::int64_t j = 0; j < live; j += 16)
    vmax = max_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(neg_inf), first_lanes(live - j), row + j), vmax);
  const float tile_max = hmax16(vmax);
  if (tile_max == neg_inf) return;
  if (tile_max > *row_max) {
    *row_sum *= std::exp(*row_max - tile_max);
    *row_max = tile_max;
  }
  const __m512 vm = _mm512_set1_ps(*row_max), vneg_inf = _mm512_set1_ps(neg_inf);
  __m512 sum = _mm512_setzero_ps();
  for (std::int64_t j = 0; j < live; j += 16) {
    const __m512 x = _mm512_maskz_loadu_ps(first_lanes(live - j), row + j);
    const __mmask16 m = _mm512_mask_cmp_ps_mask(first_lanes(live - j), x, vneg_inf, _CMP_GT_OQ);
    sum = _mm512_mask_add_ps(sum, m, sum, exp16(_mm512_sub_ps(x, vm)));
  }
  *row_sum += hsum16(sum);
}

/// Channels [0, 16) of p widened to float32 in registers; lanes outside `m` are 0 and their
/// memory is not touched (masked loads), so row tails need no special case.
KVEVICT_ALWAYS_INLINE __m512 widen16(const float* p, __mmask16 m) noexcept {
  return _mm512_maskz_loadu_ps(m, p);
}
KVEVICT_ALWAYS_INLINE __m512 widen16(const bf16* p, __mmask16 m) noexcept {
  return _mm512_castsi512_ps(slli16_epi32(cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p))));  // a float's top half
}
KVEVICT_ALWAYS_INLINE __m512 widen16(const fp16* p, __mmask16 m) noexcept {
  return cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
/// fp8 as in the AVX2 set (detail/isa/avx2.hpp): through fp16, masked byte loads.
KVEVICT_ALWAYS_INLINE __m512 widen16(const fp8_e5m2* p, __mmask16 m) noexcept {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p));
  return cvtph_ps(_mm256_slli_epi16(w, 8));
}
KVEVICT_ALWAYS_INLINE __m512 widen16(const fp8_e4m3* p, __mmask16 m) noexcept {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p));
  const __m256i mag = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
  const __m256i half =
      _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8), _mm256_slli_epi16(mag, 7));
  const __m512 value = _mm512_mul_ps(cvtph_ps(half), _mm512_set1_ps(256.0f));
  const __mmask16 nan_lanes = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7f));
  const __m512 signed_nan = _mm512_castsi512_ps(_mm512_or_si512(
      _mm512_and_si512(_mm512_castps_si512(value), _mm512_set1_epi32(std::numeric_limits<std::int32_t>::min())),
      _mm512_set1_epi32(0x7fc00000)));
  return _mm512_mask_blend_ps(nan_lanes, value, signed_nan);
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
  for (std::int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = first_lanes(n - i);
    _mm512_mask_storeu_ps(dst + i, m, widen16(src + i, m));
  }
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

/// Whether narrow_logits reads keys straight from a cache with contiguous channels, so that
/// prompt windows can compute their logits once, in chunks of cached rows (observe_head.inl).
constexpr bool reads_keys_unpacked = true;

constexpr std::int64_t panel_keys = 32;

template <class KT>
void pack_key_panels(const cache_view<const KT>& keys, std::int64_t h, std::int64_t j0, std::int64_t n,
                     std::int64_t dim, float* panel) noexcept {
  isa_avx2::pack_panels<static_cast<int>(panel_keys)>(keys, h, j0, n, dim, panel);
}

/// MR rows x 32 keys of logits: two accumulators per row, one FMA chain per logit (as the
/// AVX2 set: the same bits).
template <int MR>
KVEVICT_ALWAYS_INLINE void logits_block(const float* q, std::int64_t dim, const float* panel, float* out,
                                        std::int64_t ld) noexcept {
  __m512 acc[MR][2];
  KVEVICT_UNROLL
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (std::int64_t c = 0; c < dim; ++c) {
    const __m512 k0 = _mm512_loadu_ps(panel + c * panel_keys), k1 = _mm512_loadu_ps(panel + c * panel_keys + 16);
    KVEVICT_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m512 qv = _mm512_set1_ps(q[i * dim + c]);
      acc[i][0] = _mm512_fmadd_ps(qv, k0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(qv, k1, acc[i][1]);
    }
  }
  KVEVICT_UNROLL
  for (int i = 0; i < MR; ++i) {
    _mm512_storeu_ps(out + i * ld, acc[i][0]);
    _mm512_storeu_ps(out + i * ld + 16, acc[i][1]);
  }
}

/// out[r * ld + j] = sum_c q[r * dim + c] * key_j[c] for r < rows, j < n rounded up to 32.
inline void logits_panels(const float* q, std::int64_t rows, std::int64_t dim, const float* panel, std::int64_t n,
                          float* out, std::int64_t ld) noexcept {
  const std::int64_t panels = (n + panel_keys - 1) / panel_keys;
  // Rows in chunks whose queries stay in L1 (about 12 KB) while every panel passes by; each
  // panel, read once per chunk, stays in L1 for the chunk's micro-kernels. Streaming all the
  // rows' queries from L2 for every panel ran at two thirds of the FMA peak.
  const std::int64_t chunk = std::max<std::int64_t>(8, 3072 / (dim > 0 ? dim : 1) / 8 * 8);
  for (std::int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const std::int64_t end = std::min(rows, r0 + chunk);
    for (std::int64_t p = 0; p < panels; ++p) {
      const float* kp = panel + p * dim * panel_keys;
      float* o = out + p * panel_keys;
      std::int64_t r = r0;
      for (; end - r >= 8; r += 8) logits_block<8>(q + r * dim, dim, kp, o + r * ld, ld);
      switch (end - r) {
        case 7:
          logits_block<7>(q + r * dim, dim, kp, o + r * ld, ld);
          break;
        case 6:
          logits_block<6>(q + r * dim, dim, kp, o + r * ld, ld);
          break;
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

/// Sums of four vectors: lane i of the result is the horizontal sum of the i-th argument.
KVEVICT_ALWAYS_INLINE __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) noexcept {
  // Within each 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3), then (a, b, c, d) partial sums.
  const __m512 ab = _mm512_add_ps(unpacklo_ps(a, b), unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(unpacklo_ps(c, d), unpackhi_ps(c, d));
  __m512 x = _mm512_add_ps(shuffle_ps<_MM_SHUFFLE(1, 0, 1, 0)>(ab, cd), shuffle_ps<_MM_SHUFFLE(3, 2, 3, 2)>(ab, cd));
  // Then across the four 128-bit lanes.
  x = _mm512_add_ps(x, shuffle_f32x4<_MM_SHUFFLE(1, 0, 3, 2)>(x, x));
  x = _mm512_add_ps(x, shuffle_f32x4<_MM_SHUFFLE(2, 3, 0, 1)>(x, x));
  return __builtin_shufflevector(x, x, 0, 1, 2, 3);  // _mm512_castps512_ps128, without GCC 12's report
}

/// out[i * stride + b] = dot(q[i], k[b]) for RB (<= 8) query rows q[i] = q + i * dim (float32,
/// already scaled) and KB consecutive key rows k[b] (storage type, contiguous channels). Keys
/// are widened in registers 16 channels at a time and each chunk feeds every row, so K is
/// read once; KB = 2 keeps two independent FMA chains per row in flight.
template <int RB, int KB, class KT>
KVEVICT_ALWAYS_INLINE void narrow_dots(const float* q, std::int64_t dim, const KT* const* k, float* out,
                                       std::int64_t stride) noexcept {
  static_assert(RB >= 1 && RB <= 8 && KB >= 1 && KB <= 2, "rows and keys per pass");
  __m512 acc[KB][8];
  KVEVICT_UNROLL
  for (int b = 0; b < KB; ++b) {
    KVEVICT_UNROLL
    for (int i = 0; i < 8; ++i) acc[b][i] = _mm512_setzero_ps();
  }
  for (std::int64_t c = 0; c < dim; c += 16) {
    const __mmask16 m = first_lanes(dim - c);
    __m512 kv[KB];
    KVEVICT_UNROLL
    for (int b = 0; b < KB; ++b) kv[b] = widen16(k[b] + c, m);
    KVEVICT_UNROLL
    for (int i = 0; i < RB; ++i) {
      const __m512 qv = _mm512_maskz_loadu_ps(m, q + i * dim + c);
      KVEVICT_UNROLL
      for (int b = 0; b < KB; ++b) acc[b][i] = _mm512_fmadd_ps(kv[b], qv, acc[b][i]);
    }
  }
  KVEVICT_UNROLL
  for (int b = 0; b < KB; ++b) {
    alignas(16) float sums[8];
    _mm_store_ps(sums, hsum4(acc[b][0], acc[b][1], acc[b][2], acc[b][3]));
    if (RB > 4) _mm_store_ps(sums + 4, hsum4(acc[b][4], acc[b][5], acc[b][6], acc[b][7]));
    KVEVICT_UNROLL
    for (int i = 0; i < RB; ++i) out[i * stride + b] = sums[i];
  }
}

/// Rows [r0, rows) of one key pair (KB = 2) or key (KB = 1), in passes of up to 8 rows.
template <int KB, class KT>
KVEVICT_ALWAYS_INLINE void narrow_key_rows(const float* q, std::int64_t rows, std::int64_t dim, const KT* const* k,
                                           float* out, std::int64_t stride) noexcept {
  for (std::int64_t r0 = 0; r0 < rows; r0 += 8) {
    const float* qr = q + r0 * dim;
    float* o = out + r0 * stride;
    switch (rows - r0 < 8 ? rows - r0 : 8) {
      case 1:
        narrow_dots<1, KB>(qr, dim, k, o, stride);
        break;
      case 2:
        narrow_dots<2, KB>(qr, dim, k, o, stride);
        break;
      case 3:
        narrow_dots<3, KB>(qr, dim, k, o, stride);
        break;
      case 4:
        narrow_dots<4, KB>(qr, dim, k, o, stride);
        break;
      case 5:
        narrow_dots<5, KB>(qr, dim, k, o, stride);
        break;
      case 6:
        narrow_dots<6, KB>(qr, dim, k, o, stride);
        break;
      case 7:
        narrow_dots<7, KB>(qr, dim, k, o, stride);
        break;
      default:
        narrow_dots<8, KB>(qr, dim, k, o, stride);
        break;
    }
  }
}

/// In place: r[k] (16 rows of 16 dwords) becomes its transpose, r[k][t] = old r[t][k].
KVEVICT_ALWAYS_INLINE void transpose16x16_epi32(__m512i* r) noexcept {
  __m512i t[16], u[16];
  KVEVICT_UNROLL
  for (int i = 0; i < 16; i += 2) {  // within 128-bit lanes: (a0 b0 a1 b1), (a2 b2 a3 b3)
    t[i] = _mm512_mask_unpacklo_epi32(r[i], all16, r[i], r[i + 1]);
    t[i + 1] = _mm512_mask_unpackhi_epi32(r[i], all16, r[i], r[i + 1]);
  }
  constexpr __mmask8 all8 = 0xff;
  KVEVICT_UNROLL
  for (int g = 0; g < 16; g += 4) {  // u[g + e], lane L: rows g..g+3 at column 4L + e
    u[g + 0] = _mm512_mask_unpacklo_epi64(t[g], all8, t[g], t[g + 2]);
    u[g + 1] = _mm512_mask_unpackhi_epi64(t[g], all8, t[g], t[g + 2]);
    u[g + 2] = _mm512_mask_unpacklo_epi64(t[g + 1], all8, t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_mask_unpackhi_epi64(t[g + 1], all8, t[g + 1], t[g + 3]);
  }
  KVEVICT_UNROLL
  for (int e = 0; e < 4; ++e) {  // gather lane L of u[e], u[4+e], u[8+e], u[12+e] into row 4L + e
    const __m512i v0 = _mm512_mask_shuffle_i32x4(u[e], all16, u[e], u[4 + e], 0x44);
    const __m512i v1 = _mm512_mask_shuffle_i32x4(u[e], all16, u[e], u[4 + e], 0xee);
    const __m512i v2 = _mm512_mask_shuffle_i32x4(u[8 + e], all16, u[8 + e], u[12 + e], 0x44);
    const __m512i v3 = _mm512_mask_shuffle_i32x4(u[8 + e], all16, u[8 + e], u[12 + e], 0xee);
    r[0 + e] = _mm512_mask_shuffle_i32x4(v0, all16, v0, v2, 0x88);
    r[4 + e] = _mm512_mask_shuffle_i32x4(v0, all16, v0, v2, 0xdd);
    r[8 + e] = _mm512_mask_shuffle_i32x4(v1, all16, v1, v3, 0x88);
    r[12 + e] = _mm512_mask_shuffle_i32x4(v1, all16, v1, v3, 0xdd);
  }
}

/// One 16-key group of bf16 key rows (16 x dim, dim % 32 == 0) into pair panels: for channel
/// chunk c (32 channels) a 16 x 16 tile of dwords, panel[c][k2][t] = channels (32c + 2k2,
/// 32c + 2k2 + 1) of key t: the layout VDPBF16PS (16 keys per vector) and AMX's TDPBF16PS
/// ("B" operand) both read. Rows of missing keys (rows[t] == nullptr) are zero.
inline void pack_key_group_pairs(const std::uint16_t* const* rows, std::int64_t dim, std::uint32_t* panel) noexcept {
  for (std::int64_t c = 0; c < dim / 32; ++c) {
    __m512i r[16];
    KVEVICT_UNROLL
    for (int t = 0; t < 16; ++t)
      r[t] = rows[t] != nullptr ? _mm512_loadu_si512(rows[t] + 32 * c) : _mm512_setzero_si512();
    transpose16x16_epi32(r);
    KVEVICT_UNROLL
    for (int k2 = 0; k2 < 16; ++k2) _mm512_storeu_si512(panel + (c * 16 + k2) * 16, r[k2]);
  }
}

/// Keys [j0, j0+n) of head h (bf16, dim % 32 == 0) as pair panels: groups of 16 keys, padded
/// with zero keys to a multiple of 32; group g at panels + g * (dim / 32) * 256.
template <class KT>
void pack_key_tile_pairs(const cache_view<const KT>& keys, std::int64_t h, std::int64_t j0, std::int64_t n,
                         std::int64_t dim, std::uint32_t* panels) noexcept {
  const std::int64_t groups = (n + 31) / 32 * 2;
  for (std::int64_t g = 0; g < groups; ++g) {
    const std::uint16_t* rows[16];
    KVEVICT_UNROLL
    for (std::int64_t t = 0; t < 16; ++t) {
      const std::int64_t j = g * 16 + t;
      rows[t] = j < n ? reinterpret_cast<const std::uint16_t*>(keys.row(h, j0 + j)) : nullptr;
    }
    pack_key_group_pairs(rows, dim, panels + g * (dim / 32) * 256);
  }
}

/// Keeps offsets j (ascending) with score_key(x[j]) >= threshold; returns how many. index
/// and key need n entries.
inline std::int64_t filter_at_least(const float* x, std::int64_t n, std::uint32_t threshold, std::uint32_t* index,
                                    std::uint32_t* key) noexcept {
  std::int64_t m = 0, j = 0;
  const __m512i vthreshold = _mm512_set1_epi32(static_cast<int>(threshold));
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512i step = _mm512_set1_epi32(16);
  const __m512 zero = _mm512_setzero_ps();
  __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; n - j >= 16; j += 16) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(x + j), zero);
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i sign_fill = _mm512_mask_srai_epi32(bits, all16, bits, 31);
    __m512i k = _mm512_xor_si512(bits, _mm512_or_si512(sign_fill, sign));
    k = _mm512_mask_mov_epi32(k, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_setzero_si512());
    const __mmask16 keep = _mm512_cmp_epu32_mask(k, vthreshold, _MM_CMPINT_NLT);
    // Compress in registers and store whole vectors: VPCOMPRESSD to memory is microcoded on
    // AMD Zen 4 (tens of cycles). The lanes past the kept ones land where later ones go, and
    // m + 16 <= j + 16 <= n keeps the store inside index and key.
    _mm512_storeu_si512(index + m, _mm512_maskz_compress_epi32(keep, iota));
    _mm512_storeu_si512(key + m, _mm512_maskz_compress_epi32(keep, k));
    m += __builtin_popcount(static_cast<unsigned>(keep));
    iota = _mm512_add_epi32(iota, step);
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

}  // namespace isa_avx512
KVEVICT_TARGET_END

}  // namespace detail
KVEVICT_NAMESPACE_END
#endif  // KVEVICT_X86_DISPATCH

#endif  // KVEVICT_DETAIL_ISA_AVX512_HPP
