// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_ISA_AMX_HPP
#define KVEVICT_DETAIL_ISA_AMX_HPP

// Intel AMX tile products for bf16 x bf16 logits (cpu_isa::amx), in their own target region
// of the AVX-512 set: TDPBF16PS multiplies bf16 pairs exactly and accumulates in float32,
// about ten times the float32 FMA rate. Used only after Linux granted the process tile state
// (cpu_isa.hpp asks once, when the process's path resolves to amx); KVEVICT_NO_AMX leaves
// this file empty. Tile state is configured and released within each call, so nothing leaks
// into the caller's (or another library's) tile use.

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/detail/isa/avx512.hpp"
#include "kvevict/detail/isa/target.hpp"

#if KVEVICT_AMX_DISPATCH
KVEVICT_NAMESPACE_BEGIN
namespace detail {

KVEVICT_TARGET_AMX_BEGIN
namespace isa_avx512 {

/// Palette 1 with the first `tiles` tiles at 16 rows of 64 bytes.
struct alignas(64) amx_tile_config {
  std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
  explicit amx_tile_config(int tiles) noexcept {
    for (int t = 0; t < tiles; ++t) {
      colsb[t] = 64;  // 16 floats, or 32 bf16 = 16 pairs
      rows[t] = 16;
    }
  }
};

/// LDTILECFG with the whole 64-byte configuration as its operand. GCC 12's _tile_loadconfig
/// tells the optimiser it reads 8 bytes (a pointer's worth), so the stores that fill in the
/// tile shapes may be removed as dead: the bench's AMX roofline, built that way, loaded a
/// configuration of zero shapes and faulted in LDTILECFG.
inline void load_tile_config(const amx_tile_config& cfg) noexcept {
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

/// out[r * ld + t] = scale * dot(q[r], k[t]) for rows r < rows and keys t < keys, both
/// multiples of 32. q: bf16 rows [rows][dim] (dim % 32 == 0), unscaled; panels: the keys'
/// groups of 16 packed by pack_key_tile_pairs, group g at panels + g * (dim / 32) * 256.
/// Each step computes a 32 x 32 block in four accumulator tiles (tmm0-3) from two query
/// tiles (tmm4-5) and two key panels (tmm6-7).
inline void logits_tile_amx(const std::uint16_t* q, std::int64_t rows, std::int64_t dim, const std::uint32_t* panels,
                            std::int64_t keys, float scale, float* out, std::int64_t ld) noexcept {
  const amx_tile_config cfg(8);
  load_tile_config(cfg);
  const std::int64_t chunks = dim / 32, group_stride = chunks * 256;
  const auto q_stride = static_cast<long>(dim * 2), out_stride = static_cast<long>(ld * 4);
  const __m512 vs = _mm512_set1_ps(scale);
  for (std::int64_t t0 = 0; t0 < keys; t0 += 32) {
    const std::uint32_t* b0 = panels + (t0 / 16) * group_stride;
    const std::uint32_t* b1 = b0 + group_stride;
    for (std::int64_t r0 = 0; r0 < rows; r0 += 32) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (std::int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(4, q + r0 * dim + 32 * c, q_stride);
        _tile_loadd(5, q + (r0 + 16) * dim + 32 * c, q_stride);
        _tile_loadd(6, b0 + c * 256, 64);
        _tile_loadd(7, b1 + c * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      float* o = out + r0 * ld + t0;
      _tile_stored(0, o, out_stride);
      _tile_stored(1, o + 16, out_stride);
      _tile_stored(2, o + 16 * ld, out_stride);
      _tile_stored(3, o + 16 * ld + 16, out_stride);
      for (std::int64_t r = 0; r < 32; ++r) {  // the 1/sqrt(d) scale, while the block is in L1
        _mm512_storeu_ps(o + r * ld, _mm512_mul_ps(vs, _mm512_loadu_ps(o + r * ld)));
        _mm512_storeu_ps(o + r * ld + 16, _mm512_mul_ps(vs, _mm512_loadu_ps(o + r * ld + 16)));
      }
    }
  }
  _tile_release();
}

/// Decode-sized products: out[r * out_stride + t] = scale * dot(q[r], key t) for rows r < rows
/// (<= 16) and keys t < 16 * groups, the keys read straight from the cache (bf16 rows at
/// k + t * k_stride, dim % 32 == 0) as AMX "A" tiles, one 16-key group at a time. q_panels:
/// the query rows packed by pack_key_group_pairs (rows past `rows` zero). The 16 x 16 result
/// tile (keys x rows) is transposed in registers so each query row's logits land contiguous.
/// K is read once, with no widening and no per-key horizontal sums.
inline void narrow_logits_amx(const std::uint16_t* k, std::int64_t k_stride, std::int64_t groups, std::int64_t dim,
                              const std::uint32_t* q_panels, std::int64_t rows, float scale, float* out,
                              std::int64_t out_stride) noexcept {
  const amx_tile_config cfg(3);
  load_tile_config(cfg);
  alignas(64) std::uint32_t c_tile[16 * 16];
  const std::int64_t chunks = dim / 32;
  const auto stride_bytes = static_cast<long>(k_stride * 2);
  const __m512 vs = _mm512_set1_ps(scale);
  const std::int64_t row_bytes = dim * 2;
  for (std::int64_t g = 0; g < groups; ++g) {
    const std::uint16_t* kg = k + g * 16 * k_stride;
    // A decode step is bound by DRAM: request the group after next while this one computes
    // (tile loads alone keep too few misses in flight).
    if (g + 2 < groups)
      for (std::int64_t t = 0; t < 16; ++t)
        for (std::int64_t b = 0; b < row_bytes; b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(kg + (32 + t) * k_stride) + b, _MM_HINT_T0);
    _tile_zero(0);
    for (std::int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(1, kg + 32 * c, stride_bytes);
      _tile_loadd(2, q_panels + c * 256, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, c_tile, 64);
    __m512i r[16];
    KVEVICT_UNROLL
    for (int t = 0; t < 16; ++t) r[t] = _mm512_load_si512(c_tile + 16 * t);
    transpose16x16_epi32(r);  // r[q] = query row q's logits of the 16 keys
    for (std::int64_t q = 0; q < rows; ++q)
      _mm512_storeu_ps(out + q * out_stride + 16 * g, _mm512_mul_ps(vs, _mm512_castsi512_ps(r[q])));
  }
  _tile_release();
}

}  // namespace isa_avx512
KVEVICT_TARGET_END

}  // namespace detail
KVEVICT_NAMESPACE_END
#endif  // KVEVICT_AMX_DISPATCH

#endif  // KVEVICT_DETAIL_ISA_AMX_HPP
