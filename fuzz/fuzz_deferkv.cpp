// Fuzzing of the stateful and helper APIs:
//   * DeferKV: random configurations (valid and not) and random sequences of reserve,
//     observe_prefill, observe_decode (right and wrong layer, step, cache length, head
//     counts), scores, mark_evicted and reset, against a shadow model of the documented
//     lifecycle: every call succeeds exactly when the model says so, a failed call leaves
//     the state's observable contents unchanged, and ready scores equal the reference
//     (weighted attention of the window and decode queries, weights eta^(T - t)).
//   * DapQ / RoPE: random rope_configs (head dims, partial rotary, pairings, theta, Llama-3
//     scaling) and positions: validation follows the documented domain; accepted rotations
//     match a double-precision rotation and compose (rotate to p, then by delta == rotate
//     to p + delta); pseudo-token helpers with random arguments.
#include "common.hpp"
#include "reference/rope.hpp"

namespace {
using namespace fuzz;

struct snapshot {
  bool ready;
  i64 steps, prompt;
  double z;
  std::vector<float> sums;
  bool operator==(const snapshot& o) const {
    return ready == o.ready && steps == o.steps && prompt == o.prompt && std::memcmp(&z, &o.z, sizeof(z)) == 0 &&
           sums.size() == o.sums.size() &&
           (sums.empty() || std::memcmp(sums.data(), o.sums.data(), sums.size() * sizeof(float)) == 0);
  }
};

template <class T>
snapshot snap(const kvevict::deferkv_state<T>& st, i64 heads, i64 tokens) {
  snapshot s{st.ready(), st.steps_observed(), st.prompt_tokens(), st.state_normaliser(), {}};
  for (i64 h = 0; h < heads; ++h)
    for (i64 j = 0; j < tokens; ++j) s.sums.push_back(st.state_sum(h, j));
  return s;
}

template <class T>
void deferkv(FuzzedDataProvider& in) {
  kvevict::deferkv_config cfg;
  cfg.window = in.ConsumeIntegralInRange<i64>(-1, 12);
  cfg.delay = in.ConsumeIntegralInRange<i64>(-1, 4);
  static const double etas[] = {0.9, 0.5, 1.0, 0.25, 0.0, 1.5, -0.1};
  cfg.eta = in.ConsumeIntegralInRange<int>(0, 9) < 8 ? in.PickValueInArray(etas) : std::nan("");
  cfg.decode_feedback = in.ConsumeIntegralInRange<int>(0, 3) != 0;
  cfg.temporal_weighting = in.ConsumeBool();
  cfg.domain = static_cast<kvevict::softmax_domain>(in.ConsumeIntegralInRange<int>(0, 1));
  cfg.gqa = static_cast<kvevict::gqa_reduction>(in.ConsumeIntegralInRange<int>(0, 2));
  cfg.pool.kind = static_cast<kvevict::pooling_kind>(in.ConsumeIntegralInRange<int>(0, 2));
  cfg.pool.kernel = in.ConsumeIntegralInRange<i64>(0, 7);
  cfg.pool.count_padding = in.ConsumeBool();
  const bool config_ok =
      cfg.window >= 0 && cfg.delay >= 0 && cfg.eta > 0.0 && cfg.eta <= 1.0 && cfg.gqa != kvevict::gqa_reduction::max &&
      (cfg.pool.kind == kvevict::pooling_kind::none || (cfg.pool.kernel >= 1 && cfg.pool.kernel % 2 == 1));
  const i64 layer = in.ConsumeIntegralInRange<i64>(0, 3);
  const i64 hkv = in.ConsumeIntegralInRange<i64>(1, 2), group = in.ConsumeIntegralInRange<i64>(1, 3);
  const i64 d = in.ConsumeIntegralInRange<i64>(1, 16), lp = in.ConsumeIntegralInRange<i64>(0, 40);
  const i64 wq = in.ConsumeIntegralInRange<i64>(1, 12);  // prompt window queries handed in
  const i64 max_steps = 5, hq = hkv * group;
  const test::layout kind = in.PickValueInArray(test::kAllLayouts);
  const std::uint64_t seed = in.ConsumeIntegral<std::uint16_t>();
  // Prompt keys and decoded keys in one cache; window and decode queries.
  std::vector<double> kd = test::rounded<T>(test::normal(static_cast<std::size_t>(hkv * (lp + max_steps) * d), seed));
  std::vector<double> qd = test::rounded<T>(test::normal(static_cast<std::size_t>(hq * wq * d), seed + 1, 1.5));
  std::vector<std::vector<double>> dq;
  for (i64 s = 0; s < max_steps; ++s)
    dq.push_back(
        test::rounded<T>(test::normal(static_cast<std::size_t>(hq * d), seed + 2 + static_cast<std::uint64_t>(s))));
  auto cache = test::make_cache<T>(kind, hkv, lp + max_steps, d, kd, 4, seed);
  std::vector<i64> wpos;
  for (i64 t = 0; t < wq; ++t) wpos.push_back(std::max<i64>(0, lp - wq + t));
  auto window = test::make_queries<T>(hq, wq, d, qd, wpos);

  kvevict::deferkv_state<T> st(cfg, layer);
  // Shadow model.
  enum class phase { unreserved, empty, prefilled, ready, evicted } ph = phase::unreserved;
  i64 res_heads = 0, res_tokens = 0, prompt = 0, steps = 0, heads_seen = 0, group_seen = 1;
  std::vector<i64> decode_order;  // steps observed, for the reference
  std::vector<i64> window_pos;    // positions of the last successful prefill's window

  const int ops = in.ConsumeIntegralInRange<int>(1, 14);
  for (int op = 0; op < ops; ++op) {
    const i64 sh = std::max<i64>(res_heads, 0), stok = std::max<i64>(res_tokens, 0);
    const snapshot before = snap(st, ph == phase::unreserved ? 0 : std::min<i64>(sh, 4),
                                 ph == phase::unreserved ? 0 : std::min<i64>(stok, 64));
    kvevict::status s;
    bool expect_ok = false;
    const int which = in.ConsumeIntegralInRange<int>(0, 5);
    if (which == 0) {  // reserve
      const i64 h = in.ConsumeBool() ? hkv : in.ConsumeIntegralInRange<i64>(-1, 3);
      const i64 t = in.ConsumeBool() ? lp : in.ConsumeIntegralInRange<i64>(-1, 50);
      expect_ok = h >= 1 && t >= 0;
      s = st.reserve(h, t);
      if (expect_ok) {
        ph = phase::empty;
        res_heads = h;
        res_tokens = t;
        prompt = steps = 0;
        decode_order.clear();
      }
    } else if (which == 1) {  // observe_prefill
      const i64 lay = in.ConsumeIntegralInRange<int>(0, 5) == 0 ? layer + 1 : layer;
      const i64 w_used = in.ConsumeIntegralInRange<i64>(1, wq);
      const i64 g_used = in.ConsumeIntegralInRange<int>(0, 7) == 0 ? group + 1 : group;
      const i64 p_used = in.ConsumeIntegralInRange<int>(0, 5) == 0 ? in.ConsumeIntegralInRange<i64>(0, lp) : lp;
      // The last w_used prompt queries, at the positions before p_used.
      std::vector<i64> ppos;
      for (i64 t = 0; t < w_used; ++t) ppos.push_back(std::max<i64>(0, p_used - w_used + t));
      kvevict::layer_inputs<T> li;
      li.keys = cache.view.first_tokens(p_used);
      li.queries = window.view;
      li.queries.num_queries = w_used;
      li.queries.positions = ppos.data();
      li.queries.data = window.view.data + (wq - w_used) * window.view.query_stride;
      li.queries.num_heads = hkv * g_used;
      const bool views_ok = hkv * g_used <= hq;  // (more query heads than the buffer holds: skip)
      if (!views_ok) continue;
      // The documented order: config, layer, phase, W' <= W, views, capacity.
      expect_ok = config_ok && lay == layer && ph == phase::empty && w_used <= cfg.window && hkv <= res_heads &&
                  p_used <= res_tokens;
      std::vector<unsigned char> ws(st.workspace_size({hkv * g_used, hkv, d, p_used + max_steps, w_used}));
      s = st.observe_prefill(lay, li, {ws.data(), ws.size()});
      if (expect_ok && s.ok()) {
        ph = cfg.decode_feedback && cfg.delay > 0 ? phase::prefilled : phase::ready;
        prompt = p_used;
        steps = 0;
        heads_seen = hkv;
        group_seen = g_used;
        decode_order.clear();
        decode_order.push_back(-w_used);  // remember W'
        window_pos = ppos;
      }
    } else if (which == 2) {  // observe_decode
      const i64 lay = in.ConsumeIntegralInRange<int>(0, 5) == 0 ? layer + 2 : layer;
      const i64 step = in.ConsumeIntegralInRange<int>(0, 4) == 0 ? in.ConsumeIntegralInRange<i64>(-1, 5) : steps;
      const i64 len = in.ConsumeIntegralInRange<int>(0, 4) == 0 ? in.ConsumeIntegralInRange<i64>(0, lp + max_steps)
                                                                : prompt + step + 1;
      if (len > lp + max_steps || len < 0 || step < 0 || step >= max_steps) continue;
      auto q1 = test::make_queries<T>(hq, 1, d, dq[static_cast<std::size_t>(step)], {prompt + step});
      kvevict::layer_inputs<T> li;
      li.keys = cache.view.first_tokens(len);
      li.queries = q1.view;
      li.queries.num_heads = heads_seen * group_seen <= hq && heads_seen > 0 ? heads_seen * group_seen : hq;
      expect_ok = lay == layer && ph == phase::prefilled && cfg.decode_feedback && step == steps &&
                  len == prompt + step + 1 && li.queries.num_heads == hkv * group_seen && heads_seen == hkv;
      std::vector<unsigned char> ws(
          st.workspace_size({li.queries.num_heads, hkv, d, lp + max_steps, std::max<i64>(wq, 1)}));
      s = st.observe_decode(lay, step, li, {ws.data(), ws.size()});
      if (expect_ok && s.ok()) {
        ++steps;
        decode_order.push_back(step);
        if (steps >= cfg.delay) ph = phase::ready;
      }
    } else if (which == 3) {  // scores
      const i64 n = prompt + steps;
      const bool right_shape = in.ConsumeIntegralInRange<int>(0, 4) != 0;
      const i64 cols = right_shape ? n : n + 1;
      std::vector<float> out(static_cast<std::size_t>(std::max<i64>(heads_seen, 1) * (cols + 1)), -5.0f);
      std::vector<unsigned char> ws(st.workspace_size({hq, hkv, d, lp + max_steps, wq}));
      expect_ok = ph == phase::ready && right_shape;
      s = st.scores({out.data(), heads_seen, cols, cols}, {ws.data(), ws.size()});
      if (!s.ok()) {
        for (float x : out) FUZZ_REQUIRE(x == -5.0f, "a failed scores() wrote");
      } else if (config_ok) {
        // The reference: one problem whose queries are the window (W') then the decode
        // queries, each weighted eta^(T - t), GQA reduced before pooling.
        const i64 w_used = decode_order.empty() ? 0 : -decode_order[0];
        ref::problem p;
        p.hq = heads_seen * group_seen;
        p.hkv = heads_seen;
        p.d = d;
        p.l = n;
        p.w = w_used + steps;
        for (i64 q = 0; q < p.hq; ++q)
          for (i64 t = 0; t < p.w; ++t)
            for (i64 c = 0; c < d; ++c) {
              const double x = t < w_used
                                   ? qd[static_cast<std::size_t>((q * wq + (wq - w_used) + t) * d + c)]
                                   : dq[static_cast<std::size_t>(t - w_used)][static_cast<std::size_t>(q * d + c)];
              p.q.push_back(x);
            }
        for (i64 h = 0; h < heads_seen; ++h)
          for (i64 j = 0; j < n; ++j)
            for (i64 c = 0; c < d; ++c) p.k.push_back(kd[static_cast<std::size_t>((h * (lp + max_steps) + j) * d + c)]);
        for (i64 t = 0; t < w_used; ++t) p.qpos.push_back(window_pos[static_cast<std::size_t>(t)]);
        for (i64 sidx = 0; sidx < steps; ++sidx) p.qpos.push_back(prompt + sidx);
        ref::params rp;
        rp.dom = cfg.domain == kvevict::softmax_domain::visible ? ref::domain::visible : ref::domain::candidates;
        rp.window = ref::agg::weighted;
        rp.reduce = static_cast<ref::gqa>(static_cast<int>(cfg.gqa));
        rp.reduce_before_pool = true;
        rp.kind = static_cast<ref::pool>(static_cast<int>(cfg.pool.kind));
        rp.kernel = cfg.pool.kernel;
        rp.count_padding = cfg.pool.count_padding;
        rp.protected_tail = std::min(cfg.window, prompt) + steps;
        const double eta = cfg.temporal_weighting ? cfg.eta : 1.0;
        for (i64 t = 0; t < p.w; ++t) rp.weights.push_back(std::pow(eta, static_cast<double>(p.w - 1 - t)));
        const std::vector<ref::vec> want = ref::scores(p, rp);
        std::vector<float> dense(static_cast<std::size_t>(heads_seen * n));
        for (i64 h = 0; h < heads_seen; ++h)
          for (i64 j = 0; j < n; ++j)
            dense[static_cast<std::size_t>(h * n + j)] = out[static_cast<std::size_t>(h * cols + j)];
        i64 bh = 0, bj = 0;
        FUZZ_REQUIRE(scores_close(dense.data(), want, n, &bh, &bj), "deferkv scores head %lld token %lld: %g vs %g",
                     static_cast<long long>(bh), static_cast<long long>(bj),
                     static_cast<double>(dense[static_cast<std::size_t>(bh * n + bj)]),
                     want[static_cast<std::size_t>(bh)][static_cast<std::size_t>(bj)]);
      }
    } else if (which == 4) {
      expect_ok = ph == phase::ready;
      s = st.mark_evicted();
      if (expect_ok) ph = phase::evicted;
    } else {
      st.reset();
      if (ph != phase::unreserved) ph = phase::empty;
      prompt = steps = 0;
      decode_order.clear();
      continue;
    }
    FUZZ_REQUIRE(s.ok() == expect_ok, "op %d: the lifecycle model expected %s, got: %s", which,
                 expect_ok ? "success" : "an error", s.ok() ? "ok" : s.message());
    if (!s.ok()) {
      FUZZ_REQUIRE(s.argument()[0] != '\0', "an error without an argument name");
      FUZZ_REQUIRE(snap(st, before.sums.empty() ? 0 : std::min<i64>(sh, 4),
                        before.sums.empty() ? 0 : std::min<i64>(stok, 64)) == before,
                   "a failed call changed the state (%s)", s.message());
    }
  }
}

void rope(FuzzedDataProvider& in) {
  kvevict::rope_config c;
  static const i64 dims[] = {2, 4, 6, 8, 16, 64, 128, 1, 0, 3, 1024, 1026};
  c.head_dim = in.PickValueInArray(dims);
  static const i64 rot[] = {0, 0, 2, 4, 8, 3, -2, 32};
  c.rotary_dim = in.PickValueInArray(rot);
  static const double thetas[] = {10000.0, 500000.0, 1e6, 2.0, 1.0, 0.5};
  c.theta = in.ConsumeIntegralInRange<int>(0, 12) == 0 ? std::nan("") : in.PickValueInArray(thetas);
  c.pairing = static_cast<kvevict::rope_pairing>(in.ConsumeIntegralInRange<int>(0, 1));
  c.llama3.enabled = in.ConsumeBool();
  if (in.ConsumeBool()) c.llama3.factor = in.ConsumeIntegralInRange<int>(0, 16) / 2.0;
  if (in.ConsumeBool()) c.llama3.low_freq_factor = in.ConsumeIntegralInRange<int>(0, 8) / 2.0;
  const i64 r = c.rotary_dim == 0 ? c.head_dim : c.rotary_dim;
  const bool valid =
      c.head_dim >= 2 && r >= 2 && r <= c.head_dim && r % 2 == 0 && c.theta > 1.0 &&
      (!c.llama3.enabled || (c.llama3.factor >= 1.0 && c.llama3.high_freq_factor > c.llama3.low_freq_factor &&
                             c.llama3.low_freq_factor > 0.0 && c.llama3.original_max_position > 0.0));
  const i64 heads = in.ConsumeIntegralInRange<i64>(1, 3), n = in.ConsumeIntegralInRange<i64>(1, 4);
  const i64 qd = c.head_dim >= 1 ? c.head_dim : 4;
  std::vector<float> q(static_cast<std::size_t>(heads * n * qd));
  for (float& x : q) x = fuzz_float(in, false);
  std::vector<i64> pos;
  for (i64 t = 0; t < n; ++t) pos.push_back(in.ConsumeIntegralInRange<i64>(0, 1 << 20));
  const i64 delta = in.ConsumeIntegralInRange<i64>(-(1 << 20), 1 << 20);
  const auto view = kvevict::contiguous_queries<const float>(q.data(), heads, n, qd, pos.data());
  std::vector<float> out(q.size() + 1, -2.0f), out2(q.size(), 0.0f), out3(q.size(), 0.0f);
  std::vector<i64> opos(static_cast<std::size_t>(n) + 1, -1), opos2(static_cast<std::size_t>(n));
  const kvevict::status s = kvevict::dapq_rotate_to(view, c, delta < 0 ? -delta : delta, out.data(), opos.data());
  const bool must_fail = !valid || c.head_dim != qd || qd > 1024;
  FUZZ_REQUIRE(s.ok() == !must_fail, "rope validation: expected %s, got %s", must_fail ? "an error" : "ok",
               s.ok() ? "ok" : s.message());
  FUZZ_REQUIRE(out.back() == -2.0f && opos.back() == -1, "wrote past the rotated queries");
  if (!s.ok()) return;
  const i64 first = delta < 0 ? -delta : delta;
  const std::vector<long double> inv_freq = ref::ref_inv_freq(c);
  // Against double precision: pre-RoPE query t rotated to position first + t.
  for (i64 h = 0; h < heads; ++h)
    for (i64 t = 0; t < n; ++t) {
      const float* x = q.data() + (h * n + t) * qd;
      const float* y = out.data() + (h * n + t) * qd;
      double norm = 0;
      for (i64 cc = 0; cc < qd; ++cc) norm += static_cast<double>(x[cc]) * x[cc];
      const double tol = 1e-5 * std::sqrt(norm) + 1e-30;
      for (i64 i = 0; i < r / 2; ++i) {
        const i64 a = c.pairing == kvevict::rope_pairing::neox ? i : 2 * i;
        const i64 b = c.pairing == kvevict::rope_pairing::neox ? i + r / 2 : 2 * i + 1;
        const double ang = static_cast<double>(first + t) * static_cast<double>(inv_freq[static_cast<std::size_t>(i)]);
        const double ya = x[a] * std::cos(ang) - x[b] * std::sin(ang), yb = x[a] * std::sin(ang) + x[b] * std::cos(ang);
        FUZZ_REQUIRE(std::fabs(ya - y[a]) <= tol && std::fabs(yb - y[b]) <= tol, "rope pair %lld",
                     static_cast<long long>(i));
      }
      for (i64 cc = r; cc < qd; ++cc) FUZZ_REQUIRE(y[cc] == x[cc], "channel past rotary_dim changed");
      FUZZ_REQUIRE(opos[static_cast<std::size_t>(t)] == first + t, "rotated positions");
    }
  // Composition: rotate to p then by delta2 == rotate to p + delta2.
  const i64 delta2 = in.ConsumeIntegralInRange<i64>(0, 4096);
  kvevict::query_view<const float> rotated;
  FUZZ_REQUIRE(kvevict::dapq_rotate_to(view, c, first, out2.data(), opos2.data(), &rotated).ok(), "rotate_to");
  FUZZ_REQUIRE(kvevict::dapq_rerotate(rotated, c, delta2, out3.data(), opos.data()).ok(), "rerotate");
  FUZZ_REQUIRE(kvevict::dapq_rotate_to(view, c, first + delta2, out2.data(), opos2.data()).ok(), "rotate_to p + delta");
  for (std::size_t i = 0; i < out2.size(); ++i) {
    const double tol = 1e-4 * (std::fabs(out2[i]) + 1.0);
    FUZZ_REQUIRE(std::fabs(static_cast<double>(out3[i]) - out2[i]) <= tol, "RoPE rotations do not compose at %zu", i);
  }
  for (i64 t = 0; t < n; ++t)
    FUZZ_REQUIRE(opos[static_cast<std::size_t>(t)] == opos2[static_cast<std::size_t>(t)], "composed positions");
}

void pseudo_tokens(FuzzedDataProvider& in) {
  const i64 prompt_len = in.ConsumeIntegralInRange<i64>(-1, 40);
  i64 first = in.ConsumeIntegralInRange<i64>(-1, 40), last = in.ConsumeIntegralInRange<i64>(-1, 40);
  if (in.ConsumeIntegralInRange<int>(0, 7) == 0) first = interesting(in);
  i64 wanted = 0;  // first + last, when it fits (first near INT64_MAX: rejected, no overflow)
  const bool valid =
      prompt_len >= 1 && first >= 0 && last >= 0 && !__builtin_add_overflow(first, last, &wanted) && wanted >= 1;
  if (valid && wanted > 4096) return;  // the caller's out array would be that long
  std::vector<std::int32_t> prompt(static_cast<std::size_t>(std::max<i64>(prompt_len, 1)));
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::int32_t>(1000 + i);
  std::vector<std::int32_t> out(static_cast<std::size_t>(valid ? first + last : 1) + 1, -1);
  const kvevict::status s = kvevict::dapq_pseudo_tokens_first_last(prompt.data(), prompt_len, first, last, out.data());
  FUZZ_REQUIRE(s.ok() == valid, "first_last: %s", s.message());
  FUZZ_REQUIRE(out.back() == -1, "wrote past out");
  if (valid) {
    for (i64 i = 0; i < first; ++i)
      FUZZ_REQUIRE(out[static_cast<std::size_t>(i)] == prompt[static_cast<std::size_t>(std::min(i, prompt_len - 1))],
                   "first");
    for (i64 i = 0; i < last; ++i)
      FUZZ_REQUIRE(out[static_cast<std::size_t>(first + i)] ==
                       prompt[static_cast<std::size_t>(std::max<i64>(0, prompt_len - last + i))],
                   "last");
  }
  const i64 count = in.ConsumeIntegralInRange<i64>(-1, 64), phrase_len = in.ConsumeIntegralInRange<i64>(-1, 5);
  std::vector<std::int32_t> out2(static_cast<std::size_t>(std::max<i64>(count, 1)) + 1, -1);
  const kvevict::status s2 = kvevict::dapq_pseudo_tokens_phrase(
      prompt.data(), std::min<i64>(phrase_len, static_cast<i64>(prompt.size())), count, out2.data());
  FUZZ_REQUIRE(s2.ok() == (phrase_len >= 1 && count >= 1), "phrase: %s", s2.message());
  FUZZ_REQUIRE(out2.back() == -1, "phrase wrote past out");
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  switch (in.ConsumeIntegralInRange<int>(0, 4)) {
    case 0:
    case 1:
      with_dtype(in.ConsumeIntegral<std::uint8_t>(), [&](auto tag) { deferkv<decltype(tag)>(in); });
      break;
    case 2:
    case 3:
      rope(in);
      break;
    default:
      pseudo_tokens(in);
  }
  return 0;
}
