// NaN and +-Inf in keys, queries, attention rows, engine LSEs and precomputed scores: no
// crash, no hang, and results that follow the documented rules (docs/reliability.md):
//   * a NaN logit gets zero attention (a NaN key, or a NaN query channel, never poisons
//     the softmax of the row);
//   * NaN scores rank below every number, -inf included; equal scores (and -0 == +0) go to
//     the smaller index; the keep-list is ascending;
//   * max operations (window max, GQA max, max pooling) propagate NaN, as sums do;
//   * an observation only ever affects the keys it sees;
//   * eviction moves bits: NaN payloads, infinities and -0 survive compaction unchanged;
//   * every result is deterministic (repeated calls are bitwise identical).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "reference/reference.hpp"
#include "support/compare.hpp"
#include "support/scoring_config.hpp"
#include "support/test_cache.hpp"

namespace {

using i64 = std::int64_t;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

using config = test::scoring_config;
using test::make_config;

std::vector<config> configs() {
  using namespace kvevict;
  return {
      make_config(softmax_domain::visible, window_aggregation::mean, gqa_reduction::mean, gqa_order::after_pooling,
                  pooling_kind::avg, 5, 4),
      make_config(softmax_domain::visible, window_aggregation::sum, gqa_reduction::max, gqa_order::after_pooling,
                  pooling_kind::max, 7, 0),
      make_config(softmax_domain::candidates, window_aggregation::max, gqa_reduction::mean, gqa_order::before_pooling,
                  pooling_kind::max, 3, 6),
      make_config(softmax_domain::visible, window_aggregation::visible_mean, gqa_reduction::sum,
                  gqa_order::before_pooling, pooling_kind::none, 1, 2),
  };
}

/// Bitwise equality of two float vectors (NaN == NaN when the bits agree).
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// Scores the problem with the library (every executor path runs the same rows).
template <class T>
std::vector<float> library_scores(const ref::problem& p, const config& c, test::layout lay, i64 seed,
                                  const std::vector<float>* lse = nullptr) {
  auto keys = test::make_cache<T>(lay, p.hkv, p.l, p.d, p.k, 8, static_cast<std::uint64_t>(seed));
  auto queries = test::make_queries<T>(p.hq, p.w, p.d, p.q, p.qpos, false, test::int32_positions(lay));
  std::vector<float> out(static_cast<std::size_t>(p.hkv * p.l), -1.0f);
  kvevict::workspace ws(kvevict::observation_scores_workspace_size({p.hq, p.hkv, p.d, p.l, p.w}, c.lib));
  kvevict::observation_inputs in;
  if (lse != nullptr) in.lse = lse->data();
  const kvevict::status st =
      kvevict::observation_scores(queries.view, keys.view, c.lib, {out.data(), p.hkv, p.l, p.l}, ws, in);
  INFO(st.message());
  REQUIRE(st.ok());
  return out;
}

ref::problem make_problem(i64 hkv, i64 group, i64 d, i64 l, i64 w, std::uint64_t seed) {
  ref::problem p;
  p.hkv = hkv;
  p.hq = hkv * group;
  p.d = d;
  p.l = l;
  p.w = w;
  p.q = test::normal(static_cast<std::size_t>(p.hq * w * d), seed, 1.5);
  p.k = test::normal(static_cast<std::size_t>(hkv * l * d), seed + 1);
  for (i64 t = 0; t < w; ++t) p.qpos.push_back(l - w + t);
  return p;
}

double& key_at(ref::problem& p, i64 h, i64 j, i64 c) {
  return p.k[static_cast<std::size_t>((h * p.l + j) * p.d + c)];
}
double& query_at(ref::problem& p, i64 q, i64 t, i64 c) {
  return p.q[static_cast<std::size_t>((q * p.w + t) * p.d + c)];
}

}  // namespace

TEMPLATE_TEST_CASE("NaN and -inf in keys and queries get zero attention (reference and every path)", "[errors]", float,
                   kvevict::bf16, kvevict::fp16) {
  using T = TestType;
  // G*W <= 16 takes the cached-logit path, larger windows the two-sweep path.
  const struct { i64 hkv, group, d, l, w; } shapes[] = {{2, 2, 16, 70, 4}, {2, 4, 32, 300, 8}, {1, 1, 8, 40, 3}};
  for (const auto& s : shapes) {
    for (int variant = 0; variant < 5; ++variant) {
      ref::problem p = make_problem(s.hkv, s.group, s.d, s.l, s.w, 100 + static_cast<std::uint64_t>(variant));
      switch (variant) {
        case 0:  // one NaN channel in a few keys of every head
          for (i64 h = 0; h < s.hkv; ++h)
            for (i64 j : {i64{0}, i64{3}, s.l / 2, s.l - 1}) key_at(p, h, j, j % s.d) = kNaN;
          break;
        case 1:  // whole keys NaN, including a run of them
          for (i64 h = 0; h < s.hkv; ++h)
            for (i64 j = 5; j < 12; ++j)
              for (i64 c = 0; c < s.d; ++c) key_at(p, h, j, c) = kNaN;
          break;
        case 2:  // a NaN channel in one observation query of each head: that row sees nothing
          for (i64 q = 0; q < p.hq; ++q) query_at(p, q, q % s.w, 1) = kNaN;
          break;
        case 3:  // -inf keys: logit -inf (or NaN with mixed-sign queries): zero attention
          for (i64 h = 0; h < s.hkv; ++h)
            for (i64 c = 0; c < s.d; ++c) key_at(p, h, 7, c) = -kInf;
          break;
        default:  // every query of head 0 NaN: its KV head's scores come from the others only
          for (i64 t = 0; t < s.w; ++t)
            for (i64 c = 0; c < s.d; ++c) query_at(p, 0, t, c) = kNaN;
          break;
      }
      p.q = test::rounded<T>(p.q);
      p.k = test::rounded<T>(p.k);
      for (const config& c : configs()) {
        const std::vector<ref::vec> want = ref::scores(p, c.ref);
        for (test::layout lay : {test::layout::contiguous, test::layout::paged_hnd, test::layout::transposed}) {
          INFO("shape L=" << s.l << " G=" << s.group << " W=" << s.w << " variant " << variant << " layout "
                          << test::name(lay) << " window " << static_cast<int>(c.lib.window));
          const std::vector<float> got = library_scores<T>(p, c, lay, variant);
          // The rule keeps NaN out of the scores entirely.
          for (float x : got) REQUIRE_FALSE(std::isnan(x));
          test::require_scores_close({got.data(), p.hkv, p.l, p.l}, want);
          REQUIRE(same_bits(got, library_scores<T>(p, c, lay, variant)));
        }
      }
    }
  }
}

TEST_CASE("an infinite logit poisons only the keys its observation sees", "[errors]") {
  // Key 5 is +inf in every channel; observation 0 (position 10, all-positive query) gives it
  // a +inf logit, so its softmax is undefined (inf/inf): NaN attention for every key it sees
  // (0..10). Observation 1 (position 20, all-negative query) gives key 5 a -inf logit: zero
  // attention, a normal softmax over the rest. Keys 11..23 are not seen by observation 0 and
  // must score exactly as if it contributed nothing.
  for (i64 group : {1, 4, 9}) {  // G*W = 2, 8, 18: cached path and two-sweep path
    ref::problem p = make_problem(1, group, 8, 24, 2, 7);
    p.qpos = {10, 20};
    for (i64 c = 0; c < p.d; ++c) key_at(p, 0, 5, c) = kInf;
    for (i64 q = 0; q < p.hq; ++q)
      for (i64 c = 0; c < p.d; ++c) {
        query_at(p, q, 0, c) = 0.5 + 0.01 * static_cast<double>(c);
        query_at(p, q, 1, c) = -0.5 - 0.01 * static_cast<double>(c);
      }
    for (auto win : {kvevict::window_aggregation::mean, kvevict::window_aggregation::max}) {
      config c = make_config(kvevict::softmax_domain::visible, win, kvevict::gqa_reduction::mean,
                             kvevict::gqa_order::before_pooling, kvevict::pooling_kind::none, 1, 0);
      INFO("G " << group << " window " << static_cast<int>(win));
      const std::vector<float> got = library_scores<float>(p, c, test::layout::contiguous, 1);
      REQUIRE(same_bits(got, library_scores<float>(p, c, test::layout::paged_nhd, 2)));
      for (i64 j = 0; j <= 10; ++j) {
        INFO("key " << j << " score " << got[static_cast<std::size_t>(j)]);
        CHECK(std::isnan(got[static_cast<std::size_t>(j)]));
      }
      // Keys 11..23: the reference without observation 0 (mean divides by W = 2 all the same).
      ref::problem only1 = p;
      const std::vector<ref::vec> want = ref::scores(only1, c.ref);
      for (i64 j = 11; j < p.l; ++j) {
        const double w = want[0][static_cast<std::size_t>(j)];
        INFO("key " << j << " score " << got[static_cast<std::size_t>(j)] << " reference " << w);
        CHECK_FALSE(std::isnan(got[static_cast<std::size_t>(j)]));
        CHECK(std::fabs(static_cast<double>(got[static_cast<std::size_t>(j)]) - w) <= 1e-5 * std::fabs(w) + 1e-7);
      }
      // Selection ranks the NaN keys last and stays deterministic.
      kvevict::keep_list keep(1, 24);
      kvevict::workspace sws(kvevict::select_workspace_size(24));
      REQUIRE(
          kvevict::select(kvevict::const_score_view{got.data(), 1, 24, 24}, kvevict::budget::tokens(14), {}, keep, sws)
              .ok());
      std::vector<i64> want_keep;
      for (i64 j = 0; j < 24; ++j)
        if (j >= 11) want_keep.push_back(j);
      want_keep.insert(want_keep.begin(), i64{0});  // 14 = the 13 finite keys + the first NaN key (index 0)
      CHECK(keep.head(0) == want_keep);
    }
  }
}

TEST_CASE("engine LSEs that are NaN or infinite do not crash and stay deterministic", "[errors]") {
  ref::problem p = make_problem(2, 2, 16, 64, 4, 31);
  config c =
      make_config(kvevict::softmax_domain::visible, kvevict::window_aggregation::mean, kvevict::gqa_reduction::mean,
                  kvevict::gqa_order::after_pooling, kvevict::pooling_kind::max, 3, 4);
  std::vector<float> lse(static_cast<std::size_t>(p.hq * p.w), 2.0f);
  lse[1] = std::numeric_limits<float>::quiet_NaN();
  lse[5] = std::numeric_limits<float>::infinity();   // every probability 0: contributes nothing
  lse[6] = -std::numeric_limits<float>::infinity();  // "sees nothing": contributes nothing
  const std::vector<float> a = library_scores<float>(p, c, test::layout::contiguous, 3, &lse);
  const std::vector<float> b = library_scores<float>(p, c, test::layout::token_major, 4, &lse);
  REQUIRE(same_bits(a, b));
  // Query head 0 (KV head 0) has a NaN LSE in observation 1: KV head 0's candidates that
  // observation sees are NaN. KV head 1 (query heads 2, 3: LSE entries 8..15) is unaffected.
  for (i64 j = 0; j < p.l - 4; ++j) CHECK(std::isnan(a[static_cast<std::size_t>(j)]));
  for (i64 j = p.l; j < 2 * p.l; ++j) CHECK_FALSE(std::isnan(a[static_cast<std::size_t>(j)]));
}

// ---------------------------------------------------------------------------------------
// Selection over precomputed scores
// ---------------------------------------------------------------------------------------
namespace {
/// Rows with every kind of non-finite and tie pattern.
std::vector<std::vector<float>> special_rows(i64 n, std::uint64_t seed) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<std::vector<float>> rows;
  rows.emplace_back(static_cast<std::size_t>(n), nan);  // all NaN
  rows.emplace_back(static_cast<std::size_t>(n), inf);  // all +inf
  rows.emplace_back(static_cast<std::size_t>(n), -inf);
  rows.emplace_back(static_cast<std::size_t>(n), 0.0f);  // all tied
  std::vector<float> mixed(static_cast<std::size_t>(n));
  const std::vector<double> x = test::normal(static_cast<std::size_t>(n), seed);
  for (i64 j = 0; j < n; ++j) {
    const std::size_t i = static_cast<std::size_t>(j);
    switch (j % 7) {
      case 0:
        mixed[i] = nan;
        break;
      case 1:
        mixed[i] = -inf;
        break;
      case 2:
        mixed[i] = (j % 2) ? -0.0f : 0.0f;
        break;
      case 3:
        mixed[i] = inf;
        break;
      case 4:
        mixed[i] = -std::numeric_limits<float>::denorm_min();
        break;
      default:
        mixed[i] = static_cast<float>(std::round(x[i] * 4.0) / 4.0);  // many exact ties
    }
  }
  rows.push_back(mixed);
  std::vector<float> nan_tail(static_cast<std::size_t>(n));
  for (i64 j = 0; j < n; ++j) nan_tail[static_cast<std::size_t>(j)] = j < n / 3 ? static_cast<float>(j % 5) : nan;
  rows.push_back(nan_tail);
  // Signalling and negative NaNs, with payloads, among numbers.
  std::vector<float> payloads(static_cast<std::size_t>(n));
  for (i64 j = 0; j < n; ++j) {
    std::uint32_t bits = 0;
    if (j % 3 == 0) {
      bits = (j % 2 ? 0xff800001u : 0x7fa00000u) + static_cast<std::uint32_t>(j % 1000);  // sNaN, -sNaN
      std::memcpy(&payloads[static_cast<std::size_t>(j)], &bits, 4);
    } else {
      payloads[static_cast<std::size_t>(j)] = static_cast<float>(x[static_cast<std::size_t>(j)]);
    }
  }
  rows.push_back(payloads);
  return rows;
}
}  // namespace

TEST_CASE("select ranks NaN last, ties to the smaller index, on rows of every length", "[errors]") {
  for (i64 n : {i64{1}, i64{7}, i64{100}, i64{4095}, i64{4096}, i64{9001}}) {
    const std::vector<std::vector<float>> rows = special_rows(n, static_cast<std::uint64_t>(n));
    const i64 h = static_cast<i64>(rows.size());
    std::vector<float> scores;
    for (const auto& r : rows) scores.insert(scores.end(), r.begin(), r.end());
    kvevict::workspace ws(kvevict::select_workspace_size(n));
    for (i64 budget : {i64{0}, i64{1}, n / 3, n / 2 + 1, n - 1, n, n + 5}) {
      for (i64 tail : {i64{0}, i64{3}}) {
        const kvevict::selection_params sp{tail, kvevict::protected_mode::inside_budget};
        kvevict::keep_list keep(h, kvevict::select_capacity(h, n, kvevict::budget::tokens(budget), sp));
        REQUIRE(kvevict::select(kvevict::const_score_view{scores.data(), h, n, n}, kvevict::budget::tokens(budget), sp,
                                keep, ws)
                    .ok());
        for (i64 r = 0; r < h; ++r) {
          const std::vector<float>& row = rows[static_cast<std::size_t>(r)];
          const ref::vec rrow(row.begin(), row.end());
          INFO("n " << n << " row " << r << " budget " << budget << " tail " << tail);
          REQUIRE(keep.head(r) == ref::keep(rrow, budget, tail, true));
        }
        // The per-head overload agrees.
        std::vector<i64> budgets(static_cast<std::size_t>(h), budget);
        kvevict::keep_list keep2(h, kvevict::select_capacity(h, n, kvevict::budget::tokens(budget), sp));
        REQUIRE(kvevict::select(kvevict::const_score_view{scores.data(), h, n, n}, budgets.data(), sp, keep2, ws).ok());
        for (i64 r = 0; r < h; ++r) REQUIRE(keep2.head(r) == keep.head(r));
      }
    }
  }
}

TEST_CASE("adakv_head_budgets and chunkkv with non-finite scores are deterministic and in range", "[errors]") {
  const i64 n = 500, tail = 8;
  const std::vector<std::vector<float>> rows = special_rows(n, 5);
  const i64 h = static_cast<i64>(rows.size());
  std::vector<float> scores;
  for (const auto& r : rows) scores.insert(scores.end(), r.begin(), r.end());
  kvevict::workspace ws(kvevict::adakv_workspace_size(h, n));
  for (bool normalize : {false, true}) {
    std::vector<i64> a(static_cast<std::size_t>(h)), b(static_cast<std::size_t>(h));
    REQUIRE(kvevict::adakv_head_budgets({scores.data(), h, n, n}, tail, 40, {0.2, normalize}, a.data(), ws).ok());
    REQUIRE(kvevict::adakv_head_budgets({scores.data(), h, n, n}, tail, 40, {0.2, normalize}, b.data(), ws).ok());
    REQUIRE(a == b);
    i64 total = 0;
    for (i64 x : a) {
      REQUIRE(x >= 0);
      REQUIRE(x <= n - tail);
      total += x;
    }
    CHECK(std::llabs(total - h * 40) <= h);
  }
  // ChunkKV over KNorm: a NaN key makes its chunk's score NaN in every head (sums propagate
  // NaN), and those chunks rank last.
  const i64 hkv = 2, l = 60, d = 4;
  std::vector<double> dense = test::normal(static_cast<std::size_t>(hkv * l * d), 9);
  dense[static_cast<std::size_t>((0 * l + 23) * d + 1)] = kNaN;  // head 0, token 23: chunk [20, 30)
  auto keys = test::make_cache<float>(test::layout::contiguous, hkv, l, d, dense);
  kvevict::layer_inputs<float> in;
  in.keys = keys.view;
  std::vector<float> out(static_cast<std::size_t>(hkv * l));
  kvevict::chunkkv<kvevict::knorm<float>> policy(kvevict::knorm<float>(), {10});
  kvevict::workspace kws(policy.workspace_size({hkv, hkv, d, l, 1}));
  REQUIRE(policy.score(in, {out.data(), hkv, l, l}, kws).ok());
  for (i64 hh = 0; hh < hkv; ++hh)
    for (i64 j = 0; j < l; ++j) {
      INFO("head " << hh << " token " << j);
      CHECK(std::isnan(out[static_cast<std::size_t>(hh * l + j)]) == (j >= 20 && j < 30));
    }
}

// ---------------------------------------------------------------------------------------
// attention_scores: NaN/inf in given attention rows propagate through sums, max, pooling
// ---------------------------------------------------------------------------------------
TEST_CASE("attention rows with NaN and inf propagate through sums, max and pooling like the reference", "[errors]") {
  const i64 hq = 4, hkv = 2, w = 3, l = 30;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<float> attn(static_cast<std::size_t>(hq * w * l));
  const std::vector<double> x = test::normal(attn.size(), 77);
  for (std::size_t i = 0; i < attn.size(); ++i) attn[i] = static_cast<float>(std::fabs(x[i]));
  attn[static_cast<std::size_t>((0 * w + 1) * l + 4)] = nan;   // head 0, obs 1, key 4
  attn[static_cast<std::size_t>((3 * w + 2) * l + 17)] = inf;  // head 3, obs 2, key 17
  attn[static_cast<std::size_t>((2 * w + 0) * l + 9)] = nan;   // head 2, obs 0, key 9
  std::vector<i64> qpos{l - 3, l - 2, l - 1};
  using namespace kvevict;
  for (auto win : {window_aggregation::mean, window_aggregation::sum, window_aggregation::max}) {
    for (auto red : {gqa_reduction::mean, gqa_reduction::max, gqa_reduction::sum}) {
      for (auto order : {gqa_order::before_pooling, gqa_order::after_pooling}) {
        for (auto pool : {pooling_kind::none, pooling_kind::avg, pooling_kind::max}) {
          config c = make_config(softmax_domain::visible, win, red, order, pool, 5, 3);
          std::vector<float> out(static_cast<std::size_t>(hkv * l), -1.0f);
          workspace ws(attention_scores_workspace_size({hq, hkv, 1, l, w}, c.lib));
          // No weights (the default): GCC 12 used to warn -Warray-bounds here at -O3.
          REQUIRE(attention_scores(contiguous_attention(attn.data(), hq, w, l, qpos.data()), hkv, c.lib,
                                   {out.data(), hkv, l, l}, ws)
                      .ok());
          // Reference: window aggregation per query head, then GQA reduction and pooling.
          std::vector<ref::vec> want;
          const i64 cand = l - 3, g = hq / hkv;
          for (i64 h = 0; h < hkv; ++h) {
            std::vector<ref::vec> per_head;
            for (i64 q = h * g; q < (h + 1) * g; ++q) {
              ref::vec row(static_cast<std::size_t>(cand), 0.0);
              for (i64 j = 0; j < cand; ++j) {
                double v = 0.0;
                for (i64 t = 0; t < w; ++t) {
                  const double a = attn[static_cast<std::size_t>((q * w + t) * l + j)];
                  v = win == window_aggregation::max ? ref::nan_max(v, a) : v + a;
                }
                row[static_cast<std::size_t>(j)] = win == window_aggregation::mean ? v / static_cast<double>(w) : v;
              }
              per_head.push_back(row);
            }
            ref::vec final_row;
            if (c.ref.reduce_before_pool) {
              final_row = ref::pool_row(ref::reduce(per_head, c.ref.reduce), c.ref);
            } else {
              std::vector<ref::vec> pooled;
              for (const ref::vec& r : per_head) pooled.push_back(ref::pool_row(r, c.ref));
              final_row = ref::reduce(pooled, c.ref.reduce);
            }
            final_row.resize(static_cast<std::size_t>(l), kInf);
            want.push_back(final_row);
          }
          INFO("window " << static_cast<int>(win) << " gqa " << static_cast<int>(red) << " order "
                         << static_cast<int>(order) << " pool " << static_cast<int>(pool));
          test::require_scores_close({out.data(), hkv, l, l}, want);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// KNorm, DeferKV, DapQ/RoPE with non-finite inputs
// ---------------------------------------------------------------------------------------
TEST_CASE("KNorm scores NaN keys NaN and infinite keys -inf", "[errors]") {
  const i64 hkv = 2, l = 10, d = 4;
  std::vector<double> dense = test::normal(static_cast<std::size_t>(hkv * l * d), 3);
  dense[static_cast<std::size_t>((0 * l + 2) * d + 0)] = kNaN;
  dense[static_cast<std::size_t>((1 * l + 5) * d + 3)] = kInf;
  dense[static_cast<std::size_t>((1 * l + 6) * d + 1)] = -kInf;
  auto keys = test::make_cache<kvevict::bf16>(test::layout::token_major, hkv, l, d, dense);
  kvevict::layer_inputs<kvevict::bf16> in;
  in.keys = keys.view;
  std::vector<float> out(static_cast<std::size_t>(hkv * l));
  kvevict::knorm<kvevict::bf16> policy;
  kvevict::workspace ws(policy.workspace_size({hkv, hkv, d, l, 1}));
  REQUIRE(policy.score(in, {out.data(), hkv, l, l}, ws).ok());
  CHECK(std::isnan(out[2]));
  CHECK(out[static_cast<std::size_t>(l + 5)] == -std::numeric_limits<float>::infinity());
  CHECK(out[static_cast<std::size_t>(l + 6)] == -std::numeric_limits<float>::infinity());
  kvevict::keep_list keep(hkv, hkv * l);
  kvevict::workspace sws(kvevict::select_workspace_size(l));
  REQUIRE(
      kvevict::select(kvevict::const_score_view{out.data(), hkv, l, l}, kvevict::budget::tokens(l - 1), {}, keep, sws)
          .ok());
  const std::vector<i64> h0 = keep.head(0);
  CHECK(std::find(h0.begin(), h0.end(), 2) == h0.end());  // the NaN key is the one dropped
  const std::vector<i64> h1 = keep.head(1);
  CHECK(std::find(h1.begin(), h1.end(), 6) == h1.end());  // -inf scores: the smaller index survives
  CHECK(std::find(h1.begin(), h1.end(), 5) != h1.end());
}

TEST_CASE("KeyDiff and TOVA with NaN and infinite keys and queries never crash and repeat their bits", "[errors]") {
  const i64 hkv = 2, g = 2, hq = hkv * g, l = 12, d = 8;
  std::vector<double> k = test::normal(static_cast<std::size_t>(hkv * l * d), 5);
  std::vector<double> q = test::normal(static_cast<std::size_t>(hq * d), 6);
  k[static_cast<std::size_t>((0 * l + 3) * d + 1)] = kNaN;
  k[static_cast<std::size_t>((1 * l + 4) * d + 2)] = kInf;
  k[static_cast<std::size_t>((1 * l + 7) * d + 0)] = -kInf;
  q[static_cast<std::size_t>(1 * d + 5)] = kNaN;
  auto keys = test::make_cache<kvevict::bf16>(test::layout::paged_nhd, hkv, l, d, k);
  auto queries = test::make_queries<kvevict::bf16>(hq, 1, d, q, {l - 1});
  kvevict::layer_inputs<kvevict::bf16> in;
  in.keys = keys.view;
  in.queries = queries.view;
  const kvevict::layer_shape shape{hq, hkv, d, l, 1};
  auto twice = [&](const auto& policy) {
    std::vector<float> a(static_cast<std::size_t>(hkv * l), 1.0f), b(a.size(), -1.0f);
    kvevict::workspace ws(policy.workspace_size(shape));
    REQUIRE(policy.score(in, {a.data(), hkv, l, l}, ws).ok());
    REQUIRE(policy.score(in, {b.data(), hkv, l, l}, ws).ok());
    REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    return a;
  };
  const std::vector<float> kd = twice(kvevict::keydiff<kvevict::bf16>());
  // A NaN key spoils its head's anchor (normalised, it is NaN): every score of head 0 is NaN.
  for (i64 j = 0; j < l; ++j) CHECK(std::isnan(kd[static_cast<std::size_t>(j)]));
  (void)twice(kvevict::tova<kvevict::bf16>());
  CHECK(std::isinf(twice(kvevict::tova<kvevict::bf16>())[static_cast<std::size_t>(l - 1)]));
}

TEST_CASE("DeferKV with NaN keys and queries equals SnapKV bit for bit and never poisons its state", "[errors]") {
  const i64 hkv = 2, group = 2, d = 16, lp = 90, w = 8;
  ref::problem p = make_problem(hkv, group, d, lp + 2, w, 55);
  p.qpos.clear();
  for (i64 t = 0; t < w; ++t) p.qpos.push_back(lp - w + t);
  for (i64 c = 0; c < d; ++c) key_at(p, 1, 20, c) = kNaN;
  key_at(p, 0, 33, 2) = kNaN;
  query_at(p, 1, 3, 0) = kNaN;
  auto cache = test::make_cache<float>(test::layout::paged_nhd, hkv, lp + 2, d, p.k, 16, 3);
  auto window = test::make_queries<float>(hkv * group, w, d, p.q, p.qpos);
  kvevict::deferkv_config cfg;
  cfg.window = w;
  cfg.decode_feedback = false;
  kvevict::deferkv_state<float> state(cfg);
  REQUIRE(state.reserve(hkv, lp).ok());
  kvevict::workspace ws(state.workspace_size({hkv * group, hkv, d, lp + 2, w}));
  kvevict::layer_inputs<float> in;
  in.keys = cache.view.first_tokens(lp);
  in.queries = window.view;
  REQUIRE(state.observe_prefill(0, in, ws).ok());
  std::vector<float> deferred(static_cast<std::size_t>(hkv * lp)), snap(deferred.size());
  REQUIRE(state.scores({deferred.data(), hkv, lp, lp}, ws).ok());
  for (float x : deferred) REQUIRE_FALSE(std::isnan(x));
  // SnapKV with DeferKV's parameters (weights eta^(W-1-t), GQA before pooling).
  std::vector<float> weights;
  for (i64 t = 0; t < w; ++t) weights.push_back(static_cast<float>(std::pow(0.9, static_cast<double>(w - 1 - t))));
  kvevict::observation_inputs oi;
  oi.weights = weights.data();
  kvevict::workspace ows(kvevict::observation_scores_workspace_size({hkv * group, hkv, d, lp, w}, cfg.params()));
  REQUIRE(kvevict::observation_scores(window.view, in.keys, cfg.params(), {snap.data(), hkv, lp, lp}, ows, oi).ok());
  CHECK(same_bits(deferred, snap));

  // With decode feedback, a NaN decode query is one more observation that sees nothing.
  kvevict::deferkv_config fb = cfg;
  fb.decode_feedback = true;
  fb.delay = 2;
  kvevict::deferkv_state<float> st2(fb);
  REQUIRE(st2.reserve(hkv, lp).ok());
  REQUIRE(st2.observe_prefill(0, in, ws).ok());
  std::vector<float> dq(static_cast<std::size_t>(hkv * group * d), std::numeric_limits<float>::quiet_NaN());
  for (i64 step = 0; step < 2; ++step) {
    std::vector<i64> pos{lp + step};
    kvevict::layer_inputs<float> dec;
    dec.keys = cache.view.first_tokens(lp + step + 1);
    dec.queries = kvevict::contiguous_queries<const float>(dq.data(), hkv * group, 1, d, pos.data());
    REQUIRE(st2.observe_decode(0, step, dec, ws).ok());
  }
  std::vector<float> fed(static_cast<std::size_t>(hkv * (lp + 2)));
  REQUIRE(st2.scores({fed.data(), hkv, lp + 2, lp + 2}, ws).ok());
  for (float x : fed) REQUIRE_FALSE(std::isnan(x));
}

TEST_CASE("RoPE re-rotation confines a NaN or inf channel to its pair", "[errors]") {
  const i64 hq = 2, w = 3, d = 16;
  std::vector<float> q(static_cast<std::size_t>(hq * w * d), 0.5f);
  q[3] = std::numeric_limits<float>::quiet_NaN();                                        // head 0, obs 0, channel 3
  q[static_cast<std::size_t>(w * d + d + 10)] = std::numeric_limits<float>::infinity();  // head 1, obs 1, channel 10
  std::vector<i64> pos{100, 101, 102}, out_pos(3);
  std::vector<float> out(q.size());
  for (auto pairing : {kvevict::rope_pairing::neox, kvevict::rope_pairing::gptj}) {
    kvevict::rope_config rope;
    rope.head_dim = d;
    rope.pairing = pairing;
    rope.theta = 500000.0;
    rope.llama3.enabled = true;
    REQUIRE(kvevict::dapq_rerotate(kvevict::contiguous_queries<const float>(q.data(), hq, w, d, pos.data()), rope,
                                   1000000000000LL, out.data(), out_pos.data())
                .ok());
    CHECK(out_pos == std::vector<i64>{1000000000100LL, 1000000000101LL, 1000000000102LL});
    const auto partner = [&](i64 c) {
      return pairing == kvevict::rope_pairing::neox ? (c < d / 2 ? c + d / 2 : c - d / 2) : (c ^ 1);
    };
    for (i64 r = 0; r < hq * w; ++r)
      for (i64 c = 0; c < d; ++c) {
        const bool hit = (r == 0 && (c == 3 || c == partner(3))) || (r == w + 1 && (c == 10 || c == partner(10)));
        INFO("row " << r << " channel " << c);
        CHECK(std::isfinite(out[static_cast<std::size_t>(r * d + c)]) == !hit);
      }
  }
}

// ---------------------------------------------------------------------------------------
// Eviction moves bits
// ---------------------------------------------------------------------------------------
TEMPLATE_TEST_CASE("eviction preserves NaN payloads, infinities and signed zeros bit for bit", "[errors]", float,
                   kvevict::fp16, kvevict::bf16) {
  using T = TestType;
  const i64 hkv = 2, l = 37, d = 6;
  // Bit patterns: signalling and quiet NaNs with payloads, both infinities, -0, subnormals.
  const std::vector<std::uint32_t> f32 = {0x7f800001u, 0xffc12345u, 0x7f800000u, 0xff800000u, 0x80000000u, 0x00000001u};
  const std::vector<std::uint16_t> f16 = {0x7c01u, 0xfe3fu, 0x7c00u, 0xfc00u, 0x8000u, 0x0001u};
  const std::vector<std::uint16_t> b16 = {0x7f81u, 0xffc3u, 0x7f80u, 0xff80u, 0x8000u, 0x0001u};
  for (test::layout lay : test::kAllLayouts) {
    auto cache = test::make_cache<T>(lay, hkv, l, d, test::normal(static_cast<std::size_t>(hkv * l * d), 1), 8, 5);
    auto values = test::make_cache<T>(lay, hkv, l, d, test::normal(static_cast<std::size_t>(hkv * l * d), 2), 8, 6);
    for (i64 h = 0; h < hkv; ++h)
      for (i64 j = 0; j < l; ++j)
        for (i64 c = 0; c < d; ++c) {
          const std::size_t which = static_cast<std::size_t>((h + j + c) % 6);
          T& x = cache.at(h, j, c);
          if (sizeof(T) == 4) {
            std::memcpy(&x, &f32[which], 4);
          } else {
            std::memcpy(&x, std::is_same<T, kvevict::fp16>::value ? &f16[which] : &b16[which], 2);
          }
          values.at(h, j, c) = x;
        }
    // Expected rows, gathered by the test's own offsets.
    std::vector<i64> off{0, 12, 30}, idx;
    for (i64 j = 0; j < l; j += 3) idx.push_back(j);  // 13 entries: trim to 12
    idx.resize(12);
    for (i64 j = 1; j < l; j += 2) idx.push_back(j);
    idx.resize(30);
    std::vector<T> want;
    for (i64 h = 0; h < hkv; ++h)
      for (i64 i = off[static_cast<std::size_t>(h)]; i < off[static_cast<std::size_t>(h + 1)]; ++i)
        for (i64 c = 0; c < d; ++c) want.push_back(cache.at(h, idx[static_cast<std::size_t>(i)], c));
    kvevict::eviction_result result;
    kvevict::workspace ws(kvevict::evict_workspace_size(cache.view, values.view));
    INFO(test::name(lay));
    REQUIRE(kvevict::evict(cache.view, values.view, {hkv, off.data(), idx.data(), 30}, result, ws).ok());
    std::vector<T> got_k, got_v;
    for (i64 h = 0; h < hkv; ++h)
      for (i64 i = 0; i < off[static_cast<std::size_t>(h + 1)] - off[static_cast<std::size_t>(h)]; ++i)
        for (i64 c = 0; c < d; ++c) {
          got_k.push_back(cache.at(h, i, c));
          got_v.push_back(values.at(h, i, c));
        }
    REQUIRE(std::memcmp(got_k.data(), want.data(), want.size() * sizeof(T)) == 0);
    REQUIRE(std::memcmp(got_v.data(), want.data(), want.size() * sizeof(T)) == 0);
  }
}

namespace {
/// Every bit pattern of a 1- or 2-byte storage type (floats: each exponent with sampled
/// mantissas), counted by the report's exponent-bit test and by widening each element.
template <class T>
void check_nonfinite_count() {
  std::vector<T> row;
  std::int64_t widened = 0;
  const auto add = [&](std::uint32_t bits) {
    const kvevict::detail::storage_word<T> word = static_cast<kvevict::detail::storage_word<T>>(bits);
    T x;
    std::memcpy(&x, &word, sizeof(T));
    row.push_back(x);
    widened += std::isfinite(kvevict::to_float(x)) ? 0 : 1;
  };
  if (sizeof(T) < 4) {
    for (std::uint32_t bits = 0; bits < (1u << (8 * sizeof(T))); ++bits) add(bits);
  } else {
    for (std::uint32_t e = 0; e < 256; ++e)
      for (std::uint32_t m : {0u, 1u, 0x400000u, 0x7fffffu})
        for (std::uint32_t sign : {0u, 0x80000000u}) add(sign | (e << 23) | m);
  }
  const std::int64_t n = static_cast<std::int64_t>(row.size());
  CHECK(kvevict::detail::count_nonfinite(row.data(), n, 1) == widened);
  // Every other element through the strided loop, against the same elements widened.
  std::int64_t odd = 0;
  for (std::int64_t i = 1; i < n; i += 2)
    odd += std::isfinite(kvevict::to_float(row[static_cast<std::size_t>(i)])) ? 0 : 1;
  CHECK(kvevict::detail::count_nonfinite(row.data() + 1, n / 2, 2) == odd);
  CHECK(widened > 0);
  // A row of NaN only, two of the counter's chunks and a few more: every element counts, across
  // the chunk boundaries (the stride-1 loop counts in the element's width).
  const std::int64_t chunk = std::numeric_limits<kvevict::detail::storage_word<T>>::max();
  if (chunk < (std::int64_t{1} << 20)) {
    const T nan = row[static_cast<std::size_t>(
        std::find_if(row.begin(), row.end(), [](T x) { return std::isnan(kvevict::to_float(x)); }) - row.begin())];
    const std::vector<T> nans(static_cast<std::size_t>(2 * chunk + 3), nan);
    CHECK(kvevict::detail::count_nonfinite(nans.data(), 2 * chunk + 3, 1) == 2 * chunk + 3);
    CHECK(kvevict::detail::count_nonfinite(nans.data(), chunk, 1) == chunk);
    CHECK(kvevict::detail::count_nonfinite(nans.data(), chunk + 1, 1) == chunk + 1);
  }
}
}  // namespace

TEST_CASE("the report's non-finite counts test the exponent bits exactly as widening does", "[nonfinite]") {
  check_nonfinite_count<float>();
  check_nonfinite_count<kvevict::fp16>();
  check_nonfinite_count<kvevict::bf16>();
  check_nonfinite_count<kvevict::fp8_e4m3>();
  check_nonfinite_count<kvevict::fp8_e5m2>();
}
