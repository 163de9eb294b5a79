// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_WIDEN_HPP
#define KVEVICT_DETAIL_WIDEN_HPP

// Widening rows of storage elements to float32, one tile at a time: kvevict never converts
// a whole cache. Contiguous rows take SIMD paths when the compiler targets AVX-512 or F16C.

#include <cstdint>
#include <cstring>

#include "kvevict/config.hpp"
#include "kvevict/dtype.hpp"

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

// The hand-written AVX-512 kernels (decode dot products, vector exp) need masked 16-bit
// loads (AVX512BW + VL); without them the portable paths run.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVEVICT_DETAIL_AVX512 1
#else
#define KVEVICT_DETAIL_AVX512 0
#endif

KVEVICT_NAMESPACE_BEGIN
namespace detail {

/// dst[i] = float(src[i * stride]) for i in [0, n).
inline void widen_row(const float* src, std::int64_t stride, float* dst, std::int64_t n) noexcept {
  if (stride == 1) {
    std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) dst[i] = src[i * stride];
}

inline void widen_row(const bf16* src, std::int64_t stride, float* dst, std::int64_t n) noexcept {
  if (stride != 1) {
    for (std::int64_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_float(src[i * stride].bits);
    return;
  }
  std::int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = bf16_bits_to_float(src[i].bits);
}

inline void widen_row(const fp16* src, std::int64_t stride, float* dst, std::int64_t n) noexcept {
  if (stride != 1) {
    for (std::int64_t i = 0; i < n; ++i) dst[i] = fp16_bits_to_float(src[i * stride].bits);
    return;
  }
  std::int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = fp16_bits_to_float(src[i].bits);
}

#if KVEVICT_DETAIL_AVX512
/// Channels [0, 16) of p widened to float32 in registers; lanes outside `m` are 0 and their
/// memory is not touched (masked loads), so row tails need no special case.
KVEVICT_ALWAYS_INLINE __m512 widen16(const float* p, __mmask16 m) noexcept {
  return _mm512_maskz_loadu_ps(m, p);
}
KVEVICT_ALWAYS_INLINE __m512 widen16(const bf16* p, __mmask16 m) noexcept {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));  // bf16 is a float's top half
}
KVEVICT_ALWAYS_INLINE __m512 widen16(const fp16* p, __mmask16 m) noexcept {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
/// Mask of the first min(n, 16) lanes.
KVEVICT_ALWAYS_INLINE __mmask16 first_lanes(std::int64_t n) noexcept {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}
#endif

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DETAIL_WIDEN_HPP
