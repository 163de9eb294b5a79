// Policies against independent references: StreamingLLM, KNorm, KeyDiff, TOVA, H2O (from
// queries and from attention rows), ChunkKV, PyramidKV layer budgets, AdaKV head budgets, and a policy a
// user writes against the shared contract.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "kvevict/budgets/adakv.hpp"
#include "kvevict/budgets/pyramidkv.hpp"
#include "kvevict/policies/chunkkv.hpp"
#include "kvevict/policies/h2o.hpp"
#include "kvevict/policies/keydiff.hpp"
#include "kvevict/policies/knorm.hpp"
#include "kvevict/policies/snapkv.hpp"
#include "kvevict/policies/streaming_llm.hpp"
#include "kvevict/policies/tova.hpp"
#include "kvevict/selection/select.hpp"
#include "reference/reference.hpp"
#include "support/compare.hpp"
#include "support/test_cache.hpp"

using kvevict::bf16;
using kvevict::fp16;

namespace {

template <class Policy>
std::vector<float> score_with(const Policy& policy, const kvevict::layer_inputs<typename Policy::storage_type>& in,
                              const kvevict::layer_shape& shape) {
  std::vector<float> scores(static_cast<std::size_t>(shape.num_kv_heads * shape.num_tokens));
  kvevict::workspace ws(policy.workspace_size(shape));
  const auto st = policy.score(in, {scores.data(), shape.num_kv_heads, shape.num_tokens, shape.num_tokens}, ws);
  INFO(st.message());
  REQUIRE(st.ok());
  return scores;
}

kvevict::keep_list select_all(const std::vector<float>& scores, std::int64_t heads, std::int64_t tokens,
                              kvevict::budget b, kvevict::selection_params sp) {
  kvevict::keep_list keep(heads, kvevict::select_capacity(heads, tokens, b, sp));
  kvevict::workspace ws(kvevict::select_workspace_size(tokens));
  REQUIRE(kvevict::select(kvevict::const_score_view{scores.data(), heads, tokens, tokens}, b, sp, keep, ws).ok());
  return keep;
}

}  // namespace

TEST_CASE("StreamingLLM keeps the sinks and the most recent tokens", "[policies]") {
  std::vector<float> k(2 * 50 * 4, 0.0f);
  kvevict::layer_inputs<float> in;
  in.keys = kvevict::hf_contiguous(k.data(), 2, 50, 4);
  kvevict::streaming_llm<float> policy({4});
  const auto scores = score_with(policy, in, {2, 2, 4, 50, 0});
  for (std::int64_t b : {0, 3, 4, 10, 50, 60}) {
    const auto keep = select_all(scores, 2, 50, kvevict::budget::tokens(b), policy.selection());
    std::vector<std::int64_t> want;
    for (std::int64_t j = 0; j < 50; ++j)
      if (j < std::min<std::int64_t>(4, b) || (b > 4 && j >= 50 - (b - 4))) want.push_back(j);
    REQUIRE(keep.head(0) == want);
    REQUIRE(keep.head(1) == want);
  }
}

TEMPLATE_TEST_CASE("KNorm scores -||k|| in every layout", "[policies]", float, fp16, bf16) {
  const std::int64_t h = 3, l = 45, d = 64;
  const auto dense = test::rounded<TestType>(test::normal(static_cast<std::size_t>(h * l * d), 3));
  for (test::layout lay : test::kAllLayouts) {
    auto cache = test::make_cache<TestType>(lay, h, l, d, dense);
    kvevict::layer_inputs<TestType> in;
    in.keys = cache.view;
    kvevict::knorm<TestType> policy({5, kvevict::protected_mode::inside_budget});
    const auto scores = score_with(policy, in, {h, h, d, l, 0});
    std::vector<ref::vec> want(static_cast<std::size_t>(h), ref::vec(static_cast<std::size_t>(l), INFINITY));
    for (std::int64_t hh = 0; hh < h; ++hh)
      for (std::int64_t j = 0; j < l - 5; ++j) {
        double s = 0;
        for (std::int64_t c = 0; c < d; ++c) s += std::pow(dense[static_cast<std::size_t>((hh * l + j) * d + c)], 2);
        want[static_cast<std::size_t>(hh)][static_cast<std::size_t>(j)] = -std::sqrt(s);
      }
    test::require_scores_close({scores.data(), h, l, l}, want);
  }
}

TEMPLATE_TEST_CASE("KeyDiff scores minus the cosine to the mean normalised key, in every layout", "[policies]", float,
                   fp16, bf16) {
  struct shape {
    std::int64_t h, l, tail;
  };
  for (const shape s : {shape{3, 45, 0}, shape{2, 31, 4}, shape{1, 1, 0}, shape{4, 17, 20}}) {
    const std::int64_t d = 64;
    auto k = test::rounded<TestType>(test::normal(static_cast<std::size_t>(s.h * s.l * d), 51));
    // A zero key: PyTorch's floors make its normalised key and its cosine 0, not NaN.
    if (s.l > 3)
      for (std::int64_t c = 0; c < d; ++c) k[static_cast<std::size_t>((1 * s.l + 2) * d + c) % k.size()] = 0.0;
    // From the definition (design.md §5), in double precision.
    std::vector<ref::vec> want(static_cast<std::size_t>(s.h), ref::vec(static_cast<std::size_t>(s.l), INFINITY));
    for (std::int64_t h = 0; h < s.h; ++h) {
      auto key = [&](std::int64_t j, std::int64_t c) { return k[static_cast<std::size_t>((h * s.l + j) * d + c)]; };
      auto norm = [&](std::int64_t j) {
        double n = 0;
        for (std::int64_t c = 0; c < d; ++c) n += key(j, c) * key(j, c);
        return std::sqrt(n);
      };
      ref::vec anchor(static_cast<std::size_t>(d), 0.0);
      for (std::int64_t j = 0; j < s.l; ++j)
        for (std::int64_t c = 0; c < d; ++c)
          anchor[static_cast<std::size_t>(c)] += key(j, c) / std::max(norm(j), 1e-12) / static_cast<double>(s.l);
      double an = 0;
      for (double x : anchor) an += x * x;
      an = std::sqrt(an);
      for (std::int64_t j = 0; j < s.l - s.tail; ++j) {
        double dot = 0;
        for (std::int64_t c = 0; c < d; ++c) dot += key(j, c) * anchor[static_cast<std::size_t>(c)];
        want[static_cast<std::size_t>(h)][static_cast<std::size_t>(j)] = -dot / std::max(norm(j) * an, 1e-8);
      }
    }
    for (test::layout lay : test::kAllLayouts) {
      INFO(test::name(lay) << " Hkv " << s.h << " L " << s.l);
      auto cache = test::make_cache<TestType>(lay, s.h, s.l, d, k);
      // A positive dequantisation scale changes no cosine.
      cache.view.scale = 0.25f;
      kvevict::layer_inputs<TestType> in;
      in.keys = cache.view;
      kvevict::keydiff<TestType> policy({s.tail, kvevict::protected_mode::inside_budget});
      const auto scores = score_with(policy, in, {s.h, s.h, d, s.l, 0});
      test::require_scores_close({scores.data(), s.h, s.l, s.l}, want);
    }
  }
}

namespace {
/// TOVA from its definition (design.md §5): the last query's softmax over every key it sees,
/// itself included, averaged over all Hq query heads; the same row for every KV head.
std::vector<ref::vec> tova_reference(const std::vector<double>& q, const std::vector<double>& k, std::int64_t hq,
                                     std::int64_t hkv, std::int64_t l, std::int64_t d, std::int64_t tail) {
  const std::int64_t g = hq / hkv;
  ref::vec mean(static_cast<std::size_t>(l), 0.0);
  for (std::int64_t qh = 0; qh < hq; ++qh) {
    const std::int64_t h = qh / g;
    ref::vec logit(static_cast<std::size_t>(l));
    double top = -INFINITY;
    for (std::int64_t j = 0; j < l; ++j) {
      double dot = 0;
      for (std::int64_t c = 0; c < d; ++c)
        dot += q[static_cast<std::size_t>(qh * d + c)] * k[static_cast<std::size_t>((h * l + j) * d + c)];
      logit[static_cast<std::size_t>(j)] = dot / std::sqrt(static_cast<double>(d));
      top = std::max(top, logit[static_cast<std::size_t>(j)]);
    }
    double z = 0;
    for (double x : logit) z += std::exp(x - top);
    for (std::int64_t j = 0; j < l; ++j)
      mean[static_cast<std::size_t>(j)] +=
          std::exp(logit[static_cast<std::size_t>(j)] - top) / z / static_cast<double>(hq);
  }
  for (std::int64_t j = std::max<std::int64_t>(0, l - tail); j < l; ++j) mean[static_cast<std::size_t>(j)] = INFINITY;
  return std::vector<ref::vec>(static_cast<std::size_t>(hkv), mean);
}
}  // namespace

TEMPLATE_TEST_CASE("TOVA: the last query's attention averaged over every query head, in every layout", "[policies]",
                   float, fp16, bf16) {
  struct shape {
    std::int64_t hkv, g, l, tail;
  };
  for (const shape s : {shape{2, 3, 45, 1}, shape{4, 2, 31, 5}, shape{1, 4, 17, 1}, shape{3, 1, 2, 1}}) {
    const std::int64_t hq = s.hkv * s.g, d = 64;
    const auto q = test::rounded<TestType>(test::normal(static_cast<std::size_t>(hq * d), 41, 1.5));
    const auto k = test::rounded<TestType>(test::normal(static_cast<std::size_t>(s.hkv * s.l * d), 42));
    const auto want = tova_reference(q, k, hq, s.hkv, s.l, d, s.tail);
    auto queries = test::make_queries<TestType>(hq, 1, d, q, {s.l - 1});
    for (test::layout lay : test::kAllLayouts) {
      INFO(test::name(lay) << " Hkv " << s.hkv << " G " << s.g << " L " << s.l);
      auto cache = test::make_cache<TestType>(lay, s.hkv, s.l, d, k);
      kvevict::layer_inputs<TestType> in;
      in.keys = cache.view;
      in.queries = queries.view;
      kvevict::tova<TestType> policy({s.tail, kvevict::protected_mode::inside_budget});
      const auto scores = score_with(policy, in, {hq, s.hkv, d, s.l, 1});
      test::require_scores_close({scores.data(), s.hkv, s.l, s.l}, want);
      // The observing token is always kept, and every KV head keeps the same tokens.
      const auto keep = select_all(scores, s.hkv, s.l, kvevict::budget::tokens(s.tail + 3), policy.selection());
      for (std::int64_t h = 0; h < s.hkv; ++h) {
        REQUIRE(keep.head(h) == keep.head(0));
        REQUIRE(keep.head(h).back() == s.l - 1);
      }
    }
  }
}

TEST_CASE("H2O: accumulated attention divided by the queries that see each key", "[policies]") {
  const std::int64_t hkv = 2, g = 2, hq = hkv * g, d = 64, l = 57;
  ref::problem p;
  p.hq = hq;
  p.hkv = hkv;
  p.w = l;  // every prompt query observes
  p.l = l;
  p.d = d;
  p.q = test::rounded<bf16>(test::normal(static_cast<std::size_t>(hq * l * d), 21));
  p.k = test::rounded<bf16>(test::normal(static_cast<std::size_t>(hkv * l * d), 22));
  for (std::int64_t t = 0; t < l; ++t) p.qpos.push_back(t);
  ref::params rp;
  rp.window = ref::agg::visible_mean;
  rp.kind = ref::pool::none;
  rp.reduce_before_pool = true;
  rp.protected_tail = 8;
  const auto want = ref::scores(p, rp);

  auto keys = test::make_cache<bf16>(test::layout::paged_nhd, hkv, l, d, p.k);
  auto queries = test::make_queries<bf16>(hq, l, d, p.q, p.qpos);
  kvevict::h2o<bf16> policy({8, kvevict::protected_mode::inside_budget, kvevict::gqa_reduction::mean});
  kvevict::layer_inputs<bf16> in;
  in.keys = keys.view;
  in.queries = queries.view;
  const auto from_queries = score_with(policy, in, {hq, hkv, d, l, l});
  test::require_scores_close({from_queries.data(), hkv, l, l}, want);

  // The same scores from attention rows the engine computed ([Hq, W, L]).
  std::vector<float> rows(static_cast<std::size_t>(hq * l * l), 0.0f);
  ref::params full = rp;
  full.protected_tail = 0;
  for (std::int64_t q = 0; q < hq; ++q) {
    const auto a = ref::attention(p, full, q);
    for (std::int64_t t = 0; t < l; ++t)
      for (std::int64_t j = 0; j < l; ++j)
        rows[static_cast<std::size_t>((q * l + t) * l + j)] =
            static_cast<float>(a[static_cast<std::size_t>(t)][static_cast<std::size_t>(j)]);
  }
  kvevict::layer_inputs<bf16> rin;
  rin.keys = keys.view;
  rin.attention = kvevict::contiguous_attention(rows.data(), hq, l, l, p.qpos.data());
  const auto from_rows = score_with(policy, rin, {hq, hkv, d, l, l});
  test::require_scores_close({from_rows.data(), hkv, l, l}, want);
}

TEST_CASE("ChunkKV keeps whole chunks, the same for every head", "[policies]") {
  const std::int64_t hkv = 3, g = 2, hq = hkv * g, d = 64, l = 203, w = 16, chunk = 20;
  ref::problem p;
  p.hq = hq;
  p.hkv = hkv;
  p.w = w;
  p.l = l;
  p.d = d;
  p.q = test::normal(static_cast<std::size_t>(hq * w * d), 31, 1.5);
  p.k = test::normal(static_cast<std::size_t>(hkv * l * d), 32);
  for (std::int64_t t = 0; t < w; ++t) p.qpos.push_back(l - w + t);
  auto keys = test::make_cache<float>(test::layout::contiguous, hkv, l, d, p.k);
  auto queries = test::make_queries<float>(hq, w, d, p.q, p.qpos);
  kvevict::window_config cfg = kvevict::presets::kvpress_snapkv();
  cfg.window = w;
  kvevict::chunkkv<kvevict::snapkv<float>> policy(kvevict::snapkv<float>(cfg), {chunk});
  kvevict::layer_inputs<float> in;
  in.keys = keys.view;
  in.queries = queries.view;
  const auto scores = score_with(policy, in, {hq, hkv, d, l, w});

  // Reference: SnapKV scores summed over heads, mean per chunk of candidates.
  ref::params rp;
  rp.protected_tail = w;
  const auto snap = ref::scores(p, rp);
  const std::int64_t c = l - w;
  ref::vec chunk_scores(static_cast<std::size_t>(l), INFINITY);
  for (std::int64_t c0 = 0; c0 < c; c0 += chunk) {
    const std::int64_t c1 = std::min(c, c0 + chunk);
    double s = 0;
    for (std::int64_t h = 0; h < hkv; ++h)
      for (std::int64_t j = c0; j < c1; ++j) s += snap[static_cast<std::size_t>(h)][static_cast<std::size_t>(j)];
    for (std::int64_t j = c0; j < c1; ++j) chunk_scores[static_cast<std::size_t>(j)] = s / static_cast<double>(c1 - c0);
  }
  test::require_scores_close({scores.data(), hkv, l, l},
                             std::vector<ref::vec>(static_cast<std::size_t>(hkv), chunk_scores));
  const auto keep = select_all(scores, hkv, l, kvevict::budget::tokens(16 + 50), policy.selection());
  REQUIRE(keep.head(0) == keep.head(1));
  REQUIRE(keep.head(1) == keep.head(2));
  if (!test::near_tie_at(chunk_scores, c, 50)) REQUIRE(keep.head(0) == ref::keep(chunk_scores, 66, w, true));
  // 50 candidates = two whole chunks + the first 10 tokens of the third-best chunk.
  REQUIRE(keep.size(0) == 66);
}

TEST_CASE("PyramidKV layer budgets: mean C - w, linear and decreasing", "[policies][budgets]") {
  struct c {
    std::int64_t capacity, window, layers, tokens;
  };
  const c cases[] = {{2048, 32, 32, 32768}, {128, 8, 32, 4096}, {512, 32, 28, 600}, {100, 10, 7, 1000},
                     {64, 8, 1, 500},       {600, 8, 32, 500},  {70, 8, 32, 120},   {40, 8, 5, 40}};
  for (const c& k : cases) {
    std::vector<std::int64_t> b(static_cast<std::size_t>(k.layers));
    REQUIRE(kvevict::pyramidkv_layer_budgets(k.capacity, k.window, k.layers, k.tokens, b.data()).ok());
    const std::int64_t available = std::max<std::int64_t>(0, k.tokens - k.window);
    const std::int64_t mean = std::min(k.capacity - k.window, available);
    INFO("C=" << k.capacity << " w=" << k.window << " N=" << k.layers << " L=" << k.tokens);
    REQUIRE(std::accumulate(b.begin(), b.end(), std::int64_t{0}) == mean * k.layers);
    for (std::size_t l = 0; l < b.size(); ++l) {
      REQUIRE(b[l] >= 0);
      REQUIRE(b[l] <= available);
      if (l > 0) REQUIRE(b[l] <= b[l - 1]);
    }
    // Within one token of design.md's real-valued schedule.
    if (k.capacity - k.window < available && k.layers > 1) {
      const double avg = static_cast<double>(k.capacity - k.window);
      double lo = avg / 20.0, hi = 2.0 * avg - lo;
      if (hi >= static_cast<double>(available)) {
        hi = static_cast<double>(available);
        lo = 2.0 * avg - hi;
      }
      const double step = (hi - lo) / static_cast<double>(k.layers - 1);
      for (std::size_t l = 0; l < b.size(); ++l)
        REQUIRE(std::fabs(static_cast<double>(b[l]) - (hi - static_cast<double>(l) * step)) < 1.0);
    }
  }
  std::int64_t out[4];
  REQUIRE(kvevict::pyramidkv_layer_budgets(10, 20, 4, 100, out).code() == kvevict::errc::invalid_argument);
  REQUIRE(std::string(kvevict::pyramidkv_layer_budgets(64, 8, 0, 100, out).argument()) == "num_layers");
}

TEST_CASE("AdaKV head budgets: total Hkv*B, floor respected, matches a reference", "[policies][budgets]") {
  const std::int64_t heads = 8, tokens = 700, protect = 32;
  const std::int64_t candidates = tokens - protect;
  std::mt19937_64 rng(5);
  std::vector<float> scores(static_cast<std::size_t>(heads * tokens));
  for (std::int64_t h = 0; h < heads; ++h) {
    // Heads differ in concentration: a few large scores for low h, flat for high h.
    std::exponential_distribution<float> e(1.0f);
    for (std::int64_t j = 0; j < tokens; ++j) {
      const float x = e(rng);
      scores[static_cast<std::size_t>(h * tokens + j)] =
          j >= candidates ? INFINITY : std::pow(x, 1.0f + static_cast<float>(8 - h));
    }
  }
  for (bool normalize : {false, true})
    for (std::int64_t b : {0, 1, 16, 100, 500, 668, 1000}) {
      for (double alpha : {0.0, 0.2, 0.5}) {
        std::vector<std::int64_t> out(static_cast<std::size_t>(heads));
        kvevict::workspace ws(kvevict::adakv_workspace_size(heads, tokens));
        REQUIRE(kvevict::adakv_head_budgets({scores.data(), heads, tokens, tokens}, protect, b, {alpha, normalize},
                                            out.data(), ws)
                    .ok());
        // Reference: flatten (with optional normalisation), full sort, count, round half even.
        std::vector<std::int64_t> want(static_cast<std::size_t>(heads), std::min(b, candidates));
        if (b < candidates) {
          std::vector<std::pair<double, std::int64_t>> flat;
          for (std::int64_t h = 0; h < heads; ++h) {
            ref::vec row(scores.begin() + h * tokens, scores.begin() + h * tokens + candidates);
            double factor = 1.0;
            if (normalize && b > 0) {
              ref::vec sorted = row;
              std::sort(sorted.rbegin(), sorted.rend());
              double top = 0, total = 0;
              for (std::int64_t i = 0; i < b; ++i) top += sorted[static_cast<std::size_t>(i)];
              for (double x : row) total += x;
              factor = top / total;
            }
            for (std::int64_t j = 0; j < candidates; ++j)
              flat.push_back({static_cast<double>(static_cast<float>(row[static_cast<std::size_t>(j)] * factor)),
                              h * candidates + j});
          }
          std::sort(flat.begin(), flat.end(), [](const auto& x, const auto& y) {
            return x.first != y.first ? x.first > y.first : x.second < y.second;
          });
          std::vector<std::int64_t> count(static_cast<std::size_t>(heads), 0);
          for (std::int64_t i = 0; i < heads * b; ++i)
            ++count[static_cast<std::size_t>(flat[static_cast<std::size_t>(i)].second / candidates)];
          for (std::int64_t h = 0; h < heads; ++h) {
            const double x = static_cast<double>(count[static_cast<std::size_t>(h)]) * (1 - alpha) +
                             std::floor(alpha * static_cast<double>(b));
            want[static_cast<std::size_t>(h)] =
                std::min<std::int64_t>(candidates, static_cast<std::int64_t>(std::nearbyint(x)));
          }
        }
        INFO("B=" << b << " alpha=" << alpha << " normalize=" << normalize);
        REQUIRE(out == want);
        const std::int64_t total = std::accumulate(out.begin(), out.end(), std::int64_t{0});
        if (b < candidates) REQUIRE(std::llabs(total - heads * b) <= heads / 2);
        for (std::int64_t v : out)
          REQUIRE(v >= std::min<std::int64_t>(candidates,
                                              static_cast<std::int64_t>(std::floor(alpha * static_cast<double>(b)))));
      }
    }
}

TEST_CASE("AdaKV head budgets, kvpress's safeguard rule: a reference written from AdaKVPress", "[policies][budgets]") {
  // AdaKVPress over L = B + T kept of n tokens: n_safe = max(1, int(alpha * (B + T))) of each head
  // forced (the window T first: its scores top every head), then the layer keeps the global top
  // Hkv * (B + T) of the scores with the forced ones raised to the top. Written here in double,
  // with every head's full row and window, as kvpress computes it.
  const std::int64_t heads = 6, tokens = 500, protect = 16;
  const std::int64_t candidates = tokens - protect;
  std::mt19937_64 rng(11);
  std::vector<float> scores(static_cast<std::size_t>(heads * tokens));
  for (std::int64_t h = 0; h < heads; ++h) {
    std::exponential_distribution<float> e(1.0f);
    for (std::int64_t j = 0; j < tokens; ++j) {
      const float x = std::pow(e(rng), 1.0f + static_cast<float>(h));
      // Ties across and within heads: head 5 repeats values of head 4 and of its own tokens.
      scores[static_cast<std::size_t>(h * tokens + j)] =
          j >= candidates ? INFINITY
          : h == 5        ? scores[static_cast<std::size_t>(4 * tokens + (j / 2) * 2)]
                          : x;
    }
  }
  for (std::int64_t b : {0, 1, 3, 4, 30, 100, 483, 484, 600})
    for (double alpha : {0.0, 0.2, 0.5, 1.0}) {
      std::vector<std::int64_t> out(static_cast<std::size_t>(heads));
      kvevict::workspace ws(kvevict::adakv_workspace_size(heads, tokens));
      kvevict::adakv_params params{alpha, false, kvevict::adakv_rule::kvpress_safeguard};
      REQUIRE(
          kvevict::adakv_head_budgets({scores.data(), heads, tokens, tokens}, protect, b, params, out.data(), ws).ok());
      std::vector<std::int64_t> want(static_cast<std::size_t>(heads), std::min(b, candidates));
      if (b < candidates) {
        const std::int64_t kept = b + protect;
        std::int64_t safe = static_cast<std::int64_t>(static_cast<double>(kept) * alpha);
        if (alpha > 0) safe = std::max<std::int64_t>(safe, 1);
        // (forced, score, head, token): each head's top `safe` of its whole row (window included)
        // are forced; the layer keeps the first Hkv * (B + T) in (forced, score) order, ties to
        // the lower head, then the lower token.
        struct entry {
          int forced;
          double score;
          std::int64_t head, token;
        };
        std::vector<entry> all;
        for (std::int64_t h = 0; h < heads; ++h) {
          std::vector<entry> row;
          for (std::int64_t j = 0; j < tokens; ++j)
            row.push_back({0, scores[static_cast<std::size_t>(h * tokens + j)], h, j});
          std::sort(row.begin(), row.end(), [](const entry& x, const entry& y) {
            return x.score != y.score ? x.score > y.score : x.token < y.token;
          });
          for (std::int64_t r = 0; r < safe; ++r) row[static_cast<std::size_t>(r)].forced = 1;
          all.insert(all.end(), row.begin(), row.end());
        }
        std::sort(all.begin(), all.end(), [](const entry& x, const entry& y) {
          if (x.forced != y.forced) return x.forced > y.forced;
          if (x.score != y.score) return x.score > y.score;
          return x.head != y.head ? x.head < y.head : x.token < y.token;
        });
        std::fill(want.begin(), want.end(), 0);
        for (std::int64_t i = 0; i < heads * kept; ++i)
          if (all[static_cast<std::size_t>(i)].token < candidates)
            ++want[static_cast<std::size_t>(all[static_cast<std::size_t>(i)].head)];
      }
      INFO("B=" << b << " alpha=" << alpha);
      REQUIRE(out == want);
      if (b < candidates)
        REQUIRE(std::accumulate(out.begin(), out.end(), std::int64_t{0}) == heads * b);  // exact, unlike the paper's
    }
  kvevict::adakv_params both{0.2, true, kvevict::adakv_rule::kvpress_safeguard};
  std::int64_t out[6];
  kvevict::workspace ws(kvevict::adakv_workspace_size(heads, tokens));
  const kvevict::status st =
      kvevict::adakv_head_budgets({scores.data(), heads, tokens, tokens}, protect, 10, both, out, ws);
  REQUIRE(st.code() == kvevict::errc::invalid_argument);
  REQUIRE(std::string(st.argument()) == "params.normalize");
  kvevict::adakv_params odd{0.2, false, static_cast<kvevict::adakv_rule>(7)};
  REQUIRE(std::string(kvevict::adakv_head_budgets({scores.data(), heads, tokens, tokens}, protect, 10, odd, out, ws)
                          .argument()) == "params.rule");
}

namespace {
// A policy written by a user against the shared contract: keep the tokens whose keys have
// the largest first channel. It needs nothing from kvevict but the views.
template <class T>
struct first_channel_policy : kvevict::scoring_policy<first_channel_policy<T>, T> {
  using storage_type = T;
  static constexpr const char* evict_name = "first_channel_policy::evict";
  std::size_t workspace_size(const kvevict::layer_shape&, const kvevict::executor& = {}) const { return 0; }
  kvevict::selection_params selection() const { return {2, kvevict::protected_mode::on_top_of_budget}; }
  kvevict::status score(const kvevict::layer_inputs<T>& in, kvevict::score_view out, kvevict::workspace_span,
                        const kvevict::executor& = {}) const {
    for (std::int64_t h = 0; h < in.keys.num_heads; ++h)
      for (std::int64_t j = 0; j < in.keys.num_tokens; ++j) out.at(h, j) = kvevict::to_float(in.keys.at(h, j, 0));
    return {};
  }
};
}  // namespace

TEST_CASE("a user-defined policy plugs into the shared selection", "[policies]") {
  std::vector<fp16> k;
  for (int j = 0; j < 10; ++j) {
    k.push_back(fp16(static_cast<float>((j * 7) % 10)));
    k.push_back(fp16(0.0f));
  }
  kvevict::layer_inputs<fp16> in;
  in.keys = kvevict::hf_contiguous(k.data(), 1, 10, 2);
  first_channel_policy<fp16> policy;
  const auto scores = score_with(policy, in, {1, 1, 2, 10, 0});
  const auto keep = select_all(scores, 1, 10, kvevict::budget::tokens(3), policy.selection());
  // Channel 0 of tokens 0..7 is 0,7,4,1,8,5,2,9: the top 3 are tokens 7 (9), 4 (8), 1 (7); plus the tail 8, 9.
  REQUIRE(keep.head(0) == std::vector<std::int64_t>{1, 4, 7, 8, 9});

  // The contract's evict(), inherited from scoring_policy: score -> select -> compact.
  std::vector<fp16> v = k;
  kvevict::layer_budget b;
  b.per_head = kvevict::budget::tokens(3);
  std::vector<std::int64_t> lengths(1), positions(5);
  kvevict::eviction_result r;
  r.head_lengths = lengths.data();
  r.positions = positions.data();
  kvevict::workspace ws(policy.evict_workspace_size({1, 1, 2, 10, 0}, b));
  const kvevict::status st = policy.evict(
      {kvevict::hf_contiguous(k.data(), 1, 10, 2), kvevict::hf_contiguous(v.data(), 1, 10, 2)}, {}, b, r, ws);
  REQUIRE(st.ok());
  REQUIRE(lengths[0] == 5);
  REQUIRE(positions == std::vector<std::int64_t>{1, 4, 7, 8, 9});
  for (int i = 0; i < 5; ++i) REQUIRE(static_cast<float>(k[2 * i]) == static_cast<float>((positions[i] * 7) % 10));
}
