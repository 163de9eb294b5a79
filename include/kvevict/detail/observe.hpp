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
  bool key_positions_sorted = true;                ///< non-decreasing (true when null)
  const float* lse = nullptr;                      ///< [Hq, W] natural-log LSE, or null
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
};

inline void carve_observation_scratch(arena& a, const observation_problem& p, observation_scratch* s) noexcept {
  const tile_plan plan(p.dim);
  const std::int64_t r = p.rows();
  s->q = a.take<float>(r * p.dim);
  s->k = a.take<float>(plan.keys * p.dim);
  s->logits = a.take<float>(std::min(r, plan.rows) * plan.keys);
  s->row_max = a.take<float>(r);
  s->row_lse = a.take<float>(r);
  s->acc = a.take<float>(p.group * p.candidates);
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

/// Computes s.acc ([G, C]) for KV head h.
template <class QT, class KT>
void observe_head(const query_view<const QT>& queries, const cache_view<const KT>& keys, std::int64_t h,
                  const observation_problem& p, const observation_scratch& s) {
  using array = Eigen::Array<float, Eigen::Dynamic, 1>;
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  const tile_plan plan(p.dim);
  const std::int64_t rows = p.rows();
  const std::int64_t chunk_rows = std::min(rows, plan.rows);
  gather_queries(queries, h, p, s.q);

  // Sweep 1: each row's log-sum-exp over the softmax domain (online max and normaliser).
  if (p.lse != nullptr) {
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t g = r / p.window, t = r % p.window;
      s.row_lse[r] = p.lse[(h * p.group + g) * p.lse_head_stride + t];
    }
  } else {
    float* sums = s.row_lse;
    for (std::int64_t r = 0; r < rows; ++r) {
      s.row_max[r] = neg_inf;
      sums[r] = 0.0f;
    }
    const std::int64_t end = p.softmax_end();
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
          if (live == 0) continue;
          Eigen::Map<array> a(row, live);
          const float tile_max = a.maxCoeff();
          if (tile_max == neg_inf) continue;
          if (tile_max > s.row_max[r]) {
            sums[r] *= std::exp(s.row_max[r] - tile_max);
            s.row_max[r] = tile_max;
          }
          sums[r] += (a - s.row_max[r]).exp().sum();
        }
      }
    }
    for (std::int64_t r = 0; r < rows; ++r)
      s.row_lse[r] = sums[r] > 0.0f ? s.row_max[r] + std::log(sums[r]) : (sums[r] == 0.0f ? neg_inf : sums[r]);
  }

  // Sweep 2: accumulate probabilities of candidate keys.
  for (std::int64_t i = 0; i < p.group * p.candidates; ++i) s.acc[i] = 0.0f;
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
        const std::int64_t t = r % p.window;
        float* row = s.logits + i * n;
        const std::int64_t live = mask_row(p, row, j0, n, p.query_positions[t]);
        if (live == 0) continue;
        Eigen::Map<array> prob(row, live);
        prob = (prob - lse).exp();
        if (!p.key_positions_sorted) {
          for (std::int64_t c = 0; c < live; ++c)
            if (p.key_positions[j0 + c] > p.query_positions[t]) row[c] = 0.0f;
        }
        float* acc = s.acc + (r / p.window) * p.candidates + j0;
        if (p.max_over_window) {
          for (std::int64_t c = 0; c < live; ++c) acc[c] = nan_max(acc[c], row[c]);
        } else {
          const float w = p.weights != nullptr ? p.weights[t] : 1.0f;
          Eigen::Map<array> out(acc, live);
          if (w == 1.0f) out += prob;
          else out += w * prob;
        }
      }
    }
  }
}

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DETAIL_OBSERVE_HPP
