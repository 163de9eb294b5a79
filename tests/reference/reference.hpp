// The slow reference: scalar, double precision, written from design.md's math on plain
// dense arrays. It shares no code with the library (no views, no kernels), so agreement
// between the two is evidence, not tautology.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace ref {

using vec = std::vector<double>;

/// Dense tensors: Q[q][t][c] at (q*W + t)*d + c; K[h][j][c] at (h*L + j)*d + c.
struct problem {
  std::int64_t hq = 0, hkv = 0, w = 0, l = 0, d = 0;
  vec q, k;
  std::vector<std::int64_t> qpos;  // [W]
  std::vector<std::int64_t> kpos;  // [L]; empty: position j
};

enum class domain { visible, candidates };
enum class agg { mean, sum, max, weighted, visible_mean };
enum class gqa { mean, max, sum };
enum class pool { none, avg, max };

struct params {
  domain dom = domain::visible;
  agg window = agg::mean;
  gqa reduce = gqa::mean;
  bool reduce_before_pool = false;
  pool kind = pool::avg;
  std::int64_t kernel = 5;
  bool count_padding = true;
  std::int64_t protected_tail = 0;
  vec weights;  // [W] for agg::weighted
};

inline double nan_max(double a, double b) {
  return (std::isnan(a) || std::isnan(b)) ? NAN : std::max(a, b);
}

/// Attention probabilities A[t][j] of query head q over keys j < C (0 where not visible).
inline std::vector<vec> attention(const problem& p, const params& s, std::int64_t q) {
  const std::int64_t g = p.hq / p.hkv, h = q / g;
  const std::int64_t c_end = std::max<std::int64_t>(0, p.l - s.protected_tail);
  std::vector<vec> a(static_cast<std::size_t>(p.w), vec(static_cast<std::size_t>(c_end), 0.0));
  for (std::int64_t t = 0; t < p.w; ++t) {
    const std::int64_t domain_end = s.dom == domain::visible ? p.l : c_end;
    vec logit(static_cast<std::size_t>(domain_end), -INFINITY);
    std::vector<bool> vis(static_cast<std::size_t>(domain_end), false);
    for (std::int64_t j = 0; j < domain_end; ++j) {
      const std::int64_t kp = p.kpos.empty() ? j : p.kpos[static_cast<std::size_t>(j)];
      if (kp > p.qpos[static_cast<std::size_t>(t)]) continue;
      vis[static_cast<std::size_t>(j)] = true;
      double dot = 0;
      for (std::int64_t c = 0; c < p.d; ++c)
        dot += p.q[static_cast<std::size_t>((q * p.w + t) * p.d + c)] *
               p.k[static_cast<std::size_t>((h * p.l + j) * p.d + c)];
      const double x = dot / std::sqrt(static_cast<double>(p.d));
      logit[static_cast<std::size_t>(j)] = std::isnan(x) ? -INFINITY : x;  // NaN logits get no attention
    }
    double m = -INFINITY;
    for (double x : logit) m = std::max(m, x);
    if (m == -INFINITY) continue;  // sees nothing
    double z = 0;
    for (double x : logit) z += std::exp(x - m);
    const double lse = m + std::log(z);
    for (std::int64_t j = 0; j < c_end; ++j)
      if (vis[static_cast<std::size_t>(j)])
        a[static_cast<std::size_t>(t)][static_cast<std::size_t>(j)] =
            std::exp(logit[static_cast<std::size_t>(j)] - lse);
  }
  return a;
}

inline vec pool_row(const vec& x, const params& s) {
  const std::int64_t n = static_cast<std::int64_t>(x.size()), r = s.kernel / 2;
  if (s.kind == pool::none || r == 0) return x;
  vec y(x.size());
  for (std::int64_t j = 0; j < n; ++j) {
    double acc = s.kind == pool::max ? -INFINITY : 0.0;
    std::int64_t in_range = 0;
    for (std::int64_t i = j - r; i <= j + r; ++i) {
      if (i < 0 || i >= n) continue;
      ++in_range;
      acc = s.kind == pool::max ? nan_max(acc, x[static_cast<std::size_t>(i)]) : acc + x[static_cast<std::size_t>(i)];
    }
    if (s.kind == pool::avg) acc /= s.count_padding ? static_cast<double>(s.kernel) : static_cast<double>(in_range);
    y[static_cast<std::size_t>(j)] = acc;
  }
  return y;
}

inline vec reduce(const std::vector<vec>& rows, gqa r) {
  vec out = rows[0];
  for (std::size_t g = 1; g < rows.size(); ++g)
    for (std::size_t j = 0; j < out.size(); ++j)
      out[j] = r == gqa::max ? nan_max(out[j], rows[g][j]) : out[j] + rows[g][j];
  if (r == gqa::mean)
    for (double& v : out) v /= static_cast<double>(rows.size());
  return out;
}

/// Scores [Hkv][L]: candidates scored, protected tail +inf.
inline std::vector<vec> scores(const problem& p, const params& s) {
  const std::int64_t g = p.hq / p.hkv;
  const std::int64_t c_end = std::max<std::int64_t>(0, p.l - s.protected_tail);
  std::vector<vec> out;
  for (std::int64_t h = 0; h < p.hkv; ++h) {
    std::vector<vec> per_head;
    for (std::int64_t qi = h * g; qi < (h + 1) * g; ++qi) {
      const std::vector<vec> a = attention(p, s, qi);
      vec row(static_cast<std::size_t>(c_end), s.window == agg::max ? 0.0 : 0.0);
      double wsum = 0;
      for (std::int64_t t = 0; t < p.w; ++t)
        wsum += s.window == agg::weighted ? s.weights[static_cast<std::size_t>(t)] : 1.0;
      for (std::int64_t j = 0; j < c_end; ++j) {
        double v = 0;
        std::int64_t seen = 0;
        for (std::int64_t t = 0; t < p.w; ++t) {
          const double x = a[static_cast<std::size_t>(t)][static_cast<std::size_t>(j)];
          const std::int64_t kp = p.kpos.empty() ? j : p.kpos[static_cast<std::size_t>(j)];
          if (kp <= p.qpos[static_cast<std::size_t>(t)]) ++seen;
          switch (s.window) {
            case agg::max:
              v = nan_max(v, x);
              break;
            case agg::weighted:
              v += s.weights[static_cast<std::size_t>(t)] * x;
              break;
            default:
              v += x;
          }
        }
        if (s.window == agg::mean) v /= static_cast<double>(p.w);
        if (s.window == agg::weighted) v /= wsum;
        if (s.window == agg::visible_mean) v = seen > 0 ? v / static_cast<double>(seen) : 0.0;
        row[static_cast<std::size_t>(j)] = v;
      }
      per_head.push_back(row);
    }
    vec final_row;
    if (s.reduce_before_pool) {
      final_row = pool_row(reduce(per_head, s.reduce), s);
    } else {
      std::vector<vec> pooled;
      for (const vec& r : per_head) pooled.push_back(pool_row(r, s));
      final_row = reduce(pooled, s.reduce);
    }
    final_row.resize(static_cast<std::size_t>(p.l), INFINITY);
    out.push_back(final_row);
  }
  return out;
}

/// Top-k by full sort: larger first, NaN last, ties by smaller index; result ascending.
inline std::vector<std::int64_t> top_k(const vec& row, std::int64_t k) {
  std::vector<std::int64_t> idx(row.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](std::int64_t a, std::int64_t b) {
    const double x = row[static_cast<std::size_t>(a)], y = row[static_cast<std::size_t>(b)];
    const bool xn = std::isnan(x), yn = std::isnan(y);
    if (xn != yn) return yn;  // numbers before NaN
    if (!xn && x != y) return x > y;
    return a < b;
  });
  idx.resize(static_cast<std::size_t>(std::min<std::int64_t>(k, static_cast<std::int64_t>(row.size()))));
  std::sort(idx.begin(), idx.end());
  return idx;
}

/// Keep-list of one head: top candidates plus the protected tail.
inline std::vector<std::int64_t> keep(const vec& scores_row, std::int64_t budget, std::int64_t protected_tail,
                                      bool inside_budget) {
  const std::int64_t l = static_cast<std::int64_t>(scores_row.size());
  const std::int64_t p = std::min(protected_tail, l), c = l - p;
  std::int64_t want = inside_budget ? budget - p : budget;
  want = std::max<std::int64_t>(0, std::min(want, c));
  std::vector<std::int64_t> out = top_k(vec(scores_row.begin(), scores_row.begin() + c), want);
  for (std::int64_t j = c; j < l; ++j) out.push_back(j);
  return out;
}

}  // namespace ref
