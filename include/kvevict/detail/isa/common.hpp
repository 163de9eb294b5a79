// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_ISA_COMMON_HPP
#define KVEVICT_DETAIL_ISA_COMMON_HPP

// What the per-target kernel sets (detail/isa/scalar.hpp, avx2.hpp, avx512.hpp) share: the
// arguments of the decode-sized dot products and the packed key-panel geometry.
//
// Every kernel set provides, in its namespace (isa_scalar, isa_avx2, isa_avx512):
//   widen_row(src, stride, dst, n)              storage row -> float32
//   pack_key_panels(keys, h, j0, n, dim, panel) keys [j0, j0+n) of head h, widened and
//                                               transposed into panels of panel_keys keys
//   logits_panels(q, rows, dim, panel, n, out, ld)  out[r][j] = sum_c q[r][c] * key_j[c]
//   lse_update(row, live, &max, &sum)           online log-sum-exp of one row
//   accumulate_row(max, row, live, lse, w, acc) acc[j] += w * exp(row[j] - lse) (or max)
//   narrow_logits(keys, h, j0, n, nq, rows, dim, out, stride)  decode-sized logits straight
//                                               from the cache (false: not applicable)
//   filter_at_least(x, n, threshold, index, key)  top-k survivor sweep (score_key order)
// and the observation glue detail/isa/observe_head.inl is compiled once per set.

#include <cstdint>
#include <cstring>

#include "kvevict/config.hpp"
#include "kvevict/dtype.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

/// Query rows for narrow_logits: float32 scaled rows (q), and for bf16 x bf16 the unscaled
/// bf16 rows (qb) with the scale.
struct narrow_queries {
  const float* q = nullptr;
  const bf16* qb = nullptr;  ///< non-null selects the bf16 dot-product kernels
  float scale = 1.0f;
};

/// Unsigned key with top-k's selection order (detail/topk.hpp): NaN -> 0, -0 -> key(+0).
KVEVICT_ALWAYS_INLINE std::uint32_t score_key(float x) noexcept {
  if (x != x) return 0u;
  x += 0.0f;  // -0 + 0 = +0
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

/// The most keys per packed panel of any kernel set: key tiles are padded to a multiple of
/// it (scratch sizes use it), and logits rows are written that wide.
constexpr std::int64_t max_panel_keys = 32;

/// Padded width of a key tile of n keys, the row stride of its logits.
constexpr std::int64_t padded_keys(std::int64_t n) noexcept {
  return (n + max_panel_keys - 1) / max_panel_keys * max_panel_keys;
}

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DETAIL_ISA_COMMON_HPP
