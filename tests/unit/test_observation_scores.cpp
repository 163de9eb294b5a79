// Observation scoring against the double-precision reference: every parameter of design.md
// section 4, GQA, odd lengths, L <= W, L < kernel, every dtype and every cache layout.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kvevict/scoring/observation_scores.hpp"
#include "kvevict/selection/select.hpp"
#include "reference/reference.hpp"
#include "support/compare.hpp"
#include "support/scoring_config.hpp"
#include "support/test_cache.hpp"

using kvevict::bf16;
using kvevict::fp16;

namespace {

using config = test::scoring_config;
using test::make_config;

struct shape {
  std::int64_t hkv, group, dim, tokens, window;
};

/// Keys stored as T (scaled by key_scale: the cache holds k / scale, as fp8 caches do), queries
/// as Q.
template <class T, class Q = T>
void check_case(const shape& s, test::layout lay, config c, std::vector<std::int64_t> qpos, std::uint64_t seed,
                bool token_major_queries = false, std::vector<std::int64_t> kpos = {}, float key_scale = 1.0f) {
  const std::int64_t hq = s.hkv * s.group;
  ref::problem p;
  p.hq = hq;
  p.hkv = s.hkv;
  p.w = s.window;
  p.l = s.tokens;
  p.d = s.dim;
  p.q = test::rounded<Q>(test::normal(static_cast<std::size_t>(hq * s.window * s.dim), seed, 1.5));
  const std::vector<double> stored =
      test::rounded<T>(test::normal(static_cast<std::size_t>(s.hkv * s.tokens * s.dim), seed + 1, 1.0 / key_scale));
  p.k = stored;
  for (double& x : p.k) x *= static_cast<double>(key_scale);  // what the cache stands for
  p.qpos = qpos;
  p.kpos = kpos;
  std::vector<float> weights;
  if (c.lib.window == kvevict::window_aggregation::weighted) {
    for (std::int64_t t = 0; t < s.window; ++t) weights.push_back(std::pow(0.8f, static_cast<float>(s.window - 1 - t)));
    c.ref.weights.assign(weights.begin(), weights.end());
  }
  auto keys = test::make_cache<T>(lay, s.hkv, s.tokens, s.dim, stored, 16, seed);
  keys.view.scale = key_scale;
  auto queries = test::make_queries<Q>(hq, s.window, s.dim, p.q, qpos, token_major_queries, test::int32_positions(lay));

  std::vector<float> out(static_cast<std::size_t>(s.hkv * s.tokens), -1.0f);
  kvevict::score_view scores{out.data(), s.hkv, s.tokens, s.tokens};
  const kvevict::layer_shape shape{hq, s.hkv, s.dim, s.tokens, s.window};
  kvevict::workspace ws(kvevict::observation_scores_workspace_size(shape, c.lib));
  kvevict::observation_inputs in;
  in.weights = weights.empty() ? nullptr : weights.data();
  const std::vector<std::int32_t> kpos32(kpos.begin(), kpos.end());  // llama.cpp layouts: int32 positions
  in.key_positions = kpos.empty()                 ? kvevict::index_ptr{}
                     : test::int32_positions(lay) ? kvevict::index_ptr{kpos32.data()}
                                                  : kvevict::index_ptr{kpos.data()};
  const kvevict::status st = kvevict::observation_scores(queries.view, keys.view, c.lib, scores, ws, in);
  INFO(st.message());
  REQUIRE(st.ok());
  const auto want = ref::scores(p, c.ref);
  test::require_scores_close(scores, want);

  // Selection on these scores keeps the reference's tokens wherever the reference's
  // boundary is not a near-tie.
  const std::int64_t candidates = std::max<std::int64_t>(0, s.tokens - c.lib.protected_tail);
  for (std::int64_t b : {std::int64_t{0}, s.tokens / 3, s.tokens / 2 + c.lib.protected_tail, s.tokens + 5}) {
    const kvevict::selection_params sp{c.lib.protected_tail, kvevict::protected_mode::on_top_of_budget};
    kvevict::keep_list keep(s.hkv, kvevict::select_capacity(s.hkv, s.tokens, kvevict::budget::tokens(b), sp));
    kvevict::workspace sws(kvevict::select_workspace_size(s.tokens));
    REQUIRE(kvevict::select(scores, kvevict::budget::tokens(b), sp, keep, sws).ok());
    const std::int64_t k = kvevict::candidates_kept(b, s.tokens, sp);
    for (std::int64_t h = 0; h < s.hkv; ++h) {
      const auto& row = want[static_cast<std::size_t>(h)];
      if (test::near_tie_at(row, candidates, k)) continue;
      REQUIRE(keep.head(h) == ref::keep(row, b, c.lib.protected_tail, false));
    }
  }
}

std::vector<std::int64_t> tail_positions(std::int64_t tokens, std::int64_t window) {
  std::vector<std::int64_t> pos;
  for (std::int64_t t = 0; t < window; ++t) pos.push_back(std::max<std::int64_t>(0, tokens - window + t));
  return pos;
}

}  // namespace

using kvevict::gqa_order;
using kvevict::gqa_reduction;
using kvevict::pooling_kind;
using kvevict::softmax_domain;
using kvevict::window_aggregation;

TEMPLATE_TEST_CASE("observation scores match the reference across shapes and layouts", "[scoring]", float, fp16, bf16) {
  const shape shapes[] = {{2, 1, 64, 37, 8}, {2, 4, 64, 101, 16}, {1, 8, 128, 67, 5}, {2, 4, 128, 601, 12}};
  const config kvpress = make_config(softmax_domain::visible, window_aggregation::mean, gqa_reduction::mean,
                                     gqa_order::after_pooling, pooling_kind::avg, 5, true, 0);
  std::uint64_t seed = 11;
  for (const shape& s : shapes) {
    for (test::layout lay : test::kAllLayouts) {
      config c = kvpress;
      c.lib.protected_tail = c.ref.protected_tail = s.window;
      INFO("G=" << s.group << " d=" << s.dim << " L=" << s.tokens << " layout " << test::name(lay));
      check_case<TestType>(s, lay, c, tail_positions(s.tokens, s.window), seed++, lay == test::layout::padded);
    }
  }
}

TEMPLATE_TEST_CASE("fp8 caches: scaled keys widened in scoring, against the reference in every layout",
                   "[scoring][fp8]", kvevict::fp8_e4m3, kvevict::fp8_e5m2) {
  const shape shapes[] = {{2, 4, 64, 101, 16}, {1, 8, 128, 67, 5}, {3, 2, 96, 45, 9}};
  const config kvpress = make_config(softmax_domain::visible, window_aggregation::mean, gqa_reduction::mean,
                                     gqa_order::after_pooling, pooling_kind::avg, 5, true, 0);
  std::uint64_t seed = 301;
  for (const shape& s : shapes) {
    for (test::layout lay : test::kAllLayouts) {
      config c = kvpress;
      c.lib.protected_tail = c.ref.protected_tail = s.window;
      INFO("G=" << s.group << " d=" << s.dim << " L=" << s.tokens << " layout " << test::name(lay));
      // vLLM's k_scale: the cache holds k / scale. bf16 and fp16 models; one unscaled cache.
      const float scale = seed % 3 == 0 ? 1.0f : 0.0371f;
      if (seed % 2 == 0)
        check_case<TestType, bf16>(s, lay, c, tail_positions(s.tokens, s.window), seed++, false, {}, scale);
      else
        check_case<TestType, fp16>(s, lay, c, tail_positions(s.tokens, s.window), seed++, false, {}, scale);
    }
  }
}

TEST_CASE("observation scores: every parameter combination", "[scoring]") {
  const shape s{2, 4, 64, 83, 7};
  const softmax_domain domains[] = {softmax_domain::visible, softmax_domain::candidates};
  const window_aggregation windows[] = {window_aggregation::mean, window_aggregation::sum, window_aggregation::max,
                                        window_aggregation::weighted, window_aggregation::visible_mean};
  const gqa_reduction reductions[] = {gqa_reduction::mean, gqa_reduction::max, gqa_reduction::sum};
  const gqa_order orders[] = {gqa_order::before_pooling, gqa_order::after_pooling};
  struct pool_case {
    pooling_kind kind;
    std::int64_t kernel;
    bool count;
  };
  const pool_case pools[] = {{pooling_kind::none, 1, true},
                             {pooling_kind::avg, 5, true},
                             {pooling_kind::avg, 7, false},
                             {pooling_kind::max, 7, true},
                             {pooling_kind::max, 3, true}};
  std::uint64_t seed = 100;
  for (auto dom : domains)
    for (auto win : windows)
      for (auto red : reductions)
        for (auto order : orders)
          for (const pool_case& pc : pools)
            for (std::int64_t protect : {std::int64_t{0}, std::int64_t{7}}) {
              INFO("domain " << int(dom) << " window " << int(win) << " gqa " << int(red) << " order " << int(order)
                             << " pool " << int(pc.kind) << "/" << pc.kernel << " protect " << protect);
              config c = make_config(dom, win, red, order, pc.kind, pc.kernel, pc.count, protect);
              check_case<float>(s, test::layout::contiguous, c, tail_positions(s.tokens, s.window), seed++);
            }
}

TEST_CASE("observation scores: L <= W, L < kernel, queries beyond the cache, odd key positions", "[scoring]") {
  const config snap = make_config(softmax_domain::visible, window_aggregation::sum, gqa_reduction::mean,
                                  gqa_order::after_pooling, pooling_kind::max, 7, true, 0);
  SECTION("L <= W with the window protected: nothing is a candidate") {
    config c = snap;
    c.lib.protected_tail = c.ref.protected_tail = 8;
    check_case<bf16>({2, 2, 64, 5, 8}, test::layout::contiguous, c, {0, 1, 2, 3, 4, 5, 6, 7}, 1);
  }
  SECTION("L <= W, unprotected: early queries see a prefix") {
    check_case<fp16>({2, 2, 64, 5, 8}, test::layout::paged_nhd, snap, {0, 1, 2, 3, 4, 5, 6, 7}, 2);
  }
  SECTION("L < kernel") {
    check_case<float>({1, 4, 64, 3, 2}, test::layout::transposed, snap, {1, 2}, 3);
  }
  SECTION("decode-like queries past the end see every key") {
    config c = snap;
    c.lib.window = kvevict::window_aggregation::mean;
    c.ref.window = ref::agg::mean;
    check_case<bf16>({2, 4, 128, 257, 1}, test::layout::paged_hnd, c, {300}, 4);
  }
  SECTION("engine cell positions in arbitrary order (llama.cpp cells)") {
    std::vector<std::int64_t> kpos;
    for (std::int64_t j = 0; j < 50; ++j) kpos.push_back((j * 17) % 50);
    check_case<fp16>({2, 2, 64, 50, 4}, test::layout::token_major, snap, {30, 35, 40, 49}, 5, false, kpos);
  }
  SECTION("non-decreasing positions with gaps (after an earlier compression)") {
    std::vector<std::int64_t> kpos;
    for (std::int64_t j = 0; j < 70; ++j) kpos.push_back(j * 3);
    check_case<float>({2, 2, 64, 70, 6}, test::layout::contiguous, snap, {100, 150, 180, 200, 205, 209}, 6, false,
                      kpos);
  }
}

TEST_CASE("engine-provided log-sum-exp gives the same scores in one sweep", "[scoring]") {
  const std::int64_t hkv = 2, g = 4, hq = hkv * g, d = 64, l = 300, w = 8;
  const auto qd = test::normal(static_cast<std::size_t>(hq * w * d), 5, 1.5);
  const auto kd = test::normal(static_cast<std::size_t>(hkv * l * d), 6);
  auto keys = test::make_cache<float>(test::layout::contiguous, hkv, l, d, kd);
  std::vector<std::int64_t> pos;
  for (std::int64_t t = 0; t < w; ++t) pos.push_back(l - w + t);
  auto queries = test::make_queries<float>(hq, w, d, qd, pos);
  // The LSE a flash-attention kernel would return, computed here in double.
  std::vector<float> lse(static_cast<std::size_t>(hq * w));
  for (std::int64_t q = 0; q < hq; ++q)
    for (std::int64_t t = 0; t < w; ++t) {
      double m = -INFINITY;
      std::vector<double> logits;
      for (std::int64_t j = 0; j <= pos[static_cast<std::size_t>(t)]; ++j) {
        double dot = 0;
        for (std::int64_t c = 0; c < d; ++c)
          dot += qd[static_cast<std::size_t>((q * w + t) * d + c)] *
                 kd[static_cast<std::size_t>(((q / g) * l + j) * d + c)];
        logits.push_back(dot / 8.0);
        m = std::max(m, logits.back());
      }
      double z = 0;
      for (double x : logits) z += std::exp(x - m);
      lse[static_cast<std::size_t>(q * w + t)] = static_cast<float>(m + std::log(z));
    }
  kvevict::scoring_params params;
  params.protected_tail = w;
  std::vector<float> a(static_cast<std::size_t>(hkv * l)), b(a.size());
  kvevict::workspace ws(kvevict::observation_scores_workspace_size({hq, hkv, d, l, w}, params));
  REQUIRE(kvevict::observation_scores(queries.view, keys.view, params, {a.data(), hkv, l, l}, ws).ok());
  kvevict::observation_inputs in;
  in.lse = lse.data();
  REQUIRE(kvevict::observation_scores(queries.view, keys.view, params, {b.data(), hkv, l, l}, ws, in).ok());
  for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(b[i] == Approx(a[i]).epsilon(1e-4).margin(1e-7));
}

TEST_CASE("observation scores reject bad arguments and write nothing", "[scoring][errors]") {
  const std::int64_t hkv = 2, hq = 8, d = 64, l = 40, w = 4;
  auto keys = test::make_cache<float>(test::layout::contiguous, hkv, l, d,
                                      test::normal(static_cast<std::size_t>(hkv * l * d), 1));
  auto queries =
      test::make_queries<float>(hq, w, d, test::normal(static_cast<std::size_t>(hq * w * d), 2), {36, 37, 38, 39});
  std::vector<float> out(static_cast<std::size_t>(hkv * l), 42.0f);
  kvevict::score_view scores{out.data(), hkv, l, l};
  kvevict::scoring_params params;
  kvevict::workspace ws(kvevict::observation_scores_workspace_size({hq, hkv, d, l, w}, params));
  auto untouched = [&] {
    for (float x : out) REQUIRE(x == 42.0f);
  };
  SECTION("GQA mismatch") {
    auto q = queries.view;
    q.num_heads = 5;
    const auto st = kvevict::observation_scores(q, keys.view, params, scores, ws);
    REQUIRE(st.code() == kvevict::errc::invalid_shape);
    REQUIRE(std::string(st.argument()) == "queries.num_heads");
  }
  SECTION("even pooling kernel") {
    params.pool.kernel = 4;
    const auto st = kvevict::observation_scores(queries.view, keys.view, params, scores, ws);
    REQUIRE(st.code() == kvevict::errc::invalid_argument);
    REQUIRE(std::string(st.argument()) == "params.pool.kernel");
  }
  SECTION("workspace too small") {
    const auto st = kvevict::observation_scores(queries.view, keys.view, params, scores, {ws.span().data, 100});
    REQUIRE(st.code() == kvevict::errc::workspace_too_small);
  }
  SECTION("overlapping key strides") {
    auto k = keys.view;
    k.token_stride = 10;  // rows of 64 channels 10 apart overlap
    const auto st = kvevict::observation_scores(queries.view, k, params, scores, ws);
    REQUIRE(st.code() == kvevict::errc::invalid_stride);
    REQUIRE(std::string(st.argument()) == "keys.token_stride");
  }
  SECTION("missing positions") {
    auto q = queries.view;
    q.positions = nullptr;
    const auto st = kvevict::observation_scores(q, keys.view, params, scores, ws);
    REQUIRE(st.code() == kvevict::errc::null_pointer);
    REQUIRE(std::string(st.argument()) == "queries.positions");
  }
  SECTION("weighted aggregation without weights") {
    params.window = kvevict::window_aggregation::weighted;
    const auto st = kvevict::observation_scores(queries.view, keys.view, params, scores, ws);
    REQUIRE(st.code() == kvevict::errc::null_pointer);
    REQUIRE(std::string(st.argument()) == "inputs.weights");
  }
  SECTION("scores of the wrong shape") {
    const auto st = kvevict::observation_scores(queries.view, keys.view, params, {out.data(), hkv, l - 1, l}, ws);
    REQUIRE(st.code() == kvevict::errc::invalid_shape);
    REQUIRE(std::string(st.argument()) == "scores");
  }
  untouched();
}
