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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include <Eigen/Core>

#include "kvevict/config.hpp"
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

  std::int64_t rows() const noexcept { return group * window; }
  std::int64_t softmax_end() const noexcept { return domain == softmax_domain::visible ? tokens : candidates; }
};

/// One worker's scratch.
struct observation_scratch {
  float* q = nullptr;        ///< [R, d] scaled queries of the head's group
  float* k = nullptr;        ///< [T, d] widened key tile
  float* logits = nullptr;   ///< [rows per GEMM, T]
  float* row_max = nullptr;  ///< [R]
  float* row_lse = nullptr;  ///< [R]
  float* acc = nullptr;      ///< [G, C]
  float* cached = nullptr;   ///< [R, softmax_end] logits, for small row counts only
};

/// Observation sets of at most this many rows per KV head (G*W; a decode step's G queries)
/// keep their logits, so keys are read once; larger sets (prompt windows) read keys twice
/// and keep only a tile, as the scratch bound O(Hkv*L + tiles) requires.
constexpr std::int64_t cached_logit_rows = 16;

inline void carve_observation_scratch(arena& a, const observation_problem& p, observation_scratch* s) noexcept {
  const tile_plan plan(p.dim);
  const std::int64_t r = p.rows();
  s->q = a.take<float>(r * p.dim);
  s->k = a.take<float>(plan.keys * p.dim);
  s->logits = a.take<float>((r <= cached_logit_rows ? r : std::min(r, plan.rows)) * plan.keys);
  s->row_max = a.take<float>(r);
  s->row_lse = a.take<float>(r);
  s->acc = a.take<float>(p.group * p.candidates);
  s->cached = r <= cached_logit_rows ? a.take<float>(r * p.softmax_end()) : nullptr;
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

/// acc[j] += w * exp(logit[j] - lse) (or max) for the first `live` entries of a prepared row;
/// -inf logits (masked, or NaN) contribute exactly 0.
KVEVICT_ALWAYS_INLINE void accumulate_row(const observation_problem& p, float* row, std::int64_t live, float lse,
                                          float weight, float* acc) {
  using array = Eigen::Array<float, Eigen::Dynamic, 1>;
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  Eigen::Map<array> prob(row, live);
  prob = (prob == neg_inf).select(0.0f, (prob - lse).exp());
  if (p.max_over_window) {
    for (std::int64_t c = 0; c < live; ++c) acc[c] = nan_max(acc[c], row[c]);
  } else {
    Eigen::Map<array> out(acc, live);
    if (weight == 1.0f)
      out += prob;
    else
      out += weight * prob;
  }
}

/// Online log-sum-exp update of one row with a prepared tile row.
KVEVICT_ALWAYS_INLINE void lse_update(const float* row, std::int64_t live, float* row_max, float* row_sum) {
  using array = Eigen::Array<float, Eigen::Dynamic, 1>;
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  if (live == 0) return;
  const Eigen::Map<const array> a(row, live);
  const float tile_max = a.maxCoeff();
  if (tile_max == neg_inf) return;
  if (tile_max > *row_max) {
    *row_sum *= std::exp(*row_max - tile_max);
    *row_max = tile_max;
  }
  *row_sum += (a - *row_max).exp().sum();
}

KVEVICT_ALWAYS_INLINE float finish_lse(float row_max, float row_sum) noexcept {
  if (row_sum > 0.0f) return row_max + std::log(row_sum);
  return row_sum == 0.0f ? -std::numeric_limits<float>::infinity() : row_sum;  // NaN stays NaN
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

  if (s.cached != nullptr && p.lse == nullptr) {
    // One sweep: logits of every row over the whole domain, then softmax from the cache.
    for (std::int64_t r = 0; r < rows; ++r) {
      s.row_max[r] = neg_inf;
      s.row_lse[r] = 0.0f;
    }
    for (std::int64_t j0 = 0; j0 < end; j0 += plan.keys) {
      const std::int64_t n = std::min(plan.keys, end - j0);
      widen_key_tile(keys, h, j0, n, p.dim, s.k);
      logits_tile(s.q, rows, p.dim, s.k, n, s.logits);
      for (std::int64_t r = 0; r < rows; ++r) {
        float* row = s.logits + r * n;
        const std::int64_t live = mask_row(p, row, j0, n, p.query_positions[r % p.window]);
        for (std::int64_t c = live; c < n; ++c) row[c] = neg_inf;
        lse_update(row, live, &s.row_max[r], &s.row_lse[r]);
        std::copy(row, row + n, s.cached + r * end + j0);
      }
    }
    for (std::int64_t r = 0; r < rows; ++r) {
      const float lse = finish_lse(s.row_max[r], s.row_lse[r]);
      if (lse == neg_inf || p.candidates == 0) continue;
      accumulate_row(p, s.cached + r * end, p.candidates, lse, weight_of(r), s.acc + (r / p.window) * p.candidates);
    }
    return;
  }

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
      widen_key_tile(keys, h, j0, n, p.dim, s.k);
      for (std::int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
        const std::int64_t nr = std::min(chunk_rows, rows - r0);
        logits_tile(s.q + r0 * p.dim, nr, p.dim, s.k, n, s.logits);
        for (std::int64_t i = 0; i < nr; ++i) {
          const std::int64_t r = r0 + i;
          float* row = s.logits + i * n;
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
    widen_key_tile(keys, h, j0, n, p.dim, s.k);
    for (std::int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
      const std::int64_t nr = std::min(chunk_rows, rows - r0);
      logits_tile(s.q + r0 * p.dim, nr, p.dim, s.k, n, s.logits);
      for (std::int64_t i = 0; i < nr; ++i) {
        const std::int64_t r = r0 + i;
        const float lse = s.row_lse[r];
        if (lse == neg_inf) continue;  // the row sees no key of its domain
        float* row = s.logits + i * n;
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
