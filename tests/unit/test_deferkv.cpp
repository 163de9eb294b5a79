// DeferKV: the running state against an explicit weighted mean over the same observations,
// the paper's ablations (eta = 1, decode feedback off == SnapKV bit for bit), protection
// of the window and decoded tokens, and lifecycle misuse.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvevict/policies/deferkv.hpp"
#include "kvevict/policies/deferkv_state.hpp"
#include "kvevict/scoring/observation_scores.hpp"
#include "kvevict/selection/select.hpp"
#include "reference/reference.hpp"
#include "support/compare.hpp"
#include "support/test_cache.hpp"

using kvevict::bf16;
using kvevict::fp16;

namespace {

struct scenario {
  std::int64_t hkv = 2, group = 4, dim = 64, prompt = 97, window = 8, delay = 4;
  std::vector<double> keys;                   // dense [Hkv][prompt + delay][d]
  std::vector<double> prompt_q;               // dense [Hq][W][d]
  std::vector<std::vector<double>> decode_q;  // per step: dense [Hq][1][d]
  std::int64_t hq() const { return hkv * group; }
  std::int64_t total() const { return prompt + delay; }
};

template <class T>
scenario make_scenario(std::uint64_t seed, std::int64_t delay) {
  scenario s;
  s.delay = delay;
  s.keys = test::rounded<T>(test::normal(static_cast<std::size_t>(s.hkv * s.total() * s.dim), seed));
  s.prompt_q = test::rounded<T>(test::normal(static_cast<std::size_t>(s.hq() * s.window * s.dim), seed + 1, 1.5));
  for (std::int64_t i = 0; i < delay; ++i)
    s.decode_q.push_back(test::rounded<T>(
        test::normal(static_cast<std::size_t>(s.hq() * s.dim), seed + 2 + static_cast<std::uint64_t>(i), 1.5)));
  return s;
}

/// Dense keys of the first n tokens.
std::vector<double> first_keys(const scenario& s, std::int64_t n) {
  std::vector<double> out;
  for (std::int64_t h = 0; h < s.hkv; ++h)
    for (std::int64_t j = 0; j < n; ++j)
      for (std::int64_t c = 0; c < s.dim; ++c)
        out.push_back(s.keys[static_cast<std::size_t>((h * s.total() + j) * s.dim + c)]);
  return out;
}

/// The definition, written out: observations in time order with weights eta^(T-1-t),
/// weighted mean of the group-mean attention rows, then max-pool k = 7 over candidates.
std::vector<ref::vec> reference_scores(const scenario& s, double eta, std::int64_t steps) {
  const std::int64_t candidates = s.prompt - s.window;
  std::vector<std::vector<ref::vec>> rows;  // [obs][h] group-mean attention over candidates
  auto observe = [&](std::int64_t tokens, const std::vector<double>& q, std::int64_t w, std::vector<std::int64_t> pos) {
    ref::problem p;
    p.hq = s.hq();
    p.hkv = s.hkv;
    p.w = w;
    p.l = tokens;
    p.d = s.dim;
    p.q = q;
    p.k = first_keys(s, tokens);
    p.qpos = pos;
    ref::params rp;
    rp.protected_tail = tokens - candidates;
    for (std::int64_t t = 0; t < w; ++t) {
      std::vector<ref::vec> per_head;
      for (std::int64_t h = 0; h < s.hkv; ++h) {
        ref::vec mean(static_cast<std::size_t>(candidates), 0.0);
        for (std::int64_t g = 0; g < s.group; ++g) {
          const auto a = ref::attention(p, rp, h * s.group + g);
          for (std::int64_t j = 0; j < candidates; ++j)
            mean[static_cast<std::size_t>(j)] +=
                a[static_cast<std::size_t>(t)][static_cast<std::size_t>(j)] / static_cast<double>(s.group);
        }
        per_head.push_back(mean);
      }
      rows.push_back(per_head);
    }
  };
  std::vector<std::int64_t> pos;
  for (std::int64_t t = 0; t < s.window; ++t) pos.push_back(s.prompt - s.window + t);
  observe(s.prompt, s.prompt_q, s.window, pos);
  for (std::int64_t i = 0; i < steps; ++i)
    observe(s.prompt + i + 1, s.decode_q[static_cast<std::size_t>(i)], 1, {s.prompt + i});
  const std::int64_t total = static_cast<std::int64_t>(rows.size());
  std::vector<ref::vec> out;
  ref::params pool;
  pool.kind = ref::pool::max;
  pool.kernel = 7;
  for (std::int64_t h = 0; h < s.hkv; ++h) {
    ref::vec acc(static_cast<std::size_t>(candidates), 0.0);
    double z = 0;
    for (std::int64_t t = 0; t < total; ++t) {
      const double w = std::pow(eta, static_cast<double>(total - 1 - t));
      z += w;
      for (std::int64_t j = 0; j < candidates; ++j)
        acc[static_cast<std::size_t>(j)] +=
            w * rows[static_cast<std::size_t>(t)][static_cast<std::size_t>(h)][static_cast<std::size_t>(j)];
    }
    for (double& v : acc) v /= z;
    ref::vec pooled = ref::pool_row(acc, pool);
    pooled.resize(static_cast<std::size_t>(s.prompt + steps), INFINITY);
    out.push_back(pooled);
  }
  return out;
}

template <class T>
struct engine {
  const scenario& s;
  test::test_cache<T> cache;
  test::test_queries<T> prompt_queries;
  std::vector<test::test_queries<T>> decode_queries;
  kvevict::workspace ws;

  engine(const scenario& sc, test::layout lay) : s(sc) {
    cache = test::make_cache<T>(lay, s.hkv, s.total(), s.dim, s.keys);
    std::vector<std::int64_t> pos;
    for (std::int64_t t = 0; t < s.window; ++t) pos.push_back(s.prompt - s.window + t);
    prompt_queries = test::make_queries<T>(s.hq(), s.window, s.dim, s.prompt_q, pos);
    for (std::int64_t i = 0; i < s.delay; ++i)
      decode_queries.push_back(
          test::make_queries<T>(s.hq(), 1, s.dim, s.decode_q[static_cast<std::size_t>(i)], {s.prompt + i}));
  }
  kvevict::layer_inputs<T> prefill() const {
    kvevict::layer_inputs<T> in;
    in.keys = cache.view.first_tokens(s.prompt);
    in.queries = prompt_queries.view;
    return in;
  }
  kvevict::layer_inputs<T> decode(std::int64_t i) const {
    kvevict::layer_inputs<T> in;
    in.keys = cache.view.first_tokens(s.prompt + i + 1);
    in.queries = decode_queries[static_cast<std::size_t>(i)].view;
    return in;
  }
};

}  // namespace

TEMPLATE_TEST_CASE("DeferKV state equals the explicit weighted mean for d = 1..4", "[deferkv]", float, bf16) {
  std::uint64_t seed = 40;
  for (std::int64_t d = 1; d <= 4; ++d)
    for (double eta : {1.0, 0.9, 0.5}) {
      const scenario s = make_scenario<TestType>(seed++, d);
      const test::layout lay = d % 2 == 0 ? test::layout::paged_hnd : test::layout::contiguous;
      engine<TestType> e(s, lay);
      kvevict::deferkv_config cfg;
      cfg.window = s.window;
      cfg.delay = d;
      cfg.eta = eta;
      kvevict::deferkv_state<TestType> state(cfg, 3);
      REQUIRE(state.reserve(s.hkv, s.prompt).ok());
      e.ws.reserve(state.workspace_size({s.hq(), s.hkv, s.dim, s.total(), s.window}));
      REQUIRE(state.observe_prefill(3, e.prefill(), e.ws).ok());
      for (std::int64_t i = 0; i < d; ++i) {
        REQUIRE_FALSE(state.ready());
        const auto st = state.observe_decode(3, i, e.decode(i), e.ws);
        INFO(st.message());
        REQUIRE(st.ok());
      }
      REQUIRE(state.ready());
      REQUIRE(state.num_tokens() == s.prompt + d);
      std::vector<float> out(static_cast<std::size_t>(s.hkv * state.num_tokens()));
      REQUIRE(state.scores({out.data(), s.hkv, state.num_tokens(), state.num_tokens()}, e.ws).ok());
      INFO("d=" << d << " eta=" << eta);
      test::require_scores_close({out.data(), s.hkv, state.num_tokens(), state.num_tokens()},
                                 reference_scores(s, eta, d));
      // The running normaliser is the sum of the weights.
      double z = 0;
      for (std::int64_t t = 0; t < s.window + d; ++t) z += std::pow(eta, static_cast<double>(s.window + d - 1 - t));
      REQUIRE(state.state_normaliser() == Approx(z).epsilon(1e-6));
    }
}

TEST_CASE("DeferKV without temporal weighting is the uniform mean (eta treated as 1)", "[deferkv]") {
  const scenario s = make_scenario<float>(77, 2);
  engine<float> e(s, test::layout::contiguous);
  kvevict::deferkv_config cfg;
  cfg.window = s.window;
  cfg.delay = 2;
  cfg.eta = 0.3;
  cfg.temporal_weighting = false;
  kvevict::deferkv_state<float> state(cfg);
  REQUIRE(state.reserve(s.hkv, s.prompt).ok());
  e.ws.reserve(state.workspace_size({s.hq(), s.hkv, s.dim, s.total(), s.window}));
  REQUIRE(state.observe_prefill(0, e.prefill(), e.ws).ok());
  REQUIRE(state.observe_decode(0, 0, e.decode(0), e.ws).ok());
  REQUIRE(state.observe_decode(0, 1, e.decode(1), e.ws).ok());
  std::vector<float> out(static_cast<std::size_t>(s.hkv * state.num_tokens()));
  REQUIRE(state.scores({out.data(), s.hkv, state.num_tokens(), state.num_tokens()}, e.ws).ok());
  test::require_scores_close({out.data(), s.hkv, state.num_tokens(), state.num_tokens()}, reference_scores(s, 1.0, 2));
}

TEST_CASE("DeferKV with decode feedback off equals SnapKV bit for bit", "[deferkv]") {
  const scenario s = make_scenario<bf16>(90, 1);
  engine<bf16> e(s, test::layout::paged_nhd);
  for (double eta : {1.0, 0.8}) {
    kvevict::deferkv_config cfg;
    cfg.window = s.window;
    cfg.eta = eta;
    cfg.decode_feedback = false;
    kvevict::deferkv_state<bf16> state(cfg);
    REQUIRE(state.reserve(s.hkv, s.prompt).ok());
    e.ws.reserve(state.workspace_size({s.hq(), s.hkv, s.dim, s.total(), s.window}));
    REQUIRE(state.observe_prefill(0, e.prefill(), e.ws).ok());
    REQUIRE(state.ready());
    REQUIRE(state.observe_decode(0, 0, e.decode(0), e.ws).code() == kvevict::errc::invalid_state);
    std::vector<float> deferred(static_cast<std::size_t>(s.hkv * s.prompt));
    REQUIRE(state.scores({deferred.data(), s.hkv, s.prompt, s.prompt}, e.ws).ok());

    // SnapKV over the same window: weights eta^(W-1-t) (eta = 1: plain mean), GQA mean
    // before pooling, max-pool 7, window protected.
    kvevict::scoring_params snap = cfg.params();
    std::vector<float> weights;
    for (std::int64_t t = 0; t < s.window; ++t)
      weights.push_back(static_cast<float>(std::pow(eta, static_cast<double>(s.window - 1 - t))));
    kvevict::observation_inputs in;
    if (eta == 1.0) {
      snap.window = kvevict::window_aggregation::mean;
    } else {
      in.weights = weights.data();
    }
    std::vector<float> direct(deferred.size());
    kvevict::workspace ws(kvevict::observation_scores_workspace_size({s.hq(), s.hkv, s.dim, s.prompt, s.window}, snap));
    REQUIRE(kvevict::observation_scores(e.prompt_queries.view, e.cache.view.first_tokens(s.prompt), snap,
                                        {direct.data(), s.hkv, s.prompt, s.prompt}, ws, in)
                .ok());
    REQUIRE(std::memcmp(direct.data(), deferred.data(), direct.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("DeferKV never evicts the window or the decoded tokens", "[deferkv]") {
  const scenario s = make_scenario<fp16>(120, 3);
  engine<fp16> e(s, test::layout::token_major);
  kvevict::deferkv_config cfg;
  cfg.window = s.window;
  cfg.delay = 3;
  kvevict::deferkv_state<fp16> state(cfg);
  REQUIRE(state.reserve(s.hkv, s.prompt).ok());
  e.ws.reserve(state.workspace_size({s.hq(), s.hkv, s.dim, s.total(), s.window}));
  REQUIRE(state.observe_prefill(0, e.prefill(), e.ws).ok());
  for (std::int64_t i = 0; i < 3; ++i) REQUIRE(state.observe_decode(0, i, e.decode(i), e.ws).ok());
  const std::int64_t l = state.num_tokens();
  std::vector<float> out(static_cast<std::size_t>(s.hkv * l));
  REQUIRE(state.scores({out.data(), s.hkv, l, l}, e.ws).ok());
  for (std::int64_t budget : {0, 5, 40}) {
    for (auto mode : {kvevict::protected_mode::inside_budget, kvevict::protected_mode::on_top_of_budget}) {
      kvevict::selection_params sp = state.selection();
      sp.mode = mode;
      REQUIRE(sp.protected_tail == s.window + 3);
      kvevict::keep_list keep(s.hkv, kvevict::select_capacity(s.hkv, l, kvevict::budget::tokens(budget), sp));
      kvevict::workspace sws(kvevict::select_workspace_size(l));
      REQUIRE(kvevict::select(kvevict::const_score_view{out.data(), s.hkv, l, l}, kvevict::budget::tokens(budget), sp,
                              keep, sws)
                  .ok());
      for (std::int64_t h = 0; h < s.hkv; ++h) {
        const auto kept = keep.head(h);
        for (std::int64_t j = s.prompt - s.window; j < l; ++j)
          REQUIRE(std::find(kept.begin(), kept.end(), j) != kept.end());
      }
    }
  }
}

TEST_CASE("DeferKV lifecycle misuse is rejected and changes nothing", "[deferkv][errors]") {
  const scenario s = make_scenario<float>(150, 2);
  engine<float> e(s, test::layout::contiguous);
  kvevict::deferkv_config cfg;
  cfg.window = s.window;
  cfg.delay = 2;
  kvevict::deferkv_state<float> state(cfg, 5);
  REQUIRE(state.reserve(s.hkv, s.prompt).ok());
  e.ws.reserve(state.workspace_size({s.hq(), s.hkv, s.dim, s.total(), s.window}));
  std::vector<float> out(static_cast<std::size_t>(s.hkv * (s.prompt + 2)));
  const kvevict::score_view scores{out.data(), s.hkv, s.prompt + 2, s.prompt + 2};
  const std::vector<float> cache_before(reinterpret_cast<const float*>(e.cache.buffer.data()),
                                        reinterpret_cast<const float*>(e.cache.buffer.data()) + e.cache.buffer.size());
  auto expect = [&](const kvevict::status& st, kvevict::errc code, const char* argument) {
    INFO(st.message());
    REQUIRE(st.code() == code);
    REQUIRE(std::string(st.argument()) == argument);
  };

  expect(state.observe_decode(5, 0, e.decode(0), e.ws), kvevict::errc::invalid_state, "state");  // before prefill
  expect(state.scores(scores, e.ws), kvevict::errc::invalid_state, "state");                     // evict before ready
  expect(state.observe_prefill(4, e.prefill(), e.ws), kvevict::errc::invalid_state, "layer");    // wrong layer
  REQUIRE(state.observe_prefill(5, e.prefill(), e.ws).ok());
  const float s00 = state.state_sum(0, 0);
  const double z = state.state_normaliser();
  expect(state.observe_prefill(5, e.prefill(), e.ws), kvevict::errc::invalid_state, "state");   // twice
  expect(state.observe_decode(5, 1, e.decode(1), e.ws), kvevict::errc::invalid_state, "step");  // step skipped
  expect(state.observe_decode(5, 0, e.decode(1), e.ws), kvevict::errc::invalid_shape,
         "keys.num_tokens");                                                                     // wrong shape
  expect(state.observe_decode(6, 0, e.decode(0), e.ws), kvevict::errc::invalid_state, "layer");  // wrong layer
  expect(state.mark_evicted(), kvevict::errc::invalid_state, "state");
  expect(state.scores(scores, e.ws), kvevict::errc::invalid_state, "state");
  REQUIRE(state.state_sum(0, 0) == s00);
  REQUIRE(state.state_normaliser() == z);
  REQUIRE(state.steps_observed() == 0);
  REQUIRE(state.observe_decode(5, 0, e.decode(0), e.ws).ok());
  REQUIRE(state.observe_decode(5, 1, e.decode(1), e.ws).ok());
  REQUIRE(state.ready());
  expect(state.observe_decode(5, 2, e.decode(1), e.ws), kvevict::errc::invalid_state, "state");  // past the delay
  REQUIRE(state.scores(scores, e.ws).ok());
  REQUIRE(state.mark_evicted().ok());
  expect(state.scores(scores, e.ws), kvevict::errc::invalid_state, "state");  // already evicted
  state.reset();
  REQUIRE(state.observe_prefill(5, e.prefill(), e.ws).ok());

  kvevict::deferkv_config bad = cfg;
  bad.eta = 1.5;
  kvevict::deferkv_state<float> bad_state(bad);
  REQUIRE(bad_state.reserve(s.hkv, s.prompt).ok());
  expect(bad_state.observe_prefill(0, e.prefill(), e.ws), kvevict::errc::invalid_argument, "config.eta");
  kvevict::deferkv_state<float> small(cfg, 5);
  REQUIRE(small.reserve(s.hkv, 10).ok());
  expect(small.observe_prefill(5, e.prefill(), e.ws), kvevict::errc::invalid_state, "state");

  const float* now = reinterpret_cast<const float*>(e.cache.buffer.data());
  REQUIRE(std::equal(cache_before.begin(), cache_before.end(), now));
}

TEST_CASE("DeferKV's workspace_size covers the decode steps at long contexts", "[deferkv]") {
  // Regression: decode steps (one query per head) keep their logits, which needs more scratch
  // than the prefill window's two-sweep path; a workspace sized for W = 32 must serve both.
  const std::int64_t hkv = 1, hq = 4, d = 64, prompt = 12000, w = 32;
  const auto keys = test::normal(static_cast<std::size_t>(hkv * (prompt + 1) * d), 5);
  auto cache = test::make_cache<bf16>(test::layout::contiguous, hkv, prompt + 1, d, keys);
  std::vector<std::int64_t> pos;
  for (std::int64_t t = 0; t < w; ++t) pos.push_back(prompt - w + t);
  auto window = test::make_queries<bf16>(hq, w, d, test::normal(static_cast<std::size_t>(hq * w * d), 6), pos);
  auto step = test::make_queries<bf16>(hq, 1, d, test::normal(static_cast<std::size_t>(hq * d), 7), {prompt});
  kvevict::deferkv_config cfg;
  cfg.window = w;
  kvevict::deferkv_state<bf16> state(cfg);
  REQUIRE(state.reserve(hkv, prompt).ok());
  kvevict::workspace ws(state.workspace_size({hq, hkv, d, prompt + 1, w}));
  kvevict::layer_inputs<bf16> in;
  in.keys = cache.view.first_tokens(prompt);
  in.queries = window.view;
  REQUIRE(state.observe_prefill(0, in, ws).ok());
  in.keys = cache.view;
  in.queries = step.view;
  const auto st = state.observe_decode(0, 0, in, ws);
  INFO(st.message());
  REQUIRE(st.ok());
}
