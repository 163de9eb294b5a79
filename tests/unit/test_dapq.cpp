// DapQ: pseudo-token content, scoring with pseudo queries over prompt keys only, the RoPE
// helpers against an independent formulation (HF's rotate_half / GPT-J interleave,
// partial rotary, Llama-3 scaling), and the re-rotation variant against pseudo queries.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kvevict/policies/dapq.hpp"
#include "kvevict/rope/rope.hpp"
#include "kvevict/selection/select.hpp"
#include "reference/reference.hpp"
#include "reference/rope.hpp"
#include "support/compare.hpp"
#include "support/test_cache.hpp"

using kvevict::bf16;

namespace {

using ref::ref_rope;

std::vector<kvevict::rope_config> rope_variants() {
  std::vector<kvevict::rope_config> v;
  kvevict::rope_config neox;
  neox.head_dim = 64;
  neox.theta = 10000;
  v.push_back(neox);
  kvevict::rope_config gptj = neox;
  gptj.pairing = kvevict::rope_pairing::gptj;
  v.push_back(gptj);
  kvevict::rope_config partial = neox;
  partial.rotary_dim = 32;  // e.g. Phi / GPT-NeoX partial rotary
  v.push_back(partial);
  kvevict::rope_config llama3 = neox;
  llama3.head_dim = 128;
  llama3.theta = 500000;
  llama3.llama3.enabled = true;
  v.push_back(llama3);
  return v;
}

}  // namespace

TEST_CASE("DapQ pseudo-token content", "[dapq]") {
  std::vector<std::int32_t> prompt(100);
  for (int i = 0; i < 100; ++i) prompt[static_cast<std::size_t>(i)] = 1000 + i;
  std::vector<std::int32_t> out(32);
  REQUIRE(kvevict::dapq_pseudo_tokens_first_last(prompt.data(), 100, 8, 24, out.data()).ok());
  for (int i = 0; i < 8; ++i) REQUIRE(out[static_cast<std::size_t>(i)] == 1000 + i);
  for (int i = 0; i < 24; ++i) REQUIRE(out[static_cast<std::size_t>(8 + i)] == 1000 + 76 + i);
  REQUIRE(kvevict::dapq_pseudo_tokens_first_last(prompt.data(), 100, 2, 30, out.data()).ok());  // Qwen's 2 + 30
  REQUIRE(out[1] == 1001);
  REQUIRE(out[2] == 1070);
  REQUIRE(kvevict::dapq_pseudo_tokens_first_last(prompt.data(), 5, 8, 24, out.data()).ok());  // short prompt clamps
  REQUIRE(out[7] == 1004);
  REQUIRE(out[8] == 1000);
  REQUIRE(out[31] == 1004);
  const std::int32_t phrase[4] = {7, 8, 9, 10};
  REQUIRE(kvevict::dapq_pseudo_tokens_phrase(phrase, 4, 10, out.data()).ok());
  REQUIRE(std::vector<std::int32_t>(out.begin(), out.begin() + 10) ==
          std::vector<std::int32_t>{7, 8, 9, 10, 7, 8, 9, 10, 7, 8});
  std::int64_t pos[3];
  kvevict::dapq_pseudo_positions(50, 3, pos);
  REQUIRE(pos[0] == 50);
  REQUIRE(pos[2] == 52);
  REQUIRE(kvevict::dapq_pseudo_tokens_first_last(prompt.data(), 0, 8, 24, out.data()).code() ==
          kvevict::errc::invalid_argument);
}

TEST_CASE("RoPE rotation to position p equals the directly computed post-RoPE vector", "[dapq][rope]") {
  for (const auto& cfg : rope_variants()) {
    REQUIRE(kvevict::validate_rope_config(cfg, "test").ok());
    const auto x = test::normal(static_cast<std::size_t>(cfg.head_dim), 9);
    std::vector<float> xf(x.begin(), x.end());
    for (std::int64_t p : {0, 1, 17, 4095, 32768, 131071}) {
      std::vector<float> got(static_cast<std::size_t>(cfg.head_dim));
      kvevict::rope_rotate(cfg, xf.data(), 1, static_cast<double>(p), got.data());
      const auto want = ref_rope(cfg, std::vector<double>(xf.begin(), xf.end()), p);
      for (std::int64_t i = 0; i < cfg.head_dim; ++i)
        REQUIRE(static_cast<double>(got[static_cast<std::size_t>(i)]) ==
                Approx(want[static_cast<std::size_t>(i)]).margin(2e-6));
      // Composition: a post-RoPE vector at p moved by delta equals the vector rotated to p + delta.
      std::vector<float> moved(got.size());
      kvevict::rope_rotate(cfg, got.data(), 1, 32.0, moved.data());
      const auto direct = ref_rope(cfg, std::vector<double>(xf.begin(), xf.end()), p + 32);
      for (std::int64_t i = 0; i < cfg.head_dim; ++i)
        REQUIRE(static_cast<double>(moved[static_cast<std::size_t>(i)]) ==
                Approx(direct[static_cast<std::size_t>(i)]).margin(1e-5));
    }
  }
  kvevict::rope_config bad;
  bad.rotary_dim = 7;
  REQUIRE(std::string(kvevict::validate_rope_config(bad, "t").argument()) == "rope.rotary_dim");
}

TEST_CASE("DapQ scores prompt keys with pseudo queries at Lp .. Lp+N-1", "[dapq]") {
  const std::int64_t hkv = 2, g = 4, hq = 8, d = 64, lp = 150, n = 16;
  ref::problem p;
  p.hq = hq;
  p.hkv = hkv;
  p.w = n;
  p.l = lp;
  p.d = d;
  p.q = test::rounded<bf16>(test::normal(static_cast<std::size_t>(hq * n * d), 61, 1.5));
  const auto all_keys = test::rounded<bf16>(test::normal(static_cast<std::size_t>(hkv * (lp + n) * d), 62));
  // The reference sees the prompt's keys only.
  for (std::int64_t h = 0; h < hkv; ++h)
    for (std::int64_t j = 0; j < lp; ++j)
      for (std::int64_t c = 0; c < d; ++c)
        p.k.push_back(all_keys[static_cast<std::size_t>((h * (lp + n) + j) * d + c)]);
  for (std::int64_t t = 0; t < n; ++t) p.qpos.push_back(lp + t);
  auto cache = test::make_cache<bf16>(test::layout::paged_hnd, hkv, lp + n, d, all_keys);
  auto queries = test::make_queries<bf16>(hq, n, d, p.q, p.qpos);
  kvevict::dapq_config cfg;
  cfg.pseudo_tokens = n;
  kvevict::dapq<bf16> policy(cfg);
  kvevict::layer_inputs<bf16> in;
  in.keys = cache.view;
  in.queries = queries.view;
  std::vector<float> scores(static_cast<std::size_t>(hkv * lp));
  kvevict::workspace ws(policy.workspace_size({hq, hkv, d, lp, n}));
  REQUIRE(policy.score(in, {scores.data(), hkv, lp, lp}, ws).ok());
  ref::params rp;
  rp.reduce_before_pool = true;
  rp.kind = ref::pool::max;
  rp.kernel = 7;
  test::require_scores_close({scores.data(), hkv, lp, lp}, ref::scores(p, rp));
  // Keep-lists cover prompt tokens only.
  kvevict::keep_list keep(hkv, 2 * 40);
  kvevict::workspace sws(kvevict::select_workspace_size(lp));
  REQUIRE(kvevict::select(kvevict::const_score_view{scores.data(), hkv, lp, lp}, kvevict::budget::tokens(40),
                          policy.selection(), keep, sws)
              .ok());
  for (std::int64_t h = 0; h < hkv; ++h)
    for (std::int64_t j : keep.head(h)) REQUIRE(j < lp);
  REQUIRE(kvevict::dapq<bf16>::next_position(lp) == lp);
  // Pseudo queries positioned inside the prompt are a usage error.
  queries.positions[0] = lp - 1;
  REQUIRE(policy.score(in, {scores.data(), hkv, lp, lp}, ws).code() == kvevict::errc::out_of_range);
  (void)g;
}

TEST_CASE("DapQ re-rotation of the SnapKV window equals pseudo-query scoring", "[dapq][rope]") {
  const std::int64_t hkv = 2, hq = 8, d = 64, lp = 200, n = 32;
  for (const auto& rope_base : rope_variants()) {
    if (rope_base.head_dim != d) continue;
    const kvevict::rope_config rope = rope_base;
    const auto pre =
        test::normal(static_cast<std::size_t>(hq * n * d), 71, 1.5);  // pre-RoPE queries of the last N prompt tokens
    const auto keys = test::normal(static_cast<std::size_t>(hkv * lp * d), 72);
    auto cache = test::make_cache<float>(test::layout::contiguous, hkv, lp, d, keys);
    std::vector<std::int64_t> window_pos;
    for (std::int64_t t = 0; t < n; ++t) window_pos.push_back(lp - n + t);
    auto pre_view = test::make_queries<float>(hq, n, d, pre, window_pos);

    // Pseudo-query path: the same content rotated straight to Lp .. Lp+N-1.
    std::vector<float> pseudo(static_cast<std::size_t>(hq * n * d));
    std::vector<std::int64_t> pseudo_pos(static_cast<std::size_t>(n));
    kvevict::query_view<const float> pseudo_view;
    REQUIRE(kvevict::dapq_rotate_to(pre_view.view, rope, lp, pseudo.data(), pseudo_pos.data(), &pseudo_view).ok());
    // Re-rotation path: the window's post-RoPE queries (at Lp-N ..), moved by N.
    std::vector<float> window(static_cast<std::size_t>(hq * n * d));
    std::vector<std::int64_t> wpos(static_cast<std::size_t>(n));
    kvevict::query_view<const float> window_view;
    REQUIRE(kvevict::dapq_rotate_to(pre_view.view, rope, lp - n, window.data(), wpos.data(), &window_view).ok());
    std::vector<float> rerot(window.size());
    std::vector<std::int64_t> rpos(static_cast<std::size_t>(n));
    kvevict::query_view<const float> rerot_view;
    REQUIRE(kvevict::dapq_rerotate(window_view, rope, n, rerot.data(), rpos.data(), &rerot_view).ok());
    REQUIRE(rpos == pseudo_pos);
    for (std::size_t i = 0; i < rerot.size(); ++i) REQUIRE(rerot[i] == Approx(pseudo[i]).margin(2e-5));

    kvevict::dapq<float> policy;
    std::vector<float> a(static_cast<std::size_t>(hkv * lp)), b(a.size());
    kvevict::workspace ws(policy.workspace_size({hq, hkv, d, lp, n}));
    kvevict::layer_inputs<float> in;
    in.keys = cache.view;
    in.queries = pseudo_view;
    REQUIRE(policy.score(in, {a.data(), hkv, lp, lp}, ws).ok());
    in.queries = rerot_view;
    REQUIRE(policy.score(in, {b.data(), hkv, lp, lp}, ws).ok());
    std::vector<ref::vec> want;
    for (std::int64_t h = 0; h < hkv; ++h) want.emplace_back(a.begin() + h * lp, a.begin() + (h + 1) * lp);
    test::require_scores_close({b.data(), hkv, lp, lp}, want);
  }
}
