// Decode-time budget maintenance (compressor_options::decoding, issue 29): a sequence decodes
// far past its prompt while the compressor's one call per layer holds every layer's cache at
// target + N. Checked three ways: against the slow reference (scalar, double) for SnapKV's
// decode scorer; bit for bit against the prompt path run by hand at every round (the same
// scorer as a one-shot policy over the same cache and window), for every scope, allocation and
// scorer; and for the contract every entry point keeps (refusals that leave the cache as it
// was, determinism).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "reference/reference.hpp"
#include "support/checksum.hpp"
#include "support/near_tie.hpp"
#include "support/scoring_config.hpp"
#include "support/test_cache.hpp"
#include "tsan/thread_pool.hpp"

namespace {

using i64 = std::int64_t;
using kvevict::bf16;
using kvevict::fp16;

/// A small model decoding one sequence: every layer's K and V caches in a test layout, the
/// true position each row of each head holds, and every token's K, V and query (a function of
/// its layer and position, so two generations made alike hold the same data).
template <class T>
struct generation {
  using Q = kvevict::default_query_type_t<T>;
  i64 layers = 0, hq = 0, hkv = 0, d = 0, capacity = 0;
  std::uint64_t seed = 0;
  std::vector<test::test_cache<T>> keys, values;    // [layers]
  std::vector<std::vector<std::vector<i64>>> rows;  // [layer][head]: the position of each row
  std::vector<i64> length;                          // [layer]
  i64 next = 0;                                     // the next token's position

  generation(test::layout kind, i64 layers_, i64 hq_, i64 hkv_, i64 d_, i64 capacity_, std::uint64_t seed_)
      : layers(layers_), hq(hq_), hkv(hkv_), d(d_), capacity(capacity_), seed(seed_) {
    const std::vector<double> zero(static_cast<std::size_t>(hkv * capacity * d), 0.0);
    for (i64 l = 0; l < layers; ++l) {
      keys.push_back(test::make_cache<T>(kind, hkv, capacity, d, zero, 8, seed + 11 * static_cast<std::uint64_t>(l)));
      values.push_back(
          test::make_cache<T>(kind, hkv, capacity, d, zero, 8, seed + 13 + 11 * static_cast<std::uint64_t>(l)));
    }
    rows.assign(static_cast<std::size_t>(layers), std::vector<std::vector<i64>>(static_cast<std::size_t>(hkv)));
    length.assign(static_cast<std::size_t>(layers), 0);
  }
  std::uint64_t token_seed(i64 layer, i64 pos, i64 what) const {
    return seed * 1000003u + static_cast<std::uint64_t>((layer * 100000 + pos) * 3 + what);
  }
  /// Token `pos`'s keys [Hkv][d] (as stored), values, and queries [Hq][d] (as the query type stores them).
  std::vector<double> key(i64 layer, i64 pos) const {
    return test::rounded<T>(test::normal(static_cast<std::size_t>(hkv * d), token_seed(layer, pos, 0), 1.3));
  }
  std::vector<double> value(i64 layer, i64 pos) const {
    return test::rounded<T>(test::normal(static_cast<std::size_t>(hkv * d), token_seed(layer, pos, 1)));
  }
  std::vector<double> query(i64 layer, i64 pos) const {
    return test::rounded<Q>(test::normal(static_cast<std::size_t>(hq * d), token_seed(layer, pos, 2), 1.3));
  }
  /// Writes token `pos` into layer `layer`'s next row.
  void append(i64 layer, i64 pos) {
    const std::size_t l = static_cast<std::size_t>(layer);
    const std::vector<double> k = key(layer, pos), v = value(layer, pos);
    const i64 slot = length[l];
    REQUIRE(slot < capacity);
    for (i64 h = 0; h < hkv; ++h) {
      for (i64 c = 0; c < d; ++c) {
        keys[l].at(h, slot, c) = test::store<T>(k[static_cast<std::size_t>(h * d + c)]);
        values[l].at(h, slot, c) = test::store<T>(v[static_cast<std::size_t>(h * d + c)]);
      }
      rows[l][static_cast<std::size_t>(h)].push_back(pos);
    }
    ++length[l];
  }
  /// Queries [Hq, n, d] of tokens first .. first + n - 1 at layer `layer`.
  test::test_queries<Q> queries(i64 layer, i64 first, i64 n) const {
    std::vector<double> dense(static_cast<std::size_t>(hq * n * d));
    std::vector<i64> pos;
    for (i64 t = 0; t < n; ++t) {
      const std::vector<double> q = query(layer, first + t);
      for (i64 h = 0; h < hq; ++h)
        for (i64 c = 0; c < d; ++c)
          dense[static_cast<std::size_t>((h * n + t) * d + c)] = q[static_cast<std::size_t>(h * d + c)];
      pos.push_back(first + t);
    }
    return test::make_queries<Q>(hq, n, d, dense, pos);
  }
  kvevict::cache_view<T> kview(i64 l) const {
    return keys[static_cast<std::size_t>(l)].view.first_tokens(length[static_cast<std::size_t>(l)]);
  }
  kvevict::cache_view<T> vview(i64 l) const {
    return values[static_cast<std::size_t>(l)].view.first_tokens(length[static_cast<std::size_t>(l)]);
  }
  /// An eviction of layer `l` reported by head lengths and -1-padded kept row indices.
  void evicted(i64 l, const std::vector<i64>& head_lengths, const std::vector<i64>& padded, i64 per_head) {
    const std::size_t ls = static_cast<std::size_t>(l);
    i64 longest = 0;
    for (i64 h = 0; h < hkv; ++h) {
      std::vector<i64>& r = rows[ls][static_cast<std::size_t>(h)];
      std::vector<i64> kept;
      for (i64 i = 0; i < head_lengths[static_cast<std::size_t>(h)]; ++i)
        kept.push_back(r[static_cast<std::size_t>(padded[static_cast<std::size_t>(h * per_head + i)])]);
      r = kept;
      longest = std::max(longest, head_lengths[static_cast<std::size_t>(h)]);
    }
    length[ls] = longest;
  }
  /// Every row each head holds, as stored, in row order.
  std::vector<double> stored(i64 l) const {
    const std::size_t ls = static_cast<std::size_t>(l);
    return stored_in(keys[ls], values[ls], rows[ls]);
  }
  /// The rows `head_rows` says each head holds, read from the caches k and v.
  std::vector<double> stored_in(const test::test_cache<T>& k, const test::test_cache<T>& v,
                                const std::vector<std::vector<i64>>& head_rows) const {
    std::vector<double> out;
    for (i64 h = 0; h < hkv; ++h)
      for (i64 j = 0; j < static_cast<i64>(head_rows[static_cast<std::size_t>(h)].size()); ++j)
        for (i64 c = 0; c < d; ++c) {
          out.push_back(test::load(k.at(h, j, c)));
          out.push_back(test::load(v.at(h, j, c)));
        }
    return out;
  }
};

/// One sequence's io at one layer, with the outputs the harness reads back.
template <class T>
struct layer_call {
  using Q = kvevict::default_query_type_t<T>;
  kvevict::sequence_io<T, Q> io;
  std::vector<i64> head_lengths, padded;
  test::test_queries<Q> q;
};

template <class T>
layer_call<T> make_call(const generation<T>& g, i64 layer, kvevict::sequence_event event, i64 first_query,
                        i64 num_queries, void* state, i64 per_head_capacity) {
  layer_call<T> c;
  c.q = g.queries(layer, first_query, num_queries);
  c.io.event = event;
  c.io.keys = g.kview(layer);
  c.io.values = g.vview(layer);
  c.io.queries = c.q.view;
  c.io.state = state;
  c.head_lengths.assign(static_cast<std::size_t>(g.hkv), -1);
  c.padded.assign(static_cast<std::size_t>(g.hkv * per_head_capacity), -1);
  return c;
}

template <class T>
struct planned {
  kvevict::compressor c;
  kvevict::workspace ws;
  std::vector<std::uint64_t> state;
  std::vector<kvevict::layer_cache<T>> layers;
  explicit planned(const kvevict::compressor_options& o) {
    const kvevict::status st = kvevict::compressor::plan(o, &c);
    INFO(st.message());
    REQUIRE(st.ok());
    ws = kvevict::workspace(c.workspace_size());
    reset();
  }
  void reset() {
    state.assign(c.sequence_state_size() / 8 + 1, 0);
    REQUIRE(c.reset_sequence(state.data(), c.sequence_state_size()).ok());
  }
  void* state_ptr() { return c.sequence_state_size() > 0 ? state.data() : nullptr; }
  /// One layer's call for `g`; applies an eviction to g's bookkeeping. Returns the report.
  /// `spare`: the fresh blocks every call hands as its destination; under
  /// compaction::out_of_place they are swapped with g's when the call evicts (as an engine
  /// moves a sequence to its new blocks).
  kvevict::sequence_report run(generation<T>& g, i64 layer, kvevict::sequence_event event, i64 first_query,
                               i64 num_queries, generation<T>* spare = nullptr) {
    layer_call<T> call = make_call(g, layer, event, first_query, num_queries, state_ptr(), c.keep_capacity_per_head());
    call.io.head_lengths = call.head_lengths.data();
    call.io.padded_indices = call.padded.data();
    layers.clear();
    for (i64 l = 0; l < g.layers; ++l) {
      layers.push_back(kvevict::layer_cache<T>(g.kview(l), g.vview(l)));
      if (spare != nullptr) {
        layers.back().dst_keys = spare->keys[static_cast<std::size_t>(l)].view;
        layers.back().dst_values = spare->values[static_cast<std::size_t>(l)].view;
      }
    }
    if (spare != nullptr) {
      call.io.dst_keys = spare->keys[static_cast<std::size_t>(layer)].view;
      call.io.dst_values = spare->values[static_cast<std::size_t>(layer)].view;
    }
    call.io.layers = layers.data();
    kvevict::sequence_report r;
    const kvevict::status st = c.run(layer, &call.io, 1, &r, ws);
    INFO("layer " << layer << ": " << st.message());
    REQUIRE(st.ok());
    if (r.action == kvevict::sequence_action::evicted) {
      const bool every_layer = c.options().scope == kvevict::selection_scope::per_sequence;
      for (i64 l = every_layer ? 0 : layer; l < (every_layer ? g.layers : layer + 1); ++l) {
        g.evicted(l, call.head_lengths, call.padded, c.keep_capacity_per_head());
        if (spare != nullptr && c.options().compact == kvevict::compaction::out_of_place) {
          std::swap(g.keys[static_cast<std::size_t>(l)], spare->keys[static_cast<std::size_t>(l)]);
          std::swap(g.values[static_cast<std::size_t>(l)], spare->values[static_cast<std::size_t>(l)]);
        }
      }
    }
    return r;
  }
};

kvevict::window_config decode_snapkv(i64 window) {
  kvevict::window_config w;
  w.window = window;
  w.scoring.pool = {kvevict::pooling_kind::avg, 3, true};
  w.protect = kvevict::protected_mode::inside_budget;
  return w;
}

struct shape {
  i64 layers = 2, hq = 4, hkv = 2, d = 7;
};

}  // namespace

TEMPLATE_TEST_CASE("decode-time compressions keep what the reference keeps (SnapKV over the last decode queries)",
                   "[decoding]", float, bf16, fp16) {
  using T = TestType;
  const shape s;
  const i64 prompt = 37, steps = 220, target = 20, interval = 7, window = 4;
  for (test::layout kind : {test::layout::contiguous, test::layout::paged_nhd, test::layout::token_major}) {
    INFO(test::name(kind));
    kvevict::compressor_options o;
    o.model = {s.layers, s.hq, s.hkv, s.d, 0, kvevict::dtype_of<T>::value};
    o.policy = kvevict::policy::snapkv(decode_snapkv(6));
    o.per_head = kvevict::budget::tokens(16);
    o.sharing = kvevict::block_sharing::none;
    o.limits.max_tokens = prompt + steps;
    o.decoding.target = kvevict::budget::tokens(target);
    o.decoding.interval = interval;
    o.decoding.policy = kvevict::policy::snapkv(decode_snapkv(window));
    planned<T> a(o);
    generation<T> g(kind, s.layers, s.hq, s.hkv, s.d, prompt + steps, 5);
    for (i64 l = 0; l < s.layers; ++l) {
      for (i64 p = 0; p < prompt; ++p) g.append(l, p);
      REQUIRE(a.run(g, l, kvevict::sequence_event::prefill_end, prompt - 6, 6).action ==
              kvevict::sequence_action::evicted);
    }
    const kvevict::window_config w = decode_snapkv(window);
    const test::scoring_config sc =
        test::make_config(w.scoring.domain, w.scoring.window, w.scoring.gqa, w.scoring.order, w.scoring.pool.kind,
                          w.scoring.pool.kernel, window);
    i64 rounds = 0, compared = 0;
    for (i64 t = 0; t < steps; ++t) {
      const i64 pos = prompt + t;
      for (i64 l = 0; l < s.layers; ++l) {
        g.append(l, pos);
        const i64 before = g.length[static_cast<std::size_t>(l)];
        // The reference's round, from the rows the layer holds (row j at position j, as the
        // compressor sees a cache without key_positions) and the last `window` decode queries.
        ref::problem p;
        p.hq = s.hq;
        p.hkv = s.hkv;
        p.d = s.d;
        p.l = before;
        p.w = std::min<i64>(window, t + 1);
        for (i64 qh = 0; qh < s.hq; ++qh)
          for (i64 k = 0; k < p.w; ++k) {
            const std::vector<double> q = g.query(l, pos - p.w + 1 + k);
            for (i64 c = 0; c < s.d; ++c) p.q.push_back(q[static_cast<std::size_t>(qh * s.d + c)]);
          }
        for (i64 k = 0; k < p.w; ++k) p.qpos.push_back(pos - p.w + 1 + k);
        for (i64 h = 0; h < s.hkv; ++h)
          for (i64 j = 0; j < before; ++j) {
            const std::vector<double> k =
                g.key(l, g.rows[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)][static_cast<std::size_t>(j)]);
            for (i64 c = 0; c < s.d; ++c) p.k.push_back(k[static_cast<std::size_t>(h * s.d + c)]);
          }
        const std::vector<std::vector<i64>> held = g.rows[static_cast<std::size_t>(l)];
        const kvevict::sequence_report r = a.run(g, l, kvevict::sequence_event::decode, pos, 1);
        const bool expect = before > target + interval;  // SnapKV keeps `target` rows, its window inside
        REQUIRE((r.action == kvevict::sequence_action::evicted) == expect);
        REQUIRE(g.length[static_cast<std::size_t>(l)] <= target + interval);
        if (!expect) continue;
        ++rounds;
        REQUIRE(r.length == target);
        REQUIRE(r.dropped == before - target);
        const std::vector<ref::vec> scores = ref::scores(p, sc.ref);
        for (i64 h = 0; h < s.hkv; ++h) {
          const ref::vec& row = scores[static_cast<std::size_t>(h)];
          if (test::near_tie_at(row, before - window, target - window)) continue;
          ++compared;
          const std::vector<i64> keep = ref::keep(row, target, window, true);
          std::vector<i64> want;
          for (i64 j : keep) want.push_back(held[static_cast<std::size_t>(h)][static_cast<std::size_t>(j)]);
          REQUIRE(g.rows[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)] == want);
        }
        // The rows the compaction left are the kept tokens' K and V.
        for (i64 h = 0; h < s.hkv; ++h)
          for (i64 j = 0; j < target; ++j) {
            const i64 at =
                g.rows[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)][static_cast<std::size_t>(j)];
            const std::vector<double> k = g.key(l, at), v = g.value(l, at);
            for (i64 c = 0; c < s.d; ++c) {
              REQUIRE(test::load(g.keys[static_cast<std::size_t>(l)].at(h, j, c)) ==
                      k[static_cast<std::size_t>(h * s.d + c)]);
              REQUIRE(test::load(g.values[static_cast<std::size_t>(l)].at(h, j, c)) ==
                      v[static_cast<std::size_t>(h * s.d + c)]);
            }
          }
      }
    }
    // 220 steps from 16 rows: a round every 8 tokens per layer once the cache reaches 28.
    REQUIRE(rounds >= 2 * 25);
    REQUIRE(compared >= rounds);  // nearly every head decided
  }
}

namespace {

/// A generation under compressor_options::decoding, and the same generation with every
/// decode-time round made by hand: the prompt's compressor without decoding (`prompt`), and
/// at each round a one-shot compressor whose policy is the decode scorer and whose budget is
/// the target (`round`), handed the last decode queries at prefill_end. The two caches must be
/// equal, bit for bit, after every step. Returns the rounds seen.
template <class T>
i64 decode_equals_prompt_path(const kvevict::compressor_options& o, test::layout kind, i64 prompt, i64 steps,
                              i64 prompt_window, bool check_trigger) {
  const shape s{o.model.num_layers, o.model.num_query_heads, o.model.num_kv_heads, o.model.head_dim};
  kvevict::compressor_options po = o;
  po.decoding = kvevict::decode_budget{};
  kvevict::compressor_options ro = o;
  ro.decoding = kvevict::decode_budget{};
  ro.policy = o.decoding.policy;
  ro.per_head = o.decoding.target;
  planned<T> a(o), by_prompt(po), by_round(ro);
  const i64 w = std::max<i64>(1, by_round.c.observation_window());
  REQUIRE(a.c.keep_capacity_per_head() >= by_round.c.keep_capacity_per_head());
  generation<T> ga(kind, s.layers, s.hq, s.hkv, s.d, prompt + steps, 9);
  generation<T> gb2(kind, s.layers, s.hq, s.hkv, s.d, prompt + steps, 9);  // made alike (views into its own buffers)
  const bool h2o_prompt = o.policy.kind() == kvevict::policy_kind::h2o;
  const i64 first_q = h2o_prompt ? 0 : prompt - prompt_window;
  const i64 nq = h2o_prompt ? prompt : prompt_window;
  for (i64 l = 0; l < s.layers; ++l)
    for (i64 p = 0; p < prompt; ++p) {
      ga.append(l, p);
      gb2.append(l, p);
    }
  for (i64 l = 0; l < s.layers; ++l) {
    a.run(ga, l, kvevict::sequence_event::prefill_end, first_q, nq);
    by_prompt.run(gb2, l, kvevict::sequence_event::prefill_end, first_q, nq);
  }
  const bool shared = o.scope == kvevict::selection_scope::per_sequence;
  std::vector<i64> rows_after(static_cast<std::size_t>(s.layers), -1);
  i64 rounds = 0;
  for (i64 t = 0; t < steps; ++t) {
    const i64 pos = prompt + t;
    std::vector<bool> evicted(static_cast<std::size_t>(s.layers), false);
    std::vector<i64> before(static_cast<std::size_t>(s.layers));
    for (i64 l = 0; l < s.layers; ++l) {
      ga.append(l, pos);
      before[static_cast<std::size_t>(l)] = ga.length[static_cast<std::size_t>(l)];
      evicted[static_cast<std::size_t>(l)] =
          a.run(ga, l, kvevict::sequence_event::decode, pos, 1).action == kvevict::sequence_action::evicted;
    }
    std::vector<bool> prompt_evicted(static_cast<std::size_t>(s.layers), false);
    for (i64 l = 0; l < s.layers; ++l) {
      gb2.append(l, pos);
      prompt_evicted[static_cast<std::size_t>(l)] =
          by_prompt.run(gb2, l, kvevict::sequence_event::decode, pos, 1).action == kvevict::sequence_action::evicted;
    }
    const std::size_t last = static_cast<std::size_t>(s.layers - 1);
    std::vector<bool> round(static_cast<std::size_t>(s.layers));
    for (i64 l = 0; l < s.layers; ++l) {
      const std::size_t ls = static_cast<std::size_t>(l);
      round[ls] = shared ? evicted[last] && !prompt_evicted[last] : evicted[ls] && !prompt_evicted[ls];
      if (!round[ls]) continue;
      if (shared && l == 0) by_round.reset();
      const i64 n = std::min<i64>(w, t + 1);
      const kvevict::sequence_report r = by_round.run(gb2, l, kvevict::sequence_event::prefill_end, pos - n + 1, n);
      if (!shared || ls == last) {
        REQUIRE(r.action == kvevict::sequence_action::evicted);
        ++rounds;
      }
    }
    for (std::size_t ls = 0; ls < round.size() && check_trigger; ++ls) {
      if (!round[ls]) continue;
      // the first step past target + N compresses (lengths grow by one per step)
      const i64 after = gb2.length[ls];
      if (rows_after[ls] >= 0) REQUIRE(after == rows_after[ls]);
      rows_after[ls] = after;
      REQUIRE(before[ls] - after == o.decoding.interval + 1);
    }
    for (i64 l = 0; l < s.layers; ++l) {
      INFO("step " << t << " layer " << l);
      REQUIRE(ga.rows[static_cast<std::size_t>(l)] == gb2.rows[static_cast<std::size_t>(l)]);
      REQUIRE(ga.stored(l) == gb2.stored(l));
      if (rows_after[static_cast<std::size_t>(l)] >= 0 && check_trigger)
        REQUIRE(ga.length[static_cast<std::size_t>(l)] <=
                rows_after[static_cast<std::size_t>(l)] + o.decoding.interval);
    }
  }
  return rounds;
}

kvevict::compressor_options generation_options(kvevict::dtype type, i64 layers, i64 max_tokens) {
  kvevict::compressor_options o;
  o.model = {layers, 4, 2, 7, 0, type};
  o.policy = kvevict::policy::snapkv(decode_snapkv(5));
  o.per_head = kvevict::budget::tokens(12);
  o.sharing = kvevict::block_sharing::none;
  o.limits.max_tokens = max_tokens;
  o.decoding.target = kvevict::budget::tokens(18);
  o.decoding.interval = 6;
  o.decoding.policy = kvevict::policy::snapkv(decode_snapkv(4));
  return o;
}

}  // namespace

TEST_CASE("a decode-time compression equals the prompt path's compression of the same cache, bit for bit",
          "[decoding]") {
  const i64 prompt = 29, steps = 90;
  SECTION("per-head keep sets, PyramidKV layers, paged HND, bf16") {
    kvevict::compressor_options o = generation_options(kvevict::dtype::bf16, 3, prompt + steps);
    o.layers = kvevict::layer_allocation::pyramidkv;
    o.pyramid_beta = 4;
    // (PyramidKV's shares move with the cache's length while it is short: no fixed row count)
    CHECK(decode_equals_prompt_path<bf16>(o, test::layout::paged_hnd, prompt, steps, 5, false) >= 3 * 4);
  }
  SECTION("one keep set per layer (TOVA), H2O's prompt, token-major, fp16") {
    kvevict::compressor_options o = generation_options(kvevict::dtype::f16, 2, prompt + steps);
    o.policy = kvevict::policy::h2o();
    o.scope = kvevict::selection_scope::per_layer;
    o.decoding.policy = kvevict::policy::tova();
    CHECK(decode_equals_prompt_path<fp16>(o, test::layout::token_major, prompt, steps, prompt, true) >= 2 * 8);
  }
  SECTION("one keep set per sequence (KNorm), contiguous, f32") {
    kvevict::compressor_options o = generation_options(kvevict::dtype::f32, 3, prompt + steps);
    o.scope = kvevict::selection_scope::per_sequence;
    kvevict::knorm_config k;
    k.protected_tail = 3;
    o.decoding.policy = kvevict::policy::knorm(k);
    CHECK(decode_equals_prompt_path<float>(o, test::layout::contiguous, prompt, steps, 5, true) >= 8);
  }
  SECTION("one length per sequence (StreamingLLM's sinks and recent tokens), paged NHD, bf16") {
    kvevict::compressor_options o = generation_options(kvevict::dtype::bf16, 2, prompt + steps);
    o.lengths = kvevict::length_mode::uniform;
    kvevict::streaming_llm_config sl;
    sl.sinks = 3;
    o.decoding.policy = kvevict::policy::streaming_llm(sl);
    CHECK(decode_equals_prompt_path<bf16>(o, test::layout::paged_nhd, prompt, steps, 5, true) >= 2 * 8);
  }
  SECTION("DeferKV's prompt, then ChunkKV over SnapKV while decoding, per-head paged tables, f32") {
    kvevict::compressor_options o = generation_options(kvevict::dtype::f32, 2, prompt + steps);
    kvevict::deferkv_config dc;
    dc.window = 5;
    dc.delay = 3;
    o.policy = kvevict::policy::deferkv(dc);
    o.decoding.policy.chunk_length = 2;
    CHECK(decode_equals_prompt_path<float>(o, test::layout::paged_per_head, prompt, steps, 5, true) >= 2 * 8);
  }
  SECTION("KeyDiff's key redundancy, a ratio target, padded strides, fp16") {
    kvevict::compressor_options o = generation_options(kvevict::dtype::f16, 2, prompt + steps);
    kvevict::keydiff_config kd;
    kd.protected_tail = 2;
    o.decoding.policy = kvevict::policy::keydiff(kd);
    o.decoding.target = kvevict::budget::ratio(0.4);
    o.decoding.interval = 10;
    CHECK(decode_equals_prompt_path<fp16>(o, test::layout::padded, prompt, steps, 5, false) >= 2 * 3);
  }
}

namespace {

/// Drives two generations made alike through the same calls: the prompt, then prefill_end (its
/// last 5 queries) and one decode step per token up to `tokens`, every layer at each step;
/// `call(t, layer, event, first_query, num_queries)` makes that layer's call on both.
template <class T, class Call>
void drive_twins(generation<T>& ga, generation<T>& gb, i64 prompt, i64 tokens, Call&& call) {
  for (i64 l = 0; l < ga.layers; ++l)
    for (i64 p = 0; p < prompt; ++p) {
      ga.append(l, p);
      gb.append(l, p);
    }
  for (i64 t = 0; t <= tokens - prompt; ++t) {
    const bool prefill = t == 0;
    const i64 pos = prefill ? prompt - 5 : prompt + t - 1;
    const kvevict::sequence_event e = prefill ? kvevict::sequence_event::prefill_end : kvevict::sequence_event::decode;
    for (i64 l = 0; l < ga.layers; ++l) {
      if (!prefill) {
        ga.append(l, pos);
        gb.append(l, pos);
      }
      call(t, l, e, pos, prefill ? i64{5} : i64{1});
    }
  }
}

/// A generation compacted out of place (each round writes the kept rows into the spare blocks,
/// which become the sequence's) against the same generation compacted in place: the same rows
/// after every step, and a round leaves the blocks it read as they were. Returns the rounds.
template <class T>
i64 out_of_place_equals_in_place(kvevict::compressor_options o, test::layout kind, i64 prompt, i64 tokens) {
  const shape s{o.model.num_layers, o.model.num_query_heads, o.model.num_kv_heads, o.model.head_dim};
  o.compact = kvevict::compaction::in_place;
  planned<T> a(o);
  o.compact = kvevict::compaction::out_of_place;
  planned<T> b(o);
  generation<T> ga(kind, s.layers, s.hq, s.hkv, s.d, tokens, 5);
  generation<T> gb(kind, s.layers, s.hq, s.hkv, s.d, tokens, 5);
  generation<T> spare(kind, s.layers, s.hq, s.hkv, s.d, tokens, 6);  // other contents: a stale pool
  const bool shared = o.scope == kvevict::selection_scope::per_sequence;
  i64 rounds = 0;
  drive_twins(ga, gb, prompt, tokens, [&](i64 t, i64 l, kvevict::sequence_event e, i64 pos, i64 nq) {
    const bool ra = a.run(ga, l, e, pos, nq).action == kvevict::sequence_action::evicted;
    // The blocks a call may read: every layer's under the per-sequence scope, else this one's.
    std::vector<std::vector<double>> read;
    for (i64 k = 0; k < s.layers; ++k) read.push_back(gb.stored(k));
    const std::vector<std::vector<std::vector<i64>>> rows_before = gb.rows;
    const bool rb = b.run(gb, l, e, pos, nq, &spare).action == kvevict::sequence_action::evicted;
    INFO("step " << t << " layer " << l);
    REQUIRE(ra == rb);
    for (i64 k = 0; k < s.layers; ++k) {
      const std::size_t ks = static_cast<std::size_t>(k);
      const bool moved = rb && (shared || k == l);  // then the spare holds the blocks the call read
      REQUIRE(gb.stored_in(moved ? spare.keys[ks] : gb.keys[ks], moved ? spare.values[ks] : gb.values[ks],
                           rows_before[ks]) == read[ks]);
    }
    if (rb) rounds += t == 0 || (shared && l + 1 < s.layers) ? 0 : 1;
    for (i64 k = 0; k < s.layers; ++k) {
      REQUIRE(ga.rows[static_cast<std::size_t>(k)] == gb.rows[static_cast<std::size_t>(k)]);
      REQUIRE(ga.stored(k) == gb.stored(k));
    }
  });
  return rounds;
}

}  // namespace

TEST_CASE("decode-time rounds compacted out of place: the in-place rows, the blocks read left as they were",
          "[decoding]") {
  const i64 prompt = 29, tokens = 150;  // the prompt, then decode steps up to 150 tokens
  SECTION("per-head keep sets, paged HND, bf16") {
    kvevict::compressor_options o = generation_options(kvevict::dtype::bf16, 2, tokens);
    CHECK(out_of_place_equals_in_place<bf16>(o, test::layout::paged_hnd, prompt, tokens) >= 2 * 8);
  }
  SECTION("one keep set per layer (TOVA), token-major, fp16") {
    kvevict::compressor_options o = generation_options(kvevict::dtype::f16, 2, tokens);
    o.scope = kvevict::selection_scope::per_layer;
    o.decoding.policy = kvevict::policy::tova();
    CHECK(out_of_place_equals_in_place<fp16>(o, test::layout::token_major, prompt, tokens) >= 2 * 8);
  }
  SECTION("one keep set per sequence (KNorm), contiguous, f32") {
    kvevict::compressor_options o = generation_options(kvevict::dtype::f32, 3, tokens);
    o.scope = kvevict::selection_scope::per_sequence;
    o.decoding.policy = kvevict::policy::knorm();
    CHECK(out_of_place_equals_in_place<float>(o, test::layout::contiguous, prompt, tokens) >= 8);
  }
}

namespace {

/// A generation whose every call hands destination views under a plan that is not
/// out_of_place, against the same generation without them: the same rows after every call,
/// and the destination never written. Returns the compressing calls.
template <class T>
i64 ignores_destination(const kvevict::compressor_options& o, test::layout kind, i64 prompt, i64 tokens) {
  const shape s{o.model.num_layers, o.model.num_query_heads, o.model.num_kv_heads, o.model.head_dim};
  planned<T> a(o), b(o);
  generation<T> ga(kind, s.layers, s.hq, s.hkv, s.d, tokens, 5), gb(kind, s.layers, s.hq, s.hkv, s.d, tokens, 5);
  generation<T> spare(kind, s.layers, s.hq, s.hkv, s.d, tokens, 6);
  for (i64 l = 0; l < s.layers; ++l)
    for (i64 p = 0; p < tokens; ++p) spare.append(l, p);
  std::vector<std::vector<double>> untouched;
  for (i64 l = 0; l < s.layers; ++l) untouched.push_back(spare.stored(l));
  i64 evictions = 0;
  drive_twins(ga, gb, prompt, tokens, [&](i64 t, i64 l, kvevict::sequence_event e, i64 pos, i64 nq) {
    const bool ra = a.run(ga, l, e, pos, nq).action == kvevict::sequence_action::evicted;
    const bool rb = b.run(gb, l, e, pos, nq, &spare).action == kvevict::sequence_action::evicted;
    INFO("step " << t << " layer " << l);
    REQUIRE(ra == rb);
    evictions += rb ? 1 : 0;
    for (i64 k = 0; k < s.layers; ++k) {
      REQUIRE(ga.stored(k) == gb.stored(k));
      REQUIRE(spare.stored(k) == untouched[static_cast<std::size_t>(k)]);
    }
  });
  return evictions;
}

}  // namespace

TEST_CASE("compaction::in_place and keep_list_only ignore destination views, as cuda::compressor does", "[decoding]") {
  // An engine that always hands fresh blocks (say, to switch modes without changing its calls)
  // gets the mode it planned: in place, the rows stay in their blocks and the destination is
  // not written. (The CPU compressor used to write them there, past out_of_place's checks.)
  const i64 prompt = 29, tokens = 80;  // the prompt, then decode steps up to 80 tokens
  SECTION("in place, per-head keep sets, paged NHD, bf16") {
    kvevict::compressor_options o = generation_options(kvevict::dtype::bf16, 2, tokens);
    o.compact = kvevict::compaction::in_place;
    CHECK(ignores_destination<bf16>(o, test::layout::paged_nhd, prompt, tokens) >= 2 * 5);
  }
  SECTION("in place, one keep set per sequence (every layer compacted at the last), contiguous, f32") {
    kvevict::compressor_options o = generation_options(kvevict::dtype::f32, 3, tokens);
    o.compact = kvevict::compaction::in_place;
    o.scope = kvevict::selection_scope::per_sequence;
    CHECK(ignores_destination<float>(o, test::layout::contiguous, prompt, tokens) >= 5);
  }
  SECTION("keep list only, token-major, fp16") {
    kvevict::compressor_options o = generation_options(kvevict::dtype::f16, 2, tokens);
    o.compact = kvevict::compaction::keep_list_only;
    CHECK(ignores_destination<fp16>(o, test::layout::token_major, prompt, tokens) >= 2 * 5);
  }
}

TEST_CASE("a 4,096-token generation stays within target + N at every step", "[decoding]") {
  const i64 prompt = 300, steps = 4096, target = 64, interval = 16;
  kvevict::compressor_options o = generation_options(kvevict::dtype::bf16, 2, prompt + steps);
  o.per_head = kvevict::budget::tokens(60);  // the prompt's one-shot compression: 300 -> 60
  o.decoding.target = kvevict::budget::tokens(target);
  o.decoding.interval = interval;
  planned<bf16> a(o);
  generation<bf16> g(test::layout::paged_nhd, 2, 4, 2, 7, prompt + steps, 3);
  for (i64 l = 0; l < 2; ++l) {
    for (i64 p = 0; p < prompt; ++p) g.append(l, p);
    REQUIRE(a.run(g, l, kvevict::sequence_event::prefill_end, prompt - 5, 5).length == 60);
  }
  i64 rounds = 0, longest = 0;
  for (i64 t = 0; t < steps; ++t)
    for (i64 l = 0; l < 2; ++l) {
      g.append(l, prompt + t);
      const kvevict::sequence_report r = a.run(g, l, kvevict::sequence_event::decode, prompt + t, 1);
      rounds += r.action == kvevict::sequence_action::evicted ? 1 : 0;
      REQUIRE(r.next_position == prompt + t + 1);
      longest = std::max(longest, g.length[static_cast<std::size_t>(l)]);
      REQUIRE(g.length[static_cast<std::size_t>(l)] <= target + interval);
    }
  CHECK(longest == target + interval);
  CHECK(rounds == 2 * ((steps - (target + interval + 1 - 60)) / (interval + 1) + 1));
}

TEST_CASE("decode-time budgets: the plan refuses what it cannot serve, naming the option", "[decoding]") {
  const auto refused = [](const kvevict::compressor_options& o, const char* argument, kvevict::errc code) {
    kvevict::compressor c;
    const kvevict::status st = kvevict::compressor::plan(o, &c);
    INFO(argument << ": " << st.message());
    REQUIRE(!st.ok());
    CHECK(std::string(st.argument()).rfind(argument, 0) == 0);
    CHECK(st.code() == code);
    CHECK(!c.planned());
  };
  const kvevict::compressor_options good = generation_options(kvevict::dtype::bf16, 2, 200);
  kvevict::compressor_options o = good;
  o.decoding.interval = 0;
  refused(o, "decoding.interval", kvevict::errc::invalid_argument);
  o = good;
  o.decoding.target = kvevict::budget::ratio(0.0);
  refused(o, "decoding.target", kvevict::errc::invalid_argument);
  o.decoding.target = kvevict::budget::ratio(1.5);
  refused(o, "decoding.target", kvevict::errc::invalid_argument);
  o.decoding.target = kvevict::budget::tokens(-3);
  refused(o, "decoding.target", kvevict::errc::invalid_argument);
  o.decoding.target = kvevict::budget::tokens(201);
  refused(o, "decoding.target", kvevict::errc::invalid_argument);
  o = good;
  o.decoding.policy = kvevict::policy::deferkv();
  refused(o, "decoding.policy.kind", kvevict::errc::unsupported);
  o.decoding.policy = kvevict::policy::dapq();
  refused(o, "decoding.policy.kind", kvevict::errc::unsupported);
  o.decoding.policy = kvevict::policy::h2o();
  refused(o, "decoding.window", kvevict::errc::invalid_argument);
  o = good;
  o.decoding.window = 8;  // SnapKV observes with its own window
  refused(o, "decoding.window", kvevict::errc::invalid_argument);
  o = good;
  o.decoding.policy = kvevict::policy::snapkv(decode_snapkv(-1));
  refused(o, "decoding.policy.", kvevict::errc::invalid_argument);
  o = good;
  o.decoding.policy.chunk_length = -1;
  refused(o, "decoding.policy.chunk_length", kvevict::errc::invalid_argument);
  o = good;
  o.heads = kvevict::head_allocation::adakv;
  refused(o, "decoding", kvevict::errc::unsupported);
  // A compressor over a list of policies serves a decode scorer of its list only.
  o = good;
  o.decoding.policy = kvevict::policy::knorm();
  kvevict::basic_compressor<kvevict::policy_list<kvevict::snapkv_traits>> only_snapkv;
  const kvevict::status st =
      kvevict::basic_compressor<kvevict::policy_list<kvevict::snapkv_traits>>::plan(o, &only_snapkv);
  REQUIRE(!st.ok());
  CHECK(std::string(st.argument()) == "decoding.policy.kind");
  // Off (the default) plans as before, with no state for a stateless policy.
  o = good;
  o.decoding = kvevict::decode_budget{};
  kvevict::compressor c;
  REQUIRE(kvevict::compressor::plan(o, &c).ok());
  CHECK(c.sequence_state_size() == 0);
}

TEST_CASE("decode-time budgets: a refused call leaves every cache and state as it was", "[decoding]") {
  const i64 prompt = 25, target = 14, interval = 3;
  kvevict::compressor_options o = generation_options(kvevict::dtype::bf16, 1, 120);
  o.per_head = kvevict::budget::tokens(target);
  o.decoding.target = kvevict::budget::tokens(target);
  o.decoding.interval = interval;
  o.limits.max_sequences = 2;
  planned<bf16> a(o), b(o);
  generation<bf16> ga(test::layout::paged_hnd, 1, 4, 2, 7, 120, 21), gb(test::layout::contiguous, 1, 4, 2, 7, 120, 22);
  const auto snapshot = [&] {
    return std::vector<std::uint64_t>{
        test::fnv(test::fnv_seed, ga.keys[0].buffer), test::fnv(test::fnv_seed, ga.values[0].buffer),
        test::fnv(test::fnv_seed, gb.keys[0].buffer), test::fnv(test::fnv_seed, gb.values[0].buffer),
        test::fnv(test::fnv_seed, a.state),           test::fnv(test::fnv_seed, b.state)};
  };
  const auto call = [&](generation<bf16>& g, planned<bf16>& p, kvevict::sequence_event e, i64 first, i64 n) {
    return make_call(g, 0, e, first, n, p.state.data(), a.c.keep_capacity_per_head());
  };
  for (i64 p = 0; p < prompt; ++p) {
    ga.append(0, p);
    gb.append(0, p);
  }
  SECTION("a decode step before prefill_end") {
    layer_call<bf16> x = call(ga, a, kvevict::sequence_event::decode, prompt - 1, 1);
    const auto before = snapshot();
    kvevict::sequence_report r;
    const kvevict::status st = a.c.run(0, &x.io, 1, &r, a.ws);
    REQUIRE(st.code() == kvevict::errc::invalid_state);
    CHECK(std::string(st.argument()) == "seqs[0].event");
    CHECK(snapshot() == before);
  }
  // Both sequences past their prompts, one step before a round.
  a.run(ga, 0, kvevict::sequence_event::prefill_end, prompt - 5, 5);
  b.run(gb, 0, kvevict::sequence_event::prefill_end, prompt - 5, 5);
  for (i64 t = 0; t < interval; ++t) {
    ga.append(0, prompt + t);
    gb.append(0, prompt + t);
    REQUIRE(a.run(ga, 0, kvevict::sequence_event::decode, prompt + t, 1).action == kvevict::sequence_action::observed);
    REQUIRE(b.run(gb, 0, kvevict::sequence_event::decode, prompt + t, 1).action == kvevict::sequence_action::observed);
  }
  ga.append(0, prompt + interval);
  gb.append(0, prompt + interval);
  const i64 pos = prompt + interval;
  layer_call<bf16> x = call(ga, a, kvevict::sequence_event::decode, pos, 1);
  layer_call<bf16> y = call(gb, b, kvevict::sequence_event::decode, pos, 1);
  SECTION("a decode query out of order in the batch's other sequence") {
    y.q.positions[0] = pos - 1;  // the previous step's position again
    const auto before = snapshot();
    kvevict::sequence_io<bf16> batch[2] = {x.io, y.io};
    kvevict::sequence_report r[2];
    const kvevict::status st = a.c.run(0, batch, 2, r, a.ws);
    INFO(st.message());
    REQUIRE(st.code() == kvevict::errc::invalid_argument);
    CHECK(std::string(st.argument()) == "seqs[1].queries.positions[0]");
    CHECK(snapshot() == before);
  }
  SECTION("an overwritten window of decode queries") {
    const auto before_state = b.state;
    std::vector<std::uint64_t> bad = b.state;
    bad[bad.size() / 2] = ~0ull;  // somewhere in the state: in the window's header or its rows
    bool refused_somewhere = false;
    for (std::size_t word = 8; word < 8 + 8; ++word) {  // the first layer's window header follows the 64-byte header
      b.state = before_state;
      b.state[word] = static_cast<std::uint64_t>(-5);
      y.io.state = b.state.data();
      kvevict::sequence_io<bf16> batch[2] = {x.io, y.io};
      kvevict::sequence_report r[2];
      const auto before = snapshot();
      const kvevict::status st = a.c.run(0, batch, 2, r, a.ws);
      if (st.ok()) break;  // (reached past the header: nothing more to try)
      refused_somewhere = true;
      CHECK(std::string(st.argument()) == "seqs[1].state");
      CHECK(snapshot() == before);
    }
    CHECK(refused_somewhere);
  }
  SECTION("the batch's round, both sequences") {
    kvevict::sequence_io<bf16> batch[2] = {x.io, y.io};
    kvevict::sequence_report r[2];
    REQUIRE(a.c.run(0, batch, 2, r, a.ws).ok());
    CHECK(r[0].action == kvevict::sequence_action::evicted);
    CHECK(r[1].action == kvevict::sequence_action::evicted);
    CHECK(r[0].length == target);
    CHECK(r[1].length == target);
  }
}

TEST_CASE("decode-time budgets: the same rounds under every executor", "[decoding]") {
  const i64 prompt = 40, steps = 60;
  kvevict::compressor_options o = generation_options(kvevict::dtype::f32, 2, prompt + steps);
  o.scope = kvevict::selection_scope::per_layer;
  test::thread_pool pool(3);
  std::vector<std::vector<double>> first;
  for (const kvevict::executor& e : {kvevict::executor{}, pool.executor()}) {
    o.exec = e;
    planned<float> a(o);
    generation<float> g(test::layout::paged_nhd, 2, 4, 2, 7, prompt + steps, 17);
    for (i64 l = 0; l < 2; ++l) {
      for (i64 p = 0; p < prompt; ++p) g.append(l, p);
      a.run(g, l, kvevict::sequence_event::prefill_end, prompt - 5, 5);
    }
    for (i64 t = 0; t < steps; ++t)
      for (i64 l = 0; l < 2; ++l) {
        g.append(l, prompt + t);
        a.run(g, l, kvevict::sequence_event::decode, prompt + t, 1);
      }
    std::vector<std::vector<double>> got{g.stored(0), g.stored(1)};
    if (first.empty()) {
      first = got;
    } else {
      CHECK(got == first);
    }
  }
}

TEST_CASE("a new prompt turn after decoding observes with its own queries, as on a fresh state", "[decoding]") {
  // Multi-turn: after an answer decoded under decode-time budgets, the next user turn is
  // prefilled into the same cache and compressed at its prefill_end. The ring of decode queries
  // is not the turn's window: the result equals the same call on a state that never decoded.
  const i64 prompt = 31, steps = 40, turn = 9;
  for (bool chunked : {false, true}) {
    INFO("chunked " << chunked);
    kvevict::compressor_options o = generation_options(kvevict::dtype::bf16, 2, prompt + steps + turn);
    o.chunked_prefill = chunked;
    planned<bf16> a(o), fresh(o);
    generation<bf16> ga(test::layout::paged_nhd, 2, 4, 2, 7, prompt + steps + turn, 31);
    generation<bf16> gb(test::layout::paged_nhd, 2, 4, 2, 7, prompt + steps + turn, 31);
    i64 rounds = 0;
    for (generation<bf16>* g : {&ga, &gb})
      for (i64 l = 0; l < 2; ++l) {
        for (i64 p = 0; p < prompt; ++p) g->append(l, p);
        a.run(*g, l, kvevict::sequence_event::prefill_end, prompt - 5, 5);
      }
    // (gb's state is reset below: its prompt eviction above went through `a`'s plan alike)
    for (i64 t = 0; t < steps; ++t)
      for (i64 l = 0; l < 2; ++l) {
        ga.append(l, prompt + t);
        gb.append(l, prompt + t);
        rounds +=
            a.run(ga, l, kvevict::sequence_event::decode, prompt + t, 1).action == kvevict::sequence_action::evicted
                ? 1
                : 0;
      }
    REQUIRE(rounds > 0);
    // gb: the same cache as ga (its rows replayed from ga's), on a state that never decoded.
    for (i64 l = 0; l < 2; ++l) {
      gb.rows[static_cast<std::size_t>(l)] = ga.rows[static_cast<std::size_t>(l)];
      gb.length[static_cast<std::size_t>(l)] = ga.length[static_cast<std::size_t>(l)];
      gb.keys[static_cast<std::size_t>(l)].buffer = ga.keys[static_cast<std::size_t>(l)].buffer;
      gb.values[static_cast<std::size_t>(l)].buffer = ga.values[static_cast<std::size_t>(l)].buffer;
    }
    const i64 first = prompt + steps;
    for (i64 l = 0; l < 2; ++l)
      for (i64 p = first; p < first + turn; ++p) {
        ga.append(l, p);
        gb.append(l, p);
      }
    for (i64 l = 0; l < 2; ++l) {
      i64 last = 5;   // queries prefill_end hands: the window, or its last one after a chunk of 8
      if (chunked) {  // the turn in two chunks, the window across them
        REQUIRE(a.run(ga, l, kvevict::sequence_event::prefill_chunk, first, turn - 1).action ==
                kvevict::sequence_action::observed);
        REQUIRE(fresh.run(gb, l, kvevict::sequence_event::prefill_chunk, first, turn - 1).action ==
                kvevict::sequence_action::observed);
        last = 1;
      } else {  // the decode rows do not make up a short window: refused, nothing changed
        layer_call<bf16> x =
            make_call(ga, l, kvevict::sequence_event::prefill_end, first + turn - 2, 2, a.state.data(), 1);
        const auto before = ga.stored(l);
        kvevict::sequence_report r;
        const kvevict::status st = a.c.run(l, &x.io, 1, &r, a.ws);
        REQUIRE(st.code() == kvevict::errc::invalid_shape);
        CHECK(std::string(st.argument()) == "seqs[0].queries.num_queries");
        CHECK(ga.stored(l) == before);
      }
      const kvevict::sequence_report ra = a.run(ga, l, kvevict::sequence_event::prefill_end, first + turn - last, last);
      const kvevict::sequence_report rb =
          fresh.run(gb, l, kvevict::sequence_event::prefill_end, first + turn - last, last);
      REQUIRE(ra.action == kvevict::sequence_action::evicted);
      REQUIRE(ra.length == rb.length);
      REQUIRE(ga.rows[static_cast<std::size_t>(l)] == gb.rows[static_cast<std::size_t>(l)]);
      REQUIRE(ga.stored(l) == gb.stored(l));
    }
    // Decoding goes on after the turn, with its rounds.
    for (i64 l = 0; l < 2; ++l) {
      ga.append(l, first + turn);
      REQUIRE(a.run(ga, l, kvevict::sequence_event::decode, first + turn, 1).action != kvevict::sequence_action::none);
    }
  }
}

TEST_CASE("a prompt policy that reads no queries beside a decode scorer that does; steps of several tokens",
          "[decoding]") {
  // KNorm keeps the prompt (it reads no queries: limits.max_queries left 0 must still admit the
  // decode steps' queries), SnapKV over the last 4 decode queries keeps the generation; the steps
  // carry 1 or 2 tokens (speculative decoding's accepted tokens).
  const i64 prompt = 27, steps = 60;
  kvevict::compressor_options o = generation_options(kvevict::dtype::bf16, 2, prompt + 2 * steps);
  o.policy = kvevict::policy::knorm();
  o.per_head = kvevict::budget::ratio(0);  // the prompt whole
  o.limits.max_queries = 0;
  planned<bf16> a(o);
  REQUIRE(a.c.options().limits.max_queries >= 4);
  generation<bf16> g(test::layout::paged_hnd, 2, 4, 2, 7, prompt + 2 * steps, 41);
  for (i64 l = 0; l < 2; ++l) {
    for (i64 p = 0; p < prompt; ++p) g.append(l, p);
    REQUIRE(a.run(g, l, kvevict::sequence_event::prefill_end, prompt - 1, 1).length == prompt);
  }
  i64 pos = prompt, rounds = 0;
  for (i64 t = 0; t < steps; ++t) {
    const i64 k = 1 + t % 2;
    for (i64 l = 0; l < 2; ++l) {
      for (i64 j = 0; j < k; ++j) g.append(l, pos + j);
      const kvevict::sequence_report r = a.run(g, l, kvevict::sequence_event::decode, pos, k);
      rounds += r.action == kvevict::sequence_action::evicted ? 1 : 0;
      REQUIRE(g.length[static_cast<std::size_t>(l)] <= 18 + 6);  // rows + N after every decode call
      if (r.action == kvevict::sequence_action::evicted) {
        REQUIRE(r.length == 18);
        // the step's tokens are the newest rows, inside SnapKV's protected window
        REQUIRE(g.rows[static_cast<std::size_t>(l)][0].back() == pos + k - 1);
      }
    }
    pos += k;
  }
  CHECK(rounds >= 2 * 10);
}
