// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_GEMM_HPP
#define KVEVICT_DETAIL_GEMM_HPP

// The one matrix product of scoring: logits[R, T] = Q[R, d] * K[T, d]^T, on Eigen's GEMM.
// Callers bound R*d and T*d (see tile_plan) so that Eigen's packing buffers stay on the
// stack (below EIGEN_STACK_ALLOCATION_LIMIT) and the hot path never reaches the heap.
//
// bf16 queries and keys may instead take Intel AMX (logits_tile_amx): TDPBF16PS multiplies
// bf16 pairs exactly and accumulates in float32, about ten times the float32 FMA rate on CPUs
// that have it. Compiled where the target has AMX-BF16 (e.g. -march=native on Sapphire
// Rapids) on Linux, used only if the kernel grants the process tile state; define
// KVEVICT_NO_AMX to leave it out (it asks Linux for AMX state once per process, which enlarges
// signal frames: engines with small sigaltstack stacks may want that).

#include <cstdint>

#include <Eigen/Core>

#include "kvevict/config.hpp"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__) && \
    !defined(KVEVICT_NO_AMX)
#define KVEVICT_DETAIL_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define KVEVICT_DETAIL_AMX 0
#endif

KVEVICT_NAMESPACE_BEGIN
namespace detail {

using row_matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

inline void logits_tile(const float* q, std::int64_t rows, std::int64_t dim, const float* k, std::int64_t cols,
                        float* out) {
  const Eigen::Map<const row_matrix> Q(q, rows, dim);
  const Eigen::Map<const row_matrix> K(k, cols, dim);
  Eigen::Map<row_matrix> O(out, rows, cols);
  O.noalias() = Q * K.transpose();
}

/// Tile sizes for a head dimension: keys per tile and query rows per GEMM call, chosen so
/// that Eigen's packed blocks (rows*d and keys*d floats) stay within 64 KiB and 128 KiB.
struct tile_plan {
  std::int64_t keys;
  std::int64_t rows;
  explicit tile_plan(std::int64_t head_dim) noexcept {
    keys = head_dim > 0 ? 32768 / head_dim : 256;
    keys = keys < 16 ? 16 : (keys > 512 ? 512 : keys);
    keys -= keys % 16;
    rows = head_dim > 0 ? 16384 / head_dim : 128;
    rows = rows < 8 ? 8 : (rows > 256 ? 256 : rows);
  }
};

#if KVEVICT_DETAIL_AMX
/// Whether this process may use AMX tiles. Linux grants tile state only on request
/// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), kernel 5.16+); asked once, and a
/// refusal (older kernel, seccomp) leaves scoring on the AVX-512 path.
inline bool amx_usable() noexcept {
  static const bool granted =
      ::syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
}

/// In place: r[k] (16 rows of 16 dwords) becomes its transpose, r[k][t] = old r[t][k].
KVEVICT_ALWAYS_INLINE void transpose16x16_epi32(__m512i* r) noexcept {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // within 128-bit lanes: (a0 b0 a1 b1), (a2 b2 a3 b3)
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // u[g + e], lane L: rows g..g+3 at column 4L + e
    u[g + 0] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // gather lane L of u[e], u[4+e], u[8+e], u[12+e] into row 4L + e
    const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44), v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xee);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xee);
    r[0 + e] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
    r[8 + e] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
  }
}

/// One 16-key group of bf16 key rows (16 x dim, dim % 32 == 0) into AMX "B" panels: for
/// channel chunk c (32 channels) a 16 x 16 tile of dwords, panel[c][k2][t] = channels
/// (32c + 2k2, 32c + 2k2 + 1) of key t: the pair layout TDPBF16PS expects of B. Rows of
/// missing keys (rows[t] == nullptr) are zero.
inline void pack_key_group_vnni(const std::uint16_t* const* rows, std::int64_t dim, std::uint32_t* panel) noexcept {
  for (std::int64_t c = 0; c < dim / 32; ++c) {
    __m512i r[16];
    for (int t = 0; t < 16; ++t)
      r[t] = rows[t] != nullptr ? _mm512_loadu_si512(rows[t] + 32 * c) : _mm512_setzero_si512();
    transpose16x16_epi32(r);
    for (int k2 = 0; k2 < 16; ++k2) _mm512_store_si512(panel + (c * 16 + k2) * 16, r[k2]);
  }
}

/// out[r * ld + t] = scale * dot(q[r], k[t]) for rows r < rows and keys t < keys, both
/// multiples of 32. q: bf16 rows [rows][dim] (dim % 32 == 0), unscaled; panels: the keys'
/// groups of 16 packed by pack_key_group_vnni, group g at panels + g * (dim / 32) * 256.
/// Each step computes a 32 x 32 block in four accumulator tiles (tmm0-3) from two query
/// tiles (tmm4-5) and two key panels (tmm6-7). Tile state is configured and released
/// within the call, so nothing leaks into the caller's (or another library's) tile use.
inline void logits_tile_amx(const std::uint16_t* q, std::int64_t rows, std::int64_t dim, const std::uint32_t* panels,
                            std::int64_t keys, float scale, float* out, std::int64_t ld) noexcept {
  struct alignas(64) tile_config {
    std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
    std::uint16_t colsb[16] = {};
    std::uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;  // 16 floats, or 32 bf16 = 16 pairs
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
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
/// the query rows packed by pack_key_group_vnni (rows past `rows` zero). The 16 x 16 result
/// tile (keys x rows) is transposed in registers so each query row's logits land contiguous.
/// K is read once, with no widening and no per-key horizontal sums.
inline void narrow_logits_amx(const std::uint16_t* k, std::int64_t k_stride, std::int64_t groups, std::int64_t dim,
                              const std::uint32_t* q_panels, std::int64_t rows, float scale, float* out,
                              std::int64_t out_stride) noexcept {
  struct alignas(64) tile_config {
    std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
    std::uint16_t colsb[16] = {};
    std::uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < 3; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
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
    for (int t = 0; t < 16; ++t) r[t] = _mm512_load_si512(c_tile + 16 * t);
    transpose16x16_epi32(r);  // r[q] = query row q's logits of the 16 keys
    for (std::int64_t q = 0; q < rows; ++q)
      _mm512_storeu_ps(out + q * out_stride + 16 * g, _mm512_mul_ps(vs, _mm512_castsi512_ps(r[q])));
  }
  _tile_release();
}
#endif

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DETAIL_GEMM_HPP
