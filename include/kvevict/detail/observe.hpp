// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_OBSERVE_HPP
#define KVEVICT_DETAIL_OBSERVE_HPP

// The observation kernel shared by every attention-based policy: for one KV head h it
// computes, for each of its G query heads g, the aggregated attention row
//
//   acc[g][j] = sum_t w_t * A[g,t,j]    (or max_t A[g,t,j])      for candidate keys j < C
//
// where A is the float32 softmax of the scaled logits over the normalisation domain. Keys
// are streamed in tiles (widened to float32 and packed tile by tile); the [G*W, L] attention
// matrix is never stored. Without an engine-provided log-sum-exp the softmax needs two
// sweeps: the first finds each row's max and normaliser online, the second accumulates
// probabilities. Small observation sets (decode steps) keep their logits instead and read
// the keys once.
//
// The per-head loop (detail/isa/observe_head.inl) is compiled once per kernel set: portable,
// AVX2 and AVX-512 (docs/cpu-dispatch.md), and observe_head below runs the one the process
// chose (cpu_isa.hpp). Logits are outer-product micro-kernels on packed key panels; the
// softmax runs on a vector exp; decode-sized sets take dot products straight from the cache.
// With AVX512_BF16, bf16 queries and keys take VDPBF16PS pair products; with AMX, tile
// products. Arithmetic is float32 throughout (bf16 products are exact; sums round to float32).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/cpu_isa.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/detail/isa/amx.hpp"
#include "kvevict/detail/isa/avx2.hpp"
#include "kvevict/detail/isa/avx512.hpp"
#include "kvevict/detail/isa/avx512_bf16.hpp"
#include "kvevict/detail/isa/common.hpp"
#include "kvevict/detail/isa/scalar.hpp"
#include "kvevict/detail/isa/target.hpp"
#include "kvevict/detail/kernel_instances.hpp"
#include "kvevict/detail/pooling.hpp"
#include "kvevict/dtype.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/index_ptr.hpp"
#include "kvevict/views/query_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

/// Everything fixed for one scoring call.
struct observation_problem {
  std::int64_t group = 1;       ///< G
  std::int64_t window = 1;      ///< W
  std::int64_t dim = 1;         ///< d
  std::int64_t tokens = 0;      ///< L
  std::int64_t candidates = 0;  ///< C: keys scored are [0, C)
  softmax_domain domain = softmax_domain::visible;
  index_ptr query_positions = nullptr;  ///< [W]
  index_ptr key_positions = nullptr;    ///< [L], or null for "key j is at position j"
  bool key_positions_sorted = true;     ///< non-decreasing (true when null)
  const float* lse = nullptr;           ///< [Hq, W] natural-log LSE, or null
  std::int64_t lse_head_stride = 0;
  const float* weights = nullptr;  ///< [W] per-observation weights of the sum, or null (all 1)
  bool max_over_window = false;    ///< max_t instead of the weighted sum
  float key_scale = 1.0f;          ///< the keys' dequantisation scale (cache_view::scale)

  /// The logits' factor: 1/sqrt(d) times the key scale (exactly 1/sqrt(d) for unscaled keys).
  float logit_scale() const noexcept { return (1.0f / std::sqrt(static_cast<float>(dim))) * key_scale; }

  /// G*W (saturating: size queries see unvalidated shapes).
  std::int64_t rows() const noexcept { return saturating_mul(group, window); }
  std::int64_t softmax_end() const noexcept { return domain == softmax_domain::visible ? tokens : candidates; }
};

/// One worker's scratch.
struct observation_scratch {
  float* q = nullptr;               ///< [R, d] scaled queries of the head's group
  bf16* qb = nullptr;               ///< [R rounded up to 32, d] unscaled, for bf16 x bf16 kernels
  std::uint32_t* qpanel = nullptr;  ///< [d/32][16][16] decode-sized query rows packed for AMX
  float* k = nullptr;               ///< key tile packed into panels (float32, or bf16 pairs)
  float* logits = nullptr;          ///< [rows per GEMM, keys per tile padded to 32]
  float* row_max = nullptr;         ///< [R]
  float* row_lse = nullptr;         ///< [R]
  float* acc = nullptr;             ///< [G, C]
  float* cached = nullptr;          ///< [cached rows, softmax_end] logits, when G <= cached_logit_rows
};

/// Tile sizes for a head dimension: keys per tile and query rows per logits call, chosen so
/// that a tile's packed keys (keys*d floats) and the query block (rows*d) stay within
/// 128 KiB and 64 KiB. Rows are a multiple of 32 (AMX computes 32-row blocks).
struct tile_plan {
  std::int64_t keys;
  std::int64_t rows;
  explicit tile_plan(std::int64_t head_dim) noexcept {
    keys = head_dim > 0 ? 32768 / head_dim : 256;
    keys = keys < 16 ? 16 : (keys > 512 ? 512 : keys);
    keys -= keys % 16;
    rows = head_dim > 0 ? 16384 / head_dim : 128;
    rows = rows < 32 ? 32 : (rows > 256 ? 256 : rows);
    rows -= rows % 32;
  }
};

/// Observation sets of at most this many rows per KV head (G*W; a decode step's G queries)
/// keep their logits, so keys are read once; larger sets (prompt windows) read keys twice
/// and keep only a tile, as the scratch bound O(Hkv*L + tiles) requires.
constexpr std::int64_t cached_logit_rows = 16;

KVEVICT_ALWAYS_INLINE std::int64_t round_up(std::int64_t x, std::int64_t m) noexcept {
  return saturating_add(x, m - 1) / m * m;  // saturates (a multiple of m short of INT64_MAX)
}

/// Rows of logits the cache must hold for any window W' <= W of this problem: a workspace
/// sized for W (an upper bound, e.g. DeferKV's prompt window) must also serve its decode
/// steps (W' = 1, G rows), which take the cached path. 0 when no W' can.
inline std::int64_t cached_rows_bound(const observation_problem& p) noexcept {
  if (p.group > cached_logit_rows) return 0;
  return std::min(p.rows(), (cached_logit_rows / p.group) * p.group);
}

inline void carve_observation_scratch(arena& a, const observation_problem& p, observation_scratch* s) noexcept {
  const tile_plan plan(p.dim);
  const std::int64_t r = p.rows();
  const std::int64_t cached_rows = cached_rows_bound(p);
  const std::int64_t tile_keys = padded_keys(plan.keys);
  // Saturating products: size queries run on unvalidated shapes, and a shape whose scratch
  // does not fit must measure as SIZE_MAX, not as a wrapped small size.
  s->q = a.take<float>(saturating_mul(r, p.dim));
  s->qb = a.take<bf16>(saturating_mul(round_up(r, 32), p.dim));  // AMX works on blocks of 32 rows and keys
  s->qpanel = a.take<std::uint32_t>(saturating_mul(std::int64_t{8}, p.dim));
  s->k = a.take<float>(saturating_mul(tile_keys, p.dim));  // also holds bf16 pair panels (half the size)
  s->logits = a.take<float>(saturating_mul(std::max(round_up(std::min(r, plan.rows), 32), cached_rows), tile_keys));
  s->row_max = a.take<float>(r);
  s->row_lse = a.take<float>(r);
  s->acc = a.take<float>(saturating_mul(p.group, p.candidates));
  s->cached = cached_rows > 0 ? a.take<float>(saturating_mul(cached_rows, p.softmax_end())) : nullptr;
}

/// Number of leading keys of tile [j0, j1) that observation position `pos` sees, for
/// non-decreasing key positions.
KVEVICT_ALWAYS_INLINE std::int64_t visible_prefix(const observation_problem& p, std::int64_t j0, std::int64_t j1,
                                                  std::int64_t pos) noexcept {
  if (p.key_positions == nullptr) return std::max<std::int64_t>(0, std::min(j1, pos + 1) - j0);
  const index_ptr first = p.key_positions + j0;
  // Binary search by hand: std::upper_bound would be a std:: instantiation shared by every
  // translation unit whatever its -march (docs/cpu-dispatch.md), this is kvevict's own.
  std::int64_t lo = 0, hi = j1 - j0;
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (first[mid] <= pos)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/// Prepares row `r` of a logits tile for the softmax: keys the observation does not see
/// become -inf. Returns how many leading entries can be nonzero. (NaN logits, from a NaN key
/// or query, need nothing here: the softmax kernels give them zero attention.)
KVEVICT_ALWAYS_INLINE std::int64_t mask_row(const observation_problem& p, float* row, std::int64_t j0, std::int64_t n,
                                            std::int64_t pos) noexcept {
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  std::int64_t live = n;
  if (p.key_positions_sorted) {
    live = visible_prefix(p, j0, j0 + n, pos);
  } else {
    for (std::int64_t i = 0; i < n; ++i)
      if (p.key_positions[j0 + i] > pos) row[i] = neg_inf;
  }
  return live;
}

KVEVICT_ALWAYS_INLINE float finish_lse(float row_max, float row_sum) noexcept {
  if (row_sum > 0.0f) return row_max + std::log(row_sum);
  return row_sum == 0.0f ? -std::numeric_limits<float>::infinity() : row_sum;  // NaN stays NaN
}

KVEVICT_ALWAYS_INLINE float window_weight(const observation_problem& p, std::int64_t r) noexcept {
  return p.weights != nullptr ? p.weights[r % p.window] : 1.0f;
}

/// The unscaled bf16 query rows of head h's group for the bf16 x bf16 kernels (VDPBF16PS,
/// AMX), zero rows after them up to a multiple of 32; null for other query types.
template <class QT>
const bf16* gather_queries_bf16(const query_view<const QT>& queries, std::int64_t h, const observation_problem& p,
                                bf16* qb) noexcept {
  if (!std::is_same<QT, bf16>::value || qb == nullptr) return nullptr;
  for (std::int64_t g = 0; g < p.group; ++g)
    for (std::int64_t t = 0; t < p.window; ++t) {
      const QT* src = queries.row(h * p.group + g, t);
      bf16* dst = qb + (g * p.window + t) * p.dim;
      for (std::int64_t c = 0; c < p.dim; ++c) std::memcpy(dst + c, src + c * queries.dim_stride, sizeof(bf16));
    }
  std::memset(static_cast<void*>(qb + p.rows() * p.dim), 0,
              static_cast<std::size_t>((round_up(p.rows(), 32) - p.rows()) * p.dim) * sizeof(bf16));
  return qb;
}

/// Which bf16 x bf16 product kernels this process may use.
enum class bf16_products { none, vdpbf16ps, amx };

inline bf16_products active_bf16_products() noexcept {
  const cpu_isa isa = active_cpu_isa();
  if (isa == cpu_isa::amx) return bf16_products::amx;
  return isa == cpu_isa::avx512bf16 ? bf16_products::vdpbf16ps : bf16_products::none;
}

template <class QT, class KT>
constexpr bool bf16_pair_types() noexcept {
  return std::is_same<QT, bf16>::value && std::is_same<KT, bf16>::value;
}

/// Stand-ins for the bf16 pair and AMX kernels in the kernel sets that have none: the
/// per-head loop names them, observe_head never reaches them there (bf16_products::none).
namespace no_pair_kernels {
inline void pack_key_group_pairs(const std::uint16_t* const*, std::int64_t, std::uint32_t*) noexcept {}
template <class KT>
void pack_key_tile_pairs(const cache_view<const KT>&, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                         std::uint32_t*) noexcept {}
inline void logits_pairs(const bf16*, std::int64_t, std::int64_t, const std::uint32_t*, std::int64_t, float, float*,
                         std::int64_t) noexcept {}
}  // namespace no_pair_kernels
namespace no_amx_kernels {
inline void logits_tile_amx(const std::uint16_t*, std::int64_t, std::int64_t, const std::uint32_t*, std::int64_t, float,
                            float*, std::int64_t) noexcept {}
inline void narrow_logits_amx(const std::uint16_t*, std::int64_t, std::int64_t, std::int64_t, const std::uint32_t*,
                              std::int64_t, float, float*, std::int64_t) noexcept {}
}  // namespace no_amx_kernels

// ---- the per-head loop, once per kernel set --------------------------------------------------
namespace isa_scalar {
using no_amx_kernels::logits_tile_amx;
using no_amx_kernels::narrow_logits_amx;
using no_pair_kernels::logits_pairs;
using no_pair_kernels::pack_key_group_pairs;
using no_pair_kernels::pack_key_tile_pairs;
#include "kvevict/detail/isa/observe_head.inl"
}  // namespace isa_scalar

#if KVEVICT_X86_DISPATCH
namespace isa_avx2 {
using no_amx_kernels::logits_tile_amx;
using no_amx_kernels::narrow_logits_amx;
using no_pair_kernels::logits_pairs;
using no_pair_kernels::pack_key_group_pairs;
using no_pair_kernels::pack_key_tile_pairs;
}  // namespace isa_avx2
KVEVICT_TARGET_AVX2_BEGIN
namespace isa_avx2 {
#include "kvevict/detail/isa/observe_head.inl"
}  // namespace isa_avx2
KVEVICT_TARGET_END

#if !KVEVICT_AMX_DISPATCH
namespace isa_avx512 {
using no_amx_kernels::logits_tile_amx;
using no_amx_kernels::narrow_logits_amx;
}  // namespace isa_avx512
#endif
KVEVICT_TARGET_AVX512_BEGIN
namespace isa_avx512 {
#include "kvevict/detail/isa/observe_head.inl"
}  // namespace isa_avx512
KVEVICT_TARGET_END
#endif

/// Computes s.acc ([G, C]) for KV head h with the kernel set of the process's CPU path.
template <class QT, class KT>
void observe_head(const query_view<const QT>& queries, const cache_view<const KT>& keys, std::int64_t h,
                  const observation_problem& p, const observation_scratch& s) {
#if KVEVICT_X86_DISPATCH
  switch (active_cpu_isa()) {
    case cpu_isa::scalar:
      break;
    case cpu_isa::avx2:
      isa_avx2::observe_head(queries, keys, h, p, s, bf16_products::none);
      return;
    default:
      isa_avx512::observe_head(queries, keys, h, p, s, active_bf16_products());
      return;
  }
#endif
  isa_scalar::observe_head(queries, keys, h, p, s, bf16_products::none);
}

/// observe_head's instance for (QT, KT), the one signature the explicit instantiation
/// declarations below and their definitions (kvevict/instantiate_kernels.hpp) both expand.
#define KVEVICT_DETAIL_OBSERVE_HEAD_INSTANCE(QT, KT)                                                \
  void observe_head<QT, KT>(const query_view<const QT>&, const cache_view<const KT>&, std::int64_t, \
                            const observation_problem&, const observation_scratch&)
#if KVEVICT_EXTERN_KERNELS
#define KVEVICT_DETAIL_EXTERN_OBSERVE_HEAD(QT, KT) extern template KVEVICT_DETAIL_OBSERVE_HEAD_INSTANCE(QT, KT);
KVEVICT_DETAIL_FOR_EACH_QUERY_KEY_TYPE(KVEVICT_DETAIL_EXTERN_OBSERVE_HEAD)
#undef KVEVICT_DETAIL_EXTERN_OBSERVE_HEAD
#endif

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DETAIL_OBSERVE_HPP
