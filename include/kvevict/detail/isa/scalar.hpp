// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_ISA_SCALAR_HPP
#define KVEVICT_DETAIL_ISA_SCALAR_HPP

// The portable kernel set (cpu_isa::scalar): plain C++, compiled for the translation unit's
// own baseline, so it runs on any CPU the program runs on. The SIMD sets fall back to these
// functions for row tails and strided rows. Numerics: float32 throughout, std::exp, products
// summed over channels in order (a compiler may fuse multiply-adds where the baseline has FMA).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvevict/config.hpp"
#include "kvevict/detail/isa/common.hpp"
#include "kvevict/detail/isa/target.hpp"
#include "kvevict/detail/pooling.hpp"
#include "kvevict/dtype.hpp"
#include "kvevict/views/cache_view.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {
namespace isa_scalar {

/// dst[i] = float(src[i * stride]) for i in [0, n).
inline void widen_row(const float* src, std::int64_t stride, float* dst, std::int64_t n) noexcept {
  if (stride == 1) {
    std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) dst[i] = src[i * stride];
}
inline void widen_row(const bf16* src, std::int64_t stride, float* dst, std::int64_t n) noexcept {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_float(src[i * stride].bits);
}
inline void widen_row(const fp16* src, std::int64_t stride, float* dst, std::int64_t n) noexcept {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = fp16_bits_to_float(src[i * stride].bits);
}
inline void widen_row(const fp8_e4m3* src, std::int64_t stride, float* dst, std::int64_t n) noexcept {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = fp8_e4m3_bits_to_float(src[i * stride].bits);
}
inline void widen_row(const fp8_e5m2* src, std::int64_t stride, float* dst, std::int64_t n) noexcept {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = fp8_e5m2_bits_to_float(src[i * stride].bits);
}

/// Keys per panel: the portable micro-kernel's accumulators (4 rows x 8 keys) fit the 16
/// vector registers of the x86-64 baseline once the compiler vectorises the key loop.
/// Whether narrow_logits reads keys straight from a cache with contiguous channels, so that
/// prompt windows can compute their logits once, in chunks of cached rows (observe_head.inl).
constexpr bool reads_keys_unpacked = false;

constexpr std::int64_t panel_keys = 8;

/// Keys [j0, j0+n) of head h, widened and transposed into panels: panel p holds keys
/// [p*K, p*K + K) as dim rows of K floats (key t of channel c at panel[p*dim*K + c*K + t]),
/// missing keys of the last panel zero.
template <class KT>
void pack_key_panels(const cache_view<const KT>& keys, std::int64_t h, std::int64_t j0, std::int64_t n,
                     std::int64_t dim, float* panel) noexcept {
  const std::int64_t panels = (n + panel_keys - 1) / panel_keys;
  for (std::int64_t p = 0; p < panels; ++p) {
    float* dst = panel + p * dim * panel_keys;
    for (std::int64_t t = 0; t < panel_keys; ++t) {
      const std::int64_t j = p * panel_keys + t;
      if (j >= n) {
        for (std::int64_t c = 0; c < dim; ++c) dst[c * panel_keys + t] = 0.0f;
        continue;
      }
      const KT* row = keys.row(h, j0 + j);
      for (std::int64_t c = 0; c < dim; ++c) dst[c * panel_keys + t] = to_float(row[c * keys.dim_stride]);
    }
  }
}

template <int MR>
void logits_block(const float* q, std::int64_t dim, const float* panel, float* out, std::int64_t ld) noexcept {
  float acc[MR][panel_keys] = {};
  for (std::int64_t c = 0; c < dim; ++c) {
    const float* k = panel + c * panel_keys;
    KVEVICT_UNROLL
    for (int i = 0; i < MR; ++i) {
      const float qv = q[i * dim + c];
      KVEVICT_UNROLL
      for (std::int64_t t = 0; t < panel_keys; ++t) acc[i][t] += qv * k[t];
    }
  }
  KVEVICT_UNROLL
  for (int i = 0; i < MR; ++i) {
    KVEVICT_UNROLL
    for (std::int64_t t = 0; t < panel_keys; ++t) out[i * ld + t] = acc[i][t];
  }
}

/// out[r * ld + j] = sum_c q[r * dim + c] * key_j[c] for r < rows and j < n rounded up to
/// panel_keys (ld >= that), from panels made by pack_key_panels.
inline void logits_panels(const float* q, std::int64_t rows, std::int64_t dim, const float* panel, std::int64_t n,
                          float* out, std::int64_t ld) noexcept {
  const std::int64_t panels = (n + panel_keys - 1) / panel_keys;
  // Rows in chunks whose queries stay in L1 (about 12 KB) while every panel passes by; each
  // panel, read once per chunk, stays in L1 for the chunk's micro-kernels. Streaming all the
  // rows' queries from L2 for every panel ran at two thirds of the FMA peak.
  const std::int64_t chunk = std::max<std::int64_t>(4, 3072 / (dim > 0 ? dim : 1) / 4 * 4);
  for (std::int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const std::int64_t end = std::min(rows, r0 + chunk);
    for (std::int64_t p = 0; p < panels; ++p) {
      const float* kp = panel + p * dim * panel_keys;
      float* o = out + p * panel_keys;
      std::int64_t r = r0;
      for (; end - r >= 4; r += 4) logits_block<4>(q + r * dim, dim, kp, o + r * ld, ld);
      switch (end - r) {
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

/// Online log-sum-exp update of one row with a prepared tile row; NaN logits count as -inf
/// (a NaN key or query gets zero attention instead of poisoning the row).
inline void lse_update(const float* row, std::int64_t live, float* row_max, float* row_sum) noexcept {
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  if (live <= 0) return;
  float tile_max = neg_inf;
  for (std::int64_t j = 0; j < live; ++j) tile_max = row[j] > tile_max ? row[j] : tile_max;
  if (tile_max == neg_inf) return;
  if (tile_max > *row_max) {
    *row_sum *= std::exp(*row_max - tile_max);
    *row_max = tile_max;
  }
  float sum = 0.0f;
  for (std::int64_t j = 0; j < live; ++j) sum += row[j] > neg_inf ? std::exp(row[j] - *row_max) : 0.0f;
  *row_sum += sum;
}

/// acc[j] += weight * exp(row[j] - lse) (or the NaN-propagating max) for j < live; -inf and
/// NaN logits (masked keys; NaN keys or queries) contribute exactly 0.
inline void accumulate_row(bool max_over_window, const float* row, std::int64_t live, float lse, float weight,
                           float* acc) noexcept {
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  for (std::int64_t c = 0; c < live; ++c) {
    const float prob = row[c] > neg_inf ? std::exp(row[c] - lse) : 0.0f;
    acc[c] = max_over_window ? nan_max(acc[c], prob) : acc[c] + weight * prob;
  }
}

/// Decode-sized logits straight from the cache: the portable set has no such kernel (the
/// caller packs the keys and takes logits_panels).
template <class KT>
bool narrow_logits(const cache_view<const KT>&, std::int64_t, std::int64_t, std::int64_t, const narrow_queries&,
                   std::int64_t, std::int64_t, float*, std::int64_t) noexcept {
  return false;
}

/// Keeps offsets j (ascending) with score_key(x[j]) >= threshold; returns how many.
inline std::int64_t filter_at_least(const float* x, std::int64_t n, std::uint32_t threshold, std::uint32_t* index,
                                    std::uint32_t* key) noexcept {
  std::int64_t m = 0;
  for (std::int64_t j = 0; j < n; ++j) {
    const std::uint32_t k = score_key(x[j]);
    if (k >= threshold) {
      index[m] = static_cast<std::uint32_t>(j);
      key[m] = k;
      ++m;
    }
  }
  return m;
}

}  // namespace isa_scalar
}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DETAIL_ISA_SCALAR_HPP
