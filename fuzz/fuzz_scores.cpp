// Differential fuzzing of scoring and selection against the scalar double-precision
// reference (tests/reference/reference.hpp): random shapes (GQA groups, head dims, short
// and empty caches, W > L), every cache layout of tests/support/test_cache.hpp, every
// storage type (fp8 caches with bf16 queries), per-tensor key scales, every scoring parameter, query/key positions in
// any order, window weights and engine LSEs, a permuting executor. Checks:
//   * observation_scores within tolerance of the reference (finite data);
//   * the same scores bitwise under a permuting 3-worker executor and a dirty workspace;
//   * attention_scores on the reference's attention rows within tolerance;
//   * select equals the reference top-B on the library's own scores exactly, and on the
//     reference scores wherever the B-th and (B+1)-th candidates are not near-tied;
//   * with NaN/inf data: no crash, determinism, and selection's NaN rule.
#include "common.hpp"

namespace {

using namespace fuzz;

template <class T>
void run(FuzzedDataProvider& in) {
  const i64 hkv = in.ConsumeIntegralInRange<i64>(1, 3);
  const i64 group = in.ConsumeIntegralInRange<i64>(1, 4);
  static const i64 dims[] = {1, 2, 3, 5, 8, 16, 32, 64};
  const i64 d = in.PickValueInArray(dims);
  const i64 l = in.ConsumeIntegralInRange<i64>(0, 96);
  const i64 w = in.ConsumeIntegralInRange<i64>(1, 24);
  const i64 hq = hkv * group;
  const test::layout kind = in.PickValueInArray(test::kAllLayouts);
  static const i64 blocks[] = {1, 2, 3, 8, 16};
  const i64 block = in.PickValueInArray(blocks);
  const bool token_major_q = in.ConsumeBool();

  // Positions.
  ref::problem p;
  p.hq = hq;
  p.hkv = hkv;
  p.w = w;
  p.l = l;
  p.d = d;
  const int qmode = in.ConsumeIntegralInRange<int>(0, 3);
  for (i64 t = 0; t < w; ++t) {
    i64 pos = 0;
    switch (qmode) {
      case 0:
        pos = std::max<i64>(0, l - w + t);
        break;
      case 1:
        pos = in.ConsumeIntegralInRange<i64>(0, l + 4);
        break;
      case 2:
        pos = l / 2;
        break;
      default:
        pos = std::max<i64>(0, l - 1 - t);
    }
    p.qpos.push_back(pos);
  }
  const int kmode = in.ConsumeIntegralInRange<int>(0, 3);
  if (kmode != 0) {
    for (i64 j = 0; j < l; ++j) {
      i64 kp = j;
      if (kmode == 2) kp = j / 2;                                     // sorted, duplicates
      if (kmode == 3) kp = in.ConsumeIntegralInRange<i64>(0, l + 3);  // llama.cpp cells, any order
      p.kpos.push_back(kp);
    }
  }

  // Parameters.
  kvevict::scoring_params sp;
  ref::params rp;
  sp.domain = static_cast<kvevict::softmax_domain>(in.ConsumeIntegralInRange<int>(0, 1));
  sp.window = static_cast<kvevict::window_aggregation>(in.ConsumeIntegralInRange<int>(0, 4));
  sp.gqa = static_cast<kvevict::gqa_reduction>(in.ConsumeIntegralInRange<int>(0, 2));
  sp.order = static_cast<kvevict::gqa_order>(in.ConsumeIntegralInRange<int>(0, 1));
  sp.pool.kind = static_cast<kvevict::pooling_kind>(in.ConsumeIntegralInRange<int>(0, 2));
  sp.pool.kernel = 2 * in.ConsumeIntegralInRange<i64>(0, 4) + 1;
  sp.pool.count_padding = in.ConsumeBool();
  sp.protected_tail = in.ConsumeIntegralInRange<i64>(0, l + 2);
  rp.dom = sp.domain == kvevict::softmax_domain::visible ? ref::domain::visible : ref::domain::candidates;
  rp.window = static_cast<ref::agg>(static_cast<int>(sp.window));
  rp.reduce = static_cast<ref::gqa>(static_cast<int>(sp.gqa));
  rp.reduce_before_pool = sp.order == kvevict::gqa_order::before_pooling;
  rp.kind = static_cast<ref::pool>(static_cast<int>(sp.pool.kind));
  rp.kernel = sp.pool.kernel;
  rp.count_padding = sp.pool.count_padding;
  rp.protected_tail = sp.protected_tail;
  std::vector<float> weights;
  if (sp.window == kvevict::window_aggregation::weighted) {
    for (i64 t = 0; t < w; ++t) weights.push_back(static_cast<float>(in.ConsumeIntegralInRange<int>(0, 8)) / 4.0f);
    weights[static_cast<std::size_t>(w - 1)] += 0.5f;  // a sum >= FLT_MIN
    rp.weights.assign(weights.begin(), weights.end());
  }

  // Data: seeded normals, scaled, with a few byte-chosen overrides (maybe special values).
  const std::uint64_t seed = in.ConsumeIntegral<std::uint16_t>();
  const double scale = 0.25 + in.ConsumeIntegralInRange<int>(0, 12) * 0.25;
  p.q = test::normal(static_cast<std::size_t>(hq * w * d), seed, scale);
  p.k = test::normal(static_cast<std::size_t>(hkv * l * d), seed + 1);
  const bool special = in.ConsumeIntegralInRange<int>(0, 5) == 0;
  const int overrides = in.ConsumeIntegralInRange<int>(0, 8);
  for (int o = 0; o < overrides; ++o) {
    const bool key = in.ConsumeBool();
    std::vector<double>& v = key ? p.k : p.q;
    if (v.empty()) continue;
    const std::size_t at = in.ConsumeIntegralInRange<std::size_t>(0, v.size() - 1);
    v[at] = fuzz_float(in, special);
  }
  // Duplicate a key (exact score ties) sometimes.
  if (l >= 2 && in.ConsumeBool()) {
    const i64 a = in.ConsumeIntegralInRange<i64>(0, l - 1), b = in.ConsumeIntegralInRange<i64>(0, l - 1);
    for (i64 h = 0; h < hkv; ++h)
      for (i64 c = 0; c < d; ++c)
        p.k[static_cast<std::size_t>((h * l + b) * d + c)] = p.k[static_cast<std::size_t>((h * l + a) * d + c)];
  }
  using Q = kvevict::default_query_type_t<T>;  // fp8 caches: bf16 queries
  p.q = test::rounded<Q>(p.q);
  p.k = test::rounded<T>(p.k);
  // A per-tensor dequantisation scale (fp8 caches store k / scale): the cache holds p.k, the
  // reference sees p.k * scale (exact in double).
  const float scales[] = {1.0f, 0.03125f, 0.0371f, 3.0f};
  const float key_scale = scales[in.ConsumeIntegralInRange<int>(0, 3)];
  const std::vector<double> stored_k = p.k;
  for (double& x : p.k) x *= static_cast<double>(key_scale);
  bool finite = true;
  for (double x : p.q) finite = finite && std::isfinite(x);
  for (double x : p.k) finite = finite && std::isfinite(x);

  // Engine LSE (visible domain only): log-sum-exp of each query's visible, non-NaN logits.
  std::vector<float> lse;
  const bool use_lse = sp.domain == kvevict::softmax_domain::visible && finite && in.ConsumeBool();
  if (use_lse) {
    for (i64 q = 0; q < hq; ++q)
      for (i64 t = 0; t < w; ++t) {
        double m = -INFINITY;
        std::vector<double> logits;
        for (i64 j = 0; j < l; ++j) {
          const i64 kp = p.kpos.empty() ? j : p.kpos[static_cast<std::size_t>(j)];
          if (kp > p.qpos[static_cast<std::size_t>(t)]) continue;
          double dot = 0;
          for (i64 c = 0; c < d; ++c)
            dot += p.q[static_cast<std::size_t>((q * w + t) * d + c)] *
                   p.k[static_cast<std::size_t>(((q / group) * l + j) * d + c)];
          logits.push_back(dot / std::sqrt(static_cast<double>(d)));
          m = std::max(m, logits.back());
        }
        double z = 0;
        for (double x : logits) z += std::exp(x - m);
        lse.push_back(logits.empty() ? -std::numeric_limits<float>::infinity() : static_cast<float>(m + std::log(z)));
      }
  }

  auto keys = test::make_cache<T>(kind, hkv, l, d, stored_k, block, seed);
  keys.view.scale = key_scale;
  // llama.cpp layouts take int32 positions (every value fits: positions are small here).
  auto queries = test::make_queries<Q>(hq, w, d, p.q, p.qpos, token_major_q, test::int32_positions(kind));
  const std::vector<std::int32_t> kpos32(p.kpos.begin(), p.kpos.end());
  kvevict::observation_inputs oi;
  oi.key_positions = p.kpos.empty()                ? kvevict::index_ptr{}
                     : test::int32_positions(kind) ? kvevict::index_ptr{kpos32.data()}
                                                   : kvevict::index_ptr{p.kpos.data()};
  oi.weights = weights.empty() ? nullptr : weights.data();
  oi.lse = use_lse ? lse.data() : nullptr;
  const kvevict::layer_shape shape{hq, hkv, d, l, w};

  shuffled_executor shuffled{in.ConsumeIntegralInRange<int>(2, 4), in.ConsumeIntegral<std::uint8_t>()};
  std::vector<float> got(static_cast<std::size_t>(hkv * l) + 1, -7.0f), again(got.size(), -9.0f);
  std::vector<unsigned char> ws(kvevict::observation_scores_workspace_size(shape, sp) + 64, 0xab);
  kvevict::status st =
      kvevict::observation_scores(queries.view, keys.view, sp, {got.data(), hkv, l, l}, {ws.data(), ws.size()}, oi);
  FUZZ_REQUIRE(st.ok(), "%s", st.message());
  FUZZ_REQUIRE(got.back() == -7.0f, "wrote past the scores");
  const kvevict::executor exec = shuffled.get();
  std::vector<unsigned char> ws2(kvevict::observation_scores_workspace_size(shape, sp, exec) + 7, 0x5c);
  st = kvevict::observation_scores(queries.view, keys.view, sp, {again.data(), hkv, l, l},
                                   {ws2.data() + 7, ws2.size() - 7}, oi, exec);
  FUZZ_REQUIRE(st.ok(), "%s", st.message());
  FUZZ_REQUIRE(std::memcmp(got.data(), again.data(), static_cast<std::size_t>(hkv * l) * sizeof(float)) == 0,
               "executor changed the scores");

  std::vector<ref::vec> want;
  if (finite) {
    want = ref::scores(p, rp);
    double logit_magnitude = 0;  // the largest |q.k| / sqrt(d), the tolerance's float-logit term
    for (i64 q = 0; q < hq; ++q)
      for (i64 t = 0; t < w; ++t)
        for (i64 j = 0; j < l; ++j) {
          double dot = 0;
          for (i64 c = 0; c < d; ++c)
            dot += p.q[static_cast<std::size_t>((q * w + t) * d + c)] *
                   p.k[static_cast<std::size_t>(((q / group) * l + j) * d + c)];
          logit_magnitude = std::max(logit_magnitude, std::fabs(dot) / std::sqrt(static_cast<double>(d)));
        }
    i64 bh = 0, bj = 0;
    FUZZ_REQUIRE(scores_close(got.data(), want, l, &bh, &bj, logit_magnitude),
                 "head %lld token %lld: got %g want %g (L=%lld d=%lld)", static_cast<long long>(bh),
                 static_cast<long long>(bj), static_cast<double>(got[static_cast<std::size_t>(bh * l + bj)]),
                 want[static_cast<std::size_t>(bh)][static_cast<std::size_t>(bj)], static_cast<long long>(l),
                 static_cast<long long>(d));

    // attention_scores over the reference's own attention rows (for L = 0 an empty view with
    // zero strides and null data, which must be accepted).
    std::vector<float> rows(static_cast<std::size_t>(hq * w * l) + 1, 0.0f);
    for (i64 q = 0; q < hq; ++q) {
      const std::vector<ref::vec> a = ref::attention(p, rp, q);
      for (i64 t = 0; t < w; ++t)
        for (std::size_t j = 0; j < a[static_cast<std::size_t>(t)].size(); ++j)
          rows[static_cast<std::size_t>((q * w + t) * l) + j] = static_cast<float>(a[static_cast<std::size_t>(t)][j]);
    }
    std::vector<float> from_rows(static_cast<std::size_t>(hkv * l), -3.0f);
    std::vector<unsigned char> aws(kvevict::attention_scores_workspace_size(shape, sp));
    st =
        kvevict::attention_scores(kvevict::contiguous_attention(l > 0 ? rows.data() : nullptr, hq, w, l, p.qpos.data()),
                                  hkv, sp, {from_rows.data(), hkv, l, l}, {aws.data(), aws.size()}, oi.key_positions,
                                  weights.empty() ? nullptr : weights.data());
    FUZZ_REQUIRE(st.ok(), "%s", st.message());
    FUZZ_REQUIRE(scores_close(from_rows.data(), want, l, &bh, &bj), "attention_scores head %lld token %lld",
                 static_cast<long long>(bh), static_cast<long long>(bj));
  }

  // Selection: exact on the library's scores; against the reference where not near-tied.
  if (l == 0) return;
  const kvevict::selection_params sel{
      in.ConsumeIntegralInRange<i64>(0, l + 1),
      in.ConsumeBool() ? kvevict::protected_mode::inside_budget : kvevict::protected_mode::on_top_of_budget};
  const i64 budget = in.ConsumeIntegralInRange<i64>(0, l + 2);
  kvevict::keep_list keep(hkv, kvevict::select_capacity(hkv, l, kvevict::budget::tokens(budget), sel));
  std::vector<unsigned char> sws(kvevict::select_workspace_size(l, exec));
  st = kvevict::select(kvevict::const_score_view{got.data(), hkv, l, l}, kvevict::budget::tokens(budget), sel, keep,
                       {sws.data(), sws.size()}, exec);
  FUZZ_REQUIRE(st.ok(), "%s", st.message());
  const bool inside = sel.mode == kvevict::protected_mode::inside_budget;
  for (i64 h = 0; h < hkv; ++h) {
    const ref::vec lib_row(got.begin() + h * l, got.begin() + (h + 1) * l);
    FUZZ_REQUIRE(keep.head(h) == ref::keep(lib_row, budget, sel.protected_tail, inside), "select head %lld",
                 static_cast<long long>(h));
    if (finite) {
      const ref::vec& row = want[static_cast<std::size_t>(h)];
      const i64 protect = std::min(sel.protected_tail, l), cand = l - protect;
      const i64 k = kvevict::candidates_kept(budget, l, sel);
      if (!near_tie(row, cand, k))
        FUZZ_REQUIRE(keep.head(h) == ref::keep(row, budget, sel.protected_tail, inside),
                     "select head %lld differs from the reference keep-list", static_cast<long long>(h));
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  with_cache_dtype(in.ConsumeIntegral<std::uint8_t>(), [&](auto tag) { run<decltype(tag)>(in); });
  return 0;
}
