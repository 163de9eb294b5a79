// Each named preset pinned on a small hand-checkable case.
//
// d = 1 and k_j = ln(w_j) make exp(q*k_j) = w_j^q, so a query with q = 1 attends
// p1_j = w_j / sum(w) and one with q = 2 attends p2_j = w_j^2 / sum(w^2). The protected
// window's keys are -1000 (zero attention), so every observation sees exactly these rows.
// With w = [1,2,1,4,1,1,1,1,3,1,1,1]: sum(w) = 18, sum(w^2) = 38. Group of 2 query heads
// (q = 1 and q = 2) sharing one KV head; all W observations of a head are identical, so
// mean over the window = p and sum = W*p.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kvevict/policies/snapkv.hpp"
#include "kvevict/scoring/presets.hpp"
#include "kvevict/selection/select.hpp"
#include "kvevict/views/layouts.hpp"

namespace {

std::vector<float> run_preset(const kvevict::window_config& cfg) {
  const std::vector<double> w = {1, 2, 1, 4, 1, 1, 1, 1, 3, 1, 1, 1};
  const std::int64_t candidates = static_cast<std::int64_t>(w.size()), window = cfg.window;
  const std::int64_t tokens = candidates + window;
  std::vector<float> keys(static_cast<std::size_t>(tokens), -1000.0f);
  for (std::int64_t j = 0; j < candidates; ++j)
    keys[static_cast<std::size_t>(j)] = static_cast<float>(std::log(w[static_cast<std::size_t>(j)]));
  std::vector<float> queries;
  std::vector<std::int64_t> positions;
  for (std::int64_t t = 0; t < window; ++t) positions.push_back(candidates + t);
  for (float q : {1.0f, 2.0f})
    for (std::int64_t t = 0; t < window; ++t) queries.push_back(q);
  kvevict::snapkv<float> policy(cfg);
  kvevict::layer_inputs<float> in;
  in.keys = kvevict::hf_contiguous(keys.data(), 1, tokens, 1);
  in.queries = kvevict::contiguous_queries(queries.data(), 2, window, 1, positions.data());
  std::vector<float> scores(static_cast<std::size_t>(tokens));
  kvevict::workspace ws(policy.workspace_size({2, 1, 1, tokens, window}));
  REQUIRE(policy.score(in, {scores.data(), 1, tokens, tokens}, ws).ok());
  for (std::int64_t j = candidates; j < tokens; ++j) REQUIRE(std::isinf(scores[static_cast<std::size_t>(j)]));
  scores.resize(static_cast<std::size_t>(candidates));
  return scores;
}

void require_values(const std::vector<float>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t j = 0; j < got.size(); ++j) REQUIRE(static_cast<double>(got[j]) == Approx(want[j]).epsilon(1e-5));
}

}  // namespace

TEST_CASE("preset kvpress_snapkv", "[scoring][presets]") {
  const auto cfg = kvevict::presets::kvpress_snapkv();
  REQUIRE(cfg.window == 64);
  REQUIRE(cfg.scoring.pool.kind == kvevict::pooling_kind::avg);
  REQUIRE(cfg.scoring.pool.kernel == 5);
  REQUIRE(cfg.scoring.pool.count_padding);
  REQUIRE(cfg.scoring.window == kvevict::window_aggregation::mean);
  REQUIRE(cfg.scoring.gqa == kvevict::gqa_reduction::mean);
  REQUIRE(cfg.scoring.order == kvevict::gqa_order::after_pooling);
  REQUIRE(cfg.protect == kvevict::protected_mode::inside_budget);
  // Per head: avg-pool k = 5 of p (sums of up to 5 neighbours, divided by 5), then the mean
  // of the two heads. j = 0: ((1+2+1)/18 + (1+4+1)/38) / 5 / 2 = (4/18 + 6/38) / 10.
  require_values(run_preset(cfg), {0.0380116959, 0.102339181, 0.110526316, 0.110526316, 0.0970760234, 0.0970760234,
                                   0.0730994152, 0.0730994152, 0.0730994152, 0.0730994152, 0.0649122807, 0.0245614035});
  REQUIRE(0.0380116959 == Approx((4.0 / 18 + 6.0 / 38) / 10));
}

TEST_CASE("preset snapkv_paper", "[scoring][presets]") {
  const auto cfg = kvevict::presets::snapkv_paper();
  REQUIRE(cfg.window == 32);
  REQUIRE(cfg.scoring.pool.kind == kvevict::pooling_kind::max);
  REQUIRE(cfg.scoring.pool.kernel == 7);
  REQUIRE(cfg.scoring.window == kvevict::window_aggregation::sum);
  REQUIRE(cfg.scoring.order == kvevict::gqa_order::after_pooling);
  REQUIRE(cfg.protect == kvevict::protected_mode::on_top_of_budget);
  // Sum over 32 observations, max-pool k = 7 per head: tokens 0..6 see w = 4 (index 3),
  // tokens 7..11 see w = 3 (index 8). j <= 6: (32*4/18 + 32*16/38)/2; j >= 7: (32*3/18 + 32*9/38)/2.
  const double a = (32.0 * 4 / 18 + 32.0 * 16 / 38) / 2, b = (32.0 * 3 / 18 + 32.0 * 9 / 38) / 2;
  require_values(run_preset(cfg), {a, a, a, a, a, a, a, b, b, b, b, b});
  REQUIRE(a == Approx(10.2923977));
}

TEST_CASE("preset kvcache_factory_longbench", "[scoring][presets]") {
  const auto cfg = kvevict::presets::kvcache_factory_longbench();
  REQUIRE(cfg.window == 8);
  REQUIRE(cfg.scoring.pool.kind == kvevict::pooling_kind::max);
  REQUIRE(cfg.scoring.pool.kernel == 7);
  REQUIRE(cfg.scoring.window == kvevict::window_aggregation::sum);
  REQUIRE(cfg.scoring.order == kvevict::gqa_order::before_pooling);
  REQUIRE(cfg.protect == kvevict::protected_mode::on_top_of_budget);
  // Sum over 8, mean of the heads, then max-pool: j <= 6: 8*(4/18 + 16/38)/2.
  const double a = 8 * (4.0 / 18 + 16.0 / 38) / 2, b = 8 * (3.0 / 18 + 9.0 / 38) / 2;
  require_values(run_preset(cfg), {a, a, a, a, a, a, a, b, b, b, b, b});
  REQUIRE(a == Approx(2.57309942));
}

TEST_CASE("preset adakv", "[scoring][presets]") {
  const auto cfg = kvevict::presets::adakv();
  REQUIRE(cfg.window == 32);
  REQUIRE(cfg.scoring.pool.kind == kvevict::pooling_kind::max);
  REQUIRE(cfg.scoring.pool.kernel == 7);
  REQUIRE(cfg.scoring.window == kvevict::window_aggregation::mean);
  REQUIRE(cfg.scoring.order == kvevict::gqa_order::before_pooling);
  REQUIRE(cfg.protect == kvevict::protected_mode::on_top_of_budget);
  const double a = (4.0 / 18 + 16.0 / 38) / 2, b = (3.0 / 18 + 9.0 / 38) / 2;
  require_values(run_preset(cfg), {a, a, a, a, a, a, a, b, b, b, b, b});
  REQUIRE(a == Approx(0.321637427));
}

TEST_CASE("max pooling before or after GQA reduction differ as documented", "[scoring][presets]") {
  // The same case with mean over the window: after pooling, each head's own maximum
  // counts; before, the mean of the heads is pooled. They differ when the heads' maxima
  // sit at different tokens; here both peak at index 3, so pooled-then-averaged equals
  // averaged-then-pooled for j <= 6 -- check the algebra the docs state.
  auto cfg = kvevict::presets::adakv();
  const auto before = run_preset(cfg);
  cfg.scoring.order = kvevict::gqa_order::after_pooling;
  const auto after = run_preset(cfg);
  for (std::size_t j = 0; j < before.size(); ++j) REQUIRE(before[j] == Approx(after[j]).epsilon(1e-6));
}
