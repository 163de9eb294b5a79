// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_ISA_AVX512_BF16_HPP
#define KVEVICT_DETAIL_ISA_AVX512_BF16_HPP

// The AVX-512 kernel set's bf16 x bf16 products (cpu_isa::avx512bf16: VDPBF16PS, in their own
// target region: they run only where the CPU has AVX512_BF16), and narrow_logits, which picks
// them or the float32 chains of detail/isa/avx512.hpp. They multiply bf16 pairs exactly and
// accumulate in float32 with the instruction's own rounding (subnormal inputs and results
// flushed to zero), a different summation than the float32 chains: they agree with them
// within the tolerance of docs/cpu-dispatch.md, not bit for bit.

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/detail/isa/avx2.hpp"
#include "kvevict/detail/isa/avx512.hpp"
#include "kvevict/detail/isa/common.hpp"
#include "kvevict/detail/isa/target.hpp"
#include "kvevict/dtype.hpp"
#include "kvevict/views/cache_view.hpp"

#if KVEVICT_X86_DISPATCH
KVEVICT_NAMESPACE_BEGIN
namespace detail {

// ---- bf16 x bf16 products (cpu_isa::avx512bf16) -------------------------------------------
KVEVICT_TARGET_AVX512BF16_BEGIN
namespace isa_avx512 {

/// The bf16 x bf16 variant of narrow_dots: VDPBF16PS multiplies pairs of bf16 channels
/// exactly and adds them into float32 lanes (subnormals flushed), 32 channels per
/// instruction with no widening. q holds the unscaled bf16 query rows; the 1/sqrt(d) scale
/// is applied to the float32 sums.
template <int RB, int KB>
KVEVICT_ALWAYS_INLINE void narrow_dots_bf16(const bf16* q, std::int64_t dim, const bf16* const* k, float scale,
                                            float* out, std::int64_t stride) noexcept {
  static_assert(RB >= 1 && RB <= 8 && KB >= 1 && KB <= 2, "rows and keys per pass");
  __m512 acc[KB][8];
  KVEVICT_UNROLL
  for (int b = 0; b < KB; ++b) {
    KVEVICT_UNROLL
    for (int i = 0; i < 8; ++i) acc[b][i] = _mm512_setzero_ps();
  }
  for (std::int64_t c = 0; c < dim; c += 32) {
    const __mmask32 m = dim - c >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (dim - c)) - 1u);
    __m512i kv[KB];
    KVEVICT_UNROLL
    for (int b = 0; b < KB; ++b) kv[b] = _mm512_maskz_loadu_epi16(m, k[b] + c);
    KVEVICT_UNROLL
    for (int i = 0; i < RB; ++i) {
      const __m512i qv = _mm512_maskz_loadu_epi16(m, q + i * dim + c);
      KVEVICT_UNROLL
      for (int b = 0; b < KB; ++b) acc[b][i] = _mm512_dpbf16_ps(acc[b][i], (__m512bh)kv[b], (__m512bh)qv);
    }
  }
  const __m128 vs = _mm_set1_ps(scale);
  KVEVICT_UNROLL
  for (int b = 0; b < KB; ++b) {
    alignas(16) float sums[8];
    _mm_store_ps(sums, _mm_mul_ps(vs, hsum4(acc[b][0], acc[b][1], acc[b][2], acc[b][3])));
    if (RB > 4) _mm_store_ps(sums + 4, _mm_mul_ps(vs, hsum4(acc[b][4], acc[b][5], acc[b][6], acc[b][7])));
    KVEVICT_UNROLL
    for (int i = 0; i < RB; ++i) out[i * stride + b] = sums[i];
  }
}

template <int RB, class KT>
void narrow_rows_bf16(const cache_view<const KT>& keys, std::int64_t h, std::int64_t j0, std::int64_t n, const bf16* qb,
                      float scale, std::int64_t dim, float* out, std::int64_t stride) noexcept {
  std::int64_t j = 0;
  const std::int64_t end = keys.num_tokens;
  for (; j + 2 <= n; j += 2) {
    isa_avx2::prefetch_key(keys, h, j0 + j, end, dim);
    isa_avx2::prefetch_key(keys, h, j0 + j + 1, end, dim);
    const bf16* k[2] = {reinterpret_cast<const bf16*>(keys.row(h, j0 + j)),
                        reinterpret_cast<const bf16*>(keys.row(h, j0 + j + 1))};
    narrow_dots_bf16<RB, 2>(qb, dim, k, scale, out + j, stride);
  }
  for (; j < n; ++j) {
    const bf16* k[1] = {reinterpret_cast<const bf16*>(keys.row(h, j0 + j))};
    narrow_dots_bf16<RB, 1>(qb, dim, k, scale, out + j, stride);
  }
}

template <class KT>
void narrow_logits_bf16(const cache_view<const KT>& keys, std::int64_t h, std::int64_t j0, std::int64_t n,
                        const narrow_queries& nq, std::int64_t rows, std::int64_t dim, float* out,
                        std::int64_t stride) noexcept {
  for (std::int64_t r0 = 0; r0 < rows; r0 += 8) {
    const bf16* qb = nq.qb + r0 * dim;
    float* o = out + r0 * stride;
    switch (rows - r0 < 8 ? rows - r0 : 8) {
      case 1:
        narrow_rows_bf16<1>(keys, h, j0, n, qb, nq.scale, dim, o, stride);
        break;
      case 2:
        narrow_rows_bf16<2>(keys, h, j0, n, qb, nq.scale, dim, o, stride);
        break;
      case 3:
        narrow_rows_bf16<3>(keys, h, j0, n, qb, nq.scale, dim, o, stride);
        break;
      case 4:
        narrow_rows_bf16<4>(keys, h, j0, n, qb, nq.scale, dim, o, stride);
        break;
      case 5:
        narrow_rows_bf16<5>(keys, h, j0, n, qb, nq.scale, dim, o, stride);
        break;
      case 6:
        narrow_rows_bf16<6>(keys, h, j0, n, qb, nq.scale, dim, o, stride);
        break;
      case 7:
        narrow_rows_bf16<7>(keys, h, j0, n, qb, nq.scale, dim, o, stride);
        break;
      default:
        narrow_rows_bf16<8>(keys, h, j0, n, qb, nq.scale, dim, o, stride);
        break;
    }
  }
}

/// MR rows x 32 keys of bf16 x bf16 logits on pair panels (two 16-key groups g0, g1): each
/// logit is one VDPBF16PS chain over the channel pairs in order, then scaled.
template <int MR>
KVEVICT_ALWAYS_INLINE void logits_block_pairs(const std::uint32_t* q, std::int64_t pairs, const std::uint32_t* g0,
                                              const std::uint32_t* g1, float scale, float* out,
                                              std::int64_t ld) noexcept {
  __m512 acc[MR][2];
  KVEVICT_UNROLL
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (std::int64_t p = 0; p < pairs; ++p) {
    const __m512i k0 = _mm512_loadu_si512(g0 + p * 16), k1 = _mm512_loadu_si512(g1 + p * 16);
    KVEVICT_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m512i qv = _mm512_set1_epi32(static_cast<int>(q[i * pairs + p]));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], (__m512bh)k0, (__m512bh)qv);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], (__m512bh)k1, (__m512bh)qv);
    }
  }
  const __m512 vs = _mm512_set1_ps(scale);
  KVEVICT_UNROLL
  for (int i = 0; i < MR; ++i) {
    _mm512_storeu_ps(out + i * ld, _mm512_mul_ps(vs, acc[i][0]));
    _mm512_storeu_ps(out + i * ld + 16, _mm512_mul_ps(vs, acc[i][1]));
  }
}

/// out[r * ld + j] = scale * dot(q[r], key_j) for r < rows, j < n rounded up to 32; q: bf16
/// rows [rows][dim] (dim % 32 == 0), unscaled; panels from pack_key_tile_pairs.
inline void logits_pairs(const bf16* q, std::int64_t rows, std::int64_t dim, const std::uint32_t* panels,
                         std::int64_t n, float scale, float* out, std::int64_t ld) noexcept {
  const std::int64_t pairs = dim / 2, group_stride = (dim / 32) * 256;
  const auto* qd = reinterpret_cast<const std::uint32_t*>(q);
  for (std::int64_t t0 = 0; t0 < n; t0 += 32) {
    const std::uint32_t* g0 = panels + (t0 / 16) * group_stride;
    const std::uint32_t* g1 = g0 + group_stride;
    float* o = out + t0;
    std::int64_t r = 0;
    for (; rows - r >= 8; r += 8) logits_block_pairs<8>(qd + r * pairs, pairs, g0, g1, scale, o + r * ld, ld);
    switch (rows - r) {
      case 7:
        logits_block_pairs<7>(qd + r * pairs, pairs, g0, g1, scale, o + r * ld, ld);
        break;
      case 6:
        logits_block_pairs<6>(qd + r * pairs, pairs, g0, g1, scale, o + r * ld, ld);
        break;
      case 5:
        logits_block_pairs<5>(qd + r * pairs, pairs, g0, g1, scale, o + r * ld, ld);
        break;
      case 4:
        logits_block_pairs<4>(qd + r * pairs, pairs, g0, g1, scale, o + r * ld, ld);
        break;
      case 3:
        logits_block_pairs<3>(qd + r * pairs, pairs, g0, g1, scale, o + r * ld, ld);
        break;
      case 2:
        logits_block_pairs<2>(qd + r * pairs, pairs, g0, g1, scale, o + r * ld, ld);
        break;
      case 1:
        logits_block_pairs<1>(qd + r * pairs, pairs, g0, g1, scale, o + r * ld, ld);
        break;
      default:
        break;
    }
  }
}

}  // namespace isa_avx512
KVEVICT_TARGET_END

KVEVICT_TARGET_AVX512_BEGIN
namespace isa_avx512 {

/// Logits of `rows` (<= cached_logit_rows) queries over keys [j0, j0+n) of head h, written to
/// out[r * stride + (j - j0)], computed from the storage type without packing (keys read
/// once). bf16 x bf16 (nq.qb set, only on avx512bf16 and up) takes VDPBF16PS. False where
/// channels are not contiguous.
template <class KT>
bool narrow_logits(const cache_view<const KT>& keys, std::int64_t h, std::int64_t j0, std::int64_t n,
                   const narrow_queries& nq, std::int64_t rows, std::int64_t dim, float* out,
                   std::int64_t stride) noexcept {
  if (keys.dim_stride != 1) return false;
  if (nq.qb != nullptr) {
    narrow_logits_bf16(keys, h, j0, n, nq, rows, dim, out, stride);
    return true;
  }
  const std::int64_t end = keys.num_tokens;
  // Key pairs outer, row passes inner: each pair feeds every pass while it is in L1.
  std::int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    isa_avx2::prefetch_key(keys, h, j0 + j, end, dim);
    isa_avx2::prefetch_key(keys, h, j0 + j + 1, end, dim);
    const KT* k[2] = {keys.row(h, j0 + j), keys.row(h, j0 + j + 1)};
    narrow_key_rows<2>(nq.q, rows, dim, k, out + j, stride);
  }
  for (; j < n; ++j) {
    const KT* k[1] = {keys.row(h, j0 + j)};
    narrow_key_rows<1>(nq.q, rows, dim, k, out + j, stride);
  }
  return true;
}

}  // namespace isa_avx512
KVEVICT_TARGET_END

}  // namespace detail
KVEVICT_NAMESPACE_END
#endif  // KVEVICT_X86_DISPATCH

#endif  // KVEVICT_DETAIL_ISA_AVX512_BF16_HPP
