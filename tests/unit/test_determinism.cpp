// Determinism (design.md §6 and §9): the same inputs give bitwise-identical scores,
// keep-lists and compacted caches across repeated runs, across executors (the hook off; 1,
// 2 and 4 workers of a real thread pool; serial executors that claim 3 workers and run the
// tasks in reverse or permuted order) and whatever the workspace held before the call.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/test_cache.hpp"
#include "tsan/thread_pool.hpp"

namespace {

using i64 = std::int64_t;

/// Every executor the results must not depend on. The first is the reference (hook off).
struct executors {
  test::thread_pool pool1{1}, pool2{2}, pool4{4, test::thread_pool::order::reverse},
      pool4i{4, test::thread_pool::order::interleaved};
  test::serial_shuffle reverse{3, true}, permuted{3, false};
  std::vector<std::pair<std::string, kvevict::executor>> all() {
    return {{"hook off", kvevict::executor{}},
            {"pool x1", pool1.executor()},
            {"pool x2", pool2.executor()},
            {"pool x4 (reverse)", pool4.executor()},
            {"pool x4 (interleaved)", pool4i.executor()},
            {"serial x3 (reverse)", reverse.executor()},
            {"serial x3 (permuted)", permuted.executor()}};
  }
};

/// A workspace whose previous contents differ from run to run (NaN bytes, then garbage).
struct dirty_workspace {
  std::vector<unsigned char> bytes;
  int run = 0;
  kvevict::workspace_span get(std::size_t size) {
    bytes.assign(size + 64, static_cast<unsigned char>(run % 2 ? 0xff : 0x5a + run));
    ++run;
    // An odd offset: kvevict aligns inside any span.
    return {bytes.data() + (run % 3), size + 64 - static_cast<std::size_t>(run % 3)};
  }
};

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

/// Runs `produce(exec, ws)` once with the hook off (the reference), again with the hook off
/// over a differently dirty workspace, and once with every other executor; every result must
/// be bitwise equal to the reference.
template <class R>
void require_deterministic(const char* what,
                           const std::function<R(const kvevict::executor&, dirty_workspace&)>& produce) {
  executors ex;
  dirty_workspace ws;
  const R reference = produce(kvevict::executor{}, ws);
  for (auto& [name, exec] : ex.all()) {
    INFO(what << " with " << name);
    REQUIRE(same_bits(produce(exec, ws), reference));
  }
}

struct layer {
  i64 hkv, group, d, l, w;
  std::vector<double> k, q;
  std::vector<i64> qpos;
  layer(i64 hkv_, i64 group_, i64 d_, i64 l_, i64 w_, std::uint64_t seed)
      : hkv(hkv_), group(group_), d(d_), l(l_), w(w_) {
    k = test::normal(static_cast<std::size_t>(hkv * l * d), seed);
    q = test::normal(static_cast<std::size_t>(hkv * group * w * d), seed + 1, 1.5);
    // Quantised keys make many exactly tied scores, the hard case for tie rules.
    for (std::size_t i = 0; i < k.size(); i += 3) k[i] = std::round(k[i] * 2.0) / 2.0;
    for (i64 t = 0; t < w; ++t) qpos.push_back(l - w + t);
  }
  i64 hq() const { return hkv * group; }
};

kvevict::scoring_params with_tail(kvevict::window_config c) {
  return c.params();
}

}  // namespace

TEMPLATE_TEST_CASE("observation scores are bitwise identical across runs, executors and workspaces", "[determinism]",
                   float, kvevict::bf16) {
  using T = TestType;
  // Decode-sized (cached logits), prompt windows (two sweeps), and more rows than one GEMM
  // call takes (chunked rows); tiles end mid-row (L not a multiple of the key tile).
  const layer shapes[] = {{4, 4, 64, 777, 1, 1}, {2, 4, 128, 530, 32, 2}, {2, 4, 128, 300, 64, 3}};
  std::vector<std::pair<std::string, kvevict::scoring_params>> params = {
      {"kvpress", with_tail(kvevict::presets::kvpress_snapkv())},
      {"snapkv paper", with_tail(kvevict::presets::snapkv_paper())},
      {"kvcache factory", with_tail(kvevict::presets::kvcache_factory_longbench())},
      {"adakv", with_tail(kvevict::presets::adakv())},
      {"h2o", kvevict::h2o_config{}.params()},
  };
  kvevict::scoring_params cand = kvevict::presets::kvpress_snapkv().params();
  cand.domain = kvevict::softmax_domain::candidates;
  params.emplace_back("candidates domain", cand);
  for (const layer& s : shapes) {
    for (test::layout lay : {test::layout::contiguous, test::layout::paged_hnd}) {
      auto keys = test::make_cache<T>(lay, s.hkv, s.l, s.d, s.k, 16, 9);
      auto queries = test::make_queries<T>(s.hq(), s.w, s.d, s.q, s.qpos, true);
      for (const auto& entry : params) {
        const std::string& pname = entry.first;
        const kvevict::scoring_params& p = entry.second;
        for (bool with_lse : {false, true}) {
          if (with_lse && p.domain != kvevict::softmax_domain::visible) continue;
          std::vector<float> lse;
          if (with_lse) {
            // The engine's LSE: computed once by the library's own scoring without it is not
            // available, so use a plausible constant per row; determinism is what matters.
            lse.assign(static_cast<std::size_t>(s.hq() * s.w), 4.0f);
          }
          const std::string what = pname + " L=" + std::to_string(s.l) + " W=" + std::to_string(s.w) + " " +
                                   test::name(lay) + (with_lse ? " +lse" : "");
          require_deterministic<std::vector<float>>(
              what.c_str(), [&](const kvevict::executor& exec, dirty_workspace& ws) {
                std::vector<float> out(static_cast<std::size_t>(s.hkv * s.l), -1.0f);
                const std::size_t need =
                    kvevict::observation_scores_workspace_size({s.hq(), s.hkv, s.d, s.l, s.w}, p, exec);
                kvevict::observation_inputs in;
                if (with_lse) in.lse = lse.data();
                const kvevict::status st = kvevict::observation_scores(
                    queries.view, keys.view, p, {out.data(), s.hkv, s.l, s.l}, ws.get(need), in, exec);
                INFO(st.message());
                REQUIRE(st.ok());
                return out;
              });
        }
      }
    }
  }
}

TEST_CASE("the thread pool executor really runs kvevict's tasks on its threads", "[determinism]") {
  test::thread_pool pool(4);
  const layer s(8, 2, 32, 200, 4, 5);
  auto keys = test::make_cache<float>(test::layout::contiguous, s.hkv, s.l, s.d, s.k);
  auto queries = test::make_queries<float>(s.hq(), s.w, s.d, s.q, s.qpos);
  const kvevict::executor exec = pool.executor();
  const kvevict::scoring_params p = kvevict::presets::kvpress_snapkv().params();
  kvevict::workspace ws(kvevict::observation_scores_workspace_size({s.hq(), s.hkv, s.d, s.l, s.w}, p, exec));
  std::vector<float> out(static_cast<std::size_t>(s.hkv * s.l));
  for (int run = 0; run < 20; ++run)
    REQUIRE(kvevict::observation_scores(queries.view, keys.view, p, {out.data(), s.hkv, s.l, s.l}, ws, {}, exec).ok());
  i64 ran = 0;
  for (i64 n : pool.tasks_per_worker()) ran += n;
  CHECK(ran == 20 * s.hkv);  // one task per KV head, each run
}

TEST_CASE("selection is deterministic with ties, NaN and long rows, under every executor", "[determinism]") {
  const i64 hkv = 8, l = 9000;
  std::vector<float> scores(static_cast<std::size_t>(hkv * l));
  const std::vector<double> x = test::normal(scores.size(), 4);
  for (std::size_t i = 0; i < scores.size(); ++i) {
    scores[i] = static_cast<float>(std::round(x[i] * 3.0));  // about a dozen distinct values
    if (i % 97 == 0) scores[i] = std::numeric_limits<float>::quiet_NaN();
    if (i % 89 == 0) scores[i] = -0.0f;
  }
  std::vector<i64> budgets{0, 1, 100, 4000, 8999, 9000, 20000, 17};
  for (i64 b : {i64{1}, i64{333}, i64{4500}}) {
    for (const kvevict::selection_params sp :
         {kvevict::selection_params{0, kvevict::protected_mode::inside_budget},
          kvevict::selection_params{64, kvevict::protected_mode::on_top_of_budget}}) {
      require_deterministic<std::vector<i64>>("select", [&](const kvevict::executor& exec, dirty_workspace& ws) {
        kvevict::keep_list keep(hkv, kvevict::select_capacity(hkv, l, kvevict::budget::tokens(b), sp));
        const kvevict::status st =
            kvevict::select(kvevict::const_score_view{scores.data(), hkv, l, l}, kvevict::budget::tokens(b), sp, keep,
                            ws.get(kvevict::select_workspace_size(l, exec)), exec);
        REQUIRE(st.ok());
        std::vector<i64> flat;
        for (i64 h = 0; h < hkv; ++h) {
          const std::vector<i64> head = keep.head(h);
          flat.push_back(static_cast<i64>(head.size()));
          flat.insert(flat.end(), head.begin(), head.end());
        }
        return flat;
      });
    }
  }
  require_deterministic<std::vector<i64>>("select per head", [&](const kvevict::executor& exec, dirty_workspace& ws) {
    kvevict::keep_list keep(hkv, hkv * l);
    const kvevict::status st = kvevict::select(kvevict::const_score_view{scores.data(), hkv, l, l}, budgets.data(), {},
                                               keep, ws.get(kvevict::select_workspace_size(l, exec)), exec);
    REQUIRE(st.ok());
    std::vector<i64> flat;
    for (i64 h = 0; h < hkv; ++h) {
      const std::vector<i64> head = keep.head(h);
      flat.insert(flat.end(), head.begin(), head.end());
    }
    return flat;
  });
  // AdaKV has no executor; repeated runs over dirty workspaces agree.
  dirty_workspace ws;
  std::vector<i64> first;
  for (int run = 0; run < 3; ++run) {
    std::vector<i64> out(static_cast<std::size_t>(hkv));
    REQUIRE(kvevict::adakv_head_budgets({scores.data(), hkv, l, l}, 32, 700, {0.2, run == 2}, out.data(),
                                        ws.get(kvevict::adakv_workspace_size(hkv, l)))
                .ok());
    if (run < 2) {
      if (run == 0) first = out;
      REQUIRE(out == first);
    }
  }
}

TEST_CASE("every policy's score() is deterministic under every executor", "[determinism]") {
  const layer s(4, 2, 64, 900, 16, 21);
  auto keys = test::make_cache<kvevict::fp16>(test::layout::token_major, s.hkv, s.l, s.d, s.k, 16, 1);
  auto queries = test::make_queries<kvevict::fp16>(s.hq(), s.w, s.d, s.q, s.qpos);
  kvevict::layer_inputs<kvevict::fp16> in;
  in.keys = keys.view;
  in.queries = queries.view;
  std::vector<float> attn(static_cast<std::size_t>(s.hq() * s.w * s.l));
  const std::vector<double> a = test::normal(attn.size(), 3);
  for (std::size_t i = 0; i < attn.size(); ++i) attn[i] = static_cast<float>(std::fabs(a[i]));
  const kvevict::layer_shape shape{s.hq(), s.hkv, s.d, s.l, s.w};

  auto check = [&](const char* name, auto policy, const kvevict::layer_inputs<kvevict::fp16>& input, i64 cols) {
    require_deterministic<std::vector<float>>(name, [&](const kvevict::executor& exec, dirty_workspace& ws) {
      std::vector<float> out(static_cast<std::size_t>(s.hkv * cols), -1.0f);
      const kvevict::status st =
          policy.score(input, {out.data(), s.hkv, cols, cols}, ws.get(policy.workspace_size(shape, exec)), exec);
      INFO(st.message());
      REQUIRE(st.ok());
      return out;
    });
  };
  check("snapkv", kvevict::snapkv<kvevict::fp16>(kvevict::presets::snapkv_paper()), in, s.l);
  check("h2o (queries)", kvevict::h2o<kvevict::fp16>(kvevict::h2o_config{8}), in, s.l);
  kvevict::layer_inputs<kvevict::fp16> with_attn = in;
  with_attn.attention = kvevict::contiguous_attention(attn.data(), s.hq(), s.w, s.l, s.qpos.data());
  check("h2o (attention rows)", kvevict::h2o<kvevict::fp16>(), with_attn, s.l);
  check("knorm", kvevict::knorm<kvevict::fp16>(), in, s.l);
  check("keydiff", kvevict::keydiff<kvevict::fp16>(), in, s.l);
  kvevict::layer_inputs<kvevict::fp16> last_query = in;  // TOVA observes the last query only
  last_query.queries.data += (s.w - 1) * last_query.queries.query_stride;
  last_query.queries.positions += s.w - 1;
  last_query.queries.num_queries = 1;
  check("tova", kvevict::tova<kvevict::fp16>(), last_query, s.l);
  check("streaming_llm", kvevict::streaming_llm<kvevict::fp16>(), in, s.l);
  check("chunkkv(snapkv)", kvevict::chunkkv<kvevict::snapkv<kvevict::fp16>>(kvevict::snapkv<kvevict::fp16>()), in, s.l);
  // DapQ: the window's queries re-rotated to the pseudo positions, prompt Lp = L - W.
  std::vector<kvevict::fp16> rotated(static_cast<std::size_t>(s.hq() * s.w * s.d));
  std::vector<i64> rpos(static_cast<std::size_t>(s.w));
  kvevict::rope_config rope;
  rope.head_dim = s.d;
  kvevict::query_view<const kvevict::fp16> pseudo;
  REQUIRE(kvevict::dapq_rerotate(queries.view, rope, s.w, rotated.data(), rpos.data(), &pseudo).ok());
  kvevict::layer_inputs<kvevict::fp16> dq = in;
  dq.queries = pseudo;
  check("dapq", kvevict::dapq<kvevict::fp16>(), dq, s.l);
}

TEST_CASE("the DeferKV lifecycle is deterministic under every executor", "[determinism]") {
  const i64 hkv = 2, group = 4, d = 128, lp = 700, w = 32, delay = 3;
  const layer s(hkv, group, d, lp + delay, w, 41);
  auto cache = test::make_cache<kvevict::bf16>(test::layout::paged_nhd, hkv, lp + delay, d, s.k, 16, 2);
  std::vector<i64> qpos;
  for (i64 t = 0; t < w; ++t) qpos.push_back(lp - w + t);
  auto window = test::make_queries<kvevict::bf16>(hkv * group, w, d, s.q, qpos);
  std::vector<std::vector<kvevict::bf16>> decode_q;
  for (i64 step = 0; step < delay; ++step) {
    std::vector<double> q =
        test::normal(static_cast<std::size_t>(hkv * group * d), 90 + static_cast<std::uint64_t>(step));
    std::vector<kvevict::bf16> qq;
    for (double x : q) qq.push_back(kvevict::bf16(static_cast<float>(x)));
    decode_q.push_back(qq);
  }
  for (const bool feedback : {true, false}) {
    require_deterministic<std::vector<float>>("deferkv", [&](const kvevict::executor& exec, dirty_workspace& ws) {
      kvevict::deferkv_config cfg;
      cfg.window = w;
      cfg.delay = delay;
      cfg.decode_feedback = feedback;
      kvevict::deferkv_state<kvevict::bf16> st(cfg, 7);
      REQUIRE(st.reserve(hkv, lp).ok());
      const std::size_t need = st.workspace_size({hkv * group, hkv, d, lp + delay, w}, exec);
      kvevict::layer_inputs<kvevict::bf16> in;
      in.keys = cache.view.first_tokens(lp);
      in.queries = window.view;
      REQUIRE(st.observe_prefill(7, in, ws.get(need), exec).ok());
      for (i64 step = 0; feedback && step < delay; ++step) {
        std::vector<i64> pos{lp + step};
        kvevict::layer_inputs<kvevict::bf16> dec;
        dec.keys = cache.view.first_tokens(lp + step + 1);
        dec.queries = kvevict::contiguous_queries<const kvevict::bf16>(decode_q[static_cast<std::size_t>(step)].data(),
                                                                       hkv * group, 1, d, pos.data());
        const kvevict::status sd = st.observe_decode(7, step, dec, ws.get(need), exec);
        INFO(sd.message());
        REQUIRE(sd.ok());
      }
      REQUIRE(st.ready());
      const i64 n = st.num_tokens();
      std::vector<float> out(static_cast<std::size_t>(hkv * n));
      REQUIRE(st.scores({out.data(), hkv, n, n}, ws.get(need)).ok());
      return out;
    });
  }
}

TEST_CASE("eviction results are identical under every executor", "[determinism]") {
  const i64 hkv = 4, l = 300, d = 24;
  const std::vector<double> dense = test::normal(static_cast<std::size_t>(hkv * l * d), 8);
  // Per-head keep-lists of different lengths, runs and gaps.
  std::vector<i64> off{0}, idx;
  for (i64 h = 0; h < hkv; ++h) {
    for (i64 j = 0; j < l; ++j)
      if ((j * (h + 3)) % 7 < 3 + h || j > l - 10) idx.push_back(j);
    off.push_back(static_cast<i64>(idx.size()));
  }
  const kvevict::const_keep_list_view keep{hkv, off.data(), idx.data(), static_cast<i64>(idx.size())};
  for (test::layout lay : test::kAllLayouts) {
    require_deterministic<std::vector<kvevict::bf16>>(
        ("evict " + test::name(lay)).c_str(), [&](const kvevict::executor& exec, dirty_workspace& ws) {
          auto k = test::make_cache<kvevict::bf16>(lay, hkv, l, d, dense, 16, 3);
          auto v = test::make_cache<kvevict::bf16>(lay, hkv, l, d, dense, 16, 4);
          kvevict::eviction_result r;
          std::vector<i64> lengths(static_cast<std::size_t>(hkv)), pos(idx.size());
          r.head_lengths = lengths.data();
          r.positions = pos.data();
          REQUIRE(kvevict::evict(k.view, v.view, keep, r, ws.get(kvevict::evict_workspace_size(k.view, v.view, exec)),
                                 nullptr, exec)
                      .ok());
          std::vector<kvevict::bf16> all = k.buffer;
          all.insert(all.end(), v.buffer.begin(), v.buffer.end());
          return all;
        });
    require_deterministic<std::vector<kvevict::bf16>>(
        ("flatten_varlen " + test::name(lay)).c_str(), [&](const kvevict::executor& exec, dirty_workspace&) {
          auto k = test::make_cache<kvevict::bf16>(lay, hkv, l, d, dense, 16, 3);
          std::vector<kvevict::bf16> flat(idx.size() * static_cast<std::size_t>(d + 2), kvevict::bf16(-1.0f));
          std::vector<i64> cu(static_cast<std::size_t>(hkv + 1));
          REQUIRE(
              kvevict::flatten_varlen(k.view, keep, flat.data(), static_cast<i64>(idx.size()), d + 2, cu.data(), exec)
                  .ok());
          return flat;
        });
  }
  // A ragged batch (vLLM paged), every (sequence, head) pair a task.
  const i64 seqs = 3, block = 8, maxb = (l + block - 1) / block;
  std::vector<i64> lens{l, 121, 40};
  require_deterministic<std::vector<float>>("evict_batch", [&](const kvevict::executor& exec, dirty_workspace& ws) {
    const i64 pool_blocks = seqs * maxb * 2;
    std::vector<float> kp(static_cast<std::size_t>(pool_blocks * block * hkv * d)), vp(kp.size());
    for (std::size_t i = 0; i < kp.size(); ++i) {
      kp[i] = static_cast<float>(i % 1013);
      vp[i] = -static_cast<float>(i % 977);
    }
    std::vector<std::int32_t> ktab(static_cast<std::size_t>(seqs * maxb)), vtab(ktab.size());
    for (std::size_t i = 0; i < ktab.size(); ++i) {
      ktab[i] = static_cast<std::int32_t>((i * 5) % ktab.size());  // a permutation (5 coprime with 3*38)
      vtab[i] = static_cast<std::int32_t>(ktab.size() + i);
    }
    const auto kb = kvevict::vllm_paged_batch(kvevict::paged_nhd(kp.data(), pool_blocks, block, hkv, d, nullptr, 0),
                                              seqs, ktab.data(), maxb, lens.data());
    const auto vb = kvevict::vllm_paged_batch(kvevict::paged_hnd(vp.data(), pool_blocks, block, hkv, d, nullptr, 0),
                                              seqs, vtab.data(), maxb, lens.data());
    std::vector<std::vector<i64>> offs, idxs;
    std::vector<kvevict::const_keep_list_view> keeps;
    for (i64 sq = 0; sq < seqs; ++sq) {
      std::vector<i64> o{0}, ix;
      for (i64 h = 0; h < hkv; ++h) {
        for (i64 j = 0; j < lens[static_cast<std::size_t>(sq)]; ++j)
          if ((j + h + sq) % 3 != 0) ix.push_back(j);
        o.push_back(static_cast<i64>(ix.size()));
      }
      offs.push_back(o);
      idxs.push_back(ix);
    }
    for (i64 sq = 0; sq < seqs; ++sq)
      keeps.push_back({hkv, offs[static_cast<std::size_t>(sq)].data(), idxs[static_cast<std::size_t>(sq)].data(),
                       static_cast<i64>(idxs[static_cast<std::size_t>(sq)].size())});
    std::vector<kvevict::eviction_result> results(static_cast<std::size_t>(seqs));
    const kvevict::status st = kvevict::evict_batch(
        kb, vb, keeps.data(), results.data(), ws.get(kvevict::evict_batch_workspace_size(kb, vb, exec)), nullptr, exec);
    INFO(st.message());
    REQUIRE(st.ok());
    kp.insert(kp.end(), vp.begin(), vp.end());
    return kp;
  });
}
