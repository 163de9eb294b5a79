// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_OBSERVE_HPP
#define KVEVICT_DETAIL_OBSERVE_HPP

// The observation kernel shared by every attention-based policy: for one KV head h it
// computes, for each of its G query heads g, the aggregated attention row
//
//   acc[g][j] = sum_t w_t * A[g,t,j]    (or max_t A[g,t,j])      for candidate keys j < C
//
// where A is the float32 softmax of the scaled logits over the normalisation domain. Keys
// are streamed in tiles (widened to float32 tile by tile); the [G*W, L] attention matrix is
// never stored. Without an engine-provided log-sum-exp the softmax needs two sweeps: the
// first finds each row's max and normaliser online, the second accumulates probabilities.
// Small observation sets (decode steps) keep their logits instead and read the keys once.
//
// Kernels. With AVX-512 (BW, VL) the softmax runs on a vector exp (exp16), and small
// observation sets compute their dot products with a hand-written kernel that widens each key
// row in registers (narrow_logits; VDPBF16PS for bf16 x bf16), or, for bf16 on a strided
// cache with AMX, with tile products on keys loaded straight from the cache
// (narrow_logits_amx). Prompt windows take Eigen's GEMM on widened float32 key tiles, or, for
// bf16 queries and keys with AMX, tile products on keys packed into pair panels (gemm.hpp). Arithmetic is float32
// throughout (bf16 products are exact; sums round to float32). Without AVX-512 the same steps
// run portably on Eigen and the C++ library.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include <Eigen/Core>

#include "kvevict/config.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/detail/gemm.hpp"
#include "kvevict/detail/pooling.hpp"
#include "kvevict/detail/widen.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/views/cache_view.hpp"
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
  const std::int64_t* query_positions = nullptr;  ///< [W]
  const std::int64_t* key_positions = nullptr;    ///< [L], or null for "key j is at position j"
  bool key_positions_sorted = true;               ///< non-decreasing (true when null)
  const float* lse = nullptr;                     ///< [Hq, W] natural-log LSE, or null
  std::int64_t lse_head_stride = 0;
  const float* weights = nullptr;  ///< [W] per-observation weights of the sum, or null (all 1)
  bool max_over_window = false;    ///< max_t instead of the weighted sum

  /// G*W (saturating: size queries see unvalidated shapes).
  std::int64_t rows() const noexcept { return saturating_mul(group, window); }
  std::int64_t softmax_end() const noexcept { return domain == softmax_domain::visible ? tokens : candidates; }
};

/// One worker's scratch.
struct observation_scratch {
  float* q = nullptr;               ///< [R, d] scaled queries of the head's group
  bf16* qb = nullptr;               ///< [R rounded up to 32, d] unscaled, for bf16 x bf16 kernels
  std::uint32_t* qpanel = nullptr;  ///< [d/32][16][16] decode-sized query rows packed for AMX
  float* k = nullptr;               ///< [T, d] widened key tile
  float* logits = nullptr;          ///< [rows per GEMM, T]
  float* row_max = nullptr;         ///< [R]
  float* row_lse = nullptr;         ///< [R]
  float* acc = nullptr;             ///< [G, C]
  float* cached = nullptr;          ///< [R, softmax_end] logits, for small row counts only
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
  // Saturating products: size queries run on unvalidated shapes, and a shape whose scratch
  // does not fit must measure as SIZE_MAX, not as a wrapped small size.
  s->q = a.take<float>(saturating_mul(r, p.dim));
  s->qb = a.take<bf16>(saturating_mul(round_up(r, 32), p.dim));  // AMX works on blocks of 32 rows and keys
  s->qpanel = a.take<std::uint32_t>(saturating_mul(std::int64_t{8}, p.dim));
  s->k = a.take<float>(saturating_mul(plan.keys, p.dim));  // also holds AMX key panels (half the size)
  s->logits = a.take<float>(std::max(round_up(std::min(r, plan.rows), 32), cached_rows) * round_up(plan.keys, 32));
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
  const std::int64_t* first = p.key_positions + j0;
  return std::upper_bound(first, p.key_positions + j1, pos) - first;
}

/// Prepares row `r` of a logits tile for the softmax: NaN logits become -inf (a NaN key or
/// query gets zero attention instead of poisoning the row), keys the observation does not
/// see become -inf. Returns how many leading entries can be nonzero.
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
  for (std::int64_t i = 0; i < live; ++i)
    if (row[i] != row[i]) row[i] = neg_inf;
  return live;
}

template <class QT>
void gather_queries(const query_view<const QT>& queries, std::int64_t h, const observation_problem& p, float* q) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(p.dim));
  for (std::int64_t g = 0; g < p.group; ++g)
    for (std::int64_t t = 0; t < p.window; ++t) {
      float* dst = q + (g * p.window + t) * p.dim;
      widen_row(queries.row(h * p.group + g, t), queries.dim_stride, dst, p.dim);
      for (std::int64_t c = 0; c < p.dim; ++c) dst[c] *= scale;
    }
}

template <class KT>
void widen_key_tile(const cache_view<const KT>& keys, std::int64_t h, std::int64_t j0, std::int64_t n, std::int64_t dim,
                    float* k) {
  for (std::int64_t i = 0; i < n; ++i) widen_row(keys.row(h, j0 + i), keys.dim_stride, k + i * dim, dim);
}

#if KVEVICT_DETAIL_AVX512
/// exp(x) on 16 lanes (Cephes' expf polynomial after a two-constant ln 2 reduction, within
/// 2 ulp of expf). -inf and x < -104 give +0 exactly, so masked logits contribute nothing;
/// NaN stays NaN (max/min return their second operand when one is NaN).
KVEVICT_ALWAYS_INLINE __m512 exp16(__m512 x) noexcept {
  x = _mm512_min_ps(_mm512_set1_ps(88.7f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);  // y * 2^n, rounding correctly into the subnormals
}

/// Horizontal sum and max through memory (GCC 12's _mm512_reduce_* trip -Wuninitialized).
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
#endif

/// acc[j] += w * exp(logit[j] - lse) (or max) for the first `live` entries of a prepared row;
/// -inf logits (masked, or NaN) contribute exactly 0.
KVEVICT_ALWAYS_INLINE void accumulate_row(const observation_problem& p, const float* row, std::int64_t live, float lse,
                                          float weight, float* acc) {
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
#if KVEVICT_DETAIL_AVX512
  // Eigen 3.4 evaluates select() one coefficient at a time (a libm expf per logit), which
  // cost as much as the GEMM; this loop stays in vectors, the tail under a mask.
  const __m512 vlse = _mm512_set1_ps(lse), vw = _mm512_set1_ps(weight), vneg_inf = _mm512_set1_ps(neg_inf);
  for (std::int64_t j = 0; j < live; j += 16) {
    const __mmask16 m = first_lanes(live - j);
    const __m512 x = _mm512_maskz_loadu_ps(m, row + j);
    // A -inf logit is exactly 0 even when the row's LSE is NaN (a +inf logit elsewhere in the
    // row): an observation must not poison keys it does not see.
    const __m512 prob =
        _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vneg_inf, _CMP_NEQ_UQ), exp16(_mm512_sub_ps(x, vlse)));
    const __m512 a = _mm512_maskz_loadu_ps(m, acc + j);
    if (p.max_over_window) {  // nan_max: a NaN probability wins, as torch.max propagates it
      const __mmask16 take = _mm512_cmp_ps_mask(prob, a, _CMP_GT_OQ) | _mm512_cmp_ps_mask(prob, prob, _CMP_UNORD_Q);
      _mm512_mask_storeu_ps(acc + j, m, _mm512_mask_blend_ps(take, a, prob));
    } else {
      _mm512_mask_storeu_ps(acc + j, m, _mm512_fmadd_ps(vw, prob, a));
    }
  }
#else
  for (std::int64_t c = 0; c < live; ++c) {
    const float prob = row[c] == neg_inf ? 0.0f : std::exp(row[c] - lse);
    acc[c] = p.max_over_window ? nan_max(acc[c], prob) : acc[c] + weight * prob;
  }
#endif
  (void)neg_inf;
}

/// Online log-sum-exp update of one row with a prepared tile row.
KVEVICT_ALWAYS_INLINE void lse_update(const float* row, std::int64_t live, float* row_max, float* row_sum) {
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  if (live == 0) return;
#if KVEVICT_DETAIL_AVX512
  __m512 vmax = _mm512_set1_ps(neg_inf);
  for (std::int64_t j = 0; j < live; j += 16)
    vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(_mm512_set1_ps(neg_inf), first_lanes(live - j), row + j));
  const float tile_max = hmax16(vmax);
#else
  float tile_max = row[0];
  for (std::int64_t j = 1; j < live; ++j) tile_max = row[j] > tile_max ? row[j] : tile_max;
#endif
  if (tile_max == neg_inf) return;
  if (tile_max > *row_max) {
    *row_sum *= std::exp(*row_max - tile_max);
    *row_max = tile_max;
  }
#if KVEVICT_DETAIL_AVX512
  const __m512 vm = _mm512_set1_ps(*row_max);
  __m512 sum = _mm512_setzero_ps();
  for (std::int64_t j = 0; j < live; j += 16) {
    const __mmask16 m = first_lanes(live - j);
    sum = _mm512_mask_add_ps(sum, m, sum, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + j), vm)));
  }
  *row_sum += hsum16(sum);
#else
  float sum = 0.0f;
  for (std::int64_t j = 0; j < live; ++j) sum += row[j] == neg_inf ? 0.0f : std::exp(row[j] - *row_max);
  *row_sum += sum;
#endif
}

KVEVICT_ALWAYS_INLINE float finish_lse(float row_max, float row_sum) noexcept {
  if (row_sum > 0.0f) return row_max + std::log(row_sum);
  return row_sum == 0.0f ? -std::numeric_limits<float>::infinity() : row_sum;  // NaN stays NaN
}

/// Query rows for narrow_logits: float32 scaled rows (q), and for bf16 x bf16 the unscaled
/// bf16 rows (qb) with the scale.
struct narrow_queries {
  const float* q = nullptr;
  const bf16* qb = nullptr;  ///< non-null selects the VDPBF16PS kernel
  float scale = 1.0f;
};

#if KVEVICT_DETAIL_AVX512
/// Sums of four vectors: lane i of the result is the horizontal sum of the i-th argument.
KVEVICT_ALWAYS_INLINE __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) noexcept {
  // Within each 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3), then (a, b, c, d) partial sums.
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512 x = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  // Then across the four 128-bit lanes.
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(x);
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
  for (int b = 0; b < KB; ++b)
    for (int i = 0; i < 8; ++i) acc[b][i] = _mm512_setzero_ps();
  for (std::int64_t c = 0; c < dim; c += 16) {
    const __mmask16 m = first_lanes(dim - c);
    __m512 kv[KB];
    for (int b = 0; b < KB; ++b) kv[b] = widen16(k[b] + c, m);
    for (int i = 0; i < RB; ++i) {
      const __m512 qv = _mm512_maskz_loadu_ps(m, q + i * dim + c);
      for (int b = 0; b < KB; ++b) acc[b][i] = _mm512_fmadd_ps(kv[b], qv, acc[b][i]);
    }
  }
  for (int b = 0; b < KB; ++b) {
    alignas(16) float sums[8];
    _mm_store_ps(sums, hsum4(acc[b][0], acc[b][1], acc[b][2], acc[b][3]));
    if (RB > 4) _mm_store_ps(sums + 4, hsum4(acc[b][4], acc[b][5], acc[b][6], acc[b][7]));
    for (int i = 0; i < RB; ++i) out[i * stride + b] = sums[i];
  }
}

#if defined(__AVX512BF16__)
/// The bf16 x bf16 variant: VDPBF16PS multiplies pairs of bf16 channels exactly and adds them
/// into float32 lanes (each addition rounded to float32 like an FMA chain; subnormals
/// flushed), 32 channels per instruction with no widening. q holds the unscaled bf16 query
/// rows; the 1/sqrt(d) scale is applied to the float32 sums.
template <int RB, int KB>
KVEVICT_ALWAYS_INLINE void narrow_dots_bf16(const bf16* q, std::int64_t dim, const bf16* const* k, float scale,
                                            float* out, std::int64_t stride) noexcept {
  static_assert(RB >= 1 && RB <= 8 && KB >= 1 && KB <= 2, "rows and keys per pass");
  __m512 acc[KB][8];
  for (int b = 0; b < KB; ++b)
    for (int i = 0; i < 8; ++i) acc[b][i] = _mm512_setzero_ps();
  for (std::int64_t c = 0; c < dim; c += 32) {
    const __mmask32 m = dim - c >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (dim - c)) - 1u);
    __m512i kv[KB];
    for (int b = 0; b < KB; ++b) kv[b] = _mm512_maskz_loadu_epi16(m, k[b] + c);
    for (int i = 0; i < RB; ++i) {
      const __m512i qv = _mm512_maskz_loadu_epi16(m, q + i * dim + c);
      for (int b = 0; b < KB; ++b) acc[b][i] = _mm512_dpbf16_ps(acc[b][i], (__m512bh)kv[b], (__m512bh)qv);
    }
  }
  const __m128 vs = _mm_set1_ps(scale);
  for (int b = 0; b < KB; ++b) {
    alignas(16) float sums[8];
    _mm_store_ps(sums, _mm_mul_ps(vs, hsum4(acc[b][0], acc[b][1], acc[b][2], acc[b][3])));
    if (RB > 4) _mm_store_ps(sums + 4, _mm_mul_ps(vs, hsum4(acc[b][4], acc[b][5], acc[b][6], acc[b][7])));
    for (int i = 0; i < RB; ++i) out[i * stride + b] = sums[i];
  }
}
#endif

/// Requests key row j + 16 (every cache line of it) while rows j.. are being computed:
/// a decode step is bound by DRAM, and the kernel alone does not keep enough loads in flight.
template <class KT>
KVEVICT_ALWAYS_INLINE void prefetch_key(const cache_view<const KT>& keys, std::int64_t h, std::int64_t j,
                                        std::int64_t end, std::int64_t dim) noexcept {
  constexpr std::int64_t ahead = 16;
  if (j + ahead >= end) return;
  const char* row = reinterpret_cast<const char*>(keys.row(h, j + ahead));
  for (std::int64_t b = 0; b < dim * static_cast<std::int64_t>(sizeof(KT)); b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
}

template <int RB, class KT>
void narrow_rows(const cache_view<const KT>& keys, std::int64_t h, std::int64_t j0, std::int64_t n,
                 const narrow_queries& nq, std::int64_t r0, std::int64_t dim, float* out,
                 std::int64_t stride) noexcept {
  std::int64_t j = 0;
  const std::int64_t end = keys.num_tokens;
#if defined(__AVX512BF16__)
  if (nq.qb != nullptr) {
    const bf16* qb = nq.qb + r0 * dim;
    for (; j + 2 <= n; j += 2) {
      prefetch_key(keys, h, j0 + j, end, dim);
      prefetch_key(keys, h, j0 + j + 1, end, dim);
      const bf16* k[2] = {reinterpret_cast<const bf16*>(keys.row(h, j0 + j)),
                          reinterpret_cast<const bf16*>(keys.row(h, j0 + j + 1))};
      narrow_dots_bf16<RB, 2>(qb, dim, k, nq.scale, out + j, stride);
    }
    for (; j < n; ++j) {
      const bf16* k[1] = {reinterpret_cast<const bf16*>(keys.row(h, j0 + j))};
      narrow_dots_bf16<RB, 1>(qb, dim, k, nq.scale, out + j, stride);
    }
    return;
  }
#endif
  const float* q = nq.q + r0 * dim;
  for (; j + 2 <= n; j += 2) {
    prefetch_key(keys, h, j0 + j, end, dim);
    prefetch_key(keys, h, j0 + j + 1, end, dim);
    const KT* k[2] = {keys.row(h, j0 + j), keys.row(h, j0 + j + 1)};
    narrow_dots<RB, 2>(q, dim, k, out + j, stride);
  }
  for (; j < n; ++j) {
    const KT* k[1] = {keys.row(h, j0 + j)};
    narrow_dots<RB, 1>(q, dim, k, out + j, stride);
  }
}
#endif

/// Logits of `rows` (<= cached_logit_rows) queries over keys [j0, j0+n) of head h, written to
/// out[r * stride + (j - j0)], computed from the storage type without a widened tile or a
/// GEMM (a decode step has too few rows for either to pay). Returns false where the kernel
/// does not apply (no AVX-512, or channels not contiguous): the caller then takes the GEMM
/// path.
template <class KT>
bool narrow_logits(const cache_view<const KT>& keys, std::int64_t h, std::int64_t j0, std::int64_t n,
                   const narrow_queries& nq, std::int64_t rows, std::int64_t dim, float* out,
                   std::int64_t stride) noexcept {
#if KVEVICT_DETAIL_AVX512
  if (keys.dim_stride != 1) return false;
  for (std::int64_t r0 = 0; r0 < rows; r0 += 8) {
    float* o = out + r0 * stride;
    switch (std::min<std::int64_t>(8, rows - r0)) {
      case 1:
        narrow_rows<1>(keys, h, j0, n, nq, r0, dim, o, stride);
        break;
      case 2:
        narrow_rows<2>(keys, h, j0, n, nq, r0, dim, o, stride);
        break;
      case 3:
        narrow_rows<3>(keys, h, j0, n, nq, r0, dim, o, stride);
        break;
      case 4:
        narrow_rows<4>(keys, h, j0, n, nq, r0, dim, o, stride);
        break;
      case 5:
        narrow_rows<5>(keys, h, j0, n, nq, r0, dim, o, stride);
        break;
      case 6:
        narrow_rows<6>(keys, h, j0, n, nq, r0, dim, o, stride);
        break;
      case 7:
        narrow_rows<7>(keys, h, j0, n, nq, r0, dim, o, stride);
        break;
      default:
        narrow_rows<8>(keys, h, j0, n, nq, r0, dim, o, stride);
        break;
    }
  }
  return true;
#else
  (void)keys, (void)h, (void)j0, (void)n, (void)nq, (void)rows, (void)dim, (void)out, (void)stride;
  return false;
#endif
}

/// The unscaled bf16 query rows of head h's group for the bf16 x bf16 kernels (VDPBF16PS,
/// AMX), zero rows after them up to a multiple of 32; null for other query/key types.
template <class QT, class KT>
const bf16* gather_queries_bf16(const query_view<const QT>& queries, std::int64_t h, const observation_problem& p,
                                bf16* qb) noexcept {
  if (!std::is_same<QT, bf16>::value || !std::is_same<KT, bf16>::value || qb == nullptr) return nullptr;
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

/// Whether head h's prompt-window logits take AMX: bf16 queries and keys, contiguous
/// channels, d a multiple of 32, and a process allowed to use tiles.
template <class QT, class KT>
bool amx_applies(const cache_view<const KT>& keys, std::int64_t dim) noexcept {
#if KVEVICT_DETAIL_AMX
  return std::is_same<QT, bf16>::value && std::is_same<KT, bf16>::value && keys.dim_stride == 1 && dim % 32 == 0 &&
         amx_usable();
#else
  (void)keys, (void)dim;
  return false;
#endif
}

/// Keys [j0, j0+n) of head h as AMX key panels (groups of 16 keys, padded with zero keys
/// to a multiple of 32). Only called where amx_applies.
template <class KT>
void pack_key_tile_amx(const cache_view<const KT>& keys, std::int64_t h, std::int64_t j0, std::int64_t n,
                       std::int64_t dim, std::uint32_t* panels) noexcept {
#if KVEVICT_DETAIL_AMX
  for (std::int64_t g = 0; g < round_up(n, 32) / 16; ++g) {
    const std::uint16_t* rows[16];
    for (std::int64_t t = 0; t < 16; ++t) {
      const std::int64_t j = g * 16 + t;
      rows[t] = j < n ? reinterpret_cast<const std::uint16_t*>(keys.row(h, j0 + j)) : nullptr;
    }
    pack_key_group_vnni(rows, dim, panels + g * (dim / 32) * 256);
  }
#else
  (void)keys, (void)h, (void)j0, (void)n, (void)dim, (void)panels;
#endif
}

/// Decode-sized query rows (<= 16; null rows are zero) packed for narrow_logits_amx.
inline void pack_query_panel_amx(const std::uint16_t* const* rows, std::int64_t dim, std::uint32_t* panel) noexcept {
#if KVEVICT_DETAIL_AMX
  pack_key_group_vnni(rows, dim, panel);
#else
  (void)rows, (void)dim, (void)panel;
#endif
}

/// AMX logits of whole 16-key groups of keys [j0, j0+n) of a strided cache (see
/// narrow_logits_amx); returns how many keys it did (the caller does the rest).
template <class KT>
std::int64_t narrow_logits_amx_tile(const cache_view<const KT>& keys, std::int64_t h, std::int64_t j0, std::int64_t n,
                                    const std::uint32_t* qpanel, std::int64_t rows, std::int64_t dim, float* out,
                                    std::int64_t stride) noexcept {
#if KVEVICT_DETAIL_AMX
  const std::int64_t groups = n / 16;
  if (groups > 0)
    narrow_logits_amx(reinterpret_cast<const std::uint16_t*>(keys.row(h, j0)), keys.token_stride, groups, dim, qpanel,
                      rows, 1.0f / std::sqrt(static_cast<float>(dim)), out, stride);
  return groups * 16;
#else
  (void)keys, (void)h, (void)j0, (void)n, (void)qpanel, (void)rows, (void)dim, (void)out, (void)stride;
  return 0;
#endif
}

/// Computes s.acc ([G, C]) for KV head h.
template <class QT, class KT>
void observe_head(const query_view<const QT>& queries, const cache_view<const KT>& keys, std::int64_t h,
                  const observation_problem& p, const observation_scratch& s) {
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  const tile_plan plan(p.dim);
  const std::int64_t rows = p.rows();
  const std::int64_t chunk_rows = std::min(rows, plan.rows);
  const std::int64_t end = p.softmax_end();
  gather_queries(queries, h, p, s.q);
  for (std::int64_t i = 0; i < p.group * p.candidates; ++i) s.acc[i] = 0.0f;  // probabilities are >= 0
  auto weight_of = [&](std::int64_t r) { return p.weights != nullptr ? p.weights[r % p.window] : 1.0f; };

  if (rows <= cached_logit_rows && s.cached != nullptr && p.lse == nullptr) {
    // One sweep: logits of every row over the whole domain, then softmax from the cache.
    for (std::int64_t r = 0; r < rows; ++r) {
      s.row_max[r] = neg_inf;
      s.row_lse[r] = 0.0f;
    }
    narrow_queries nq;
    nq.q = s.q;
#if defined(__AVX512BF16__)
    nq.qb = gather_queries_bf16<QT, KT>(queries, h, p, s.qb);
#endif
    nq.scale = 1.0f / std::sqrt(static_cast<float>(p.dim));
    // bf16 x bf16 on a strided cache: AMX products for whole groups of 16 keys.
    const bool amx = !keys.is_paged() && amx_applies<QT, KT>(keys, p.dim);
    if (amx) {
      const bf16* qb = gather_queries_bf16<QT, KT>(queries, h, p, s.qb);
      const std::uint16_t* qrows[16];
      for (std::int64_t r = 0; r < 16; ++r)
        qrows[r] = r < rows ? reinterpret_cast<const std::uint16_t*>(qb + r * p.dim) : nullptr;
      pack_query_panel_amx(qrows, p.dim, s.qpanel);
    }
    for (std::int64_t j0 = 0; j0 < end; j0 += plan.keys) {
      const std::int64_t n = std::min(plan.keys, end - j0);
      float* tile = s.cached + j0;  // row r of this tile starts at tile + r * end
      const std::int64_t done = amx ? narrow_logits_amx_tile(keys, h, j0, n, s.qpanel, rows, p.dim, tile, end) : 0;
      if (done < n && !narrow_logits(keys, h, j0 + done, n - done, nq, rows, p.dim, tile + done, end)) {
        widen_key_tile(keys, h, j0, n, p.dim, s.k);
        logits_tile(s.q, rows, p.dim, s.k, n, s.logits);
        for (std::int64_t r = 0; r < rows; ++r) std::copy(s.logits + r * n, s.logits + (r + 1) * n, tile + r * end);
      }
      for (std::int64_t r = 0; r < rows; ++r) {
        float* row = tile + r * end;
        const std::int64_t live = mask_row(p, row, j0, n, p.query_positions[r % p.window]);
        for (std::int64_t c = live; c < n; ++c) row[c] = neg_inf;
        lse_update(row, live, &s.row_max[r], &s.row_lse[r]);
      }
    }
    for (std::int64_t r = 0; r < rows; ++r) {
      const float lse = finish_lse(s.row_max[r], s.row_lse[r]);
      if (lse == neg_inf || p.candidates == 0) continue;
      accumulate_row(p, s.cached + r * end, p.candidates, lse, weight_of(r), s.acc + (r / p.window) * p.candidates);
    }
    return;
  }

  // The logits of one key tile: Eigen's GEMM on a widened float32 tile, or AMX on bf16
  // panels. tile_logits returns the row stride of what it wrote.
  const bool amx = amx_applies<QT, KT>(keys, p.dim);
  const bf16* qb = amx ? gather_queries_bf16<QT, KT>(queries, h, p, s.qb) : nullptr;
  auto* panels = reinterpret_cast<std::uint32_t*>(s.k);
  const float scale = 1.0f / std::sqrt(static_cast<float>(p.dim));
  auto load_tile = [&](std::int64_t j0, std::int64_t n) {
    if (amx)
      pack_key_tile_amx(keys, h, j0, n, p.dim, panels);
    else
      widen_key_tile(keys, h, j0, n, p.dim, s.k);
  };
  auto tile_logits = [&](std::int64_t r0, std::int64_t nr, std::int64_t n) -> std::int64_t {
#if KVEVICT_DETAIL_AMX
    if (amx) {
      const std::int64_t ld = round_up(n, 32);
      logits_tile_amx(reinterpret_cast<const std::uint16_t*>(qb + r0 * p.dim), round_up(nr, 32), p.dim, panels, ld,
                      scale, s.logits, ld);
      return ld;
    }
#endif
    logits_tile(s.q + r0 * p.dim, nr, p.dim, s.k, n, s.logits);
    return n;
  };
  (void)qb, (void)scale;

  // Sweep 1: each row's log-sum-exp over the softmax domain (online max and normaliser).
  if (p.lse != nullptr) {
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t g = r / p.window, t = r % p.window;
      s.row_lse[r] = p.lse[(h * p.group + g) * p.lse_head_stride + t];
    }
  } else {
    for (std::int64_t r = 0; r < rows; ++r) {
      s.row_max[r] = neg_inf;
      s.row_lse[r] = 0.0f;
    }
    for (std::int64_t j0 = 0; j0 < end; j0 += plan.keys) {
      const std::int64_t n = std::min(plan.keys, end - j0);
      load_tile(j0, n);
      for (std::int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
        const std::int64_t nr = std::min(chunk_rows, rows - r0);
        const std::int64_t ld = tile_logits(r0, nr, n);
        for (std::int64_t i = 0; i < nr; ++i) {
          const std::int64_t r = r0 + i;
          float* row = s.logits + i * ld;
          const std::int64_t live = mask_row(p, row, j0, n, p.query_positions[r % p.window]);
          lse_update(row, live, &s.row_max[r], &s.row_lse[r]);
        }
      }
    }
    for (std::int64_t r = 0; r < rows; ++r) s.row_lse[r] = finish_lse(s.row_max[r], s.row_lse[r]);
  }

  // Sweep 2: accumulate probabilities of candidate keys.
  for (std::int64_t j0 = 0; j0 < p.candidates; j0 += plan.keys) {
    const std::int64_t n = std::min(plan.keys, p.candidates - j0);
    load_tile(j0, n);
    for (std::int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
      const std::int64_t nr = std::min(chunk_rows, rows - r0);
      const std::int64_t ld = tile_logits(r0, nr, n);
      for (std::int64_t i = 0; i < nr; ++i) {
        const std::int64_t r = r0 + i;
        const float lse = s.row_lse[r];
        if (lse == neg_inf) continue;  // the row sees no key of its domain
        float* row = s.logits + i * ld;
        const std::int64_t live = mask_row(p, row, j0, n, p.query_positions[r % p.window]);
        if (live == 0) continue;
        accumulate_row(p, row, live, lse, weight_of(r), s.acc + (r / p.window) * p.candidates + j0);
      }
    }
  }
}

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DETAIL_OBSERVE_HPP
