// GPU tests of kvevict::cuda against the CPU library on the same inputs (ctest label "gpu":
// they need a CUDA device; scripts/gpu-check runs them). Compiled by the host compiler; the
// device work happens behind gpu_runner.hpp.
//
//   scoring:    every layout and storage type, every section-4 parameter, GQA, odd head
//               dims, L <= W, unsorted key positions, engine LSE, NaN/Inf keys: close to the
//               CPU (float32 rounding) and to the double reference
//   decode:     one- and two-pass DeferKV steps against the CPU's W = 1 scoring; the state's
//               finalisation against finalize_reduced_row bit for bit
//   selection:  bit-identical keep-lists to kvevict::select (ties, NaN, +-0, +-Inf, long
//               rows, per-row budgets, both protected modes), ragged batches in one launch
//   compaction: every layout pair against the definition, outputs, and device-detected
//               errors leaving the cache untouched
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpu_runner.hpp"
#include "kvevict/budgets/adakv.hpp"
#include "kvevict/budgets/layer_budget.hpp"
#include "kvevict/detail/finalize.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/eviction/evict.hpp"
#include "kvevict/policies/dapq.hpp"
#include "kvevict/policies/keydiff.hpp"
#include "kvevict/policies/knorm.hpp"
#include "kvevict/policies/streaming_llm.hpp"
#include "kvevict/scoring/observation_scores.hpp"
#include "kvevict/selection/scope.hpp"
#include "kvevict/selection/select.hpp"
#include "kvevict/views/layouts.hpp"
#include "reference/reference.hpp"
#include "shared_pool.hpp"
#include "support/test_cache.hpp"

using kvevict::bf16;
using kvevict::fp16;
using kvevict::fp8_e4m3;
using kvevict::fp8_e5m2;
using kvevict::gqa_order;
using kvevict::gqa_reduction;
using kvevict::pooling_kind;
using kvevict::softmax_domain;
using kvevict::window_aggregation;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

/// GPU against CPU where the kernel repeats the CPU's operations: the same bits, NaN where the
/// CPU has NaN (any NaN: the payload is not part of the contract).
void require_same_bits(const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    INFO("entry " << i << " gpu " << got[i] << " cpu " << want[i]);
    if (std::isnan(want[i])) {
      REQUIRE(std::isnan(got[i]));
    } else {
      REQUIRE(std::memcmp(&got[i], &want[i], sizeof(float)) == 0);
    }
  }
}

/// GPU against CPU: both float32, different summation orders and exp implementations.
void require_close(const std::vector<float>& got, const std::vector<float>& want, std::int64_t rows,
                   std::int64_t cols) {
  REQUIRE(got.size() == want.size());
  for (std::int64_t h = 0; h < rows; ++h) {
    double scale = 0;
    for (std::int64_t j = 0; j < cols; ++j) {
      const float w = want[static_cast<std::size_t>(h * cols + j)];
      if (std::isfinite(w)) scale = std::max(scale, std::fabs(static_cast<double>(w)));
    }
    for (std::int64_t j = 0; j < cols; ++j) {
      const double g = got[static_cast<std::size_t>(h * cols + j)], w = want[static_cast<std::size_t>(h * cols + j)];
      INFO("row " << h << " col " << j << " gpu " << g << " cpu " << w);
      if (std::isnan(w)) {
        REQUIRE(std::isnan(g));
      } else if (std::isinf(w)) {
        REQUIRE(g == w);
      } else {
        REQUIRE(std::fabs(g - w) <= 2e-4 * std::fabs(w) + 2e-6 * scale + 1e-30);
      }
    }
  }
}

std::vector<std::int64_t> tail_positions(std::int64_t l, std::int64_t w) {
  std::vector<std::int64_t> p;
  for (std::int64_t t = 0; t < w; ++t) p.push_back(l - w + t);
  return p;
}

kvevict::scoring_params make_params(softmax_domain dom, window_aggregation win, gqa_reduction red, gqa_order order,
                                    pooling_kind pool, std::int64_t kernel, bool count_padding, std::int64_t tail) {
  kvevict::scoring_params p;
  p.domain = dom;
  p.window = win;
  p.gqa = red;
  p.order = order;
  p.pool = {pool, kernel, count_padding};
  p.protected_tail = tail;
  return p;
}

ref::params ref_params(const kvevict::scoring_params& p, const std::vector<float>& weights) {
  ref::params r;
  r.dom = p.domain == softmax_domain::visible ? ref::domain::visible : ref::domain::candidates;
  r.window = static_cast<ref::agg>(static_cast<int>(p.window));
  r.reduce = static_cast<ref::gqa>(static_cast<int>(p.gqa));
  r.reduce_before_pool = p.order == gqa_order::before_pooling;
  r.kind = static_cast<ref::pool>(static_cast<int>(p.pool.kind));
  r.kernel = p.pool.kernel;
  r.count_padding = p.pool.count_padding;
  r.protected_tail = p.protected_tail;
  r.weights.assign(weights.begin(), weights.end());
  return r;
}

struct shape {
  std::int64_t hkv, group, dim, tokens, window;
};

struct obs_case {
  std::vector<std::int64_t> qpos;
  std::vector<std::int64_t> kpos;
  std::vector<float> weights;
  bool token_major = false;
  bool engine_lse = false;
  bool specials = false;  // NaN and +inf key elements
};

/// Runs CPU and GPU scoring on the same stored data and compares them (and, without special
/// values, the double reference).
template <class QT, class KT>
void check_obs(const shape& s, test::layout lay, const kvevict::scoring_params& params, obs_case c,
               std::uint64_t seed) {
  const std::int64_t hq = s.hkv * s.group;
  std::vector<double> qd = test::rounded<QT>(test::normal(static_cast<std::size_t>(hq * s.window * s.dim), seed, 1.5));
  std::vector<double> kd =
      test::rounded<KT>(test::normal(static_cast<std::size_t>(s.hkv * s.tokens * s.dim), seed + 1));
  if (c.specials && !kd.empty()) {
    kd[kd.size() / 3] = std::numeric_limits<double>::quiet_NaN();
    kd[kd.size() / 2] = std::numeric_limits<double>::infinity();
  }
  auto keys = test::make_cache<KT>(lay, s.hkv, s.tokens, s.dim, kd);
  auto queries = test::make_queries<QT>(hq, s.window, s.dim, qd, c.qpos, c.token_major);
  const kvevict::query_view<const QT> qv = queries.view;
  const kvevict::cache_view<const KT> kv = keys.view;

  gpu::obs_inputs in;
  in.key_positions = c.kpos;
  in.weights = c.weights;
  if (c.engine_lse) {
    in.lse.assign(static_cast<std::size_t>(hq * s.window), 0.0f);
    for (std::int64_t q = 0; q < hq; ++q)
      for (std::int64_t t = 0; t < s.window; ++t) {
        double m = -INFINITY;
        std::vector<double> logits;
        for (std::int64_t j = 0; j < s.tokens; ++j) {
          const std::int64_t kp = c.kpos.empty() ? j : c.kpos[static_cast<std::size_t>(j)];
          if (kp > c.qpos[static_cast<std::size_t>(t)]) continue;
          double dot = 0;
          for (std::int64_t ch = 0; ch < s.dim; ++ch)
            dot += qd[static_cast<std::size_t>((q * s.window + t) * s.dim + ch)] *
                   kd[static_cast<std::size_t>(((q / s.group) * s.tokens + j) * s.dim + ch)];
          logits.push_back(dot / std::sqrt(static_cast<double>(s.dim)));
          m = std::max(m, logits.back());
        }
        double z = 0;
        for (double x : logits) z += std::exp(x - m);
        in.lse[static_cast<std::size_t>(q * s.window + t)] = static_cast<float>(m + std::log(z));
      }
  }

  std::vector<float> cpu(static_cast<std::size_t>(s.hkv * s.tokens), 0.0f);
  kvevict::observation_inputs cin;
  cin.key_positions = c.kpos.empty() ? nullptr : c.kpos.data();
  cin.weights = c.weights.empty() ? nullptr : c.weights.data();
  cin.lse = c.engine_lse ? in.lse.data() : nullptr;
  kvevict::workspace ws(kvevict::observation_scores_workspace_size({hq, s.hkv, s.dim, s.tokens, s.window}, params));
  REQUIRE(kvevict::observation_scores(qv, kv, params, {cpu.data(), s.hkv, s.tokens, s.tokens}, ws, cin).ok());

  const gpu::scores_result g = gpu::observation_scores(qv, gpu::buffer_of(queries.buffer), kv,
                                                       gpu::buffer_of(keys.buffer), keys.table, params, in);
  INFO("status " << g.st.message());
  REQUIRE(g.st.ok());
  REQUIRE(g.flags == 0);
  require_close(g.scores, cpu, s.hkv, s.tokens);

  if (!c.specials) {
    ref::problem p;
    p.hq = hq;
    p.hkv = s.hkv;
    p.w = s.window;
    p.l = s.tokens;
    p.d = s.dim;
    p.q = qd;
    p.k = kd;
    p.qpos = c.qpos;
    p.kpos = c.kpos;
    const auto want = ref::scores(p, ref_params(params, c.weights));
    std::vector<float> flat;
    for (const auto& row : want) flat.insert(flat.end(), row.begin(), row.end());
    // float32 against double: the CPU suite's tolerance, doubled for the GPU's exp.
    require_close(g.scores, flat, s.hkv, s.tokens);
  }
}

/// Every combination of the parameter sweep by default. KVEVICT_GPU_SWEEP_STRIDE=k checks
/// every k-th one only: a fixed subset (k = 7 keeps 69 of 480, with every pair of parameter
/// values, which the test verifies), for the sanitizer runs of the CPU simulator; the layout
/// sweeps of scoring and compaction and AdaKV's largest shape are trimmed there too (each
/// says how). A GPU, and the simulator's Release run in the gcc stage, run them all.
std::size_t sweep_stride() {
  const char* env = std::getenv("KVEVICT_GPU_SWEEP_STRIDE");
  const long k = env != nullptr ? std::strtol(env, nullptr, 10) : 1;
  return k > 1 ? static_cast<std::size_t>(k) : 1;
}

const kvevict::scoring_params kKvpress =
    make_params(softmax_domain::visible, window_aggregation::mean, gqa_reduction::mean, gqa_order::after_pooling,
                pooling_kind::avg, 5, true, 0);

}  // namespace

TEST_CASE("GPU observation scores: every layout and storage type", "[gpu][gpu_scoring]") {
  const shape shapes[] = {{2, 2, 16, 70, 5}, {1, 4, 64, 300, 8}, {2, 3, 40, 129, 30}, {2, 2, 128, 1000, 32}};
  // Sanitizer runs (KVEVICT_GPU_SWEEP_STRIDE > 1) take the 1000-token shape, 70% of this test's
  // time, in one layout of each kind only (strided, token-major, transposed, paged, per-head
  // tables), each in one storage type, the four types in turn; the three smaller shapes still
  // cover every layout with every type.
  const bool trimmed = sweep_stride() > 1;
  const auto long_shape_layout = [](test::layout l) {
    return l == test::layout::contiguous || l == test::layout::token_major || l == test::layout::transposed ||
           l == test::layout::paged_hnd || l == test::layout::paged_per_head;
  };
  std::uint64_t seed = 1;
  int long_turn = 0;  // which storage type the next trimmed long-shape layout runs
  for (const shape& s : shapes)
    for (test::layout lay : test::kAllLayouts) {
      const bool trim_types = trimmed && s.tokens >= 1000;
      if (trim_types && !long_shape_layout(lay)) {
        ++seed;
        continue;
      }
      const int type_turn = trim_types ? long_turn++ % 4 : -1;
      const auto runs = [&](int type) { return type_turn < 0 || type_turn == type; };
      kvevict::scoring_params p = kKvpress;
      p.protected_tail = s.window;
      obs_case c;
      c.qpos = tail_positions(s.tokens, s.window);
      c.token_major = lay == test::layout::padded;
      INFO("G=" << s.group << " d=" << s.dim << " L=" << s.tokens << " W=" << s.window << " " << test::name(lay));
      if (runs(0)) {
        SECTION("f32 " + test::name(lay) + " " + std::to_string(s.tokens)) {
          check_obs<float, float>(s, lay, p, c, seed);
        }
      }
      if (runs(1)) {
        SECTION("f16 " + test::name(lay) + " " + std::to_string(s.tokens)) {
          check_obs<fp16, fp16>(s, lay, p, c, seed);
        }
      }
      if (runs(2)) {
        SECTION("bf16 " + test::name(lay) + " " + std::to_string(s.tokens)) {
          check_obs<bf16, bf16>(s, lay, p, c, seed);
        }
      }
      if (runs(3)) {
        SECTION("f32/bf16 " + test::name(lay) + " " + std::to_string(s.tokens)) {
          check_obs<float, bf16>(s, lay, p, c, seed);
        }
      }
      ++seed;
    }
}

TEST_CASE("GPU observation scores: every parameter combination", "[gpu][gpu_scoring]") {
  // G*W = 4*20 = 80 rows: two row chunks of the register tile, with a group spanning both.
  const shape s{2, 4, 64, 150, 20};
  const window_aggregation windows[] = {window_aggregation::mean, window_aggregation::sum, window_aggregation::max,
                                        window_aggregation::weighted, window_aggregation::visible_mean};
  struct pool_case {
    pooling_kind kind;
    std::int64_t kernel;
    bool count;
  };
  const pool_case pools[] = {{pooling_kind::none, 1, true},
                             {pooling_kind::avg, 5, true},
                             {pooling_kind::avg, 7, false},
                             {pooling_kind::max, 7, true}};
  std::vector<float> weights;
  for (std::int64_t t = 0; t < s.window; ++t) weights.push_back(std::pow(0.9f, static_cast<float>(s.window - 1 - t)));
  const std::size_t stride = sweep_stride();
  std::vector<std::array<int, 6>> run;  // the parameter indices of every combination checked
  std::uint64_t seed = 100;
  std::size_t index = 0;
  for (int dom = 0; dom < 2; ++dom)
    for (int win = 0; win < 5; ++win)
      for (int red = 0; red < 3; ++red)
        for (int order = 0; order < 2; ++order)
          for (int pool = 0; pool < 4; ++pool)
            for (int protect = 0; protect < 2; ++protect, ++seed) {
              if (index++ % stride != 0) continue;
              run.push_back({dom, win, red, order, pool, protect});
              const pool_case& pc = pools[pool];
              const kvevict::scoring_params p =
                  make_params(dom == 0 ? softmax_domain::visible : softmax_domain::candidates, windows[win],
                              static_cast<gqa_reduction>(red), static_cast<gqa_order>(order), pc.kind, pc.kernel,
                              pc.count, protect * 20);
              INFO("domain " << int(p.domain) << " window " << int(p.window) << " gqa " << int(p.gqa) << " order "
                             << int(p.order) << " pool " << int(pc.kind) << "/" << pc.kernel << " protect "
                             << p.protected_tail);
              obs_case c;
              // Early observations see a prefix only (causal masking inside the window).
              c.qpos = tail_positions(s.tokens, s.window);
              c.qpos[0] = 40;
              c.qpos[1] = 90;
              if (p.window == window_aggregation::weighted) c.weights = weights;
              check_obs<float, float>(s, test::layout::contiguous, p, c, seed);
            }
  // A trimmed sweep must still pair every value of every parameter with every value of
  // every other parameter.
  const int values[6] = {2, 5, 3, 2, 4, 2};
  for (int a = 0; a < 6; ++a)
    for (int b = a + 1; b < 6; ++b)
      for (int va = 0; va < values[a]; ++va)
        for (int vb = 0; vb < values[b]; ++vb) {
          INFO("stride " << stride << ": parameter " << a << " = " << va << " never meets parameter " << b << " = "
                         << vb);
          REQUIRE(std::any_of(run.begin(), run.end(), [&](const std::array<int, 6>& r) {
            return r[static_cast<std::size_t>(a)] == va && r[static_cast<std::size_t>(b)] == vb;
          }));
        }
}

TEST_CASE("GPU observation scores: edge shapes, positions, engine LSE, special values", "[gpu][gpu_scoring]") {
  const kvevict::scoring_params snap =
      make_params(softmax_domain::visible, window_aggregation::sum, gqa_reduction::mean, gqa_order::after_pooling,
                  pooling_kind::max, 7, true, 0);
  SECTION("L <= W with the window protected: nothing is a candidate") {
    kvevict::scoring_params p = snap;
    p.protected_tail = 8;
    obs_case c;
    c.qpos = {0, 1, 2, 3, 4, 5, 6, 7};
    check_obs<bf16, bf16>({2, 2, 64, 5, 8}, test::layout::contiguous, p, c, 1);
  }
  SECTION("L <= W, unprotected") {
    obs_case c;
    c.qpos = {0, 1, 2, 3, 4, 5, 6, 7};
    check_obs<fp16, fp16>({2, 2, 64, 5, 8}, test::layout::paged_nhd, snap, c, 2);
  }
  SECTION("L < kernel, one token") {
    obs_case c;
    c.qpos = {3, 4};
    check_obs<float, float>({1, 4, 64, 1, 2}, test::layout::transposed, snap, c, 3);
  }
  SECTION("head_dim 256 (shared memory above 48 KiB) and odd head_dim 72") {
    obs_case c;
    c.qpos = tail_positions(200, 16);
    check_obs<bf16, bf16>({2, 2, 256, 200, 16}, test::layout::contiguous, kKvpress, c, 4);
    check_obs<fp16, fp16>({2, 2, 72, 200, 16}, test::layout::paged_hnd, kKvpress, c, 5);
  }
  SECTION("odd head_dim on tensor cores (45, 33: half-filled channel pairs and MMA steps)") {
    obs_case c;
    c.qpos = tail_positions(130, 12);
    check_obs<bf16, bf16>({2, 3, 45, 130, 12}, test::layout::paged_nhd, kKvpress, c, 21);
    check_obs<fp16, fp16>({1, 4, 33, 130, 12}, test::layout::transposed, kKvpress, c, 22);
  }
  SECTION("large group: G = 8, W = 64 (512 rows)") {
    obs_case c;
    c.qpos = tail_positions(333, 64);
    kvevict::scoring_params p = kKvpress;
    p.protected_tail = 64;
    check_obs<bf16, bf16>({1, 8, 128, 333, 64}, test::layout::paged_nhd, p, c, 6);
  }
  SECTION("key positions in arbitrary order (llama.cpp cells)") {
    obs_case c;
    for (std::int64_t j = 0; j < 50; ++j) c.kpos.push_back((j * 17) % 50);
    c.qpos = {30, 35, 40, 49};
    check_obs<fp16, fp16>({2, 2, 64, 50, 4}, test::layout::token_major, snap, c, 7);
  }
  SECTION("engine LSE (one pass) equals two passes") {
    obs_case c;
    c.qpos = tail_positions(300, 8);
    c.engine_lse = true;
    kvevict::scoring_params p = kKvpress;
    p.protected_tail = 8;
    check_obs<float, float>({2, 4, 64, 300, 8}, test::layout::contiguous, p, c, 8);
    check_obs<bf16, bf16>({2, 4, 128, 300, 8}, test::layout::paged_hnd, p, c, 9);
  }
  SECTION("NaN and +inf key elements behave as on the CPU") {
    obs_case c;
    c.qpos = tail_positions(100, 4);
    c.specials = true;
    check_obs<float, float>({2, 2, 32, 100, 4}, test::layout::contiguous, snap, c, 10);
    check_obs<bf16, bf16>({2, 2, 32, 100, 4}, test::layout::paged_nhd, kKvpress, c, 11);
  }
}

namespace {
/// A ragged batch of one layer (Hkv = 2, G = 3, d = 40) scored in one call equals each
/// sequence scored alone, bit for bit: L from 6 to 1000, W from 5 to 32, five layouts, key
/// positions out of order, sequences with and without an engine LSE, one sequence whose
/// tokens are all protected.
template <class T>
void check_obs_batch(const kvevict::scoring_params& params, std::uint64_t seed) {
  struct spec {
    test::layout lay;
    std::int64_t tokens, window;
    bool lse, shuffled;
  };
  const spec specs[] = {{test::layout::contiguous, 70, 5, false, false},
                        {test::layout::paged_nhd, 300, 8, true, false},
                        {test::layout::cells, 129, 30, false, true},
                        {test::layout::paged_hnd, 1000, 32, false, false},
                        {test::layout::paged_int64, 6, 12, false, false}};
  const std::int64_t hkv = 2, group = 3, d = 40, hq = hkv * group;
  std::vector<test::test_cache<T>> caches;
  std::vector<test::test_queries<T>> queries;
  caches.reserve(std::size(specs));
  queries.reserve(std::size(specs));
  std::vector<gpu::batch_sequence<T, T>> batch;
  for (const spec& sp : specs) {
    caches.push_back(test::make_cache<T>(sp.lay, hkv, sp.tokens, d,
                                         test::normal(static_cast<std::size_t>(hkv * sp.tokens * d), seed++)));
    std::vector<std::int64_t> qpos;
    for (std::int64_t t = 0; t < sp.window; ++t) qpos.push_back(std::max<std::int64_t>(0, sp.tokens - sp.window) + t);
    queries.push_back(test::make_queries<T>(
        hq, sp.window, d, test::normal(static_cast<std::size_t>(hq * sp.window * d), seed++, 1.5), qpos));
    gpu::batch_sequence<T, T> b;
    b.q = queries.back().view;
    b.qbuf = gpu::buffer_of(queries.back().buffer);
    b.k = caches.back().view;
    b.kbuf = gpu::buffer_of(caches.back().buffer);
    b.table = &caches.back().table;
    if (sp.shuffled)
      for (std::int64_t j = 0; j < sp.tokens; ++j) b.in.key_positions.push_back((j * 7) % sp.tokens);
    if (sp.lse && params.domain == softmax_domain::visible)
      b.in.lse.assign(static_cast<std::size_t>(hq * sp.window), 2.5f);
    batch.push_back(b);
  }
  const auto got = gpu::observation_scores_batch(batch, params);
  INFO("status " << got.st.message());
  REQUIRE(got.st.ok());
  REQUIRE(got.flags == 0);
  REQUIRE(got.scores.size() == batch.size());
  for (std::size_t i = 0; i < batch.size(); ++i) {
    INFO("seqs[" << i << "]: L " << batch[i].k.num_tokens << " W " << batch[i].q.num_queries);
    const auto one = gpu::observation_scores(batch[i].q, batch[i].qbuf, batch[i].k, batch[i].kbuf, *batch[i].table,
                                             params, batch[i].in);
    REQUIRE(one.st.ok());
    REQUIRE(one.scores.size() == got.scores[i].size());
    for (std::size_t j = 0; j < one.scores.size(); ++j) {
      INFO("entry " << j << ": " << got.scores[i][j] << " vs " << one.scores[j]);
      REQUIRE(std::memcmp(&got.scores[i][j], &one.scores[j], sizeof(float)) == 0);
    }
  }
}
}  // namespace

TEST_CASE("GPU observation scores of a ragged batch in one launch per kernel", "[gpu][gpu_scoring]") {
  kvevict::scoring_params tail = make_params(softmax_domain::visible, window_aggregation::sum, gqa_reduction::max,
                                             gqa_order::before_pooling, pooling_kind::max, 7, true, 8);
  kvevict::scoring_params candidates =
      make_params(softmax_domain::candidates, window_aggregation::visible_mean, gqa_reduction::mean,
                  gqa_order::after_pooling, pooling_kind::avg, 5, false, 4);
  SECTION("bf16 (tensor cores), kvpress") {
    check_obs_batch<bf16>(kKvpress, 1700);
  }
  SECTION("bf16, protected tail, max pooling before the GQA max") {
    check_obs_batch<bf16>(tail, 1710);
  }
  SECTION("fp16, candidates domain, visible mean") {
    check_obs_batch<fp16>(candidates, 1720);
  }
  SECTION("float (CUDA cores)") {
    check_obs_batch<float>(tail, 1730);
  }
}

TEST_CASE("GPU batched scoring refuses a bad sequence by name, before anything runs", "[gpu][gpu_errors]") {
  const std::int64_t d = 32;
  auto k0 = test::make_cache<float>(test::layout::contiguous, 2, 50, d, test::normal(2 * 50 * d, 1800));
  auto k1 = test::make_cache<float>(test::layout::paged_nhd, 2, 60, d, test::normal(2 * 60 * d, 1801));
  auto k3 = test::make_cache<float>(test::layout::contiguous, 3, 60, d, test::normal(3 * 60 * d, 1802));
  auto q0 = test::make_queries<float>(4, 4, d, test::normal(4 * 4 * d, 1803), {46, 47, 48, 49});
  auto q2 = test::make_queries<float>(4, 4, d + 1, test::normal(4 * 4 * (d + 1), 1804), {56, 57, 58, 59});
  auto q3 = test::make_queries<float>(6, 4, d, test::normal(6 * 4 * d, 1805), {56, 57, 58, 59});
  auto sequence = [](const test::test_queries<float>& q, const test::test_cache<float>& k) {
    gpu::batch_sequence<float, float> b;
    b.q = q.view;
    b.qbuf = gpu::buffer_of(q.buffer);
    b.k = k.view;
    b.kbuf = gpu::buffer_of(k.buffer);
    b.table = &k.table;
    return b;
  };
  struct bad_case {
    std::vector<gpu::batch_sequence<float, float>> seqs;
    kvevict::errc code;
    const char* argument;
  };
  const bad_case cases[] = {
      {{sequence(q0, k0), sequence(q2, k1)}, kvevict::errc::invalid_shape, "seqs[1].queries.head_dim"},
      {{sequence(q0, k0), sequence(q0, k1), sequence(q3, k3)}, kvevict::errc::invalid_shape, "seqs[2].keys.num_heads"},
  };
  for (const bad_case& c : cases) {
    const auto r = gpu::observation_scores_batch(c.seqs, kKvpress);
    INFO("status " << r.st.message());
    REQUIRE(r.st.code() == c.code);
    REQUIRE(std::string(r.st.message()).find(c.argument) != std::string::npos);
    for (const auto& scores : r.scores)
      for (float x : scores) REQUIRE(x == 12345.0f);  // nothing ran
  }
}

TEST_CASE("GPU pooling: every mode and kernel size, at the row's ends and across finalize tiles",
          "[gpu][gpu_scoring]") {
  // Every column is compared with the CPU, so a window clipped wrongly at either end of the row,
  // or a halo that misses keys of the neighbouring finalize tile (256 keys), fails here; the
  // lengths end the row before, on and after a tile boundary, and kernel 301 reaches across one.
  // Sanitizer runs (KVEVICT_GPU_SWEEP_STRIDE > 1) keep a short row and one that crosses a boundary.
  const std::vector<std::int64_t> lengths =
      sweep_stride() > 1 ? std::vector<std::int64_t>{5, 257} : std::vector<std::int64_t>{5, 255, 256, 257, 600};
  const std::int64_t kernels[] = {1, 3, 5, 7, 9, 31, 301};
  struct mode {
    pooling_kind kind;
    bool count_padding;
  };
  const mode modes[] = {{pooling_kind::avg, true}, {pooling_kind::avg, false}, {pooling_kind::max, true}};
  std::uint64_t seed = 2600;
  for (std::int64_t l : lengths)
    for (const mode& m : modes)
      for (std::size_t k = 0; k < std::size(kernels); ++k, ++seed) {
        const gqa_order order = k % 2 == 0 ? gqa_order::after_pooling : gqa_order::before_pooling;
        const kvevict::scoring_params p =
            make_params(softmax_domain::visible, window_aggregation::mean,
                        m.kind == pooling_kind::max ? gqa_reduction::max : gqa_reduction::mean, order, m.kind,
                        kernels[k], m.count_padding, 0);
        INFO("L=" << l << " pool " << int(m.kind) << "/" << kernels[k] << " count " << m.count_padding << " order "
                  << int(order));
        const std::int64_t w = std::min<std::int64_t>(l, 4);
        obs_case c;
        c.qpos = tail_positions(l, w);
        check_obs<float, float>({1, 2, 16, l, w}, test::layout::contiguous, p, c, seed);
      }
}

TEST_CASE("GPU observation scores are deterministic", "[gpu][gpu_scoring]") {
  // Sanitizer runs (KVEVICT_GPU_SWEEP_STRIDE > 1) take 1,100 keys: still past 16 key tiles.
  const std::int64_t hkv = 2, hq = 8, d = 128, l = sweep_stride() > 1 ? 1100 : 2000, w = 32;
  auto keys = test::make_cache<bf16>(test::layout::contiguous, hkv, l, d,
                                     test::normal(static_cast<std::size_t>(hkv * l * d), 1));
  auto queries =
      test::make_queries<bf16>(hq, w, d, test::normal(static_cast<std::size_t>(hq * w * d), 2), tail_positions(l, w));
  const kvevict::query_view<const bf16> qv = queries.view;
  const kvevict::cache_view<const bf16> kv = keys.view;
  const auto a = gpu::observation_scores(qv, gpu::buffer_of(queries.buffer), kv, gpu::buffer_of(keys.buffer),
                                         keys.table, kKvpress);
  const auto b = gpu::observation_scores(qv, gpu::buffer_of(queries.buffer), kv, gpu::buffer_of(keys.buffer),
                                         keys.table, kKvpress);
  REQUIRE(a.st.ok());
  REQUIRE(b.st.ok());
  REQUIRE(std::memcmp(a.scores.data(), b.scores.data(), a.scores.size() * sizeof(float)) == 0);
}

TEST_CASE("GPU observation scores: device-detected problems raise flags", "[gpu][gpu_scoring]") {
  const std::int64_t hkv = 2, hq = 4, d = 32, l = 64, w = 4;
  auto keys = test::make_cache<float>(test::layout::paged_nhd, hkv, l, d,
                                      test::normal(static_cast<std::size_t>(hkv * l * d), 1));
  auto queries =
      test::make_queries<float>(hq, w, d, test::normal(static_cast<std::size_t>(hq * w * d), 2), tail_positions(l, w));
  const kvevict::query_view<const float> qv = queries.view;
  SECTION("a block id outside the pool") {
    keys.table[1] = 1000;
    const kvevict::cache_view<const float> kv = keys.view;
    const auto g = gpu::observation_scores(qv, gpu::buffer_of(queries.buffer), kv, gpu::buffer_of(keys.buffer),
                                           keys.table, kKvpress);
    REQUIRE(g.st.ok());
    REQUIRE((g.flags & kvevict::cuda::flag_block_id_out_of_range) != 0);
    REQUIRE(kvevict::cuda::device_flags_status(g.flags).code() == kvevict::errc::out_of_range);
  }
  SECTION("a negative observation position") {
    queries.positions[0] = -3;
    const kvevict::cache_view<const float> kv = keys.view;
    const auto g = gpu::observation_scores(qv, gpu::buffer_of(queries.buffer), kv, gpu::buffer_of(keys.buffer),
                                           keys.table, kKvpress);
    REQUIRE(g.st.ok());
    REQUIRE((g.flags & kvevict::cuda::flag_negative_position) != 0);
  }
  SECTION("negative window weights") {
    kvevict::scoring_params p = kKvpress;
    p.window = window_aggregation::weighted;
    gpu::obs_inputs in;
    in.weights = {1.0f, -1.0f, 1.0f, 1.0f};
    const kvevict::cache_view<const float> kv = keys.view;
    const auto g =
        gpu::observation_scores(qv, gpu::buffer_of(queries.buffer), kv, gpu::buffer_of(keys.buffer), keys.table, p, in);
    REQUIRE(g.st.ok());
    REQUIRE((g.flags & kvevict::cuda::flag_invalid_weights) != 0);
  }
}

TEST_CASE("GPU calls reject what the host can check, before launching", "[gpu][gpu_errors]") {
  const auto a = gpu::observation_with_host_keys();
  REQUIRE(a.code() == kvevict::errc::invalid_argument);
  REQUIRE(std::string(a.argument()) == "keys.data");
  REQUIRE(gpu::observation_with_small_workspace().code() == kvevict::errc::workspace_too_small);
  const auto c = gpu::compact_with_aliased_kv();
  REQUIRE(c.code() == kvevict::errc::invalid_argument);
  REQUIRE(std::string(c.argument()) == "values.data");
  REQUIRE(gpu::select_with_small_capacity().code() == kvevict::errc::invalid_keep_list);
  REQUIRE(gpu::decode_with_two_queries().code() == kvevict::errc::invalid_shape);
  SECTION("engine LSE with the candidates domain") {
    auto keys = test::make_cache<float>(test::layout::contiguous, 1, 10, 8, test::normal(80, 1));
    auto queries = test::make_queries<float>(1, 1, 8, test::normal(8, 2), {9});
    gpu::obs_inputs in;
    in.lse = {0.0f};
    kvevict::scoring_params p = kKvpress;
    p.domain = softmax_domain::candidates;
    const kvevict::query_view<const float> qv = queries.view;
    const kvevict::cache_view<const float> kv = keys.view;
    const auto g =
        gpu::observation_scores(qv, gpu::buffer_of(queries.buffer), kv, gpu::buffer_of(keys.buffer), keys.table, p, in);
    REQUIRE(g.st.code() == kvevict::errc::unsupported);
    for (float x : g.scores) REQUIRE(x == 12345.0f);  // nothing written
  }
}

namespace {

/// The CPU's W = 1 scoring with pooling off and window sum gives, per KV head, the GQA
/// reduction (sum or max) of the decode query heads' attention rows: exactly one DeferKV step.
template <class QT, class KT>
std::vector<float> cpu_decode_rows(const kvevict::query_view<const QT>& q, const kvevict::cache_view<const KT>& k,
                                   gqa_reduction red, softmax_domain dom, std::int64_t tail,
                                   const std::vector<std::int64_t>& kpos) {
  kvevict::scoring_params p =
      make_params(dom, window_aggregation::sum, red == gqa_reduction::max ? gqa_reduction::max : gqa_reduction::sum,
                  gqa_order::before_pooling, pooling_kind::none, 1, true, tail);
  std::vector<float> scores(static_cast<std::size_t>(k.num_heads * k.num_tokens));
  kvevict::workspace ws(
      kvevict::observation_scores_workspace_size({q.num_heads, k.num_heads, k.head_dim, k.num_tokens, 1}, p));
  kvevict::observation_inputs in;
  in.key_positions = kpos.empty() ? nullptr : kpos.data();
  REQUIRE(kvevict::observation_scores(q, k, p, {scores.data(), k.num_heads, k.num_tokens, k.num_tokens}, ws, in).ok());
  const std::int64_t c = std::max<std::int64_t>(0, k.num_tokens - tail);
  std::vector<float> rows(static_cast<std::size_t>(k.num_heads * c));
  for (std::int64_t h = 0; h < k.num_heads; ++h)
    for (std::int64_t j = 0; j < c; ++j)
      rows[static_cast<std::size_t>(h * c + j)] = scores[static_cast<std::size_t>(h * k.num_tokens + j)];
  return rows;
}

/// Two decode steps (eta 0 on a NaN state, then eta 0.5) against the CPU, the engine-LSE
/// single pass against the two passes, and the state's finalisation against the CPU's.
/// `kscale` is the keys' dequantisation scale; `special_keys` (NaN or an infinity), when not
/// zero, is written into two key elements.
template <class Q, class K = Q>
void check_decode(test::layout lay, std::int64_t hkv, std::int64_t group, std::int64_t d, std::int64_t l,
                  gqa_reduction red, softmax_domain dom, std::int64_t tail, bool unsorted_kpos, std::uint64_t seed,
                  float kscale = 1.0f, double special_keys = 0.0) {
  const std::int64_t hq = hkv * group, c = std::max<std::int64_t>(0, l - tail);
  std::vector<double> kd = test::normal(static_cast<std::size_t>(hkv * l * d), seed, kscale == 1.0f ? 1.0 : 4.0);
  if (special_keys != 0.0) {
    kd[kd.size() / 3] = special_keys;
    kd[kd.size() / 2 + 1] = special_keys;
  }
  auto keys = test::make_cache<K>(lay, hkv, l, d, kd);
  keys.view.scale = kscale;
  std::vector<std::int64_t> kpos;
  if (unsorted_kpos)
    for (std::int64_t j = 0; j < l; ++j) kpos.push_back((j * 7) % l);
  // Step 1 at a position that sees most keys; step 2 sees all.
  auto q1 = test::make_queries<Q>(hq, 1, d, test::normal(static_cast<std::size_t>(hq * d), seed + 1, 1.5), {l - 3});
  auto q2 = test::make_queries<Q>(hq, 1, d, test::normal(static_cast<std::size_t>(hq * d), seed + 2, 1.5), {l + 4});
  const kvevict::cache_view<const K> kv = keys.view;
  const kvevict::query_view<const Q> qv1 = q1.view, qv2 = q2.view;

  gpu::decode_step step;
  step.gqa = red;
  step.domain = dom;
  step.protected_tail = tail;
  step.key_positions = kpos;
  step.eta = 0.0f;  // overwrite: the state starts as garbage
  const std::vector<float> garbage(static_cast<std::size_t>(hkv * c), std::numeric_limits<float>::quiet_NaN());
  const auto s1 = gpu::decode_observation(qv1, gpu::buffer_of(q1.buffer), kv, gpu::buffer_of(keys.buffer), keys.table,
                                          step, garbage);
  INFO("status " << s1.st.message());
  REQUIRE(s1.st.ok());
  REQUIRE(s1.flags == 0);
  const auto want1 = cpu_decode_rows(qv1, kv, red, dom, tail, kpos);
  require_close(s1.state, want1, hkv, c);

  step.eta = 0.5f;
  const auto s2 = gpu::decode_observation(qv2, gpu::buffer_of(q2.buffer), kv, gpu::buffer_of(keys.buffer), keys.table,
                                          step, s1.state);
  REQUIRE(s2.st.ok());
  const auto a2 = cpu_decode_rows(qv2, kv, red, dom, tail, kpos);
  std::vector<float> want2(a2.size());
  for (std::size_t i = 0; i < a2.size(); ++i) want2[i] = 0.5f * s1.state[i] + a2[i];
  require_close(s2.state, want2, hkv, c);

  if (dom == softmax_domain::visible) {  // one pass with the engine's LSE
    step.lse.assign(static_cast<std::size_t>(hq), 0.0f);
    for (std::int64_t q = 0; q < hq; ++q) {
      std::vector<double> logits;
      double m = -INFINITY;
      for (std::int64_t j = 0; j < l; ++j) {
        double dot = 0;
        for (std::int64_t ch = 0; ch < d; ++ch)
          dot += test::load(q2.buffer[static_cast<std::size_t>(q * d + ch)]) * test::load(keys.at(q / group, j, ch));
        if (std::isnan(dot)) continue;  // a NaN logit gets no attention
        logits.push_back(dot * static_cast<double>(kscale) / std::sqrt(static_cast<double>(d)));
        m = std::max(m, logits.back());
      }
      double z = 0;
      for (double x : logits) z += std::exp(x - m);
      step.lse[static_cast<std::size_t>(q)] = static_cast<float>(m + std::log(z));
    }
    const auto s3 = gpu::decode_observation(qv2, gpu::buffer_of(q2.buffer), kv, gpu::buffer_of(keys.buffer), keys.table,
                                            step, s1.state);
    REQUIRE(s3.st.ok());
    require_close(s3.state, s2.state, hkv, c);
  }

  // Finalisation of the state equals the CPU's finalize_reduced_row bit for bit.
  for (auto pool : {pooling_kind::avg, pooling_kind::max}) {
    kvevict::scoring_params fp = make_params(dom, window_aggregation::mean, red, gqa_order::before_pooling, pool,
                                             pool == pooling_kind::avg ? 5 : 7, true, tail);
    const float scale = 1.0f / 1.5f;
    const auto g = gpu::finalize_state(s2.state, hkv, l, group, scale, fp);
    REQUIRE(g.st.ok());
    kvevict::detail::window_normaliser norm;
    norm.scale = scale;
    for (std::int64_t h = 0; h < hkv; ++h) {
      std::vector<float> row(s2.state.begin() + h * c, s2.state.begin() + (h + 1) * c),
          out(static_cast<std::size_t>(l));
      kvevict::detail::finalize_reduced_row(row.data(), group, c, l, fp, norm, out.data());
      for (std::int64_t j = 0; j < l; ++j) {
        const float x = g.scores[static_cast<std::size_t>(h * l + j)], y = out[static_cast<std::size_t>(j)];
        INFO("head " << h << " token " << j << " gpu " << x << " cpu " << y);
        REQUIRE((std::memcmp(&x, &y, sizeof(float)) == 0 || (std::isnan(x) && std::isnan(y))));
      }
    }
  }
}

}  // namespace

TEST_CASE("GPU observation_state: DeferKV's prefill observation as an un-normalised state", "[gpu][gpu_decode]") {
  const std::int64_t hkv = 2, group = 4, hq = hkv * group, d = 64, l = 260, w = 12, tail = 12, c = l - tail;
  const auto kd = test::normal(static_cast<std::size_t>(hkv * l * d), 41);
  auto keys = test::make_cache<bf16>(test::layout::paged_nhd, hkv, l, d, kd);
  auto queries = test::make_queries<bf16>(hq, w, d, test::normal(static_cast<std::size_t>(hq * w * d), 42, 1.5),
                                          tail_positions(l, w));
  const kvevict::query_view<const bf16> qv = queries.view;
  const kvevict::cache_view<const bf16> kv = keys.view;
  std::vector<float> weights;
  double wsum = 0;
  for (std::int64_t t = 0; t < w; ++t) {
    weights.push_back(std::pow(0.9f, static_cast<float>(w - 1 - t)));
    wsum += weights.back();
  }
  for (auto red : {gqa_reduction::sum, gqa_reduction::max}) {
    INFO("gqa " << int(red));
    // GPU: weighted, un-normalised, GQA-reduced, no pooling.
    kvevict::scoring_params p = make_params(softmax_domain::visible, window_aggregation::weighted, red,
                                            gqa_order::before_pooling, pooling_kind::none, 1, true, tail);
    gpu::obs_inputs in;
    in.weights = weights;
    const std::vector<float> garbage(static_cast<std::size_t>(hkv * c), std::numeric_limits<float>::quiet_NaN());
    const auto s1 = gpu::observation_state(qv, gpu::buffer_of(queries.buffer), kv, gpu::buffer_of(keys.buffer),
                                           keys.table, p, 0.0f, garbage, in);
    INFO("status " << s1.st.message());
    REQUIRE(s1.st.ok());
    REQUIRE(s1.flags == 0);
    // CPU: the same scoring normalised by 1 / sum(w); scale the GPU state alike.
    std::vector<float> cpu(static_cast<std::size_t>(hkv * l));
    kvevict::workspace ws(kvevict::observation_scores_workspace_size({hq, hkv, d, l, w}, p));
    kvevict::observation_inputs cin;
    cin.weights = weights.data();
    REQUIRE(kvevict::observation_scores(qv, kv, p, {cpu.data(), hkv, l, l}, ws, cin).ok());
    std::vector<float> got(s1.state.size()), want(s1.state.size());
    for (std::int64_t h = 0; h < hkv; ++h)
      for (std::int64_t j = 0; j < c; ++j) {
        got[static_cast<std::size_t>(h * c + j)] =
            s1.state[static_cast<std::size_t>(h * c + j)] * static_cast<float>(1.0 / wsum);
        want[static_cast<std::size_t>(h * c + j)] = cpu[static_cast<std::size_t>(h * l + j)];
      }
    require_close(got, want, hkv, c);
    // A second fold with decay: state <- 0.5 * state + the same observation.
    const auto s2 = gpu::observation_state(qv, gpu::buffer_of(queries.buffer), kv, gpu::buffer_of(keys.buffer),
                                           keys.table, p, 0.5f, s1.state, in);
    REQUIRE(s2.st.ok());
    std::vector<float> want2(s1.state.size());
    for (std::size_t i = 0; i < want2.size(); ++i) want2[i] = 0.5f * s1.state[i] + s1.state[i];
    require_close(s2.state, want2, hkv, c);
  }
  SECTION("mean aggregation is rejected: the state is un-normalised") {
    const auto g = gpu::observation_state(qv, gpu::buffer_of(queries.buffer), kv, gpu::buffer_of(keys.buffer),
                                          keys.table, kKvpress, 0.0f, std::vector<float>(hkv * l, 0.0f));
    REQUIRE(g.st.code() == kvevict::errc::invalid_argument);
  }
}

TEST_CASE("GPU decode observation (DeferKV step)", "[gpu][gpu_decode]") {
  std::uint64_t seed = 500;
  for (auto red : {gqa_reduction::mean, gqa_reduction::sum, gqa_reduction::max})
    for (auto dom : {softmax_domain::visible, softmax_domain::candidates}) {
      INFO("gqa " << int(red) << " domain " << int(dom));
      check_decode<bf16>(test::layout::contiguous, 2, 4, 128, 700, red, dom, 16, false, seed++);  // 16-byte loads
      check_decode<float>(test::layout::contiguous, 2, 2, 64, 300, red, dom, 0, false, seed++);   // float4 loads
      check_decode<fp16>(test::layout::paged_hnd, 2, 3, 36, 301, red, dom, 5, false, seed++);     // scalar, paged
      check_decode<bf16>(test::layout::transposed, 1, 12, 64, 129, red, dom, 0, true, seed++);    // G > 8, strided
    }
}

// The logits kernel is instantiated per group bucket (1, 2, 4, 8; larger groups in chunks of
// 8), per key load (float4, 16-byte 16-bit, 8-byte fp8, scalar) and per pass count. Every
// instantiation runs here against the CPU, with one and two 128-channel panels (queries
// resident in registers or reloaded per panel), partial panels, absent group members
// (G = 3, 5, 12) and the paged and strided layouts.
TEST_CASE("GPU decode observation: every group bucket, key load and layout", "[gpu][gpu_decode]") {
  using test::layout;
  const auto mean = gqa_reduction::mean, sum = gqa_reduction::sum, max = gqa_reduction::max;
  const auto vis = softmax_domain::visible, cand = softmax_domain::candidates;
  std::uint64_t seed = 2600;
  SECTION("G = 1") {
    check_decode<float>(layout::contiguous, 2, 1, 128, 300, mean, vis, 0, false, seed++);  // float4
    check_decode<bf16>(layout::paged_nhd, 3, 1, 64, 270, max, vis, 7, true, seed++);       // 16-byte
    check_decode<fp16>(layout::transposed, 1, 1, 80, 260, sum, cand, 4, false, seed++);    // scalar
    check_decode<bf16, fp8_e4m3>(layout::paged_hnd, 2, 1, 128, 290, mean, vis, 0, false, seed++, 0.05f);
  }
  SECTION("G = 2") {
    check_decode<bf16>(layout::contiguous, 2, 2, 128, 300, mean, vis, 3, false, seed++);
    check_decode<fp16>(layout::transposed, 2, 2, 64, 280, max, vis, 0, false, seed++);
    check_decode<float>(layout::paged_hnd, 1, 2, 200, 260, sum, vis, 0, true, seed++);  // two panels
    check_decode<fp16, fp8_e5m2>(layout::contiguous, 2, 2, 64, 270, mean, cand, 9, false, seed++, 2.0f);
  }
  SECTION("G = 3 and 4 (bucket 4)") {
    check_decode<float>(layout::paged_hnd, 2, 3, 128, 300, mean, vis, 0, false, seed++);
    check_decode<bf16, fp8_e4m3>(layout::contiguous, 2, 3, 128, 290, sum, vis, 5, false, seed++, 0.0371f);
    check_decode<bf16>(layout::transposed, 1, 4, 128, 280, max, vis, 0, true, seed++);
    check_decode<fp16, fp8_e5m2>(layout::paged_nhd, 2, 4, 64, 300, mean, vis, 0, false, seed++, 1.0f);
    check_decode<bf16>(layout::paged_nhd, 2, 4, 256, 270, mean, vis, 0, false, seed++);  // two panels
  }
  SECTION("G = 5 and 8 (bucket 8)") {
    check_decode<bf16>(layout::contiguous, 2, 5, 200, 270, mean, vis, 0, false, seed++);  // two panels
    check_decode<bf16>(layout::paged_hnd, 2, 8, 128, 300, sum, vis, 2, false, seed++);
    check_decode<float>(layout::transposed, 1, 8, 96, 260, max, cand, 6, false, seed++);
    check_decode<bf16, fp8_e4m3>(layout::paged_nhd, 1, 8, 128, 280, mean, vis, 0, true, seed++, 3.5f);
  }
  SECTION("G = 12 and 16 (chunks of 8)") {
    check_decode<fp16>(layout::contiguous, 1, 12, 128, 270, mean, vis, 0, false, seed++);
    check_decode<bf16, fp8_e4m3>(layout::paged_hnd, 1, 12, 256, 260, max, vis, 0, false, seed++, 0.5f);
    check_decode<float>(layout::paged_nhd, 1, 16, 36, 280, sum, vis, 3, false, seed++);  // partial panel
  }
  SECTION("fp8 rows of d % 16 == 8 (8-byte loads)") {
    check_decode<bf16, fp8_e4m3>(layout::contiguous, 2, 4, 40, 290, mean, vis, 3, false, seed++, 0.5f);
    check_decode<fp16, fp8_e5m2>(layout::paged_nhd, 1, 2, 72, 270, max, cand, 0, true, seed++, 2.0f);
    check_decode<bf16, fp8_e4m3>(layout::paged_hnd, 2, 8, 136, 260, sum, vis, 0, false, seed++, 1.0f);  // 2 panels
  }
  SECTION("fp8 rows that do not allow 8-byte loads (scalar)") {
    check_decode<fp16, fp8_e5m2>(layout::paged_hnd, 2, 3, 45, 270, mean, vis, 0, false, seed++, 0.25f);
    check_decode<bf16, fp8_e4m3>(layout::transposed, 1, 8, 64, 260, sum, vis, 0, false, seed++, 1.0f);
  }
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  SECTION("NaN key elements behave as on the CPU") {
    check_decode<bf16>(layout::contiguous, 2, 4, 128, 300, mean, vis, 0, false, seed++, 1.0f, nan);
    check_decode<fp16>(layout::paged_nhd, 2, 2, 64, 280, max, cand, 4, false, seed++, 1.0f, nan);
    check_decode<float>(layout::transposed, 1, 8, 32, 270, sum, vis, 0, false, seed++, 1.0f, nan);
    check_decode<float>(layout::contiguous, 1, 1, 128, 260, mean, vis, 0, false, seed++, 1.0f, nan);
  }
  // An infinite logit makes its head's softmax NaN (inf - inf) in the CPU library's scores, and
  // so on the GPU: the rows of that KV head are NaN, the other heads' finite.
  SECTION("+inf and -inf key elements behave as on the CPU") {
    check_decode<bf16>(layout::contiguous, 2, 4, 128, 300, mean, vis, 0, false, seed++, 1.0f, inf);
    check_decode<fp16>(layout::paged_nhd, 2, 2, 64, 280, max, cand, 4, false, seed++, 1.0f, inf);
    check_decode<float>(layout::transposed, 1, 8, 32, 270, sum, vis, 0, false, seed++, 1.0f, -inf);
    check_decode<fp16, fp8_e5m2>(layout::paged_hnd, 2, 2, 64, 270, mean, vis, 0, false, seed++, 2.0f, inf);
  }
}

TEST_CASE("GPU decode observation: a block id outside the pool is flagged and its keys get no attention",
          "[gpu][gpu_decode]") {
  const std::int64_t hkv = 2, group = 4, hq = hkv * group, d = 128, l = 300;
  for (test::layout lay : {test::layout::paged_nhd, test::layout::paged_hnd}) {
    INFO(test::name(lay));
    auto keys = test::make_cache<bf16>(lay, hkv, l, d, test::normal(static_cast<std::size_t>(hkv * l * d), 2700));
    keys.table[1] = 100000;
    const std::int64_t bs = keys.block_size;
    auto q = test::make_queries<bf16>(hq, 1, d, test::normal(static_cast<std::size_t>(hq * d), 2701, 1.5), {l});
    gpu::decode_step step;
    step.gqa = gqa_reduction::sum;
    step.eta = 0.0f;
    const kvevict::cache_view<const bf16> kv = keys.view;
    const auto s = gpu::decode_observation(kvevict::query_view<const bf16>(q.view), gpu::buffer_of(q.buffer), kv,
                                           gpu::buffer_of(keys.buffer), keys.table, step,
                                           std::vector<float>(static_cast<std::size_t>(hkv * l), NAN));
    REQUIRE(s.st.ok());
    REQUIRE(s.flags == kvevict::cuda::flag_block_id_out_of_range);
    for (std::int64_t h = 0; h < hkv; ++h) {
      double row = 0;
      for (std::int64_t j = 0; j < l; ++j) {
        const float x = s.state[static_cast<std::size_t>(h * l + j)];
        INFO("head " << h << " key " << j);
        if (j / bs == 1) {
          REQUIRE(x == 0.0f);
        } else {
          REQUIRE(x > 0.0f);
        }
        row += x;
      }
      REQUIRE(std::fabs(row - static_cast<double>(group)) < 1e-3);  // G softmaxes over the other keys
    }
  }
}

namespace {
/// fp8 caches with a dequantisation scale and queries in the model's 16-bit type: GPU
/// scores against the CPU's (which the unit suite checks against the scalar double
/// reference for fp8), and one decode step against the CPU's decode observation.
template <class Q, class K>
void check_fp8(test::layout lay, std::int64_t hkv, std::int64_t group, std::int64_t d, std::int64_t l, std::int64_t w,
               float scale, const kvevict::scoring_params& params, std::uint64_t seed) {
  const std::int64_t hq = hkv * group;
  auto keys = test::make_cache<K>(lay, hkv, l, d, test::normal(static_cast<std::size_t>(hkv * l * d), seed, 4.0));
  keys.view.scale = scale;
  auto q = test::make_queries<Q>(hq, w, d, test::normal(static_cast<std::size_t>(hq * w * d), seed + 1, 1.5),
                                 tail_positions(l, w));
  const kvevict::query_view<const Q> qv = q.view;
  const kvevict::cache_view<const K> kv = keys.view;
  std::vector<float> cpu(static_cast<std::size_t>(hkv * l));
  kvevict::workspace ws(kvevict::observation_scores_workspace_size({hq, hkv, d, l, w}, params));
  REQUIRE(kvevict::observation_scores(qv, kv, params, {cpu.data(), hkv, l, l}, ws).ok());
  const auto g =
      gpu::observation_scores(qv, gpu::buffer_of(q.buffer), kv, gpu::buffer_of(keys.buffer), keys.table, params, {});
  INFO(test::name(lay) << " scale " << scale << " status " << g.st.message());
  REQUIRE(g.st.ok());
  REQUIRE(g.flags == 0);
  require_close(g.scores, cpu, hkv, l);

  // One decode step (the last observation as the decode query) on a NaN-filled state.
  auto q1 = test::make_queries<Q>(hq, 1, d, test::normal(static_cast<std::size_t>(hq * d), seed + 2, 1.5), {l + 2});
  const kvevict::query_view<const Q> qv1 = q1.view;
  gpu::decode_step step;
  step.eta = 0.0f;
  const auto s1 = gpu::decode_observation(qv1, gpu::buffer_of(q1.buffer), kv, gpu::buffer_of(keys.buffer), keys.table,
                                          step, std::vector<float>(static_cast<std::size_t>(hkv * l), NAN));
  REQUIRE(s1.st.ok());
  const auto want = cpu_decode_rows(qv1, kv, gqa_reduction::mean, softmax_domain::visible, 0, {});
  require_close(s1.state, want, hkv, l);
}
}  // namespace

TEST_CASE("GPU scoring of fp8 caches with a dequantisation scale", "[gpu][gpu_scoring]") {
  std::uint64_t seed = 1900;
  for (test::layout lay : test::kAllLayouts) {
    check_fp8<bf16, fp8_e4m3>(lay, 2, 4, 64, 150, 8, 0.0371f, kKvpress, seed++);
    check_fp8<fp16, fp8_e5m2>(lay, 1, 3, 45, 101, 5, 1.0f, kKvpress, seed++);
  }
  check_fp8<bf16, fp8_e4m3>(test::layout::contiguous, 2, 2, 128, 700, 16, 3.5f, kKvpress,
                            seed++);  // d = 128, 11 key tiles
}

namespace {
/// cuda::key_norm_scores, streaming_scores or keydiff_scores against kvevict::knorm /
/// streaming_llm / keydiff::score on the same keys: the same bits, NaN where the CPU has NaN.
/// `param` is the protected tail (KNorm, KeyDiff) or the sinks (StreamingLLM).
template <class T>
void check_key_scores(test::layout lay, gpu::key_scorer_kind kind, std::int64_t heads, std::int64_t tokens,
                      std::int64_t dim, std::int64_t param, float scale, std::uint64_t seed, bool nan_key = true) {
  std::vector<double> kd = test::rounded<T>(test::normal(static_cast<std::size_t>(heads * tokens * dim), seed, 3.0));
  if (nan_key && kd.size() > 8) kd[kd.size() / 3] = std::numeric_limits<double>::quiet_NaN();  // one NaN key
  if (!nan_key && tokens > 2)
    for (std::int64_t c = 0; c < dim; ++c) kd[static_cast<std::size_t>(tokens / 2 * dim + c)] = 0.0;  // a zero key
  auto keys = test::make_cache<T>(lay, heads, tokens, dim, kd);
  keys.view.scale = scale;
  const kvevict::cache_view<const T> kv = keys.view;
  std::vector<float> cpu(static_cast<std::size_t>(heads * tokens), 0.0f);
  using Q = kvevict::default_query_type_t<T>;
  kvevict::layer_inputs<T, Q> in;
  in.keys = kv;
  const kvevict::score_view out{cpu.data(), heads, tokens, tokens};
  const kvevict::layer_shape shape{heads, heads, dim, tokens, 1};
  if (kind == gpu::key_scorer_kind::knorm) {
    kvevict::knorm_config c;
    c.protected_tail = param;
    const kvevict::knorm<T, Q> policy(c);
    kvevict::workspace ws(policy.workspace_size(shape));
    REQUIRE(policy.score(in, out, ws).ok());
  } else if (kind == gpu::key_scorer_kind::streaming_llm) {
    kvevict::streaming_llm_config c;
    c.sinks = param;
    REQUIRE(kvevict::streaming_llm<T, Q>(c).score(in, out).ok());
  } else {
    kvevict::keydiff_config c;
    c.protected_tail = param;
    const kvevict::keydiff<T, Q> policy(c);
    kvevict::workspace ws(policy.workspace_size(shape));
    REQUIRE(policy.score(in, out, ws).ok());
  }
  const gpu::scores_result g = gpu::key_scores(kv, gpu::buffer_of(keys.buffer), keys.table, kind, param);
  INFO(test::name(lay) << " L " << tokens << " d " << dim << " status " << g.st.message());
  REQUIRE(g.st.ok());
  REQUIRE(g.flags == 0);
  require_same_bits(g.scores, cpu);
}
}  // namespace

TEST_CASE("GPU KNorm and StreamingLLM scores equal the CPU policies' bit for bit", "[gpu][gpu_scoring]") {
  using kind = gpu::key_scorer_kind;
  std::uint64_t seed = 2300;
  for (test::layout lay : test::kAllLayouts) {
    check_key_scores<float>(lay, kind::knorm, 2, 300, 64, 5, 1.0f, seed++);
    check_key_scores<bf16>(lay, kind::knorm, 3, 257, 40, 0, 1.0f, seed++);
    check_key_scores<fp16>(lay, kind::knorm, 1, 70, 128, 70, 1.0f, seed++);  // all protected
    check_key_scores<fp8_e5m2>(lay, kind::knorm, 2, 129, 24, 3, 0.0371f, seed++);
    check_key_scores<bf16>(lay, kind::streaming_llm, 2, 300, 16, 4, 1.0f, seed++);
    check_key_scores<float>(lay, kind::streaming_llm, 1, 9, 8, 20, 1.0f, seed++);  // every token a sink
  }
  check_key_scores<bf16>(test::layout::contiguous, kind::knorm, 2, 0, 16, 0, 1.0f, seed++);  // empty
  check_key_scores<bf16>(test::layout::contiguous, kind::streaming_llm, 2, 0, 16, 4, 1.0f, seed++);
}

TEST_CASE("GPU KeyDiff scores equal kvevict::keydiff's bit for bit", "[gpu][gpu_scoring]") {
  using kind = gpu::key_scorer_kind;
  std::uint64_t seed = 2400;
  // Lengths across the anchor's chunks of 256 (one partial chunk, exactly two, more than
  // two), d above the channel block of 128, a zero key (the floors), a NaN key (its head NaN).
  for (test::layout lay : test::kAllLayouts) {
    check_key_scores<float>(lay, kind::keydiff, 2, 300, 64, 5, 1.0f, seed++, false);
    check_key_scores<bf16>(lay, kind::keydiff, 3, 512, 40, 0, 1.0f, seed++);
    check_key_scores<fp16>(lay, kind::keydiff, 1, 70, 136, 70, 1.0f, seed++, false);  // all protected
    check_key_scores<fp8_e5m2>(lay, kind::keydiff, 2, 601, 24, 3, 0.0371f, seed++, false);
  }
  check_key_scores<bf16>(test::layout::contiguous, kind::keydiff, 2, 1, 16, 0, 1.0f, seed++, false);  // one token
  check_key_scores<bf16>(test::layout::contiguous, kind::keydiff, 2, 0, 16, 0, 1.0f, seed++);         // empty
}

namespace {
/// One DapQ re-rotation on the device against kvevict::dapq_rerotate: queries [Hq, W, d] in a
/// query-major buffer with padded rows (and every second element when `spread`), positions as
/// int32 or int64.
template <class QT>
void check_rerotation(const kvevict::rope_config& rope, std::int64_t heads, std::int64_t window, std::int64_t delta,
                      bool spread, bool narrow_positions, std::uint64_t seed) {
  const std::int64_t d = rope.head_dim, step = spread ? 2 : 1, row = d * step + 3;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<QT> buf(static_cast<std::size_t>(window * heads * row));
  for (QT& x : buf) x = kvevict::from_float<QT>(normal(rng));
  std::vector<std::int64_t> pos64(static_cast<std::size_t>(window));
  std::vector<std::int32_t> pos32(static_cast<std::size_t>(window));
  for (std::int64_t t = 0; t < window; ++t) {
    pos64[static_cast<std::size_t>(t)] = 1000 + 3 * t;
    pos32[static_cast<std::size_t>(t)] = static_cast<std::int32_t>(1000 + 3 * t);
  }
  kvevict::query_view<const QT> q;
  q.data = buf.data();
  q.num_heads = heads;
  q.num_queries = window;
  q.head_dim = d;
  q.head_stride = row;
  q.query_stride = heads * row;
  q.dim_stride = step;
  if (narrow_positions) {
    q.positions = pos32.data();
  } else {
    q.positions = pos64.data();
  }
  std::vector<QT> want(static_cast<std::size_t>(heads * window * d));
  std::vector<std::int64_t> want_pos(static_cast<std::size_t>(window));
  REQUIRE(kvevict::dapq_rerotate(q, rope, delta, want.data(), want_pos.data()).ok());
  const auto got = gpu::dapq_rerotate(q, gpu::buffer_of(buf), rope, delta);
  INFO("status " << got.st.message());
  REQUIRE(got.st.ok());
  REQUIRE(got.positions == want_pos);
  for (std::size_t i = 0; i < want.size(); ++i) {
    INFO("element " << i);
    const float w = kvevict::to_float(want[i]);
    REQUIRE(std::memcmp(&got.queries[i], &w, sizeof(float)) == 0);
  }
}
}  // namespace

TEST_CASE("GPU DapQ re-rotation equals the CPU's for every RoPE convention", "[gpu][gpu_scoring]") {
  std::uint64_t seed = 4100;
  for (const kvevict::rope_pairing pairing : {kvevict::rope_pairing::neox, kvevict::rope_pairing::gptj})
    for (const std::int64_t rotary : {std::int64_t{0}, std::int64_t{24}})
      for (const bool llama3 : {false, true}) {
        kvevict::rope_config rope;
        rope.head_dim = 40;
        rope.rotary_dim = rotary;
        rope.pairing = pairing;
        rope.theta = llama3 ? 500000.0 : 10000.0;
        rope.llama3.enabled = llama3;
        rope.llama3.original_max_position = 64.0;  // pairs on both sides of the smoothing band
        INFO("pairing " << static_cast<int>(pairing) << " rotary_dim " << rotary << " llama3 " << llama3);
        check_rerotation<float>(rope, 4, 6, 6, false, false, seed++);
        check_rerotation<kvevict::bf16>(rope, 4, 5, 5, true, true, seed++);
        check_rerotation<kvevict::fp16>(rope, 2, 3, 100003, false, true, seed++);  // large angles
      }
  kvevict::rope_config wide;  // d = 128, the Llama shape
  check_rerotation<kvevict::bf16>(wide, 8, 32, 32, false, false, seed++);
  // Refused before anything runs: a RoPE of another head_dim, and no table.
  kvevict::rope_config other;
  other.head_dim = 64;
  std::vector<float> buf(4 * 2 * 128);
  std::vector<std::int64_t> pos{7, 8};
  const auto q = kvevict::contiguous_queries<const float>(buf.data(), 4, 2, 128, pos.data());
  const auto bad = gpu::dapq_rerotate(q, gpu::buffer_of(buf), other, 2);
  REQUIRE(bad.st.code() == kvevict::errc::invalid_shape);
  REQUIRE(std::string(bad.st.argument()) == "rope.head_dim");
}

TEST_CASE("GPU ChunkKV chunk scores follow kvevict::chunkkv's operations bit for bit", "[gpu][gpu_scoring]") {
  // kvevict::chunkkv::score after its base, in float, in its order: heads ascending, then the
  // chunk's tokens; one division; the tail untouched. (The compressor suite compares the real
  // CPU class through whole calls.)
  std::uint64_t seed = 2400;
  struct chunk_case {
    std::int64_t rows, cols, tail, chunk;
  };
  for (const chunk_case& c :
       {chunk_case{2, 61, 6, 5}, chunk_case{1, 20, 0, 20}, chunk_case{4, 300, 32, 7}, chunk_case{3, 9, 9, 4},
        chunk_case{2, 17, 3, 100}, chunk_case{8, 4100, 8, 20}, chunk_case{1, 0, 0, 3}}) {
    std::vector<double> d = test::normal(static_cast<std::size_t>(c.rows * c.cols), seed++, 2.0);
    std::vector<float> scores(d.begin(), d.end());
    for (std::int64_t h = 0; h < c.rows; ++h)
      for (std::int64_t j = c.cols - std::min(c.tail, c.cols); j < c.cols; ++j)
        scores[static_cast<std::size_t>(h * c.cols + j)] = kInf;
    if (c.cols > 10) scores[5] = std::numeric_limits<float>::quiet_NaN();  // its chunk becomes NaN
    std::vector<float> want = scores;
    const std::int64_t cand = std::max<std::int64_t>(0, c.cols - c.tail);
    for (std::int64_t c0 = 0; c0 < cand; c0 += c.chunk) {
      const std::int64_t c1 = std::min(c0 + c.chunk, cand);
      float sum = 0.0f;
      for (std::int64_t h = 0; h < c.rows; ++h)
        for (std::int64_t j = c0; j < c1; ++j) sum += scores[static_cast<std::size_t>(h * c.cols + j)];
      const float mean = sum / static_cast<float>(c1 - c0);
      for (std::int64_t h = 0; h < c.rows; ++h)
        for (std::int64_t j = c0; j < c1; ++j) want[static_cast<std::size_t>(h * c.cols + j)] = mean;
    }
    const gpu::scores_result g = gpu::chunk_scores(scores, c.rows, c.cols, c.tail, c.chunk);
    INFO("rows " << c.rows << " cols " << c.cols << " tail " << c.tail << " chunk " << c.chunk << ": "
                 << g.st.message());
    REQUIRE(g.st.ok());
    require_same_bits(g.scores, want);
  }
  REQUIRE(gpu::chunk_scores({1.0f}, 1, 1, 0, 0).st.code() == kvevict::errc::invalid_argument);
  REQUIRE(std::string(gpu::chunk_scores({1.0f}, 1, 1, 0, 0).st.argument()) == "chunk_length");
  REQUIRE(std::string(gpu::chunk_scores({1.0f}, 1, 1, -1, 2).st.argument()) == "protected_tail");
}

namespace {
/// The GPU batch of `seqs` (one launch per kernel) against the CPU's observation_scores of
/// each sequence (not against the single-sequence GPU call, which shares its kernels).
template <class T>
void check_obs_batch_cpu(const std::vector<gpu::batch_sequence<T, T>>& seqs, const kvevict::scoring_params& params) {
  const auto got = gpu::observation_scores_batch(seqs, params);
  INFO("status " << got.st.message());
  REQUIRE(got.st.ok());
  REQUIRE(got.flags == 0);
  REQUIRE(got.scores.size() == seqs.size());
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const gpu::batch_sequence<T, T>& b = seqs[i];
    const std::int64_t hkv = b.k.num_heads, l = b.k.num_tokens;
    INFO("seqs[" << i << "]: L " << l);
    std::vector<float> cpu(static_cast<std::size_t>(hkv * l), 0.0f);
    kvevict::observation_inputs cin;
    cin.key_positions = b.in.key_positions.empty() ? nullptr : b.in.key_positions.data();
    cin.lse = b.in.lse.empty() ? nullptr : b.in.lse.data();
    kvevict::workspace ws(
        kvevict::observation_scores_workspace_size({b.q.num_heads, hkv, b.k.head_dim, l, b.q.num_queries}, params));
    REQUIRE(kvevict::observation_scores(b.q, b.k, params, {cpu.data(), hkv, l, l}, ws, cin).ok());
    require_close(got.scores[i], cpu, hkv, l);
  }
}
}  // namespace

// More than 16 key tiles (64 keys each; 256 for decode) in every scoring kernel: the row-LSE
// fold strides its 32 lanes over a row's tiles and then reduces across the warp, so with 16
// tiles or fewer lanes 16-31 hold nothing and half of that butterfly is never exercised.
// Small heads keep each case cheap; sanitizer runs (KVEVICT_GPU_SWEEP_STRIDE > 1) keep one
// case per kernel family.
TEST_CASE("GPU scoring past 16 key tiles (L > 1024) in every kernel variant", "[gpu][gpu_scoring]") {
  const bool trimmed = sweep_stride() > 1;
  kvevict::scoring_params p = kKvpress;
  p.protected_tail = 4;
  SECTION("observation scores: CUDA cores, tensor cores, mixed types, per-head tables, engine LSE") {
    const shape s{2, 2, 16, 1100, 4};
    obs_case c;
    c.qpos = tail_positions(s.tokens, s.window);
    check_obs<float, float>(s, test::layout::paged_per_head, p, c, 3100);                  // CUDA cores, computed LSE
    check_obs<bf16, bf16>({1, 3, 24, 1350, 4}, test::layout::paged_per_head, p, c, 3101);  // tensor cores
    if (!trimmed) {
      check_obs<fp16, fp16>(s, test::layout::transposed, p, c, 3102);
      check_obs<float, bf16>(s, test::layout::contiguous, p, c, 3103);
      obs_case e = c;
      e.engine_lse = true;  // one pass: no row LSE
      check_obs<bf16, bf16>(s, test::layout::paged_hnd, p, e, 3104);
    }
  }
  SECTION("fp8 keys with a scale") {
    check_fp8<bf16, fp8_e4m3>(test::layout::paged_per_head, 1, 2, 32, 1090, 4, 0.0371f, p, 3110);
    if (!trimmed) check_fp8<fp16, fp8_e5m2>(test::layout::contiguous, 1, 2, 32, 1170, 4, 2.0f, p, 3111);
  }
  SECTION("a batch of long sequences in one launch per kernel") {
    const std::int64_t hkv = 2, group = 2, d = 16, w = 4;
    const std::int64_t lengths[] = {1100, 70, 1300};
    const test::layout lays[] = {test::layout::paged_per_head, test::layout::contiguous, test::layout::paged_nhd};
    std::vector<test::test_cache<bf16>> caches;
    std::vector<test::test_queries<bf16>> queries;
    caches.reserve(3);
    queries.reserve(3);
    std::vector<gpu::batch_sequence<bf16, bf16>> batch;
    for (std::size_t i = 0; i < 3; ++i) {
      const std::int64_t l = lengths[i];
      caches.push_back(
          test::make_cache<bf16>(lays[i], hkv, l, d, test::normal(static_cast<std::size_t>(hkv * l * d), 3120 + i)));
      queries.push_back(test::make_queries<bf16>(hkv * group, w, d,
                                                 test::normal(static_cast<std::size_t>(hkv * group * w * d), 3130 + i),
                                                 tail_positions(l, w)));
      gpu::batch_sequence<bf16, bf16> b;
      b.q = queries.back().view;
      b.qbuf = gpu::buffer_of(queries.back().buffer);
      b.k = caches.back().view;
      b.kbuf = gpu::buffer_of(caches.back().buffer);
      b.table = &caches.back().table;
      batch.push_back(b);
    }
    check_obs_batch_cpu(batch, p);
  }
  SECTION("decode: two passes past 16 tiles of 256 keys, and the one-pass engine-LSE step") {
    check_decode<bf16>(test::layout::paged_per_head, 1, 2, 32, 4400, gqa_reduction::mean, softmax_domain::visible, 8,
                       false, 3140);
    if (!trimmed)
      check_decode<float>(test::layout::contiguous, 1, 4, 32, 4200, gqa_reduction::max, softmax_domain::candidates, 0,
                          true, 3141);
  }
}

namespace {
/// A decode_plan over a cache of `capacity` tokens, stepped through `lengths`, directly and
/// through a replayed CUDA graph: every valid step equals decode_observation over a view of
/// that many tokens applied to the previous state, bit for bit, and leaves the state's
/// columns past the step's candidates untouched; an invalid length changes nothing, is
/// flagged and not counted.
template <class T>
void check_decode_plan(test::layout lay, std::int64_t hkv, std::int64_t group, std::int64_t d, std::int64_t capacity,
                       std::int64_t tail, bool engine_lse, bool unsorted_kpos, std::uint64_t seed) {
  const std::int64_t hq = hkv * group, c = std::max<std::int64_t>(0, capacity - tail);
  const auto kd = test::normal(static_cast<std::size_t>(hkv * capacity * d), seed);
  auto keys = test::make_cache<T>(lay, hkv, capacity, d, kd);
  std::vector<std::int64_t> kpos;
  if (unsorted_kpos)
    for (std::int64_t j = 0; j < capacity; ++j) kpos.push_back((j * 7) % capacity);
  auto q =
      test::make_queries<T>(hq, 1, d, test::normal(static_cast<std::size_t>(hq * d), seed + 1, 1.5), {capacity - 40});
  const kvevict::cache_view<const T> kv = keys.view;
  const kvevict::query_view<const T> qv = q.view;
  gpu::decode_step step;
  step.eta = 0.5f;
  step.protected_tail = tail;
  step.key_positions = kpos;
  if (engine_lse)
    for (std::int64_t h = 0; h < hq; ++h) step.lse.push_back(1.5f + 0.25f * static_cast<float>(h % 5));
  const auto normal = test::normal(static_cast<std::size_t>(hkv * c), seed + 2);
  const std::vector<float> start(normal.begin(), normal.end());
  const auto over = static_cast<std::int32_t>(capacity + 1);
  const std::vector<std::int32_t> lengths = {
      static_cast<std::int32_t>(capacity / 2), 1, over,
      static_cast<std::int32_t>(capacity - 1), 0, static_cast<std::int32_t>(capacity)};
  for (bool graph : {false, true}) {
    INFO((graph ? "graph replay" : "direct runs"));
    const auto r = gpu::decode_plan_steps(qv, gpu::buffer_of(q.buffer), kv, gpu::buffer_of(keys.buffer), keys.table,
                                          step, lengths, start, graph);
    INFO("status " << r.st.message());
    REQUIRE(r.st.ok());
    REQUIRE(r.states.size() == lengths.size());
    REQUIRE(r.flags == kvevict::cuda::flag_length_out_of_range);
    REQUIRE(r.steps == static_cast<std::int32_t>(lengths.size()) - 1);
    std::vector<float> prev = start;
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      const std::int64_t n = lengths[i];
      INFO("step " << i << ": " << n << " tokens");
      const std::vector<float>& got = r.states[i];
      const std::int64_t cn = n > capacity ? 0 : std::max<std::int64_t>(0, n - tail);
      if (cn > 0) {
        kvevict::cache_view<const T> kn = kv;
        kn.num_tokens = n;
        gpu::decode_step sn = step;
        if (!kpos.empty()) sn.key_positions.assign(kpos.begin(), kpos.begin() + n);
        std::vector<float> compact;
        for (std::int64_t h = 0; h < hkv; ++h)
          compact.insert(compact.end(), prev.begin() + h * c, prev.begin() + h * c + cn);
        const auto want = gpu::decode_observation(qv, gpu::buffer_of(q.buffer), kn, gpu::buffer_of(keys.buffer),
                                                  keys.table, sn, compact);
        REQUIRE(want.st.ok());
        for (std::int64_t h = 0; h < hkv; ++h)
          for (std::int64_t j = 0; j < cn; ++j) {
            const float a = got[static_cast<std::size_t>(h * c + j)],
                        b = want.state[static_cast<std::size_t>(h * cn + j)];
            INFO("head " << h << " candidate " << j);
            REQUIRE(std::memcmp(&a, &b, sizeof(float)) == 0);
          }
      }
      for (std::int64_t h = 0; h < hkv; ++h)
        for (std::int64_t j = cn; j < c; ++j) {
          INFO("head " << h << " untouched candidate " << j);
          REQUIRE(std::memcmp(&got[static_cast<std::size_t>(h * c + j)], &prev[static_cast<std::size_t>(h * c + j)],
                              sizeof(float)) == 0);
        }
      prev = got;
    }
  }
}
}  // namespace

TEST_CASE("GPU decode plan: graph-captured steps over a growing cache", "[gpu][gpu_decode]") {
  // Capacities over several 256-key tiles; lengths fill some tiles partially and leave others
  // empty, so the step's extent comes from the device.
  check_decode_plan<bf16>(test::layout::contiguous, 2, 4, 64, 600, 0, false, false, 1300);
  check_decode_plan<bf16>(test::layout::paged_nhd, 2, 4, 64, 600, 5, true, true, 1301);
  check_decode_plan<fp16>(test::layout::paged_hnd, 1, 3, 36, 530, 5, false, true, 1302);
  check_decode_plan<float>(test::layout::paged_int64, 2, 2, 32, 300, 0, true, false, 1303);
}

TEST_CASE("GPU decode plan: init validates once, run refuses an unplanned plan", "[gpu][gpu_errors]") {
  const auto kd = test::normal(static_cast<std::size_t>(2 * 100 * 32), 1400);
  auto keys = test::make_cache<float>(test::layout::contiguous, 2, 100, 32, kd);
  auto q = test::make_queries<float>(4, 1, 32, test::normal(static_cast<std::size_t>(4 * 32), 1401), {90});
  gpu::decode_step step;
  const std::vector<float> start(2 * 100, 0.0f);
  // A capacity that leaves no candidate: refused, naming the token count.
  step.protected_tail = 100;
  const auto none = gpu::decode_plan_steps(kvevict::query_view<const float>(q.view), gpu::buffer_of(q.buffer),
                                           kvevict::cache_view<const float>(keys.view), gpu::buffer_of(keys.buffer),
                                           keys.table, step, {50}, std::vector<float>(), false);
  REQUIRE(none.st.code() == kvevict::errc::invalid_shape);
  REQUIRE(std::string(none.st.message()).find("keys.num_tokens") != std::string::npos);
  REQUIRE(none.states.empty());
  // Host checks of decode_observation happen at init.
  step.protected_tail = 0;
  step.eta = 2.0f;
  const auto bad = gpu::decode_plan_steps(kvevict::query_view<const float>(q.view), gpu::buffer_of(q.buffer),
                                          kvevict::cache_view<const float>(keys.view), gpu::buffer_of(keys.buffer),
                                          keys.table, step, {50}, start, false);
  REQUIRE(bad.st.code() == kvevict::errc::invalid_argument);
  REQUIRE(std::string(bad.st.message()).find("p.eta") != std::string::npos);
  REQUIRE(bad.states.empty());
  const auto st = gpu::decode_plan_unplanned_run();
  REQUIRE(st.code() == kvevict::errc::invalid_argument);
  REQUIRE(std::string(st.message()).find("plan") != std::string::npos);
}

namespace {
std::vector<float> score_matrix(std::int64_t rows, std::int64_t cols, std::uint64_t seed, int kind) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(rows * cols));
  for (auto& x : v) {
    x = u(rng);
    if (kind == 1) x = std::round(x * 3.0f);  // heavy ties
    if (kind == 2) {
      const auto r = rng() % 8;
      if (r == 0) x = std::numeric_limits<float>::quiet_NaN();
      if (r == 1) x = kInf;
      if (r == 2) x = -kInf;
      if (r == 3) x = -0.0f;
      if (r == 4) x = 0.0f;
    }
    if (kind == 3) x = 0.25f;  // all equal
  }
  return v;
}

void check_select(const std::vector<float>& scores, std::int64_t rows, std::int64_t cols, kvevict::budget b,
                  const std::vector<std::int64_t>& head_budgets, const kvevict::selection_params& params) {
  std::int64_t capacity = 0;
  if (head_budgets.empty()) {
    capacity = kvevict::select_capacity(rows, cols, b, params);
  } else {
    for (std::int64_t hb : head_budgets) capacity += kvevict::tokens_kept(hb, cols, params);
  }
  kvevict::keep_list cpu(rows, capacity);
  kvevict::workspace ws(kvevict::select_workspace_size(cols));
  const kvevict::const_score_view sv{scores.data(), rows, cols, cols};
  if (head_budgets.empty()) {
    REQUIRE(kvevict::select(sv, b, params, cpu, ws).ok());
  } else {
    REQUIRE(kvevict::select(sv, head_budgets.data(), params, cpu, ws).ok());
  }
  const auto g = gpu::select(scores, rows, cols, b, head_budgets, params, capacity);
  INFO("status " << g.st.message());
  REQUIRE(g.st.ok());
  REQUIRE(g.flags == 0);
  for (std::int64_t h = 0; h <= rows; ++h) REQUIRE(g.offsets[static_cast<std::size_t>(h)] == cpu.view().offsets[h]);
  for (std::int64_t i = 0; i < capacity; ++i) {
    INFO("entry " << i);
    REQUIRE(g.indices[static_cast<std::size_t>(i)] == cpu.view().indices[i]);
  }
}
}  // namespace

TEST_CASE("GPU selection equals the CPU's bit for bit", "[gpu][gpu_select]") {
  std::uint64_t seed = 900;
  // Sanitizer runs (KVEVICT_GPU_SWEEP_STRIDE > 1) select inside the 33,000-candidate rows only
  // (budget cols / 3); the edge budgets run on the smaller rows.
  const bool trimmed = sweep_stride() > 1;
  for (std::int64_t cols : {0, 1, 5, 100, 4095, 4097, 33000})
    for (int kind = 0; kind < 4; ++kind)
      for (std::int64_t budget : {std::int64_t{0}, std::int64_t{1}, cols / 3, cols - 1, cols + 5})
        for (auto mode : {kvevict::protected_mode::inside_budget, kvevict::protected_mode::on_top_of_budget}) {
          if (budget < 0) continue;
          if (trimmed && cols > 4097 && budget != cols / 3) {
            ++seed;
            continue;
          }
          INFO("cols " << cols << " kind " << kind << " budget " << budget << " mode " << int(mode));
          const std::int64_t rows = 3;
          const auto scores = score_matrix(rows, cols, seed++, kind);
          check_select(scores, rows, cols, kvevict::budget::tokens(budget), {},
                       {std::min<std::int64_t>(7, cols), mode});
        }
}

TEST_CASE("GPU selection: ratios, per-row budgets, many rows", "[gpu][gpu_select]") {
  SECTION("compression ratio") {
    const auto scores = score_matrix(8, 3000, 1, 0);
    check_select(scores, 8, 3000, kvevict::budget::ratio(0.7), {}, {32, kvevict::protected_mode::inside_budget});
  }
  SECTION("head-adaptive budgets") {
    const auto scores = score_matrix(8, 5000, 2, 1);
    check_select(scores, 8, 5000, {}, {0, 1, 100, 2048, 4999, 5000, 9000, 64},
                 {64, kvevict::protected_mode::on_top_of_budget});
  }
  SECTION("1200 rows in one launch (sequences x layers x heads)") {
    // Sanitizer runs (KVEVICT_GPU_SWEEP_STRIDE > 1) launch 300 rows: under TSan the cost is per
    // block (one per row), 75 s of the TSan stage at 1,200 with two workers on the CI machine.
    const std::int64_t rows = sweep_stride() > 1 ? 300 : 1200;
    const auto scores = score_matrix(rows, 700, 3, 2);
    check_select(scores, rows, 700, kvevict::budget::tokens(100), {}, {8, kvevict::protected_mode::inside_budget});
  }
  SECTION("per-row budgets above the capacity: offsets written, no index") {
    const auto scores = score_matrix(2, 100, 4, 0);
    const auto g = gpu::select(scores, 2, 100, {}, {50, 60}, {}, 80);
    REQUIRE(g.st.ok());
    REQUIRE((g.flags & kvevict::cuda::flag_capacity_exceeded) != 0);
    for (std::int64_t x : g.indices) REQUIRE(x == -7);
  }
  SECTION("a negative per-row budget") {
    const auto scores = score_matrix(2, 100, 5, 0);
    const auto g = gpu::select(scores, 2, 100, {}, {50, -1}, {}, 200);
    REQUIRE(g.st.ok());
    REQUIRE((g.flags & kvevict::cuda::flag_invalid_row) != 0);
    for (std::int64_t x : g.indices) REQUIRE(x == -7);
  }
}

TEST_CASE("GPU AdaKV head budgets equal the CPU's and feed the selection without a host round trip",
          "[gpu][gpu_select]") {
  std::uint64_t seed = 1500;
  struct shape_case {
    std::int64_t rows, cols, tail;
  };
  // 4 x 4,500 and 8 x 4,200: 17,972 and 33,528 candidates in the flattened row, which takes
  // the wide selection (from 16 Ki keys).
  const shape_case shapes[] = {{1, 37, 0}, {8, 300, 5}, {5, 1000, 32}, {4, 4500, 7}, {8, 4200, 9}};
  const bool trimmed = sweep_stride() > 1;
  std::size_t combination = 0;
  for (const shape_case& sc : shapes)
    for (int kind : {0, 1, 2, 3})
      for (double alpha : {0.0, 0.2, 0.5, 1.0}) {
        const std::int64_t c = sc.cols - sc.tail;
        for (std::int64_t b : {std::int64_t{0}, std::int64_t{1}, std::int64_t{7}, c / 3, c - 1, c, c + 5}) {
          // Sanitizer runs: of the two wide shapes the larger (the select's many tiles and blocks),
          // with two of the score kinds (the others run on the smaller shapes); and of the
          // (kind, alpha, budget) combinations every third (3 is prime to the 7 budgets and the
          // 16 kind-alpha pairs, so every value still meets every other).
          if (trimmed && (sc.cols == 4500 || (sc.cols > 4000 && kind > 1))) continue;
          const bool wide = sc.rows > 4 && sc.cols > 4000;  // the large shape: two budgets, two alphas, always
          if (wide && ((b != c / 3 && b != c - 1) || alpha == 0.0 || alpha == 0.5)) continue;
          if (trimmed && combination++ % 3 != 0) continue;
          INFO("Hkv " << sc.rows << " L " << sc.cols << " P " << sc.tail << " kind " << kind << " alpha " << alpha
                      << " B " << b);
          const auto scores = score_matrix(sc.rows, sc.cols, seed++, kind);
          const kvevict::const_score_view sv{scores.data(), sc.rows, sc.cols, sc.cols};
          kvevict::adakv_params params;
          params.alpha = alpha;
          // The paper's rule, with and without the normalisation, and kvpress's safeguard rule:
          // all three in full runs; sanitizer runs take them in turn over the combinations kept.
          for (int variant : {0, 1, 2}) {
            if (trimmed && variant != static_cast<int>((combination / 3) % 3)) continue;
            params.rule = variant == 2 ? kvevict::adakv_rule::kvpress_safeguard : kvevict::adakv_rule::paper;
            params.normalize = variant == 1;
            INFO("variant " << variant << " (0 paper, 1 paper normalised, 2 kvpress_safeguard)");
            std::vector<std::int64_t> want(static_cast<std::size_t>(sc.rows));
            kvevict::workspace ws(kvevict::adakv_workspace_size(sc.rows, sc.cols) +
                                  kvevict::select_workspace_size(sc.cols));
            REQUIRE(kvevict::adakv_head_budgets(sv, sc.tail, b, params, want.data(), ws).ok());
            kvevict::selection_params sel;
            sel.protected_tail = sc.tail;
            std::int64_t capacity = 0;
            for (std::int64_t hb : want) capacity += kvevict::tokens_kept(hb, sc.cols, sel);
            kvevict::keep_list cpu(sc.rows, capacity);
            REQUIRE(kvevict::select(sv, want.data(), sel, cpu, ws).ok());

            const auto g = gpu::adakv(scores, sc.rows, sc.cols, b, params, sel, capacity);
            INFO("status " << g.st.message());
            REQUIRE(g.st.ok());
            REQUIRE(g.keep.flags == 0);
            REQUIRE(g.budgets == want);
            for (std::int64_t h = 0; h <= sc.rows; ++h)
              REQUIRE(g.keep.offsets[static_cast<std::size_t>(h)] == cpu.view().offsets[h]);
            for (std::int64_t i = 0; i < capacity; ++i) {
              INFO("entry " << i);
              REQUIRE(g.keep.indices[static_cast<std::size_t>(i)] == cpu.view().indices[i]);
            }
          }
        }
      }
}

TEST_CASE("GPU AdaKV head budgets: bad input is refused before anything runs", "[gpu][gpu_errors]") {
  const auto scores = score_matrix(4, 100, 1600, 0);
  kvevict::selection_params sel;
  kvevict::adakv_params normalised;  // the normalisation is the paper rule's, not kvpress's
  normalised.normalize = true;
  normalised.rule = kvevict::adakv_rule::kvpress_safeguard;
  const auto n = gpu::adakv(scores, 4, 100, 10, normalised, sel, 40);
  REQUIRE(n.st.code() == kvevict::errc::invalid_argument);
  REQUIRE(std::string(n.st.message()).find("params.normalize") != std::string::npos);
  REQUIRE(n.budgets == std::vector<std::int64_t>(4, -7));
  kvevict::adakv_params wild;
  wild.alpha = 1.5;
  const auto a = gpu::adakv(scores, 4, 100, 10, wild, sel, 40);
  REQUIRE(a.st.code() == kvevict::errc::invalid_argument);
  REQUIRE(std::string(a.st.message()).find("params.alpha") != std::string::npos);
  REQUIRE(a.budgets == std::vector<std::int64_t>(4, -7));
  kvevict::adakv_params unknown;
  unknown.rule = static_cast<kvevict::adakv_rule>(9);
  const auto r = gpu::adakv(scores, 4, 100, 10, unknown, sel, 40);
  REQUIRE(r.st.code() == kvevict::errc::invalid_argument);
  REQUIRE(std::string(r.st.message()).find("params.rule") != std::string::npos);
  REQUIRE(r.budgets == std::vector<std::int64_t>(4, -7));
  const auto b = gpu::adakv(scores, 4, 100, -1, kvevict::adakv_params{}, sel, 40);
  REQUIRE(b.st.code() == kvevict::errc::invalid_argument);
  REQUIRE(std::string(b.st.message()).find("per_head_budget") != std::string::npos);
  sel.protected_tail = -2;
  const auto t = gpu::adakv(scores, 4, 100, 10, kvevict::adakv_params{}, sel, 40);
  REQUIRE(t.st.code() == kvevict::errc::invalid_argument);
  REQUIRE(std::string(t.st.message()).find("protected_tail") != std::string::npos);
}

TEST_CASE("GPU select_rows: a ragged batch in one launch", "[gpu][gpu_select]") {
  std::vector<gpu::row_spec> rows;
  std::uint64_t seed = 77;
  for (std::int64_t len : {0, 1, 17, 4096, 4097, 10000, 70000}) {
    for (int kind = 0; kind < 3; ++kind) {
      gpu::row_spec r;
      r.scores = score_matrix(1, len, seed++, kind);
      r.budget = (len * (kind + 1)) / 5;
      r.protected_tail = kind;
      r.mode = kind == 1 ? kvevict::protected_mode::on_top_of_budget : kvevict::protected_mode::inside_budget;
      rows.push_back(r);
    }
  }
  gpu::row_spec bad;  // longer than max_length: flagged, not written
  bad.scores = score_matrix(1, 50, 1, 0);
  bad.length = 80000;
  bad.budget = 5;
  rows.push_back(bad);
  const auto g = gpu::select_rows(rows, 70000);
  REQUIRE(g.st.ok());
  REQUIRE(g.flags == kvevict::cuda::flag_invalid_row);
  for (std::size_t i = 0; i + 1 < rows.size(); ++i) {
    const auto& r = rows[i];
    const std::int64_t n = static_cast<std::int64_t>(r.scores.size());
    const auto want = ref::keep(std::vector<double>(r.scores.begin(), r.scores.end()), r.budget, r.protected_tail,
                                r.mode == kvevict::protected_mode::inside_budget);
    INFO("row " << i << " length " << n << " budget " << r.budget);
    const std::vector<std::int64_t> got(g.out[i].begin(), g.out[i].begin() + static_cast<std::ptrdiff_t>(want.size()));
    REQUIRE(got == want);
    REQUIRE(g.out[i][want.size()] == -7);  // nothing past the row's keep-list
  }
  for (std::int64_t x : g.out.back()) REQUIRE(x == -7);
}

// The wide selection (cuda/select_wide.cuh): rows cut into tiles of 4,096 keys over up to 128
// blocks each, four histogram passes as kernels, then per-block counts and emission. Its
// keep-lists must be the reference's (and select_rows'), whatever the ties, NaNs and budgets,
// with k landing inside a tile, across blocks and in a block's second tile.
TEST_CASE("GPU select_rows_wide: many blocks per row, the same keep-lists as the reference", "[gpu][gpu_select]") {
  // Sanitizer runs (KVEVICT_GPU_SWEEP_STRIDE > 1) take two of the four score kinds per length,
  // in turn, one of them for the 70,001-key row, and the bound of 600,000 (128 blocks for every
  // row, whatever its length: that grid is the simulated time) on the last four rows only.
  const bool trimmed = sweep_stride() > 1;
  std::vector<gpu::row_spec> rows;
  std::uint64_t seed = 177;
  int length_index = 0;
  for (std::int64_t len : {0, 1, 17, 4096, 4097, 12289, 70001}) {
    ++length_index;
    for (int kind = 0; kind < 4; ++kind) {
      if (trimmed && (kind + length_index) % 2 != 0) continue;
      gpu::row_spec r;
      r.scores = score_matrix(1, len, seed++, kind);
      r.budget = (len * (kind + 1)) / 6 + kind;
      r.protected_tail = kind;
      r.mode = kind == 1 ? kvevict::protected_mode::on_top_of_budget : kvevict::protected_mode::inside_budget;
      rows.push_back(r);
    }
  }
  gpu::row_spec all = rows.back();  // a budget past the candidates: every key kept
  all.budget = 80000;
  rows.push_back(all);
  gpu::row_spec one = rows[rows.size() - 2];  // k = 1 on a 70,001-key row
  one.budget = 1;
  one.protected_tail = 0;
  rows.push_back(one);
  gpu::row_spec bad;  // longer than max_length: flagged, not written
  bad.scores = score_matrix(1, 50, 1, 0);
  bad.length = 700000;
  bad.budget = 5;
  rows.push_back(bad);
  // 70,001 keys: 18 tiles, one block each; a bound of 600,000: 147 tiles over 128 blocks, two
  // tiles per block.
  for (const std::int64_t max_length : {std::int64_t{70001}, std::int64_t{600000}}) {
    INFO("max_length " << max_length);
    const std::vector<gpu::row_spec> batch =
        trimmed && max_length > 70001 ? std::vector<gpu::row_spec>(rows.end() - 4, rows.end()) : rows;
    const auto g = gpu::select_rows(batch, max_length, true);
    REQUIRE(g.st.ok());
    REQUIRE(g.flags == kvevict::cuda::flag_invalid_row);
    for (std::size_t i = 0; i + 1 < batch.size(); ++i) {
      const auto& r = batch[i];
      const std::int64_t n = static_cast<std::int64_t>(r.scores.size());
      const auto want = ref::keep(std::vector<double>(r.scores.begin(), r.scores.end()), r.budget, r.protected_tail,
                                  r.mode == kvevict::protected_mode::inside_budget);
      INFO("row " << i << " length " << n << " budget " << r.budget);
      const std::vector<std::int64_t> got(g.out[i].begin(),
                                          g.out[i].begin() + static_cast<std::ptrdiff_t>(want.size()));
      REQUIRE(got == want);
      REQUIRE(g.out[i][want.size()] == -7);  // nothing past the row's keep-list
    }
    for (std::int64_t x : g.out.back()) REQUIRE(x == -7);
  }
  const auto none = gpu::select_rows({}, 10, true);
  REQUIRE(none.st.ok());
}

namespace {

/// Compaction by the definition: head h's row i <- old row keep[h][i], other elements as were.
template <class T>
std::vector<T> expected_compaction(const test::test_cache<T>& c, const std::vector<std::int64_t>& offsets,
                                   const std::vector<std::int64_t>& indices) {
  std::vector<T> out = c.buffer;
  for (std::int64_t h = 0; h < c.heads; ++h)
    for (std::int64_t i = 0; i < offsets[static_cast<std::size_t>(h + 1)] - offsets[static_cast<std::size_t>(h)]; ++i)
      for (std::int64_t ch = 0; ch < c.dim; ++ch) {
        const std::int64_t src = indices[static_cast<std::size_t>(offsets[static_cast<std::size_t>(h)] + i)];
        out[static_cast<std::size_t>(c.offset(h, i, ch))] = c.buffer[static_cast<std::size_t>(c.offset(h, src, ch))];
      }
  return out;
}

template <class T>
void require_bytes(const std::vector<unsigned char>& got, const std::vector<T>& want) {
  REQUIRE(got.size() == want.size() * sizeof(T));
  REQUIRE(std::memcmp(got.data(), want.data(), got.size()) == 0);
}

void random_keep(std::int64_t heads, std::int64_t tokens, std::uint64_t seed, std::vector<std::int64_t>* offsets,
                 std::vector<std::int64_t>* indices) {
  std::mt19937_64 rng(seed);
  offsets->assign(1, 0);
  indices->clear();
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t j = 0; j < tokens; ++j) {
      const bool keep = h == 0 ? j < tokens / 2 : (h == 1 ? false : rng() % 3 == 0 || j >= tokens - 4);
      if (keep) indices->push_back(j);  // head 0: identity prefix, head 1: empty, others random + tail
    }
    offsets->push_back(static_cast<std::int64_t>(indices->size()));
  }
}

template <class KT, class VT>
void check_compact(test::layout klay, test::layout vlay, std::int64_t heads, std::int64_t tokens, std::int64_t dk,
                   std::int64_t dv, std::uint64_t seed) {
  auto k =
      test::make_cache<KT>(klay, heads, tokens, dk, test::normal(static_cast<std::size_t>(heads * tokens * dk), seed));
  auto v = test::make_cache<VT>(vlay, heads, tokens, dv,
                                test::normal(static_cast<std::size_t>(heads * tokens * dv), seed + 1), 16, seed + 2);
  std::vector<std::int64_t> offsets, indices, kpos;
  random_keep(heads, tokens, seed + 3, &offsets, &indices);
  for (std::int64_t j = 0; j < tokens; ++j) kpos.push_back(1000 + 3 * j);
  const std::int64_t capacity = static_cast<std::int64_t>(indices.size()) + 3;
  const auto g = gpu::compact(k.view, gpu::buffer_of(k.buffer), k.table, v.view, gpu::buffer_of(v.buffer), v.table,
                              offsets, indices, capacity, kpos);
  INFO(test::name(klay) << " / " << test::name(vlay) << " status " << g.st.message());
  REQUIRE(g.st.ok());
  REQUIRE(g.flags == 0);
  require_bytes(g.keys, expected_compaction(k, offsets, indices));
  require_bytes(g.values, expected_compaction(v, offsets, indices));
  for (std::int64_t h = 0; h < heads; ++h)
    REQUIRE(g.head_lengths[static_cast<std::size_t>(h)] ==
            offsets[static_cast<std::size_t>(h + 1)] - offsets[static_cast<std::size_t>(h)]);
  for (std::size_t e = 0; e < indices.size(); ++e)
    REQUIRE(g.positions[e] == kpos[static_cast<std::size_t>(indices[e])]);
  REQUIRE(g.positions[indices.size()] == -7);
}

template <class T>
gpu::side<T> side_of(test::test_cache<T>& c) {
  return {c.view, gpu::buffer_of(c.buffer), &c.table};
}

/// compact_into from a cache in `slay` into fresh caches in `dlay`: destination row (h, i) is
/// source row (h, keep[i]), the rest of the destination and the whole source unchanged.
template <class KT, class VT>
void check_compact_into(test::layout slay, test::layout dlay, std::int64_t heads, std::int64_t tokens, std::int64_t dk,
                        std::int64_t dv, std::uint64_t seed) {
  auto k =
      test::make_cache<KT>(slay, heads, tokens, dk, test::normal(static_cast<std::size_t>(heads * tokens * dk), seed));
  auto v = test::make_cache<VT>(slay, heads, tokens, dv,
                                test::normal(static_cast<std::size_t>(heads * tokens * dv), seed + 1), 16, seed + 2);
  std::vector<std::int64_t> offsets, indices, kpos;
  random_keep(heads, tokens, seed + 3, &offsets, &indices);
  std::int64_t longest = 0;
  for (std::int64_t h = 0; h < heads; ++h)
    longest = std::max(longest, offsets[static_cast<std::size_t>(h + 1)] - offsets[static_cast<std::size_t>(h)]);
  for (std::int64_t j = 0; j < tokens; ++j) kpos.push_back(500 + 2 * j);
  auto fk = test::make_cache<KT>(dlay, heads, longest, dk,
                                 test::normal(static_cast<std::size_t>(heads * longest * dk), seed + 4), 16, seed + 5);
  auto fv = test::make_cache<VT>(dlay, heads, longest, dv,
                                 test::normal(static_cast<std::size_t>(heads * longest * dv), seed + 6), 16, seed + 7);
  const auto g = gpu::compact_into(side_of(k), side_of(v), side_of(fk), side_of(fv), offsets, indices,
                                   static_cast<std::int64_t>(indices.size()), kpos);
  INFO(test::name(slay) << " -> " << test::name(dlay) << " status " << g.st.message());
  REQUIRE(g.st.ok());
  REQUIRE(g.flags == 0);
  const auto expect = [&](const auto& src, auto dst) {
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t i = 0; i < offsets[static_cast<std::size_t>(h + 1)] - offsets[static_cast<std::size_t>(h)]; ++i)
        for (std::int64_t ch = 0; ch < src.dim; ++ch)
          dst.buffer[static_cast<std::size_t>(dst.offset(h, i, ch))] = src.buffer[static_cast<std::size_t>(
              src.offset(h, indices[static_cast<std::size_t>(offsets[static_cast<std::size_t>(h)] + i)], ch))];
    return dst.buffer;
  };
  require_bytes(g.dst_keys, expect(k, fk));
  require_bytes(g.dst_values, expect(v, fv));
  require_bytes(g.src_keys, k.buffer);
  require_bytes(g.src_values, v.buffer);
  for (std::int64_t h = 0; h < heads; ++h)
    REQUIRE(g.head_lengths[static_cast<std::size_t>(h)] ==
            offsets[static_cast<std::size_t>(h + 1)] - offsets[static_cast<std::size_t>(h)]);
  for (std::size_t e = 0; e < indices.size(); ++e)
    REQUIRE(g.positions[e] == kpos[static_cast<std::size_t>(indices[e])]);
}

}  // namespace

TEST_CASE("GPU compaction into fresh memory: every layout pair", "[gpu][gpu_compact]") {
  std::uint64_t seed = 3500;
  for (test::layout sl : test::kAllLayouts)
    for (test::layout dl : {test::layout::contiguous, test::layout::paged_nhd, test::layout::transposed, sl}) {
      check_compact_into<bf16, bf16>(sl, dl, 3, 90, 64, 64, seed++);
      check_compact_into<fp8_e4m3, fp8_e4m3>(sl, dl, 2, 70, 45, 24, seed++);
    }
}

TEST_CASE("GPU compaction into fresh blocks of the source's pool (prefix-shared blocks stay intact)",
          "[gpu][gpu_compact]") {
  const std::int64_t heads = 2, tokens = 90, d = 32;
  auto k = test::make_cache<bf16>(test::layout::paged_nhd, heads, tokens, d, test::normal(heads * tokens * d, 3600));
  auto v = test::make_cache<bf16>(test::layout::paged_nhd, heads, tokens, d, test::normal(heads * tokens * d, 3601));
  // The pool's spare blocks (3 of 16 tokens) are the fresh ones.
  const auto spare = [](const test::test_cache<bf16>& c) {
    std::vector<std::int32_t> ids;
    for (std::int32_t id = 0; id < static_cast<std::int32_t>(c.pool_blocks); ++id)
      if (std::find(c.table.begin(), c.table.end(), id) == c.table.end()) ids.push_back(id);
    return ids;
  };
  std::vector<std::int32_t> kfresh = spare(k), vfresh = spare(v);
  REQUIRE(kfresh.size() == 3);
  std::vector<std::int64_t> offsets{0, 40, 48}, indices;
  for (std::int64_t j = 0; j < 40; ++j) indices.push_back(2 * j + 1);
  for (std::int64_t j = 0; j < 8; ++j) indices.push_back(80 + j);
  const auto into = [&](const std::vector<std::int32_t>& kt, const std::vector<std::int32_t>& vt) {
    gpu::side<bf16> dk = side_of(k), dv = side_of(v);
    dk.view.block_table = kt.data();
    dk.view.num_tokens = 48;
    dk.table = &kt;
    dv.view.block_table = vt.data();
    dv.view.num_tokens = 48;
    dv.table = &vt;
    return gpu::compact_into(side_of(k), side_of(v), dk, dv, offsets, indices, 48, {});
  };
  const auto g = into(kfresh, vfresh);
  INFO("status " << g.st.message());
  REQUIRE(g.st.ok());
  REQUIRE(g.flags == 0);
  // Every source row is intact (its blocks are untouched); the fresh blocks hold the kept rows.
  auto want = k.buffer;
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t i = 0; i < offsets[static_cast<std::size_t>(h + 1)] - offsets[static_cast<std::size_t>(h)]; ++i)
      for (std::int64_t c = 0; c < d; ++c) {
        const std::int64_t blk = kfresh[static_cast<std::size_t>(i / 16)];
        want[static_cast<std::size_t>(((blk * 16 + i % 16) * heads + h) * d + c)] =
            k.at(h, indices[static_cast<std::size_t>(offsets[static_cast<std::size_t>(h)] + i)], c);
      }
  require_bytes(g.src_keys, want);
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t j = 0; j < tokens; ++j)
      for (std::int64_t c = 0; c < d; ++c) {
        bf16 x;
        std::memcpy(&x, g.src_keys.data() + k.offset(h, j, c) * 2, 2);
        REQUIRE(x.bits == k.at(h, j, c).bits);
      }
  // A destination naming a block the source uses (a prefix-shared block), a block named twice,
  // or a head keeping more rows than the destination holds: flagged, nothing written.
  std::vector<std::int32_t> shared = kfresh, twice = kfresh;
  shared[1] = k.table[0];
  twice[2] = twice[0];
  for (const auto* t : {&shared, &twice}) {
    const auto bad = into(*t, vfresh);
    REQUIRE(bad.st.ok());
    REQUIRE(bad.flags == kvevict::cuda::flag_duplicate_block);
    require_bytes(bad.src_keys, k.buffer);
    require_bytes(bad.src_values, v.buffer);
    REQUIRE(bad.head_lengths == std::vector<std::int64_t>(2, -7));
  }
  offsets = {0, 40, 49};
  indices.push_back(89);
  const auto over = [&] {
    gpu::side<bf16> dk = side_of(k), dv = side_of(v);
    dk.view.block_table = kfresh.data();
    dk.view.num_tokens = 39;
    dk.table = &kfresh;
    dv.view.block_table = vfresh.data();
    dv.view.num_tokens = 39;
    dv.table = &vfresh;
    return gpu::compact_into(side_of(k), side_of(v), dk, dv, offsets, indices, 49, {});
  }();
  REQUIRE(over.st.ok());
  REQUIRE(over.flags == kvevict::cuda::flag_capacity_exceeded);
  require_bytes(over.src_keys, k.buffer);
}

TEST_CASE("GPU compaction: every layout pair against the definition", "[gpu][gpu_compact]") {
  std::uint64_t seed = 3000;
  // Sanitizer runs (KVEVICT_GPU_SWEEP_STRIDE = k > 1): the pairs whose layouts are 0 or k apart
  // in kAllLayouts, so that every K layout and every V layout still runs, each with two partners.
  const std::size_t stride = sweep_stride(), n = std::size(test::kAllLayouts);
  for (std::size_t ki = 0; ki < n; ++ki)
    for (std::size_t vi = 0; vi < n; ++vi, seed += 2) {
      const std::size_t apart = (vi + n - ki) % n;
      if (stride > 1 && apart != 0 && apart != stride % n) continue;
      const test::layout kl = test::kAllLayouts[ki], vl = test::kAllLayouts[vi];
      check_compact<bf16, bf16>(kl, vl, 4, 300, 128, 128, seed);
      check_compact<fp16, fp16>(kl, vl, 3, 77, 40, 24, seed + 1);
    }
  // fp8: rows of 45 bytes (byte copies) and of 128 (16-byte copies).
  for (test::layout kl : test::kAllLayouts) {
    check_compact<fp8_e4m3, fp8_e4m3>(kl, kl, 2, 90, 45, 128, seed++);
    check_compact<fp8_e5m2, bf16>(kl, test::layout::paged_nhd, 2, 90, 128, 64, seed++);
  }
  check_compact<float, float>(test::layout::contiguous, test::layout::transposed, 4, 1000, 64, 64, seed++);
  check_compact<bf16, float>(test::layout::paged_nhd, test::layout::paged_hnd, 8, 2000, 128, 96, seed++);
}

namespace {
/// Marks for the shared-block cases: none, a block every head keeps in place (the first of
/// each table: every head's kept prefix covers it), or a block the compaction writes (table
/// 0's second: every head's rows from 20 on move). Into fresh blocks: a destination block past
/// the longest head, or the first destination block.
enum class marked { none, kept_in_place, written };

/// One case's shared-block marks, as reference counts or as a bitmap (the same blocks), and
/// the block inputs and outputs handed to the device and to the CPU.
struct block_marks {
  bool bitmap = false;
  std::vector<std::int32_t> refs;
  std::vector<std::uint32_t> bits;
  block_marks(std::int64_t pool, bool use_bitmap)
      : bitmap(use_bitmap),
        refs(static_cast<std::size_t>(pool), 1),
        bits(static_cast<std::size_t>((pool + 31) / 32), 0u) {}
  void mark(std::int64_t id) {
    refs[static_cast<std::size_t>(id)] = 3;
    bits[static_cast<std::size_t>(id / 32)] |= 1u << (id % 32);
  }
  bool marked_id(std::int64_t id) const {
    return bitmap ? ((bits[static_cast<std::size_t>(id / 32)] >> (id % 32)) & 1u) != 0
                  : refs[static_cast<std::size_t>(id)] > 1;
  }
  /// Whether a block either view uses is marked (K's and V's ids index one array, so a mark
  /// meant for one may fall on a block of the other).
  template <class T>
  bool any_used(const kvevict::cache_view<T>& a, const kvevict::cache_view<T>& b) const {
    bool any = false;
    for (const auto* c : {&a, &b})
      for (std::int64_t t = 0; t < c->num_tables(); ++t)
        for (std::int64_t i = 0; i < c->num_used_blocks(); ++i)
          any = any || marked_id(c->block_table[t * c->head_table_stride + i]);
    return any;
  }
  gpu::compact_blocks request(bool every_used_block, std::int64_t changed_entries) const {
    gpu::compact_blocks b;
    if (bitmap) {
      b.shared_bits = bits;
    } else {
      b.refcounts = refs;
    }
    b.every_used_block = every_used_block;
    b.changed = b.freed = true;
    b.changed_entries = changed_entries;
    return b;
  }
  kvevict::eviction_options options() const {
    kvevict::eviction_options o;
    o.block_refcounts = bitmap ? nullptr : refs.data();
    o.shared_blocks = bitmap ? bits.data() : nullptr;
    return o;
  }
};

/// The CPU's block outputs for one call.
struct cpu_blocks {
  std::vector<std::int64_t> lengths, freed;
  std::vector<std::int32_t> changed;
  kvevict::eviction_result res;
  cpu_blocks(std::int64_t heads, std::int64_t entries)
      : lengths(static_cast<std::size_t>(heads)),
        freed(static_cast<std::size_t>(heads)),
        changed(static_cast<std::size_t>(entries)) {
    res.head_lengths = lengths.data();
    res.head_freed_blocks = freed.data();
    res.changed_blocks = changed.data();
  }
};

/// The device's block outputs against the CPU's: when refused, none written; else the CPU's
/// changed-block list, one -1, the rest untouched (77), and the same freed blocks.
void require_block_outputs(bool refused, const std::vector<std::int32_t>& changed,
                           const std::vector<std::int64_t>& freed, const cpu_blocks& cpu, std::int64_t entries) {
  if (refused) {
    REQUIRE(changed[0] == 77);
    REQUIRE(freed[0] == -7);
    return;
  }
  const std::int64_t n = cpu.res.num_changed_blocks;
  REQUIRE(n > 0);
  for (std::int64_t i = 0; i <= entries; ++i) {
    INFO("changed block " << i << " of " << n);
    REQUIRE(changed[static_cast<std::size_t>(i)] == (i < n    ? cpu.changed[static_cast<std::size_t>(i)]
                                                     : i == n ? -1
                                                              : 77));
  }
  REQUIRE(freed == cpu.freed);
}

/// cuda::compact with block_refcounts (or the shared-block bitmap), changed_blocks and
/// head_freed_blocks against kvevict::evict with the same eviction_options: the same refusals
/// (a status on the CPU, flag_shared_block on the device, the cache untouched either way), the
/// same caches, the same changed-block list (then -1 on the device) and freed blocks.
template <class T>
void check_shared_compaction(test::layout lay, marked mark, bool bitmap, bool every_used_block, std::uint64_t seed) {
  const std::int64_t heads = 3, tokens = 70, dim = 24;
  auto k = test::make_cache<T>(lay, heads, tokens, dim,
                               test::normal(static_cast<std::size_t>(heads * tokens * dim), seed), 16, seed + 1);
  auto v = test::make_cache<T>(lay, heads, tokens, dim,
                               test::normal(static_cast<std::size_t>(heads * tokens * dim), seed + 2), 16, seed + 3);
  // Head h keeps its first 20 + h tokens in place, then every third token and the last 4.
  std::vector<std::int64_t> offsets{0}, indices;
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t j = 0; j < tokens; ++j)
      if (j < 20 + h || (j % 3 == 0 && j > 30 + h) || j >= tokens - 4) indices.push_back(j);
    offsets.push_back(static_cast<std::int64_t>(indices.size()));
  }
  const std::int64_t capacity = static_cast<std::int64_t>(indices.size());
  block_marks marks(std::max(k.view.num_pool_blocks, v.view.num_pool_blocks), bitmap);
  for (std::int64_t t = 0; t < k.view.num_tables(); ++t) {
    if (mark == marked::kept_in_place) marks.mark(k.view.block_table[t * k.view.head_table_stride]);
    if (mark == marked::written && t == 0) marks.mark(k.view.block_table[1]);  // rows 16-31: row 20 on moves
  }
  const std::int64_t entries =
      k.view.num_used_blocks() * k.view.num_tables() + v.view.num_used_blocks() * v.view.num_tables();
  const auto g = gpu::compact(k.view, gpu::buffer_of(k.buffer), k.table, v.view, gpu::buffer_of(v.buffer), v.table,
                              offsets, indices, capacity, {}, marks.request(every_used_block, entries));
  INFO(test::name(lay) << (bitmap ? " bitmap" : " refcounts") << " mark " << static_cast<int>(mark)
                       << (every_used_block ? " every used block" : " written blocks") << " status " << g.st.message());
  REQUIRE(g.st.ok());

  const std::vector<T> k_before = k.buffer, v_before = v.buffer;
  cpu_blocks cpu(heads, entries);
  kvevict::workspace ws(kvevict::evict_workspace_size(k.view, v.view));
  const kvevict::status st =
      kvevict::evict(k.view, v.view, kvevict::const_keep_list_view{heads, offsets.data(), indices.data(), capacity},
                     cpu.res, ws, marks.options());
  INFO("cpu " << st.message());
  if (mark == marked::none) REQUIRE(st.ok());
  if (mark == marked::written) {
    REQUIRE(st.code() == kvevict::errc::invalid_argument);
    REQUIRE(std::string(st.argument()).rfind("keys.block_table[", 0) == 0);
  }
  // evict refuses a written block that is marked; the compressor's rule any used block.
  const bool refused = every_used_block ? marks.any_used(k.view, v.view) : !st.ok();
  REQUIRE(g.flags == (refused ? kvevict::cuda::flag_shared_block : 0u));
  if (refused) REQUIRE(std::string(kvevict::cuda::device_flags_status(g.flags).argument()) == "block_refcounts");
  require_bytes(g.keys, refused ? k_before : k.buffer);  // refused: nothing moved
  require_bytes(g.values, refused ? v_before : v.buffer);
  require_block_outputs(refused, g.changed_blocks, g.head_freed_blocks, cpu, entries);
}
}  // namespace

TEST_CASE("GPU compaction: prefix-shared blocks, changed blocks and freed blocks as kvevict::evict",
          "[gpu][gpu_compact]") {
  std::uint64_t seed = 2600;
  for (test::layout lay : {test::layout::paged_nhd, test::layout::paged_hnd, test::layout::packed_nhd,
                           test::layout::flashinfer_kv, test::layout::paged_per_head, test::layout::paged_int64})
    for (marked mark : {marked::none, marked::kept_in_place, marked::written})
      for (bool every_used_block : {false, true}) {
        check_shared_compaction<kvevict::bf16>(lay, mark, false, every_used_block, seed++);
        check_shared_compaction<float>(lay, mark, true, every_used_block, seed++);
      }
}

namespace {
/// cuda::compact_into with marks on the destination, changed_blocks and head_freed_blocks
/// against kvevict::evict_into: no mark, a mark on a destination block it writes (table 0's
/// first), a mark on a destination block past the longest head (accepted by the written rule,
/// refused under shared_block_check::used).
template <class T>
void check_shared_compaction_into(test::layout lay, marked mark, bool bitmap, bool every_used_block,
                                  std::uint64_t seed) {
  const std::int64_t heads = 3, tokens = 70, dim = 24;
  auto k = test::make_cache<T>(lay, heads, tokens, dim,
                               test::normal(static_cast<std::size_t>(heads * tokens * dim), seed), 16, seed + 1);
  auto v = test::make_cache<T>(lay, heads, tokens, dim,
                               test::normal(static_cast<std::size_t>(heads * tokens * dim), seed + 2), 16, seed + 3);
  std::vector<std::int64_t> offsets, indices;
  random_keep(heads, tokens, seed + 4, &offsets, &indices);
  std::int64_t longest = 0;
  for (std::int64_t h = 0; h < heads; ++h)
    longest = std::max(longest, offsets[static_cast<std::size_t>(h + 1)] - offsets[static_cast<std::size_t>(h)]);
  const std::int64_t room = longest + 40;  // destination blocks past every head's rows
  auto fk = test::make_cache<T>(lay, heads, room, dim,
                                test::normal(static_cast<std::size_t>(heads * room * dim), seed + 5), 16, seed + 6);
  auto fv = test::make_cache<T>(lay, heads, room, dim,
                                test::normal(static_cast<std::size_t>(heads * room * dim), seed + 7), 16, seed + 8);
  block_marks marks(std::max(fk.view.num_pool_blocks, fv.view.num_pool_blocks), bitmap);
  if (mark == marked::written) marks.mark(fk.view.block_table[0]);
  if (mark == marked::kept_in_place) marks.mark(fk.view.block_table[fk.view.num_used_blocks() - 1]);  // past the rows
  const std::int64_t entries =
      fk.view.num_used_blocks() * fk.view.num_tables() + fv.view.num_used_blocks() * fv.view.num_tables();
  const auto g =
      gpu::compact_into(side_of(k), side_of(v), side_of(fk), side_of(fv), offsets, indices,
                        static_cast<std::int64_t>(indices.size()), {}, marks.request(every_used_block, entries));
  INFO(test::name(lay) << (bitmap ? " bitmap" : " refcounts") << " mark " << static_cast<int>(mark)
                       << (every_used_block ? " every used block" : " written blocks") << " status " << g.st.message());
  REQUIRE(g.st.ok());
  const std::vector<T> fk_before = fk.buffer, fv_before = fv.buffer;
  cpu_blocks cpu(heads, entries);
  kvevict::workspace ws(kvevict::evict_into_workspace_size(k.view, v.view, fk.view, fv.view));
  const kvevict::status st = kvevict::evict_into(
      k.view, v.view, fk.view, fv.view,
      kvevict::const_keep_list_view{heads, offsets.data(), indices.data(), static_cast<std::int64_t>(indices.size())},
      cpu.res, ws, marks.options());
  INFO("cpu " << st.message());
  if (mark == marked::none) REQUIRE(st.ok());
  if (mark == marked::written) REQUIRE(!st.ok());
  const bool refused = every_used_block ? marks.any_used(fk.view, fv.view) : !st.ok();
  REQUIRE(g.flags == (refused ? kvevict::cuda::flag_shared_block : 0u));
  require_bytes(g.dst_keys, refused ? fk_before : fk.buffer);
  require_bytes(g.dst_values, refused ? fv_before : fv.buffer);
  require_block_outputs(refused, g.changed_blocks, g.head_freed_blocks, cpu, entries);
}
}  // namespace

TEST_CASE("GPU compaction into fresh blocks: shared marks, changed blocks and freed blocks as kvevict::evict_into",
          "[gpu][gpu_compact]") {
  std::uint64_t seed = 2700;
  for (test::layout lay : {test::layout::paged_nhd, test::layout::paged_hnd, test::layout::flashinfer_kv,
                           test::layout::paged_per_head, test::layout::paged_int64})
    for (marked mark : {marked::none, marked::kept_in_place, marked::written})
      for (bool every_used_block : {false, true}) {
        check_shared_compaction_into<kvevict::bf16>(lay, mark, false, every_used_block, seed++);
        check_shared_compaction_into<float>(lay, mark, true, every_used_block, seed++);
      }
}

TEST_CASE("GPU compaction: problems found on the device leave the cache untouched", "[gpu][gpu_compact]") {
  const std::int64_t heads = 2, tokens = 64, d = 32;
  auto k = test::make_cache<float>(test::layout::paged_nhd, heads, tokens, d,
                                   test::normal(static_cast<std::size_t>(heads * tokens * d), 1));
  auto v = test::make_cache<float>(test::layout::paged_hnd, heads, tokens, d,
                                   test::normal(static_cast<std::size_t>(heads * tokens * d), 2), 16, 9);
  std::vector<std::int64_t> offsets{0, 3, 5}, indices{1, 5, 40, 0, 63};
  auto run = [&] {
    return gpu::compact(k.view, gpu::buffer_of(k.buffer), k.table, v.view, gpu::buffer_of(v.buffer), v.table, offsets,
                        indices, 5);
  };
  auto untouched = [&](const gpu::compact_result& g) {
    require_bytes(g.keys, k.buffer);
    require_bytes(g.values, v.buffer);
    for (std::int64_t x : g.head_lengths) REQUIRE(x == -7);
    for (std::int64_t x : g.positions) REQUIRE(x == -7);
  };
  SECTION("descending indices") {
    indices = {5, 1, 40, 0, 63};
    const auto g = run();
    REQUIRE(g.st.ok());
    REQUIRE(g.flags == kvevict::cuda::flag_invalid_keep_list);
    untouched(g);
  }
  SECTION("an index past L") {
    indices[4] = 64;
    const auto g = run();
    REQUIRE(g.flags == kvevict::cuda::flag_invalid_keep_list);
    untouched(g);
  }
  SECTION("offsets beyond the capacity") {
    offsets = {0, 3, 6};
    const auto g = run();
    REQUIRE(g.flags == kvevict::cuda::flag_invalid_keep_list);
    untouched(g);
  }
  SECTION("a block id outside the pool") {
    k.table[2] = 99;
    const auto g = run();
    REQUIRE((g.flags & kvevict::cuda::flag_block_id_out_of_range) != 0);
    untouched(g);
  }
  SECTION("a block id repeated in a table") {
    v.table[3] = v.table[0];
    const auto g = run();
    REQUIRE((g.flags & kvevict::cuda::flag_duplicate_block) != 0);
    untouched(g);
  }
}

TEST_CASE("GPU compaction: random corruptions are flagged exactly when the CPU rejects them", "[gpu][gpu_compact]") {
  // Keep-lists corrupted the ways an engine's bug would (an index out of range or out of
  // order, an offset bumped, offsets[0] moved, negative offsets, too small a capacity) and
  // block tables with an id outside the pool or repeated: the device must flag exactly the
  // inputs the CPU validators reject, read nothing outside its arguments (the sanitizer
  // builds of the simulator check that), and leave the cache as it was.
  const std::int64_t heads = 3, tokens = 40, d = 8;
  std::mt19937_64 rng(23);
  for (int trial = 0; trial < 120; ++trial) {
    auto k = test::make_cache<bf16>(test::layout::paged_nhd, heads, tokens, d,
                                    test::normal(static_cast<std::size_t>(heads * tokens * d), rng()), 8, rng());
    auto v = test::make_cache<float>(trial % 2 ? test::layout::paged_hnd : test::layout::contiguous, heads, tokens, d,
                                     test::normal(static_cast<std::size_t>(heads * tokens * d), rng()), 8, rng());
    std::vector<std::int64_t> offsets, indices;
    random_keep(heads, tokens, rng(), &offsets, &indices);
    std::int64_t capacity = static_cast<std::int64_t>(indices.size()) + static_cast<std::int64_t>(rng() % 3);
    bool table_bad = false;
    const int kind = static_cast<int>(rng() % 9);
    switch (kind) {
      case 0:
        if (!indices.empty()) indices[rng() % indices.size()] = static_cast<std::int64_t>(rng() % (tokens + 4)) - 2;
        break;
      case 1:
        offsets[rng() % offsets.size()] += 1 + static_cast<std::int64_t>(rng() % 3);
        break;
      case 2:
        offsets[0] = -static_cast<std::int64_t>(rng() % 5) - 1;
        break;
      case 3:
        for (std::size_t h = 1; h < offsets.size(); ++h) offsets[h] = -offsets[h];
        break;
      case 4:
        capacity = std::max<std::int64_t>(0, static_cast<std::int64_t>(indices.size()) - 1);
        break;
      case 5:
        if (indices.size() > 1) std::swap(indices[0], indices[1]);
        break;
      case 6:
        k.table[rng() % k.table.size()] = static_cast<std::int32_t>(rng() % 2 ? k.pool_blocks : -1);
        table_bad = true;
        break;
      case 7:
        if (k.table.size() > 1) {
          k.table[1] = k.table[0];
          table_bad = true;
        }
        break;
      default:
        break;  // valid
    }
    std::vector<std::int64_t> padded = indices;
    padded.resize(static_cast<std::size_t>(std::max<std::int64_t>(capacity, 1)), 0);
    const kvevict::const_keep_list_view keep{heads, offsets.data(), padded.data(), capacity};
    const bool cpu_ok = kvevict::detail::validate_keep_list(keep, heads, tokens, "t", "keep").ok();
    INFO("trial " << trial << " corruption " << kind);
    const auto g = gpu::compact(k.view, gpu::buffer_of(k.buffer), k.table, v.view, gpu::buffer_of(v.buffer), v.table,
                                offsets, indices, capacity);
    REQUIRE(g.st.ok());
    REQUIRE((g.flags != 0) == (!cpu_ok || table_bad));
    if (g.flags != 0) {
      require_bytes(g.keys, k.buffer);
      require_bytes(g.values, v.buffer);
      for (std::int64_t x : g.head_lengths) REQUIRE(x == -7);
    } else {
      require_bytes(g.keys, expected_compaction(k, offsets, indices));
      require_bytes(g.values, expected_compaction(v, offsets, indices));
    }
  }
}

// Problems of three kinds found at once by many threads of several blocks: every kind's
// flag must come back. The flag word is raised by an atomic or; an or written as a plain
// read-modify-write loses the bits of threads that raced it (the simulator's interleaving
// schedule makes such races happen).
TEST_CASE("GPU compaction: problems of different kinds found at once raise every flag", "[gpu][gpu_compact]") {
  const std::int64_t heads = 4, tokens = 600, d = 8;
  for (std::uint64_t trial = 0; trial < 3; ++trial) {
    INFO("trial " << trial);
    auto k = test::make_cache<bf16>(test::layout::paged_per_head, heads, tokens, d,
                                    test::normal(static_cast<std::size_t>(heads * tokens * d), 3200 + trial), 8);
    auto v = test::make_cache<float>(test::layout::contiguous, heads, tokens, d,
                                     test::normal(static_cast<std::size_t>(heads * tokens * d), 3210 + trial), 8);
    // Every table entry in use: even ones outside the pool, odd ones all naming one block.
    const std::int64_t used = (tokens + 7) / 8;
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t b = 0; b < used; ++b) {
        auto& id = k.table[static_cast<std::size_t>(h * k.table_stride() + b)];
        id = b % 2 == 0 ? static_cast<std::int32_t>(k.pool_blocks + b) : k.table[1];
      }
    // Every head keeps its tokens in descending order: every entry but a head's first is bad.
    std::vector<std::int64_t> offsets{0}, indices;
    for (std::int64_t h = 0; h < heads; ++h) {
      for (std::int64_t i = 0; i < 100; ++i) indices.push_back(tokens - 1 - 3 * i - static_cast<std::int64_t>(trial));
      offsets.push_back(static_cast<std::int64_t>(indices.size()));
    }
    const auto g = gpu::compact(k.view, gpu::buffer_of(k.buffer), k.table, v.view, gpu::buffer_of(v.buffer), v.table,
                                offsets, indices, static_cast<std::int64_t>(indices.size()));
    REQUIRE(g.st.ok());
    REQUIRE(g.flags == (kvevict::cuda::flag_invalid_keep_list | kvevict::cuda::flag_block_id_out_of_range |
                        kvevict::cuda::flag_duplicate_block));
    require_bytes(g.keys, k.buffer);
    require_bytes(g.values, v.buffer);
  }
}

TEST_CASE("GPU compaction: K and V in one pool (TensorRT-LLM block offsets)", "[gpu][gpu_compact]") {
  const std::int64_t heads = 2, bs = 8, d = 16, tokens = 30, blocks = 10;
  std::vector<bf16> pool(static_cast<std::size_t>(blocks * heads * bs * d));
  for (std::size_t i = 0; i < pool.size(); ++i) pool[i] = bf16(static_cast<float>(i % 251));
  std::vector<std::int32_t> ktab{0, 2, 4, 6}, vtab{1, 3, 5, 7};
  const auto kv = kvevict::trtllm_paged(pool.data(), blocks, bs, heads, d, ktab.data(), tokens);
  auto vv = kvevict::trtllm_paged(pool.data(), blocks, bs, heads, d, vtab.data(), tokens);
  std::vector<std::int64_t> offsets{0, 3, 6}, indices{2, 9, 29, 0, 17, 28};
  SECTION("distinct blocks: compacted") {
    const auto g = gpu::compact(kv, gpu::buffer_of(pool), ktab, vv, gpu::buffer_of(pool), vtab, offsets, indices, 6);
    REQUIRE(g.st.ok());
    REQUIRE(g.flags == 0);
    std::vector<bf16> want = pool;
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t i = 0; i < 3; ++i)
        for (std::int64_t c = 0; c < d; ++c) {
          const std::int64_t src = indices[static_cast<std::size_t>(h * 3 + i)];
          want[static_cast<std::size_t>(kv.offset(h, i, c))] = pool[static_cast<std::size_t>(kv.offset(h, src, c))];
          want[static_cast<std::size_t>(vv.offset(h, i, c))] = pool[static_cast<std::size_t>(vv.offset(h, src, c))];
        }
    require_bytes(g.keys, want);
  }
  SECTION("a block in both tables: flagged, untouched") {
    vtab[2] = 4;
    vv.block_table = vtab.data();
    const auto g = gpu::compact(kv, gpu::buffer_of(pool), ktab, vv, gpu::buffer_of(pool), vtab, offsets, indices, 6);
    REQUIRE((g.flags & kvevict::cuda::flag_duplicate_block) != 0);
    require_bytes(g.keys, pool);
  }
}

// ---- shared selection scopes on the device ------------------------------------------------

namespace {

/// Scores with every float class the combining rule meets: attention-like mass spread over
/// a wide exponent range (so the exact normaliser differs from a naive float sum), negative
/// values (|x| is summed), zeros, subnormals, NaN, +inf in the candidates, +inf in the tail.
std::vector<float> scope_matrix(std::int64_t rows, std::int64_t cols, std::int64_t stride, std::int64_t tail,
                                std::uint64_t seed, bool specials) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::uniform_int_distribution<int> e(-60, 20);
  std::vector<float> v(static_cast<std::size_t>(rows * stride), 12345.0f);  // padding past cols
  for (std::int64_t h = 0; h < rows; ++h)
    for (std::int64_t j = 0; j < cols; ++j) {
      float x = std::ldexp(u(rng), e(rng)) * static_cast<float>(h + 1);
      if (specials) {
        const auto r = rng() % 64;
        if (r == 0) x = std::numeric_limits<float>::quiet_NaN();
        if (r == 1) x = kInf;
        if (r == 2) x = -x;
        if (r == 3) x = 0.0f;
        if (r == 4) x = std::numeric_limits<float>::denorm_min() * static_cast<float>(rng() % 1000);
      }
      if (j >= cols - tail) x = kInf;
      v[static_cast<std::size_t>(h * stride + j)] = x;
    }
  return v;
}

/// Bit equality that also accepts any NaN for a NaN.
bool same_float(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  std::uint32_t x = 0, y = 0;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y;
}

constexpr kvevict::scope_combine kRules[] = {kvevict::scope_combine::normalized_max,
                                             kvevict::scope_combine::normalized_mean, kvevict::scope_combine::max,
                                             kvevict::scope_combine::mean};

}  // namespace

TEST_CASE("GPU combine_head_scores equals the CPU's bit for bit", "[gpu][gpu_select][gpu_scope]") {
  std::uint64_t seed = 2100;
  struct shape_case {
    std::int64_t rows, cols, stride, tail;
  };
  // One and several chunks of the bins kernel (4096 keys), a strided view, an all-tail row.
  const shape_case shapes[] = {{1, 1, 1, 0}, {3, 17, 20, 3}, {8, 300, 300, 60}, {2, 9000, 9001, 5}, {4, 40, 40, 40}};
  for (const shape_case& sc : shapes)
    for (bool specials : {false, true})
      for (auto rule : kRules) {
        INFO("rows " << sc.rows << " cols " << sc.cols << " tail " << sc.tail << " specials " << specials << " "
                     << kvevict::to_string(rule));
        const auto s = scope_matrix(sc.rows, sc.cols, sc.stride, sc.tail, seed++, specials);
        std::vector<float> want(static_cast<std::size_t>(sc.cols));
        REQUIRE(kvevict::combine_head_scores({s.data(), sc.rows, sc.cols, sc.stride}, sc.tail, rule, want.data()).ok());
        const auto g = gpu::combine_head_scores(s, sc.rows, sc.cols, sc.stride, sc.tail, rule);
        INFO("status " << g.st.message());
        REQUIRE(g.st.ok());
        REQUIRE(g.flags == 0);
        for (std::int64_t j = 0; j < sc.cols; ++j) {
          INFO("j " << j << " cpu " << want[static_cast<std::size_t>(j)] << " gpu "
                    << g.row[static_cast<std::size_t>(j)]);
          REQUIRE(same_float(g.row[static_cast<std::size_t>(j)], want[static_cast<std::size_t>(j)]));
        }
      }
}

TEST_CASE("GPU layer and sequence scopes select the CPU's keep sets", "[gpu][gpu_select][gpu_scope]") {
  std::uint64_t seed = 2300;
  SECTION("one keep set per layer: kvevict::select_layer's") {
    for (auto rule : kRules)
      for (std::int64_t b : {std::int64_t{0}, std::int64_t{40}, std::int64_t{700}})
        for (auto mode : {kvevict::protected_mode::inside_budget, kvevict::protected_mode::on_top_of_budget}) {
          const std::int64_t rows = 4, cols = 513, tail = 16;
          INFO(kvevict::to_string(rule) << " B " << b << " mode " << int(mode));
          const auto s = scope_matrix(rows, cols, cols, tail, seed++, true);
          const kvevict::selection_params sel{tail, mode};
          kvevict::layer_budget lb;
          lb.per_head = kvevict::budget::tokens(b);
          lb.scope = kvevict::selection_scope::per_layer;
          lb.combine = rule;
          const std::int64_t capacity = kvevict::select_layer_capacity(rows, cols, sel, lb);
          kvevict::keep_list cpu(rows, capacity);
          kvevict::workspace ws(kvevict::select_layer_workspace_size(rows, cols, lb));
          REQUIRE(kvevict::select_layer({s.data(), rows, cols, cols}, sel, lb, cpu, ws).ok());
          // On the device: combine, then one set for the layer's heads.
          const auto combined = gpu::combine_head_scores(s, rows, cols, cols, tail, rule);
          REQUIRE(combined.st.ok());
          const auto g = gpu::select_shared(combined.row, 1, kvevict::budget::tokens(b), sel, rows, capacity);
          INFO("status " << g.st.message());
          REQUIRE(g.st.ok());
          REQUIRE(g.flags == 0);
          for (std::int64_t h = 0; h <= rows; ++h)
            REQUIRE(g.offsets[static_cast<std::size_t>(h)] == cpu.view().offsets[h]);
          for (std::int64_t e = 0; e < cpu.view().offsets[rows]; ++e)
            REQUIRE(g.indices[static_cast<std::size_t>(e)] == cpu.view().indices[e]);
        }
  }
  SECTION("one keep set per sequence: the compressor's fold over layers") {
    // 40,000 tokens: the combined row takes the wide selection. Sanitizer runs
    // (KVEVICT_GPU_SWEEP_STRIDE > 1) take it with one max rule and one mean rule.
    const bool trimmed = sweep_stride() > 1;
    for (auto rule : kRules)
      for (const std::int64_t cols : {std::int64_t{4200}, std::int64_t{40000}}) {
        if (trimmed && cols > 4200 && (rule == kvevict::scope_combine::max || rule == kvevict::scope_combine::mean))
          continue;
        const std::int64_t layers = 3, rows = 2, tail = 9, heads = 2;
        INFO(kvevict::to_string(rule) << " L " << cols);
        std::vector<std::vector<float>> scores;
        for (std::int64_t l = 0; l < layers; ++l)
          scores.push_back(scope_matrix(rows, cols, cols, tail, seed++, l == 1));
        // The CPU: compressor::run's sequence scope, step by step.
        const auto across =
            kvevict::detail::combines_by_max(rule) ? kvevict::scope_combine::max : kvevict::scope_combine::mean;
        std::vector<float> layer_row(static_cast<std::size_t>(cols)), want(static_cast<std::size_t>(cols));
        for (std::int64_t l = 0; l < layers; ++l) {
          REQUIRE(kvevict::combine_head_scores({scores[static_cast<std::size_t>(l)].data(), rows, cols, cols}, tail,
                                               rule, layer_row.data())
                      .ok());
          kvevict::detail::fold_row(want.data(), layer_row.data(), cols, cols - tail, across, l == 0);
        }
        kvevict::detail::finish_mean(want.data(), cols - tail, layers, across);
        const kvevict::selection_params sel{tail, kvevict::protected_mode::inside_budget};
        kvevict::layer_budget lb;
        lb.per_head = kvevict::budget::ratio(0.25);
        const std::int64_t capacity = kvevict::select_layer_capacity(heads, cols, sel, lb);
        kvevict::keep_list cpu(heads, capacity);
        std::vector<std::int64_t> scratch(static_cast<std::size_t>(cols + 2));
        kvevict::workspace ws(kvevict::select_workspace_size(cols));
        REQUIRE(kvevict::select_shared({want.data(), 1, cols, cols}, sel, lb, cpu, scratch.data(), ws).ok());

        const auto g = gpu::sequence_scope(scores, rows, cols, tail, rule, lb.per_head, sel, heads, capacity);
        INFO("status " << g.combined.st.message() << " / " << g.keep.st.message());
        REQUIRE(g.combined.st.ok());
        for (std::int64_t j = 0; j < cols; ++j) {
          INFO("j " << j);
          REQUIRE(same_float(g.combined.row[static_cast<std::size_t>(j)], want[static_cast<std::size_t>(j)]));
        }
        REQUIRE(g.keep.st.ok());
        REQUIRE(g.keep.flags == 0);
        for (std::int64_t h = 0; h <= heads; ++h)
          REQUIRE(g.keep.offsets[static_cast<std::size_t>(h)] == cpu.view().offsets[h]);
        for (std::int64_t e = 0; e < cpu.view().offsets[heads]; ++e)
          REQUIRE(g.keep.indices[static_cast<std::size_t>(e)] == cpu.view().indices[e]);
      }
  }
}

TEST_CASE("GPU selection scopes refuse bad arguments by name and write nothing", "[gpu][gpu_errors][gpu_scope]") {
  using kvevict::errc;
  const auto s = scope_matrix(2, 50, 50, 0, 1, false);
  const auto rule = kvevict::scope_combine::normalized_max;
  struct expect {
    const char* what;
    kvevict::status st;
    errc code;
    const char* arg;
  };
  const kvevict::selection_params sel{0, kvevict::protected_mode::inside_budget};
  const std::vector<float> row(s.begin(), s.begin() + 50);
  const expect cases[] = {
      {"no rows", gpu::combine_head_scores(s, 0, 50, 50, 0, rule).st, errc::invalid_shape, "scores.rows"},
      {"row stride below L", gpu::combine_head_scores(s, 2, 50, 40, 0, rule).st, errc::invalid_stride,
       "scores.row_stride"},
      {"negative tail", gpu::combine_head_scores(s, 2, 50, 50, -1, rule).st, errc::invalid_argument, "protected_tail"},
      {"unknown rule", gpu::combine_head_scores(s, 2, 50, 50, 0, static_cast<kvevict::scope_combine>(7)).st,
       errc::invalid_argument, "rule"},
      {"workspace too small", gpu::combine_head_scores(s, 2, 50, 50, 0, rule, 16).st, errc::workspace_too_small, "ws"},
      {"fold: layer past the count", gpu::fold_layer_scores_call(50, 0, rule, 3, 3, false), errc::invalid_argument,
       "layer"},
      {"fold: no layers", gpu::fold_layer_scores_call(50, 0, rule, 0, 0, false), errc::invalid_argument, "num_layers"},
      {"fold: null rows", gpu::fold_layer_scores_call(50, 0, rule, 0, 2, true), errc::null_pointer, "layer_row"},
      {"fold: negative tokens", gpu::fold_layer_scores_call(-1, 0, rule, 0, 2, false), errc::invalid_shape, "tokens"},
      {"shared: two rows", gpu::select_shared(s, 2, kvevict::budget::tokens(5), sel, 4, 100).st, errc::invalid_shape,
       "row.rows"},
      {"shared: capacity for one head", gpu::select_shared(row, 1, kvevict::budget::tokens(5), sel, 4, 5).st,
       errc::invalid_keep_list, "out.capacity"},
      {"shared: bad ratio", gpu::select_shared(row, 1, kvevict::budget::ratio(1.5), sel, 4, 100).st,
       errc::invalid_argument, "budget"},
      {"shared: no heads", gpu::select_shared(row, 1, kvevict::budget::tokens(5), sel, 0, 100).st, errc::invalid_shape,
       "out.num_heads"},
  };
  for (const expect& c : cases) {
    INFO(c.what << ": " << c.st.message());
    REQUIRE(c.st.code() == c.code);
    REQUIRE(std::string(c.st.argument()) == c.arg);
  }
  // A refused call enqueues nothing: the output keeps its fill.
  const auto g = gpu::select_shared(row, 1, kvevict::budget::tokens(5), sel, 4, 5);
  for (std::int64_t x : g.indices) REQUIRE(x == -7);
  for (std::int64_t x : g.offsets) REQUIRE(x == -7);
  const auto c = gpu::combine_head_scores(s, 2, 50, 50, 0, rule, 16);
  for (float x : c.row) REQUIRE(x == -7.0f);
}

// ---- batched compaction ---------------------------------------------------------------------

namespace {

/// A batch of five sequences of one layer: four in the shared K and V pools (ragged lengths,
/// one of a single token), one with caches of its own (contiguous K, transposed V).
template <class KT, class VT>
struct compaction_batch {
  static constexpr std::int64_t heads = 3;
  std::vector<std::int64_t> lengths{100, 37, 16, 1};
  gpu::shared_pool<KT> kpool;
  gpu::shared_pool<VT> vpool;
  test::test_cache<KT> own_k;
  test::test_cache<VT> own_v;
  std::vector<gpu::batch_compaction<KT, VT>> seqs;

  compaction_batch(std::int64_t dk, std::int64_t dv, std::uint64_t seed)
      : kpool(test::layout::paged_nhd, heads, lengths, dk, seed),
        vpool(test::layout::paged_hnd, heads, lengths, dv, seed + 10),
        own_k(test::make_cache<KT>(test::layout::contiguous, heads, 64, dk,
                                   test::normal(static_cast<std::size_t>(heads * 64 * dk), seed + 20))),
        own_v(test::make_cache<VT>(test::layout::transposed, heads, 64, dv,
                                   test::normal(static_cast<std::size_t>(heads * 64 * dv), seed + 21))) {
    for (std::size_t s = 0; s <= lengths.size(); ++s) {
      gpu::batch_compaction<KT, VT> b;
      const bool own = s == lengths.size();
      const std::int64_t l = own ? 64 : lengths[s];
      b.k = own ? gpu::side<KT>{own_k.view, gpu::buffer_of(own_k.buffer), &own_k.table} : kpool.side(s, l);
      b.v = own ? gpu::side<VT>{own_v.view, gpu::buffer_of(own_v.buffer), &own_v.table} : vpool.side(s, l);
      random_keep(heads, l, seed + 30 + s, &b.offsets, &b.indices);
      b.capacity = static_cast<std::int64_t>(b.indices.size()) + 2;
      for (std::int64_t j = 0; j < l; ++j) b.key_positions.push_back(7 * j + static_cast<std::int64_t>(s));
      seqs.push_back(b);
    }
  }

  /// Every buffer as it was (sequence `other`'s K aside: a test gave it another cache).
  void require_untouched(const gpu::compact_batch_result& g, std::size_t other = SIZE_MAX) const {
    for (std::size_t s = 0; s < seqs.size(); ++s) {
      if (s == other) continue;
      const bool own = s == lengths.size();
      if (own) {
        require_bytes(g.keys[s], own_k.buffer);
        require_bytes(g.values[s], own_v.buffer);
      } else {
        require_bytes(g.keys[s], kpool.pool.buffer);
        require_bytes(g.values[s], vpool.pool.buffer);
      }
      for (std::int64_t x : g.head_lengths[s]) REQUIRE(x == -7);
      for (std::int64_t x : g.positions[s]) REQUIRE(x == -7);
    }
  }
};

template <class KT, class VT>
void check_compact_batch(std::int64_t dk, std::int64_t dv, std::uint64_t seed, std::size_t misalign = 0) {
  compaction_batch<KT, VT> b(dk, dv, seed);
  const auto g = gpu::compact_batch(b.seqs, SIZE_MAX, misalign);
  INFO("status " << g.st.message());
  REQUIRE(g.st.ok());
  REQUIRE(g.flags == 0);
  std::vector<KT> kwant = b.kpool.pool.buffer;
  std::vector<VT> vwant = b.vpool.pool.buffer;
  for (std::size_t s = 0; s < b.lengths.size(); ++s) {
    b.kpool.apply(&kwant, s, b.seqs[s].offsets, b.seqs[s].indices);
    b.vpool.apply(&vwant, s, b.seqs[s].offsets, b.seqs[s].indices);
  }
  for (std::size_t s = 0; s < b.seqs.size(); ++s) {
    INFO("sequence " << s);
    const auto& q = b.seqs[s];
    if (s == b.lengths.size()) {
      require_bytes(g.keys[s], expected_compaction(b.own_k, q.offsets, q.indices));
      require_bytes(g.values[s], expected_compaction(b.own_v, q.offsets, q.indices));
    } else {
      require_bytes(g.keys[s], kwant);
      require_bytes(g.values[s], vwant);
    }
    for (std::int64_t h = 0; h < b.heads; ++h)
      REQUIRE(g.head_lengths[s][static_cast<std::size_t>(h)] ==
              q.offsets[static_cast<std::size_t>(h + 1)] - q.offsets[static_cast<std::size_t>(h)]);
    for (std::size_t e = 0; e < q.indices.size(); ++e)
      REQUIRE(g.positions[s][e] == q.key_positions[static_cast<std::size_t>(q.indices[e])]);
    REQUIRE(g.positions[s][q.indices.size()] == -7);
  }
}

}  // namespace

TEST_CASE("GPU batched compaction: every sequence of a layer in one launch per kernel", "[gpu][gpu_compact]") {
  check_compact_batch<bf16, bf16>(128, 128, 4100);     // 16-byte rows in the pools, channel-strided V of its own
  check_compact_batch<float, fp8_e4m3>(36, 45, 4200);  // 16-byte K rows, byte-copied fp8 V rows
  check_compact_batch<bf16, bf16>(64, 64, 4250, 8);    // a workspace pointer 8 bytes past an aligned one
}

TEST_CASE("GPU batched compaction: a problem in one sequence moves nothing in any", "[gpu][gpu_compact]") {
  compaction_batch<bf16, bf16> b(64, 64, 4300);
  SECTION("a descending keep-list in sequence 1") {
    std::swap(b.seqs[1].indices[0], b.seqs[1].indices[1]);
    const auto g = gpu::compact_batch(b.seqs);
    REQUIRE(g.st.ok());
    REQUIRE(g.flags == kvevict::cuda::flag_invalid_keep_list);
    b.require_untouched(g);
  }
  SECTION("a block shared by sequences 0 and 2 (prefix caching: compact_into's case)") {
    b.kpool.pool.table[static_cast<std::size_t>(b.kpool.first[2])] =
        b.kpool.pool.table[static_cast<std::size_t>(b.kpool.first[0])];
    const auto g = gpu::compact_batch(b.seqs);
    REQUIRE(g.st.ok());
    REQUIRE(g.flags == kvevict::cuda::flag_duplicate_block);
    b.require_untouched(g);
  }
  SECTION("a block id outside the V pool in the last pooled sequence") {
    b.vpool.pool.table[static_cast<std::size_t>(b.vpool.first[3])] = 1 << 20;
    const auto g = gpu::compact_batch(b.seqs);
    REQUIRE(g.st.ok());
    REQUIRE((g.flags & kvevict::cuda::flag_block_id_out_of_range) != 0);
    b.require_untouched(g);
  }
}

TEST_CASE("GPU batched compaction refuses bad batches on the host, naming the sequence", "[gpu][gpu_errors]") {
  using kvevict::errc;
  compaction_batch<bf16, bf16> b(64, 64, 4400);
  auto other = test::make_cache<bf16>(test::layout::paged_nhd, 3, 37, 64, test::normal(3 * 37 * 64, 1));
  struct expect {
    const char* what;
    std::function<void(std::vector<gpu::batch_compaction<bf16, bf16>>&)> change;
    errc code;
    const char* arg;
    std::size_t workspace = SIZE_MAX;
    std::size_t replaced = SIZE_MAX;  ///< the sequence whose K cache the change replaced
  };
  const expect cases[] = {
      {"a sequence in another K pool",
       [&](auto& s) {
         s[1].k = {other.view, gpu::buffer_of(other.buffer), &other.table};
       },
       errc::invalid_argument, "seqs[1].keys.data", SIZE_MAX, 1},
      {"two sequences on one contiguous buffer", [&](auto& s) { s.push_back(s.back()); }, errc::invalid_argument,
       "seqs[5].keys.data"},
      {"another head_dim", [&](auto& s) { s[2].v.view.head_dim = 32; }, errc::invalid_shape, "seqs[2].values.head_dim"},
      {"a negative keep capacity", [&](auto& s) { s[0].capacity = -1; }, errc::invalid_shape, "seqs[0].keep.capacity"},
      {"a workspace too small", [](auto&) {}, errc::workspace_too_small, "ws", 64},
  };
  for (const expect& c : cases) {
    auto seqs = b.seqs;
    c.change(seqs);
    const auto g = gpu::compact_batch(seqs, c.workspace);
    INFO(c.what << ": " << g.st.message());
    REQUIRE(g.st.code() == c.code);
    REQUIRE(std::string(g.st.argument()) == c.arg);
    b.require_untouched(g, c.replaced);
  }
}

namespace {

/// Three sequences whose first two blocks are one shared prefix (prefix caching), each with
/// blocks of its own after it, compacted into fresh blocks of the same K and V pools. V is
/// reached through K's tables (vLLM): the same ids in the V pool.
struct prefix_batch {
  static constexpr std::int64_t heads = 3, dim = 64, pool_blocks = 24;
  std::vector<std::int64_t> lengths{50, 40, 33};
  test::test_cache<bf16> kpool, vpool;
  std::vector<std::int64_t> where;  ///< block id -> its first token in the pool's own numbering
  std::vector<std::vector<std::int32_t>> src_tables, dst_tables;
  std::vector<gpu::batch_compaction_into<bf16, bf16>> seqs;

  explicit prefix_batch(std::uint64_t seed)
      : kpool(test::make_cache<bf16>(test::layout::paged_nhd, heads, pool_blocks * 16, dim,
                                     test::normal(static_cast<std::size_t>(heads * pool_blocks * 16 * dim), seed), 16,
                                     seed + 1)),
        vpool(test::make_cache<bf16>(test::layout::paged_hnd, heads, pool_blocks * 16, dim,
                                     test::normal(static_cast<std::size_t>(heads * pool_blocks * 16 * dim), seed + 2),
                                     16, seed + 1)) {
    REQUIRE(kpool.table == vpool.table);  // the same shuffle: one id names the same place in both
    where.assign(static_cast<std::size_t>(kpool.view.num_pool_blocks), -1);
    for (std::int64_t k = 0; k < pool_blocks; ++k)
      where[static_cast<std::size_t>(kpool.table[static_cast<std::size_t>(k)])] = 16 * k;
    // The pool's own blocks handed out in table order: the first two are the shared prefix.
    std::size_t next = 2;
    const auto take = [&] { return kpool.table[next++]; };
    for (std::size_t s = 0; s < lengths.size(); ++s) {
      std::vector<std::int32_t> src{kpool.table[0], kpool.table[1]};
      while (static_cast<std::int64_t>(src.size()) * 16 < lengths[s]) src.push_back(take());
      src_tables.push_back(src);
    }
    for (std::size_t s = 0; s < lengths.size(); ++s) {
      gpu::batch_compaction_into<bf16, bf16> b;
      random_keep(heads, lengths[s], seed + 10 + s, &b.offsets, &b.indices);
      std::int64_t longest = 1;
      for (std::int64_t h = 0; h < heads; ++h)
        longest =
            std::max(longest, b.offsets[static_cast<std::size_t>(h + 1)] - b.offsets[static_cast<std::size_t>(h)]);
      std::vector<std::int32_t> dst;
      while (static_cast<std::int64_t>(dst.size()) * 16 < longest) dst.push_back(take());
      dst_tables.push_back(dst);
      b.capacity = static_cast<std::int64_t>(b.indices.size()) + 1;
      for (std::int64_t j = 0; j < lengths[s]; ++j) b.key_positions.push_back(11 * j + static_cast<std::int64_t>(s));
      b.dst_k.view.num_tokens = longest;  // views and tables set in bind()
      seqs.push_back(b);
    }
    REQUIRE(static_cast<std::int64_t>(next) <= pool_blocks);
    bind();
  }

  /// Views over the pools through each sequence's tables (after a test edits a table).
  void bind() {
    for (std::size_t s = 0; s < seqs.size(); ++s) {
      auto& b = seqs[s];
      const std::int64_t longest = b.dst_k.view.num_tokens;
      b.src_k = {kpool.view, gpu::buffer_of(kpool.buffer), &src_tables[s]};
      b.src_v = {vpool.view, gpu::buffer_of(vpool.buffer), &src_tables[s]};
      b.dst_k = {kpool.view, gpu::buffer_of(kpool.buffer), &dst_tables[s]};
      b.dst_v = {vpool.view, gpu::buffer_of(vpool.buffer), &dst_tables[s]};
      b.src_k.view.block_table = src_tables[s].data();
      b.src_v.view.block_table = src_tables[s].data();
      b.dst_k.view.block_table = dst_tables[s].data();
      b.dst_v.view.block_table = dst_tables[s].data();
      b.src_k.view.num_tokens = b.src_v.view.num_tokens = lengths[s];
      b.dst_k.view.num_tokens = b.dst_v.view.num_tokens = longest;
    }
  }

  /// Token (table, j) of a pool at its place in the pool's own numbering.
  std::int64_t token(const std::vector<std::int32_t>& table, std::int64_t j) const {
    return where[static_cast<std::size_t>(table[static_cast<std::size_t>(j / 16)])] + j % 16;
  }

  std::vector<bf16> expected(const test::test_cache<bf16>& pool) const {
    std::vector<bf16> out = pool.buffer;
    for (std::size_t s = 0; s < seqs.size(); ++s) {
      const auto& b = seqs[s];
      for (std::int64_t h = 0; h < heads; ++h)
        for (std::int64_t i = 0;
             i < b.offsets[static_cast<std::size_t>(h + 1)] - b.offsets[static_cast<std::size_t>(h)]; ++i)
          for (std::int64_t c = 0; c < dim; ++c) {
            const std::int64_t src = b.indices[static_cast<std::size_t>(b.offsets[static_cast<std::size_t>(h)] + i)];
            out[static_cast<std::size_t>(pool.offset(h, token(dst_tables[s], i), c))] =
                pool.buffer[static_cast<std::size_t>(pool.offset(h, token(src_tables[s], src), c))];
          }
    }
    return out;
  }
};

}  // namespace

TEST_CASE("GPU batched compaction into fresh blocks: sequences sharing a prefix, one call", "[gpu][gpu_compact]") {
  prefix_batch b(4500);
  SECTION("every sequence's kept rows in its fresh blocks; the shared prefix intact") {
    const auto g = gpu::compact_into_batch_bf16(b.seqs);
    INFO("status " << g.st.message());
    REQUIRE(g.st.ok());
    REQUIRE(g.flags == 0);
    const auto kwant = b.expected(b.kpool), vwant = b.expected(b.vpool);
    for (std::size_t s = 0; s < b.seqs.size(); ++s) {
      INFO("sequence " << s);
      require_bytes(g.keys[s], kwant);  // the sources' blocks (prefix included) are unchanged in it
      require_bytes(g.values[s], vwant);
      const auto& q = b.seqs[s];
      for (std::int64_t h = 0; h < b.heads; ++h)
        REQUIRE(g.head_lengths[s][static_cast<std::size_t>(h)] ==
                q.offsets[static_cast<std::size_t>(h + 1)] - q.offsets[static_cast<std::size_t>(h)]);
      for (std::size_t e = 0; e < q.indices.size(); ++e)
        REQUIRE(g.positions[s][e] == q.key_positions[static_cast<std::size_t>(q.indices[e])]);
    }
  }
  const auto untouched = [&](const gpu::compact_batch_result& g) {
    for (std::size_t s = 0; s < b.seqs.size(); ++s) {
      require_bytes(g.keys[s], b.kpool.buffer);
      require_bytes(g.values[s], b.vpool.buffer);
      for (std::int64_t x : g.head_lengths[s]) REQUIRE(x == -7);
      for (std::int64_t x : g.positions[s]) REQUIRE(x == -7);
    }
  };
  SECTION("a destination block that another sequence reads (the shared prefix): nothing moves") {
    b.dst_tables[2][0] = b.src_tables[0][1];
    b.bind();
    const auto g = gpu::compact_into_batch_bf16(b.seqs);
    REQUIRE(g.st.ok());
    REQUIRE(g.flags == kvevict::cuda::flag_duplicate_block);
    untouched(g);
  }
  SECTION("two sequences' destinations in one block: nothing moves") {
    b.dst_tables[1][0] = b.dst_tables[0][0];
    b.bind();
    const auto g = gpu::compact_into_batch_bf16(b.seqs);
    REQUIRE(g.st.ok());
    REQUIRE(g.flags == kvevict::cuda::flag_duplicate_block);
    untouched(g);
  }
  SECTION("a bad keep-list in one sequence: nothing moves") {
    std::swap(b.seqs[0].indices[0], b.seqs[0].indices[1]);
    const auto g = gpu::compact_into_batch_bf16(b.seqs);
    REQUIRE(g.st.ok());
    REQUIRE(g.flags == kvevict::cuda::flag_invalid_keep_list);
    untouched(g);
  }
}

TEST_CASE("GPU batched compaction into fresh memory refuses a destination that is another sequence's source",
          "[gpu][gpu_errors]") {
  const std::int64_t heads = 2, tokens = 40, d = 32;
  std::vector<test::test_cache<bf16>> c;
  for (std::uint64_t i = 0; i < 6; ++i)
    c.push_back(test::make_cache<bf16>(test::layout::contiguous, heads, tokens, d,
                                       test::normal(static_cast<std::size_t>(heads * tokens * d), 4600 + i)));
  const auto side = [&](std::size_t i) { return gpu::side<bf16>{c[i].view, gpu::buffer_of(c[i].buffer), &c[i].table}; };
  std::vector<gpu::batch_compaction_into<bf16, bf16>> seqs(2);
  for (std::size_t s = 0; s < 2; ++s) {
    random_keep(heads, tokens, 4700 + s, &seqs[s].offsets, &seqs[s].indices);
    seqs[s].capacity = static_cast<std::int64_t>(seqs[s].indices.size());
  }
  // Sequence 0: 0, 1 -> 2, 3. Sequence 1 reads 4, 5 and would write into sequence 0's source.
  seqs[0].src_k = side(0), seqs[0].src_v = side(1), seqs[0].dst_k = side(2), seqs[0].dst_v = side(3);
  seqs[1].src_k = side(4), seqs[1].src_v = side(5), seqs[1].dst_k = side(0), seqs[1].dst_v = side(1);
  const auto g = gpu::compact_into_batch_bf16(seqs);
  INFO(g.st.message());
  REQUIRE(g.st.code() == kvevict::errc::invalid_argument);
  REQUIRE(std::string(g.st.argument()) == "seqs[1].dst_keys.data");
  require_bytes(g.keys[0], c[2].buffer);  // nothing written
  require_bytes(g.keys[1], c[0].buffer);
  // Two sources sharing memory are fine (they are only read).
  seqs[1].src_k = side(0), seqs[1].src_v = side(1), seqs[1].dst_k = side(4), seqs[1].dst_v = side(5);
  REQUIRE(gpu::compact_into_batch_bf16(seqs).st.ok());
}
