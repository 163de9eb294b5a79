// The bad-input matrix (design.md §9): every public entry point, fed each kind of bad
// argument, must return an error naming the argument (status::argument() and code()), and
// every cache, output buffer, keep-list and state must be bit-for-bit what it was (FNV-1a
// checksums before and after). Cases are table rows: a name, the expected code and
// argument, and a function that prepares the world and returns the failing call.
//
// Sizes near 2^31 / 2^32 are exercised with views that claim huge shapes over small real
// buffers: each such row is one where validation must reject before any element is read.
//
// Library bugs found while writing this table and by the fuzzers, since fixed, keep their
// regression tests at the end of the file ("regression: ...").

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/checksum.hpp"
#include "support/test_cache.hpp"

namespace {

using kvevict::errc;
using i64 = std::int64_t;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr i64 kTwo31 = i64{1} << 31;
constexpr i64 kTwo32 = i64{1} << 32;

using test::fnv;
/// A vector's bytes and its size: a failing call must not resize an output either.
template <class T>
std::uint64_t fnv_sized(std::uint64_t x, const std::vector<T>& v) {
  x = test::fnv(x, v);
  const std::uint64_t n = v.size();
  return test::fnv(x, &n, sizeof(n));
}
template <class T>
std::uint64_t fnv_value(std::uint64_t x, const T& v) {
  return fnv(x, &v, sizeof(T));
}

/// Every buffer any entry point reads or writes, with valid contents. Small: one world is
/// built per table row.
struct world {
  static constexpr i64 hkv = 2, hq = 4, d = 8, l = 24, w = 4, block = 8, pool_blocks = 5;
  static constexpr i64 batch = 3, max_len = 24;

  // Caches and observation inputs.
  std::vector<float> k, v, q, weights, lse, attn;
  std::vector<i64> qpos, kpos;
  // Paged caches (NHD pools of pool_blocks blocks) and their tables.
  std::vector<float> pool_k, pool_v;
  std::vector<std::int32_t> table_k{3, 0, 4}, table_v{1, 4, 2};
  // Outputs: scores, selection, budgets, eviction results, flattened rows, rotated queries.
  std::vector<float> scores, sel, flat, rot;
  std::vector<i64> out_offsets, out_indices, head_budgets, budgets_out, head_lengths, positions, cu, rot_pos;
  std::vector<std::int32_t> prompt_ids, pseudo_ids;
  // A valid keep-list.
  std::vector<i64> keep_offsets, keep_indices;
  kvevict::eviction_result result;
  // Ragged batches: strided [batch, Hkv, max_len, d] and paged (vLLM table [batch, 3]).
  std::vector<float> bk, bv, bpool_k, bpool_v;
  std::vector<i64> seq_lens{24, 10, 0}, pseq_lens{24, 10, 5};
  std::vector<std::int32_t> btable_k{0, 1, 2, 3, 4, -1, 5, -1, -1}, btable_v{8, 7, 6, 5, 4, -1, 3, -1, -1};
  std::vector<std::int32_t> indptr{0, 3, 5, 6};
  std::vector<std::vector<i64>> bkeep_offsets, bkeep_indices;
  std::vector<kvevict::const_keep_list_view> bkeeps;
  std::vector<kvevict::eviction_result> bresults;
  // DeferKV state (layer 3, window w, delay 2).
  kvevict::deferkv_config dcfg;
  kvevict::deferkv_state<float> state;
  std::vector<float> dk;  // [Hkv, l + 2, d]: prompt plus two decoded tokens
  std::vector<i64> dpos0{l}, dpos1{l + 1};
  // Scratch (never part of the checksum: scratch is the library's to scribble on).
  std::vector<unsigned char> ws;

  static std::vector<float> data(std::size_t n, std::uint64_t seed) {
    std::vector<float> out(n);
    const std::vector<double> x = test::normal(n, seed);
    for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<float>(x[i]);
    return out;
  }

  world() : state(make_dcfg(), 3) {
    dcfg = make_dcfg();
    k = data(hkv * l * d, 1);
    v = data(hkv * l * d, 2);
    q = data(hq * w * d, 3);
    weights.assign(w, 1.0f);
    lse.assign(hq * w, 3.0f);
    for (i64 t = 0; t < w; ++t) qpos.push_back(l - w + t);
    for (i64 j = 0; j < l; ++j) kpos.push_back(j);
    attn.assign(hq * w * l, 0.0f);
    for (i64 h = 0; h < hq; ++h)
      for (i64 t = 0; t < w; ++t)
        for (i64 j = 0; j <= qpos[t]; ++j) attn[(h * w + t) * l + j] = 1.0f / static_cast<float>(qpos[t] + 1);
    pool_k = data(pool_blocks * block * hkv * d, 4);
    pool_v = data(pool_blocks * block * hkv * d, 5);
    scores.assign(hkv * l, 42.0f);
    sel = data(hkv * l, 6);
    flat.assign(hkv * l * d, -3.0f);
    rot.assign(hq * w * d, -4.0f);
    rot_pos.assign(w, -4);
    out_offsets.assign(hkv + 1, -1);
    out_indices.assign(hkv * l, -1);
    head_budgets.assign(hkv, 10);
    budgets_out.assign(8, -5);
    head_lengths.assign(hkv, -6);
    positions.assign(hkv * l, -7);
    cu.assign(hkv + 1, -8);
    for (i64 j = 0; j < l; ++j) prompt_ids.push_back(static_cast<std::int32_t>(100 + j));
    pseudo_ids.assign(32, -9);
    keep_offsets = {0, 5, 9};
    keep_indices = {1, 3, 7, 8, 23, 0, 2, 4, 22};
    result.head_lengths = head_lengths.data();
    result.positions = positions.data();
    result.max_length = -11;
    result.freed_blocks = -12;
    bk = data(batch * hkv * max_len * d, 7);
    bv = data(batch * hkv * max_len * d, 8);
    bpool_k = data(9 * block * hkv * d, 9);
    bpool_v = data(9 * block * hkv * d, 10);
    const std::vector<std::vector<std::vector<i64>>> kept = {{{0, 5, 23}, {1, 2, 3}}, {{0, 9}, {4}}, {{}, {}}};
    for (const auto& seq : kept) {
      std::vector<i64> off{0}, idx;
      for (const auto& head : seq) {
        idx.insert(idx.end(), head.begin(), head.end());
        off.push_back(static_cast<i64>(idx.size()));
      }
      bkeep_offsets.push_back(off);
      bkeep_indices.push_back(idx);
    }
    for (std::size_t s = 0; s < kept.size(); ++s)
      bkeeps.push_back({hkv, bkeep_offsets[s].data(), bkeep_indices[s].empty() ? nullptr : bkeep_indices[s].data(),
                        static_cast<i64>(bkeep_indices[s].size())});
    bresults.assign(batch, kvevict::eviction_result{});
    dk = data(hkv * (l + 2) * d, 11);
    ws.assign(1 << 20, 0);
  }

  static kvevict::deferkv_config make_dcfg() {
    kvevict::deferkv_config c;
    c.window = w;
    c.delay = 2;
    return c;
  }

  // ---- views of the valid world ----
  kvevict::cache_view<float> keys() { return kvevict::hf_contiguous(k.data(), hkv, l, d); }
  kvevict::cache_view<float> values() { return kvevict::hf_contiguous(v.data(), hkv, l, d); }
  kvevict::cache_view<float> paged_keys() {
    return kvevict::paged_nhd(pool_k.data(), pool_blocks, block, hkv, d, table_k.data(), l);
  }
  kvevict::cache_view<float> paged_values() {
    return kvevict::paged_nhd(pool_v.data(), pool_blocks, block, hkv, d, table_v.data(), l);
  }
  kvevict::query_view<const float> queries() {
    return kvevict::contiguous_queries<const float>(q.data(), hq, w, d, qpos.data());
  }
  kvevict::score_view score_out() { return {scores.data(), hkv, l, l}; }
  kvevict::const_score_view sel_in() { return {sel.data(), hkv, l, l}; }
  kvevict::keep_list_view select_out() { return {hkv, out_offsets.data(), out_indices.data(), hkv * l}; }
  kvevict::const_keep_list_view keep() {
    return {hkv, keep_offsets.data(), keep_indices.data(), static_cast<i64>(keep_indices.size())};
  }
  kvevict::attention_view attention() { return kvevict::contiguous_attention(attn.data(), hq, w, l, qpos.data()); }
  kvevict::workspace_span span() { return {ws.data(), ws.size()}; }
  static kvevict::workspace_span tiny() {
    static unsigned char bytes[16];
    return {bytes, sizeof(bytes)};
  }
  static kvevict::scoring_params params() {
    kvevict::scoring_params p = kvevict::presets::kvpress_snapkv().params();
    p.protected_tail = w;
    return p;
  }
  kvevict::batch_cache_view<float> batch_keys() {
    return kvevict::hf_contiguous_batch(bk.data(), batch, hkv, max_len, d, seq_lens.data());
  }
  kvevict::batch_cache_view<float> batch_values() {
    return kvevict::hf_contiguous_batch(bv.data(), batch, hkv, max_len, d, seq_lens.data());
  }
  kvevict::batch_cache_view<float> paged_batch_keys() {
    return kvevict::vllm_paged_batch(kvevict::paged_nhd(bpool_k.data(), 9, block, hkv, d, nullptr, 0), batch,
                                     btable_k.data(), 3, pseq_lens.data());
  }
  kvevict::batch_cache_view<float> paged_batch_values() {
    return kvevict::vllm_paged_batch(kvevict::paged_nhd(bpool_v.data(), 9, block, hkv, d, nullptr, 0), batch,
                                     btable_v.data(), 3, pseq_lens.data());
  }
  kvevict::layer_inputs<float> layer() {
    kvevict::layer_inputs<float> in;
    in.keys = keys();
    in.queries = queries();
    return in;
  }
  kvevict::layer_inputs<float> prefill() {
    kvevict::layer_inputs<float> in;
    in.keys = kvevict::strided_cache<const float>(dk.data(), hkv, l, d, (l + 2) * d, d);
    in.queries = queries();
    return in;
  }
  kvevict::layer_inputs<float> decode(i64 step) {
    kvevict::layer_inputs<float> in;
    in.keys = kvevict::strided_cache<const float>(dk.data(), hkv, l + 1 + step, d, (l + 2) * d, d);
    in.queries = kvevict::contiguous_queries<const float>(q.data(), hq, 1, d, step == 0 ? dpos0.data() : dpos1.data());
    return in;
  }
  void reserve_state() { REQUIRE(state.reserve(hkv, l).ok()); }
  void prefill_state() {
    reserve_state();
    REQUIRE(state.observe_prefill(3, prefill(), span()).ok());
  }
  void ready_state() {
    prefill_state();
    REQUIRE(state.observe_decode(3, 0, decode(0), span()).ok());
    REQUIRE(state.observe_decode(3, 1, decode(1), span()).ok());
    REQUIRE(state.ready());
  }

  /// FNV-1a of every cache, input and output buffer, the eviction results and the DeferKV
  /// state's observable contents.
  std::uint64_t checksum() const {
    std::uint64_t x = test::fnv_seed;
    for (const auto* f : {&k, &v, &q, &weights, &lse, &attn, &pool_k, &pool_v, &scores, &sel, &flat, &rot, &bk, &bv,
                          &bpool_k, &bpool_v, &dk})
      x = fnv_sized(x, *f);
    for (const auto* f :
         {&qpos, &kpos, &out_offsets, &out_indices, &head_budgets, &budgets_out, &head_lengths, &positions, &cu,
          &rot_pos, &keep_offsets, &keep_indices, &seq_lens, &pseq_lens, &dpos0, &dpos1})
      x = fnv_sized(x, *f);
    for (const auto* f : {&table_k, &table_v, &btable_k, &btable_v, &indptr, &prompt_ids, &pseudo_ids})
      x = fnv_sized(x, *f);
    for (const auto& f : bkeep_offsets) x = fnv_sized(x, f);
    for (const auto& f : bkeep_indices) x = fnv_sized(x, f);
    x = fnv_value(x, result.max_length);
    x = fnv_value(x, result.freed_blocks);
    for (const auto& r : bresults) {
      x = fnv_value(x, r.max_length);
      x = fnv_value(x, r.freed_blocks);
    }
    x = fnv_value(x, state.ready());
    x = fnv_value(x, state.steps_observed());
    x = fnv_value(x, state.prompt_tokens());
    x = fnv_value(x, state.state_normaliser());
    if (state_checked)
      for (i64 h = 0; h < hkv; ++h)
        for (i64 j = 0; j < l; ++j) x = fnv_value(x, state.state_sum(h, j));
    return x;
  }
  bool state_checked = false;
};

using call_fn = std::function<kvevict::status()>;
struct bad_case {
  std::string name;
  errc code;
  std::string argument;
  std::function<call_fn(world&)> prepare;  ///< mutates the world's inputs, returns the call
};

/// Runs every row on a fresh world: expected code and argument, a message that names the
/// function and the argument, and nothing changed.
void run_table(const char* entry, const std::vector<bad_case>& rows) {
  for (const bad_case& c : rows) {
    world wd;
    const call_fn call = c.prepare(wd);
    const std::uint64_t before = wd.checksum();
    const kvevict::status st = call();
    INFO(entry << " / " << c.name << " -> " << kvevict::to_string(st.code()) << " [" << st.argument() << "] "
               << st.message());
    CHECK(st.code() == c.code);
    CHECK(std::string(st.argument()) == c.argument);
    const std::string message = st.message();
    CHECK(message.rfind("kvevict::", 0) == 0);
    CHECK(message.find(c.argument) != std::string::npos);
    CHECK(wd.checksum() == before);
  }
}

// ---- argument bundles, one per entry point, valid by default ----

struct obs_args {
  kvevict::query_view<const float> q;
  kvevict::cache_view<const float> k;
  kvevict::scoring_params p;
  kvevict::score_view s;
  kvevict::workspace_span ws;
  kvevict::observation_inputs in;
  kvevict::status run() const { return kvevict::observation_scores(q, k, p, s, ws, in); }
};
obs_args obs(world& wd) {
  return {wd.queries(), wd.keys(), world::params(), wd.score_out(), wd.span(), {}};
}

bad_case obs_case(std::string name, errc code, std::string arg, std::function<void(world&, obs_args&)> mutate) {
  return {std::move(name), code, std::move(arg), [mutate](world& wd) -> call_fn {
            obs_args a = obs(wd);
            mutate(wd, a);
            return [a] { return a.run(); };
          }};
}

struct attn_args {
  kvevict::attention_view a;
  i64 hkv;
  kvevict::scoring_params p;
  kvevict::score_view s;
  kvevict::workspace_span ws;
  const i64* kpos = nullptr;
  const float* weights = nullptr;
  kvevict::status run() const { return kvevict::attention_scores(a, hkv, p, s, ws, kpos, weights); }
};
attn_args attn(world& wd) {
  return {wd.attention(), world::hkv, world::params(), wd.score_out(), wd.span()};
}

struct select_args {
  kvevict::const_score_view s;
  kvevict::budget b = kvevict::budget::tokens(10);
  const i64* head_budgets = nullptr;
  bool per_head = false;
  kvevict::selection_params p{world::w, kvevict::protected_mode::inside_budget};
  kvevict::keep_list_view out;
  kvevict::workspace_span ws;
  kvevict::status run() const {
    return per_head ? kvevict::select(s, head_budgets, p, out, ws) : kvevict::select(s, b, p, out, ws);
  }
};
select_args sel(world& wd) {
  select_args a;
  a.s = wd.sel_in();
  a.out = wd.select_out();
  a.ws = wd.span();
  return a;
}

struct evict_args {
  kvevict::cache_view<float> k, v;
  kvevict::const_keep_list_view keep;
  kvevict::eviction_result* result;
  kvevict::workspace_span ws;
  kvevict::status run() const { return kvevict::evict(k, v, keep, *result, ws); }
};
evict_args ev(world& wd) {
  return {wd.keys(), wd.values(), wd.keep(), &wd.result, wd.span()};
}
evict_args ev_paged(world& wd) {
  return {wd.paged_keys(), wd.paged_values(), wd.keep(), &wd.result, wd.span()};
}

struct batch_args {
  kvevict::batch_cache_view<float> k, v;
  const kvevict::const_keep_list_view* keeps;
  kvevict::eviction_result* results;
  kvevict::workspace_span ws;
  kvevict::status run() const { return kvevict::evict_batch(k, v, keeps, results, ws); }
};
batch_args batch(world& wd) {
  return {wd.batch_keys(), wd.batch_values(), wd.bkeeps.data(), wd.bresults.data(), wd.span()};
}
batch_args paged_batch(world& wd) {
  return {wd.paged_batch_keys(), wd.paged_batch_values(), wd.bkeeps.data(), wd.bresults.data(), wd.span()};
}

struct flat_args {
  kvevict::cache_view<const float> src;
  kvevict::const_keep_list_view keep;
  float* dst;
  i64 rows, stride;
  i64* cu;
  kvevict::status run() const { return kvevict::flatten_varlen(src, keep, dst, rows, stride, cu); }
};
flat_args flat(world& wd) {
  return {wd.keys(), wd.keep(), wd.flat.data(), world::hkv * world::l, world::d, wd.cu.data()};
}

template <class Args, class Make>
bad_case make_case(std::string name, errc code, std::string arg, Make make, std::function<void(world&, Args&)> mutate) {
  return {std::move(name), code, std::move(arg), [make, mutate](world& wd) -> call_fn {
            Args a = make(wd);
            mutate(wd, a);
            return [a] { return a.run(); };
          }};
}

/// A view over a small real buffer that claims `tokens` tokens ([Hkv, tokens, d] contiguous).
kvevict::cache_view<float> huge_keys(world& wd, i64 tokens) {
  return kvevict::hf_contiguous(wd.k.data(), world::hkv, tokens, world::d);
}

/// The world's layer observed by its last query only (what TOVA reads).
kvevict::layer_inputs<float> last_query(world& wd) {
  kvevict::layer_inputs<float> in = wd.layer();
  in.queries.data += (in.queries.num_queries - 1) * in.queries.query_stride;
  in.queries.positions += in.queries.num_queries - 1;
  in.queries.num_queries = 1;
  return in;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// The valid world is valid: every entry point accepts it (so each row's error comes from
// its one mutation).
// ---------------------------------------------------------------------------------------
TEST_CASE("bad-input matrix: the unmutated world is accepted by every entry point", "[errors]") {
  {
    world wd;
    REQUIRE(obs(wd).run().ok());
    REQUIRE(attn(wd).run().ok());
    REQUIRE(sel(wd).run().ok());
    select_args ph = sel(wd);
    ph.per_head = true;
    ph.head_budgets = wd.head_budgets.data();
    REQUIRE(ph.run().ok());
  }
  {
    world wd;
    REQUIRE(ev(wd).run().ok());
  }
  {
    world wd;
    REQUIRE(ev_paged(wd).run().ok());
  }
  {
    world wd;
    REQUIRE(batch(wd).run().ok());
  }
  {
    world wd;
    REQUIRE(paged_batch(wd).run().ok());
  }
  {
    world wd;
    REQUIRE(flat(wd).run().ok());
    REQUIRE(kvevict::keep_list_positions(wd.keep(), world::l, nullptr, wd.positions.data()).ok());
    REQUIRE(kvevict::adakv_head_budgets(wd.sel_in(), world::w, 5, {}, wd.budgets_out.data(), wd.span()).ok());
    REQUIRE(kvevict::pyramidkv_layer_budgets(12, 4, 8, world::l, wd.budgets_out.data()).ok());
    REQUIRE(kvevict::dapq_pseudo_tokens_first_last(wd.prompt_ids.data(), world::l, 8, 24, wd.pseudo_ids.data()).ok());
    REQUIRE(kvevict::dapq_pseudo_tokens_phrase(wd.prompt_ids.data(), 5, 32, wd.pseudo_ids.data()).ok());
    kvevict::rope_config rope;
    rope.head_dim = world::d;
    REQUIRE(kvevict::dapq_rerotate(wd.queries(), rope, 4, wd.rot.data(), wd.rot_pos.data()).ok());
    REQUIRE(kvevict::dapq_rotate_to(wd.queries(), rope, 24, wd.rot.data(), wd.rot_pos.data()).ok());
  }
  {
    world wd;
    const kvevict::layer_inputs<float> in = wd.layer();
    REQUIRE(kvevict::snapkv<float>().score(in, wd.score_out(), wd.span()).ok());
    REQUIRE(kvevict::streaming_llm<float>().score(in, wd.score_out()).ok());
    REQUIRE(kvevict::knorm<float>().score(in, wd.score_out(), wd.span()).ok());
    REQUIRE(kvevict::tova<float>().score(last_query(wd), wd.score_out(), wd.span()).ok());
    REQUIRE(kvevict::keydiff<float>().score(in, wd.score_out(), wd.span()).ok());
    REQUIRE(kvevict::h2o<float>().score(in, wd.score_out(), wd.span()).ok());
    REQUIRE(kvevict::chunkkv<kvevict::knorm<float>>(kvevict::knorm<float>()).score(in, wd.score_out(), wd.span()).ok());
    kvevict::layer_inputs<float> pin = wd.layer();
    std::vector<i64> ppos{20, 21, 22, 23};
    pin.queries.positions = ppos.data();
    REQUIRE(kvevict::dapq<float>().score(pin, {wd.scores.data(), world::hkv, 20, world::l}, wd.span()).ok());
  }
  {
    world wd;
    wd.ready_state();
    std::vector<float> out(world::hkv * (world::l + 2));
    REQUIRE(wd.state.scores({out.data(), world::hkv, world::l + 2, world::l + 2}, wd.span()).ok());
    REQUIRE(wd.state.mark_evicted().ok());
  }
}

// ---------------------------------------------------------------------------------------
// observation_scores (and through it SnapKV, H2O from queries, DapQ)
// ---------------------------------------------------------------------------------------
TEST_CASE("bad input: observation_scores", "[errors]") {
  using A = obs_args;
  auto c = [](std::string n, errc e, std::string arg, std::function<void(world&, A&)> m) {
    return obs_case(std::move(n), e, std::move(arg), std::move(m));
  };
  run_table(
      "observation_scores",
      {
          c("null query data", errc::null_pointer, "queries.data", [](world&, A& a) { a.q.data = nullptr; }),
          c("null query positions", errc::null_pointer, "queries.positions",
            [](world&, A& a) { a.q.positions = nullptr; }),
          c("null key data", errc::null_pointer, "keys.data", [](world&, A& a) { a.k.data = nullptr; }),
          c("null scores", errc::null_pointer, "scores.data", [](world&, A& a) { a.s.data = nullptr; }),
          c("zero query heads", errc::invalid_shape, "queries.num_heads", [](world&, A& a) { a.q.num_heads = 0; }),
          c("zero observations", errc::invalid_shape, "queries.num_queries", [](world&, A& a) { a.q.num_queries = 0; }),
          c("negative observations", errc::invalid_shape, "queries.num_queries",
            [](world&, A& a) { a.q.num_queries = -4; }),
          c("zero query head_dim", errc::invalid_shape, "queries.head_dim", [](world&, A& a) { a.q.head_dim = 0; }),
          c("zero KV heads", errc::invalid_shape, "keys.num_heads", [](world&, A& a) { a.k.num_heads = 0; }),
          c("zero key head_dim", errc::invalid_shape, "keys.head_dim", [](world&, A& a) { a.k.head_dim = 0; }),
          c("negative tokens", errc::invalid_shape, "keys.num_tokens", [](world&, A& a) { a.k.num_tokens = -1; }),
          c("Hq not divisible by Hkv", errc::invalid_shape, "queries.num_heads",
            [](world&, A& a) { a.q.num_heads = 3; }),
          c("Hq < Hkv", errc::invalid_shape, "queries.num_heads", [](world&, A& a) { a.q.num_heads = 1; }),
          c("head_dim mismatch", errc::invalid_shape, "queries.head_dim",
            [](world&, A& a) {
              a.q.head_dim = 4;
              a.q.query_stride = 4;
              a.q.head_stride = 16;
            }),
          c("negative query stride", errc::invalid_stride, "queries", [](world&, A& a) { a.q.query_stride = -8; }),
          c("overlapping query rows", errc::invalid_stride, "queries.query_stride",
            [](world&, A& a) { a.q.query_stride = 4; }),
          c("overlapping query heads", errc::invalid_stride, "queries.head_stride",
            [](world&, A& a) { a.q.head_stride = 16; }),
          c("negative query position", errc::out_of_range, "queries.positions[2]",
            [](world& wd, A& a) {
              static std::vector<i64> p;
              p = wd.qpos;
              p[2] = -1;
              a.q.positions = p.data();
            }),
          c("negative key token stride", errc::invalid_stride, "keys.token_stride",
            [](world&, A& a) { a.k.token_stride = -8; }),
          c("negative key head stride", errc::invalid_stride, "keys.head_stride",
            [](world&, A& a) { a.k.head_stride = -1; }),
          c("negative key dim stride", errc::invalid_stride, "keys.dim_stride",
            [](world&, A& a) { a.k.dim_stride = -1; }),
          c("overlapping key rows", errc::invalid_stride, "keys.token_stride",
            [](world&, A& a) { a.k.token_stride = 4; }),
          c("zero key token stride", errc::invalid_stride, "keys.token_stride",
            [](world&, A& a) { a.k.token_stride = 0; }),
          c("overlapping key heads", errc::invalid_stride, "keys.head_stride",
            [](world&, A& a) { a.k.head_stride = 100; }),
          c("key view spanning 2^63 elements", errc::overflow, "keys",
            [](world&, A& a) { a.k.token_stride = i64{1} << 61; }),
          c("scores with the wrong shape", errc::invalid_shape, "scores",
            [](world&, A& a) { a.s.cols = world::l - 1; }),
          c("scores with the wrong rows", errc::invalid_shape, "scores", [](world&, A& a) { a.s.rows = 1; }),
          c("scores row stride below L", errc::invalid_stride, "scores.row_stride",
            [](world&, A& a) { a.s.row_stride = world::l - 1; }),
          c("negative scores row stride", errc::invalid_stride, "scores.row_stride",
            [](world&, A& a) { a.s.row_stride = -world::l; }),
          c("even pooling kernel", errc::invalid_argument, "params.pool.kernel",
            [](world&, A& a) { a.p.pool.kernel = 4; }),
          c("zero pooling kernel", errc::invalid_argument, "params.pool.kernel",
            [](world&, A& a) { a.p.pool.kernel = 0; }),
          c("negative pooling kernel", errc::invalid_argument, "params.pool.kernel",
            [](world&, A& a) {
              a.p.pool.kind = kvevict::pooling_kind::max;
              a.p.pool.kernel = -3;
            }),
          c("negative protected tail", errc::invalid_argument, "params.protected_tail",
            [](world&, A& a) { a.p.protected_tail = -1; }),
          c("bad softmax domain", errc::invalid_argument, "params.domain",
            [](world&, A& a) { a.p.domain = static_cast<kvevict::softmax_domain>(7); }),
          c("bad window aggregation", errc::invalid_argument, "params.window",
            [](world&, A& a) { a.p.window = static_cast<kvevict::window_aggregation>(-1); }),
          c("bad GQA reduction", errc::invalid_argument, "params.gqa",
            [](world&, A& a) { a.p.gqa = static_cast<kvevict::gqa_reduction>(3); }),
          c("bad GQA order", errc::invalid_argument, "params.order",
            [](world&, A& a) { a.p.order = static_cast<kvevict::gqa_order>(2); }),
          c("bad pooling kind", errc::invalid_argument, "params.pool.kind",
            [](world&, A& a) { a.p.pool.kind = static_cast<kvevict::pooling_kind>(3); }),
          c("weighted without weights", errc::null_pointer, "inputs.weights",
            [](world&, A& a) { a.p.window = kvevict::window_aggregation::weighted; }),
          c("negative weight", errc::invalid_argument, "inputs.weights",
            [](world& wd, A& a) {
              wd.weights[1] = -1.0f;
              a.p.window = kvevict::window_aggregation::weighted;
              a.in.weights = wd.weights.data();
            }),
          c("NaN weight", errc::invalid_argument, "inputs.weights",
            [](world& wd, A& a) {
              wd.weights[2] = kNaN;
              a.p.window = kvevict::window_aggregation::weighted;
              a.in.weights = wd.weights.data();
            }),
          c("infinite weight", errc::invalid_argument, "inputs.weights",
            [](world& wd, A& a) {
              wd.weights[0] = kInf;
              a.p.window = kvevict::window_aggregation::weighted;
              a.in.weights = wd.weights.data();
            }),
          c("all-zero weights", errc::invalid_argument, "inputs.weights",
            [](world& wd, A& a) {
              wd.weights.assign(world::w, 0.0f);
              a.p.window = kvevict::window_aggregation::weighted;
              a.in.weights = wd.weights.data();
            }),
          c("LSE with the candidates domain", errc::unsupported, "inputs.lse",
            [](world& wd, A& a) {
              a.p.domain = kvevict::softmax_domain::candidates;
              a.in.lse = wd.lse.data();
            }),
          c("LSE head stride below W", errc::invalid_stride, "inputs.lse_head_stride",
            [](world& wd, A& a) {
              a.in.lse = wd.lse.data();
              a.in.lse_head_stride = 2;
            }),
          c("negative LSE head stride", errc::invalid_stride, "inputs.lse_head_stride",
            [](world& wd, A& a) {
              a.in.lse = wd.lse.data();
              a.in.lse_head_stride = -4;
            }),
          c("workspace too small", errc::workspace_too_small, "ws", [](world&, A& a) { a.ws = world::tiny(); }),
          c("no workspace", errc::workspace_too_small, "ws", [](world&, A& a) { a.ws = {}; }),
          c("paged keys: block id past the pool", errc::out_of_range, "keys.block_table[1]",
            [](world& wd, A& a) {
              wd.table_k[1] = world::pool_blocks;
              a.k = wd.paged_keys();
            }),
          c("paged keys: negative block id", errc::out_of_range, "keys.block_table[2]",
            [](world& wd, A& a) {
              wd.table_k[2] = -1;
              a.k = wd.paged_keys();
            }),
          c("paged keys: zero block size", errc::invalid_shape, "keys.block_size",
            [](world& wd, A& a) {
              a.k = wd.paged_keys();
              a.k.block_size = 0;
            }),
          c("paged keys: empty pool", errc::invalid_shape, "keys.num_pool_blocks",
            [](world& wd, A& a) {
              a.k = wd.paged_keys();
              a.k.num_pool_blocks = 0;
            }),
          c("paged keys: negative block stride", errc::invalid_stride, "keys.block_stride",
            [](world& wd, A& a) {
              a.k = wd.paged_keys();
              a.k.block_stride = -1;
            }),
          c("paged keys: overlapping blocks", errc::invalid_stride, "keys.block_stride",
            [](world& wd, A& a) {
              a.k = wd.paged_keys();
              a.k.block_stride = 17;
            }),
          c("paged keys: pool spanning 2^63 elements", errc::overflow, "keys",
            [](world& wd, A& a) {
              a.k = wd.paged_keys();
              a.k.block_stride = i64{1} << 62;
            }),
          // Huge shapes over small buffers: rejected before any element is read.
          c("L = 2^31 + 7 claimed, workspace for 24", errc::workspace_too_small, "ws",
            [](world& wd, A& a) {
              a.k = huge_keys(wd, kTwo31 + 7);
              a.s = {wd.scores.data(), world::hkv, kTwo31 + 7, kTwo31 + 7};
            }),
          c("L = 2^33 claimed, workspace for 24", errc::workspace_too_small, "ws",
            [](world& wd, A& a) {
              a.k = huge_keys(wd, i64{1} << 33);
              a.s = {wd.scores.data(), world::hkv, i64{1} << 33, i64{1} << 33};
            }),
          c("L = 2^31 + 7 claimed, scores for 24", errc::invalid_shape, "scores",
            [](world& wd, A& a) { a.k = huge_keys(wd, kTwo31 + 7); }),
          c("W = 2^31 claimed, overlapping", errc::invalid_stride, "queries.head_stride",
            [](world&, A& a) { a.q.num_queries = kTwo31; }),
      });
}

// ---------------------------------------------------------------------------------------
// attention_scores (and through it H2O from attention rows)
// ---------------------------------------------------------------------------------------
TEST_CASE("bad input: attention_scores", "[errors]") {
  using A = attn_args;
  auto c = [](std::string n, errc e, std::string arg, std::function<void(world&, A&)> m) {
    return make_case<A>(std::move(n), e, std::move(arg), attn, std::move(m));
  };
  run_table("attention_scores",
            {
                c("null attention", errc::null_pointer, "attention.data", [](world&, A& a) { a.a.data = nullptr; }),
                c("zero heads", errc::invalid_shape, "attention", [](world&, A& a) { a.a.num_heads = 0; }),
                c("zero queries", errc::invalid_shape, "attention", [](world&, A& a) { a.a.num_queries = 0; }),
                c("negative tokens", errc::invalid_shape, "attention", [](world&, A& a) { a.a.num_tokens = -1; }),
                c("negative stride", errc::invalid_stride, "attention", [](world&, A& a) { a.a.query_stride = -1; }),
                c("overlapping rows", errc::invalid_stride, "attention.query_stride",
                  [](world&, A& a) { a.a.query_stride = world::l - 1; }),
                c("overlapping heads", errc::invalid_stride, "attention.head_stride",
                  [](world&, A& a) { a.a.head_stride = 2 * world::l; }),
                c("zero KV heads", errc::invalid_shape, "num_kv_heads", [](world&, A& a) { a.hkv = 0; }),
                c("Hq not divisible by Hkv", errc::invalid_shape, "num_kv_heads", [](world&, A& a) { a.hkv = 3; }),
                c("Hkv > Hq", errc::invalid_shape, "num_kv_heads", [](world&, A& a) { a.hkv = 8; }),
                c("scores with the wrong shape", errc::invalid_shape, "scores", [](world&, A& a) { a.s.cols = 5; }),
                c("null scores", errc::null_pointer, "scores.data", [](world&, A& a) { a.s.data = nullptr; }),
                c("even pooling kernel", errc::invalid_argument, "params.pool.kernel",
                  [](world&, A& a) { a.p.pool.kernel = 2; }),
                c("weighted without weights", errc::null_pointer, "weights",
                  [](world&, A& a) { a.p.window = kvevict::window_aggregation::weighted; }),
                c("weighted with a NaN weight", errc::invalid_argument, "weights",
                  [](world& wd, A& a) {
                    wd.weights[3] = kNaN;
                    a.weights = wd.weights.data();
                    a.p.window = kvevict::window_aggregation::weighted;
                  }),
                c("visible_mean without positions", errc::null_pointer, "attention.positions",
                  [](world&, A& a) {
                    a.p.window = kvevict::window_aggregation::visible_mean;
                    a.a.positions = nullptr;
                  }),
                c("workspace too small", errc::workspace_too_small, "ws", [](world&, A& a) { a.ws = world::tiny(); }),
                c("L = 2^31 + 7 claimed, workspace for 24", errc::workspace_too_small, "ws",
                  [](world& wd, A& a) {
                    a.a =
                        kvevict::contiguous_attention(wd.attn.data(), world::hq, world::w, kTwo31 + 7, wd.qpos.data());
                    a.s = {wd.scores.data(), world::hkv, kTwo31 + 7, kTwo31 + 7};
                  }),
            });
}

// ---------------------------------------------------------------------------------------
// select (both overloads)
// ---------------------------------------------------------------------------------------
TEST_CASE("bad input: select", "[errors]") {
  using A = select_args;
  auto c = [](std::string n, errc e, std::string arg, std::function<void(world&, A&)> m) {
    return make_case<A>(std::move(n), e, std::move(arg), sel, std::move(m));
  };
  run_table(
      "select",
      {
          c("zero rows", errc::invalid_shape, "scores.rows", [](world&, A& a) { a.s.rows = 0; }),
          c("negative rows", errc::invalid_shape, "scores.rows", [](world&, A& a) { a.s.rows = -2; }),
          c("null scores", errc::null_pointer, "scores.data", [](world&, A& a) { a.s.data = nullptr; }),
          c("negative columns", errc::invalid_shape, "scores.cols", [](world&, A& a) { a.s.cols = -1; }),
          c("row stride below columns", errc::invalid_stride, "scores.row_stride",
            [](world&, A& a) { a.s.row_stride = 3; }),
          c("rows of 2^32 tokens", errc::overflow, "scores.cols",
            [](world&, A& a) {
              a.s.cols = kTwo32;
              a.s.row_stride = kTwo32;
            }),
          c("rows of 2^40 tokens", errc::overflow, "scores.cols",
            [](world&, A& a) {
              a.s.cols = i64{1} << 40;
              a.s.row_stride = i64{1} << 40;
            }),
          c("rows of 2^32 - 1 tokens, workspace for 24", errc::workspace_too_small, "ws",
            [](world&, A& a) {
              a.s.cols = kTwo32 - 1;
              a.s.row_stride = kTwo32 - 1;
            }),
          c("rows of 2^31 + 1 tokens, keep-list for 48", errc::invalid_keep_list, "out.capacity",
            [](world&, A& a) {
              a.s.cols = kTwo31 + 1;
              a.s.row_stride = kTwo31 + 1;
              a.b = kvevict::budget::ratio(0.5);
            }),
          c("negative budget", errc::invalid_argument, "budget",
            [](world&, A& a) { a.b = kvevict::budget::tokens(-1); }),
          c("negative compression ratio", errc::invalid_argument, "budget",
            [](world&, A& a) { a.b = kvevict::budget::ratio(-0.25); }),
          c("compression ratio above 1", errc::invalid_argument, "budget",
            [](world&, A& a) { a.b = kvevict::budget::ratio(1.5); }),
          c("NaN compression ratio", errc::invalid_argument, "budget",
            [](world&, A& a) { a.b = kvevict::budget::ratio(std::nan("")); }),
          c("negative protected tail", errc::invalid_argument, "params.protected_tail",
            [](world&, A& a) { a.p.protected_tail = -1; }),
          c("bad protected mode", errc::invalid_argument, "params.mode",
            [](world&, A& a) { a.p.mode = static_cast<kvevict::protected_mode>(5); }),
          c("keep-list for another head count", errc::invalid_shape, "out.num_heads",
            [](world&, A& a) { a.out.num_heads = 3; }),
          c("null offsets", errc::null_pointer, "out.offsets", [](world&, A& a) { a.out.offsets = nullptr; }),
          c("capacity too small", errc::invalid_keep_list, "out.capacity", [](world&, A& a) { a.out.capacity = 19; }),
          c("negative capacity", errc::invalid_keep_list, "out.capacity", [](world&, A& a) { a.out.capacity = -1; }),
          c("null indices", errc::null_pointer, "out.indices", [](world&, A& a) { a.out.indices = nullptr; }),
          c("workspace too small", errc::workspace_too_small, "ws", [](world&, A& a) { a.ws = world::tiny(); }),
          c("per head: null budgets", errc::null_pointer, "head_budgets", [](world&, A& a) { a.per_head = true; }),
          c("per head: negative budget", errc::invalid_argument, "head_budgets[1]",
            [](world& wd, A& a) {
              wd.head_budgets[1] = -3;
              a.per_head = true;
              a.head_budgets = wd.head_budgets.data();
            }),
          c("per head: capacity below the sum", errc::invalid_keep_list, "out.capacity",
            [](world& wd, A& a) {
              wd.head_budgets = {24, 23};
              a.per_head = true;
              a.head_budgets = wd.head_budgets.data();
              a.out.capacity = 46;
            }),
          c("per head: zero rows", errc::invalid_shape, "scores.rows",
            [](world& wd, A& a) {
              a.per_head = true;
              a.head_budgets = wd.head_budgets.data();
              a.s.rows = 0;
            }),
      });
}

// ---------------------------------------------------------------------------------------
// adakv_head_budgets, pyramidkv_layer_budgets
// ---------------------------------------------------------------------------------------
namespace {
struct adakv_args {
  kvevict::const_score_view s;
  i64 tail = world::w, budget = 5;
  kvevict::adakv_params p;
  i64* out;
  kvevict::workspace_span ws;
  kvevict::status run() const { return kvevict::adakv_head_budgets(s, tail, budget, p, out, ws); }
};
adakv_args ada(world& wd) {
  adakv_args a;
  a.s = wd.sel_in();
  a.out = wd.budgets_out.data();
  a.ws = wd.span();
  return a;
}
struct pyramid_args {
  i64 capacity = 12, window = 4, layers = 8, tokens = world::l;
  i64* out;
  double beta = 20.0;
  kvevict::status run() const { return kvevict::pyramidkv_layer_budgets(capacity, window, layers, tokens, out, beta); }
};
pyramid_args pyr(world& wd) {
  pyramid_args a;
  a.out = wd.budgets_out.data();
  return a;
}
}  // namespace

TEST_CASE("bad input: adakv_head_budgets and pyramidkv_layer_budgets", "[errors]") {
  using A = adakv_args;
  auto c = [](std::string n, errc e, std::string arg, std::function<void(world&, A&)> m) {
    return make_case<A>(std::move(n), e, std::move(arg), ada, std::move(m));
  };
  run_table(
      "adakv_head_budgets",
      {
          c("zero rows", errc::invalid_shape, "scores.rows", [](world&, A& a) { a.s.rows = 0; }),
          c("null scores", errc::null_pointer, "scores.data", [](world&, A& a) { a.s.data = nullptr; }),
          c("row stride below columns", errc::invalid_stride, "scores.row_stride",
            [](world&, A& a) { a.s.row_stride = 1; }),
          c("negative protected tail", errc::invalid_argument, "protected_tail", [](world&, A& a) { a.tail = -1; }),
          c("negative budget", errc::invalid_argument, "per_head_budget", [](world&, A& a) { a.budget = -1; }),
          c("negative alpha", errc::invalid_argument, "params.alpha", [](world&, A& a) { a.p.alpha = -0.5; }),
          c("alpha above 1", errc::invalid_argument, "params.alpha", [](world&, A& a) { a.p.alpha = 1.01; }),
          c("NaN alpha", errc::invalid_argument, "params.alpha", [](world&, A& a) { a.p.alpha = std::nan(""); }),
          c("null out", errc::null_pointer, "out", [](world&, A& a) { a.out = nullptr; }),
          c("workspace too small", errc::workspace_too_small, "ws", [](world&, A& a) { a.ws = world::tiny(); }),
          c("2 x (2^31 + 1) candidates", errc::overflow, "scores",
            [](world&, A& a) {
              a.s.cols = kTwo31 + 1 + world::w;
              a.s.row_stride = a.s.cols;
            }),
          c("1 x (2^32 - 1) candidates, workspace for 24", errc::workspace_too_small, "ws",
            [](world&, A& a) {
              a.s.rows = 1;
              a.s.cols = kTwo32 - 1 + world::w;
              a.s.row_stride = a.s.cols;
            }),
      });

  using P = pyramid_args;
  auto p = [](std::string n, errc e, std::string arg, std::function<void(world&, P&)> m) {
    return make_case<P>(std::move(n), e, std::move(arg), pyr, std::move(m));
  };
  run_table(
      "pyramidkv_layer_budgets",
      {
          p("negative window", errc::invalid_argument, "window", [](world&, P& a) { a.window = -1; }),
          p("capacity below the window", errc::invalid_argument, "capacity", [](world&, P& a) { a.capacity = 3; }),
          p("zero layers", errc::invalid_argument, "num_layers", [](world&, P& a) { a.layers = 0; }),
          p("negative tokens", errc::invalid_argument, "num_tokens", [](world&, P& a) { a.tokens = -1; }),
          p("beta below 1", errc::invalid_argument, "beta", [](world&, P& a) { a.beta = 0.5; }),
          p("NaN beta", errc::invalid_argument, "beta", [](world&, P& a) { a.beta = std::nan(""); }),
          p("infinite beta", errc::invalid_argument, "beta",
            [](world&, P& a) { a.beta = std::numeric_limits<double>::infinity(); }),
          p("null out", errc::null_pointer, "out", [](world&, P& a) { a.out = nullptr; }),
      });
}

// ---------------------------------------------------------------------------------------
// Every policy's score()
// ---------------------------------------------------------------------------------------
TEST_CASE("bad input: policy score()", "[errors]") {
  auto c = [](std::string n, errc e, std::string arg, std::function<call_fn(world&)> prepare) {
    return bad_case{std::move(n), e, std::move(arg), std::move(prepare)};
  };
  run_table(
      "policies",
      {
          c("snapkv: negative window", errc::invalid_argument, "config.window",
            [](world& wd) -> call_fn {
              kvevict::window_config cfg = kvevict::presets::snapkv_paper();
              cfg.window = -1;
              return [&wd, cfg] { return kvevict::snapkv<float>(cfg).score(wd.layer(), wd.score_out(), wd.span()); };
            }),
          c("snapkv: even kernel", errc::invalid_argument, "params.pool.kernel",
            [](world& wd) -> call_fn {
              kvevict::window_config cfg = kvevict::presets::kvpress_snapkv();
              cfg.scoring.pool.kernel = 6;
              return [&wd, cfg] { return kvevict::snapkv<float>(cfg).score(wd.layer(), wd.score_out(), wd.span()); };
            }),
          c("snapkv: no queries", errc::invalid_shape, "queries.num_heads",
            [](world& wd) -> call_fn {
              return [&wd] {
                kvevict::layer_inputs<float> in;
                in.keys = wd.keys();
                return kvevict::snapkv<float>().score(in, wd.score_out(), wd.span());
              };
            }),
          c("streaming_llm: negative sinks", errc::invalid_argument, "config.sinks",
            [](world& wd) -> call_fn {
              return [&wd] { return kvevict::streaming_llm<float>({-1}).score(wd.layer(), wd.score_out()); };
            }),
          c("streaming_llm: no keys", errc::invalid_shape, "keys.num_heads",
            [](world& wd) -> call_fn {
              return [&wd] { return kvevict::streaming_llm<float>().score({}, wd.score_out()); };
            }),
          c("streaming_llm: 2^24 + 1 tokens claimed", errc::overflow, "keys.num_tokens",
            [](world& wd) -> call_fn {
              return [&wd] {
                kvevict::layer_inputs<float> in;
                in.keys = huge_keys(wd, (i64{1} << 24) + 1);
                return kvevict::streaming_llm<float>().score(
                    in, {wd.scores.data(), world::hkv, (i64{1} << 24) + 1, (i64{1} << 24) + 1});
              };
            }),
          c("streaming_llm: scores of the wrong shape", errc::invalid_shape, "scores",
            [](world& wd) -> call_fn {
              return [&wd] {
                return kvevict::streaming_llm<float>().score(wd.layer(), {wd.scores.data(), 1, world::l, world::l});
              };
            }),
          c("knorm: negative protected tail", errc::invalid_argument, "config.protected_tail",
            [](world& wd) -> call_fn {
              return [&wd] {
                return kvevict::knorm<float>({-2, kvevict::protected_mode::inside_budget})
                    .score(wd.layer(), wd.score_out(), wd.span());
              };
            }),
          c("knorm: workspace too small", errc::workspace_too_small, "ws",
            [](world& wd) -> call_fn {
              return [&wd] { return kvevict::knorm<float>().score(wd.layer(), wd.score_out(), {}); };
            }),
          c("knorm: L = 2^31 + 7 claimed, scores for 24", errc::invalid_shape, "scores",
            [](world& wd) -> call_fn {
              return [&wd] {
                kvevict::layer_inputs<float> in;
                in.keys = huge_keys(wd, kTwo31 + 7);
                return kvevict::knorm<float>().score(in, wd.score_out(), wd.span());
              };
            }),
          c("knorm: overlapping keys", errc::invalid_stride, "keys.token_stride",
            [](world& wd) -> call_fn {
              return [&wd] {
                kvevict::layer_inputs<float> in = wd.layer();
                in.keys.token_stride = 4;
                return kvevict::knorm<float>().score(in, wd.score_out(), wd.span());
              };
            }),
          c("keydiff: negative protected tail", errc::invalid_argument, "config.protected_tail",
            [](world& wd) -> call_fn {
              return [&wd] {
                return kvevict::keydiff<float>({-1, kvevict::protected_mode::inside_budget})
                    .score(wd.layer(), wd.score_out(), wd.span());
              };
            }),
          c("keydiff: workspace too small", errc::workspace_too_small, "ws",
            [](world& wd) -> call_fn {
              return [&wd] { return kvevict::keydiff<float>().score(wd.layer(), wd.score_out(), {}); };
            }),
          c("keydiff: L = 2^31 + 7 claimed, scores for 24", errc::invalid_shape, "scores",
            [](world& wd) -> call_fn {
              return [&wd] {
                kvevict::layer_inputs<float> in;
                in.keys = huge_keys(wd, kTwo31 + 7);
                return kvevict::keydiff<float>().score(in, wd.score_out(), wd.span());
              };
            }),
          c("keydiff: overlapping keys", errc::invalid_stride, "keys.token_stride",
            [](world& wd) -> call_fn {
              return [&wd] {
                kvevict::layer_inputs<float> in = wd.layer();
                in.keys.token_stride = 4;
                return kvevict::keydiff<float>().score(in, wd.score_out(), wd.span());
              };
            }),
          c("tova: protected tail 0 (the observing token must be kept)", errc::invalid_argument,
            "config.protected_tail",
            [](world& wd) -> call_fn {
              return [&wd] {
                return kvevict::tova<float>({0, kvevict::protected_mode::inside_budget})
                    .score(last_query(wd), wd.score_out(), wd.span());
              };
            }),
          c("tova: unknown protected mode", errc::invalid_argument, "config.protect",
            [](world& wd) -> call_fn {
              return [&wd] {
                return kvevict::tova<float>({1, static_cast<kvevict::protected_mode>(3)})
                    .score(last_query(wd), wd.score_out(), wd.span());
              };
            }),
          c("tova: the whole window of queries", errc::invalid_shape, "queries.num_queries",
            [](world& wd) -> call_fn {
              return [&wd] { return kvevict::tova<float>().score(wd.layer(), wd.score_out(), wd.span()); };
            }),
          c("tova: null positions", errc::null_pointer, "queries.positions",
            [](world& wd) -> call_fn {
              return [&wd] {
                kvevict::layer_inputs<float> in = last_query(wd);
                in.queries.positions = nullptr;
                return kvevict::tova<float>().score(in, wd.score_out(), wd.span());
              };
            }),
          c("tova: workspace too small", errc::workspace_too_small, "ws",
            [](world& wd) -> call_fn {
              return [&wd] { return kvevict::tova<float>().score(last_query(wd), wd.score_out(), {}); };
            }),
          c("tova: scores of the wrong shape", errc::invalid_shape, "scores",
            [](world& wd) -> call_fn {
              return [&wd] {
                return kvevict::tova<float>().score(last_query(wd), {wd.scores.data(), 1, world::l, world::l},
                                                    wd.span());
              };
            }),
          c("h2o (queries): null positions", errc::null_pointer, "queries.positions",
            [](world& wd) -> call_fn {
              return [&wd] {
                kvevict::layer_inputs<float> in = wd.layer();
                in.queries.positions = nullptr;
                return kvevict::h2o<float>().score(in, wd.score_out(), wd.span());
              };
            }),
          c("h2o (queries): negative recent window", errc::invalid_argument, "params.protected_tail",
            [](world& wd) -> call_fn {
              kvevict::h2o_config cfg;
              cfg.recent_window = -1;
              return [&wd, cfg] { return kvevict::h2o<float>(cfg).score(wd.layer(), wd.score_out(), wd.span()); };
            }),
          c("h2o (attention): no positions", errc::null_pointer, "attention.positions",
            [](world& wd) -> call_fn {
              return [&wd] {
                kvevict::layer_inputs<float> in = wd.layer();
                in.attention = wd.attention();
                in.attention.positions = nullptr;
                return kvevict::h2o<float>().score(in, wd.score_out(), wd.span());
              };
            }),
          c("h2o (attention): keys give no Hkv", errc::invalid_shape, "num_kv_heads",
            [](world& wd) -> call_fn {
              return [&wd] {
                kvevict::layer_inputs<float> in;
                in.attention = wd.attention();
                return kvevict::h2o<float>().score(in, wd.score_out(), wd.span());
              };
            }),
          c("h2o (attention): Hq not divisible", errc::invalid_shape, "num_kv_heads",
            [](world& wd) -> call_fn {
              return [&wd] {
                kvevict::layer_inputs<float> in = wd.layer();
                in.attention = wd.attention();
                in.keys.num_heads = 3;
                return kvevict::h2o<float>().score(in, wd.score_out(), wd.span());
              };
            }),
          c("chunkkv: zero chunk length", errc::invalid_argument, "config.chunk_length",
            [](world& wd) -> call_fn {
              return [&wd] {
                return kvevict::chunkkv<kvevict::knorm<float>>(kvevict::knorm<float>(), {0})
                    .score(wd.layer(), wd.score_out(), wd.span());
              };
            }),
          c("chunkkv: base policy error propagates", errc::invalid_argument, "config.sinks",
            [](world& wd) -> call_fn {
              return [&wd] {
                return kvevict::chunkkv<kvevict::streaming_llm<float>>(kvevict::streaming_llm<float>({-3}))
                    .score(wd.layer(), wd.score_out(), wd.span());
              };
            }),
          c("dapq: prompt longer than the cache", errc::invalid_shape, "scores.cols",
            [](world& wd) -> call_fn {
              return [&wd] {
                std::vector<float> big(world::hkv * (world::l + 1));
                return kvevict::dapq<float>().score(wd.layer(), {big.data(), world::hkv, world::l + 1, world::l + 1},
                                                    wd.span());
              };
            }),
          c("dapq: negative prompt length", errc::invalid_shape, "scores.cols",
            [](world& wd) -> call_fn {
              return [&wd] {
                return kvevict::dapq<float>().score(wd.layer(), {wd.scores.data(), world::hkv, -1, 0}, wd.span());
              };
            }),
          c("dapq: pseudo positions inside the prompt", errc::out_of_range, "queries.positions",
            [](world& wd) -> call_fn {
              return [&wd] {
                // positions 20..23 with Lp = 22: two pseudo queries sit inside the prompt.
                return kvevict::dapq<float>().score(wd.layer(), {wd.scores.data(), world::hkv, 22, world::l},
                                                    wd.span());
              };
            }),
          c("dapq: Hq not divisible", errc::invalid_shape, "queries.num_heads",
            [](world& wd) -> call_fn {
              return [&wd] {
                kvevict::layer_inputs<float> in = wd.layer();
                in.queries.num_heads = 3;
                return kvevict::dapq<float>().score(in, {wd.scores.data(), world::hkv, 20, world::l}, wd.span());
              };
            }),
      });
}

// ---------------------------------------------------------------------------------------
// DeferKV lifecycle
// ---------------------------------------------------------------------------------------
TEST_CASE("bad input: deferkv_state lifecycle", "[errors]") {
  // Each row prepares the state up to some phase, then makes one bad call; the state's
  // observable contents (every S[h][j], Z, steps, prompt, ready) must be unchanged.
  auto c = [](std::string n, errc e, std::string arg, std::function<call_fn(world&)> prepare) {
    return bad_case{std::move(n), e, std::move(arg), [prepare](world& wd) -> call_fn {
                      call_fn f = prepare(wd);
                      return f;
                    }};
  };
  auto with_state = [](world& wd, int phase) {
    // 0: fresh, 1: reserved, 2: prefilled, 3: one decode step, 4: ready, 5: evicted
    if (phase >= 1) wd.reserve_state();
    if (phase >= 2) REQUIRE(wd.state.observe_prefill(3, wd.prefill(), wd.span()).ok());
    if (phase >= 3) REQUIRE(wd.state.observe_decode(3, 0, wd.decode(0), wd.span()).ok());
    if (phase >= 4) REQUIRE(wd.state.observe_decode(3, 1, wd.decode(1), wd.span()).ok());
    if (phase >= 5) REQUIRE(wd.state.mark_evicted().ok());
    wd.state_checked = phase >= 1;
  };
  std::vector<bad_case> rows;
  const auto add = [&](std::string n, errc e, std::string arg, int phase, std::function<kvevict::status(world&)> call) {
    rows.push_back(c(std::move(n), e, std::move(arg), [with_state, phase, call](world& wd) -> call_fn {
      with_state(wd, phase);
      return [&wd, call] { return call(wd); };
    }));
  };
  // reserve
  add("reserve: zero heads", errc::invalid_argument, "num_kv_heads", 0,
      [](world& wd) { return wd.state.reserve(0, 10); });
  add("reserve: negative tokens", errc::invalid_argument, "max_prompt_tokens", 0,
      [](world& wd) { return wd.state.reserve(2, -1); });
  add("reserve (after prefill): zero heads", errc::invalid_argument, "num_kv_heads", 2,
      [](world& wd) { return wd.state.reserve(0, 10); });
  // observe_prefill
  add("prefill before reserve", errc::invalid_state, "state", 0,
      [](world& wd) { return wd.state.observe_prefill(3, wd.prefill(), wd.span()); });
  add("prefill: wrong layer", errc::invalid_state, "layer", 1,
      [](world& wd) { return wd.state.observe_prefill(2, wd.prefill(), wd.span()); });
  add("prefill: twice", errc::invalid_state, "state", 2,
      [](world& wd) { return wd.state.observe_prefill(3, wd.prefill(), wd.span()); });
  add("prefill: after ready", errc::invalid_state, "state", 4,
      [](world& wd) { return wd.state.observe_prefill(3, wd.prefill(), wd.span()); });
  add("prefill: more queries than W", errc::invalid_shape, "queries.num_queries", 1, [](world& wd) {
    kvevict::layer_inputs<float> in = wd.prefill();
    static std::vector<i64> pos{18, 19, 20, 21, 22, 23};
    in.queries = kvevict::contiguous_queries<const float>(wd.q.data(), 2, 6, world::d, pos.data());
    return wd.state.observe_prefill(3, in, wd.span());
  });
  add("prefill: more KV heads than reserved", errc::invalid_state, "state", 1, [](world& wd) {
    kvevict::layer_inputs<float> in = wd.prefill();
    in.keys = kvevict::hf_contiguous<const float>(wd.k.data(), 4, 12, world::d);
    return wd.state.observe_prefill(3, in, wd.span());
  });
  add("prefill: more tokens than reserved", errc::invalid_state, "state", 1, [](world& wd) {
    kvevict::layer_inputs<float> in = wd.prefill();
    in.keys.num_tokens = world::l + 1;
    return wd.state.observe_prefill(3, in, wd.span());
  });
  add("prefill: 2^31 tokens claimed", errc::invalid_state, "state", 1, [](world& wd) {
    kvevict::layer_inputs<float> in = wd.prefill();
    in.keys = kvevict::hf_contiguous<const float>(wd.dk.data(), world::hkv, kTwo31, world::d);
    return wd.state.observe_prefill(3, in, wd.span());
  });
  add("prefill: Hq not divisible", errc::invalid_shape, "queries.num_heads", 1, [](world& wd) {
    kvevict::layer_inputs<float> in = wd.prefill();
    in.queries.num_heads = 3;
    return wd.state.observe_prefill(3, in, wd.span());
  });
  add("prefill: null keys", errc::null_pointer, "keys.data", 1, [](world& wd) {
    kvevict::layer_inputs<float> in = wd.prefill();
    in.keys.data = nullptr;
    return wd.state.observe_prefill(3, in, wd.span());
  });
  add("prefill: null positions", errc::null_pointer, "queries.positions", 1, [](world& wd) {
    kvevict::layer_inputs<float> in = wd.prefill();
    in.queries.positions = nullptr;
    return wd.state.observe_prefill(3, in, wd.span());
  });
  add("prefill: engine LSE given", errc::unsupported, "observation", 1, [](world& wd) {
    kvevict::layer_inputs<float> in = wd.prefill();
    in.observation.lse = wd.lse.data();
    return wd.state.observe_prefill(3, in, wd.span());
  });
  add("prefill: window weights given", errc::unsupported, "observation", 1, [](world& wd) {
    kvevict::layer_inputs<float> in = wd.prefill();
    in.observation.weights = wd.weights.data();
    return wd.state.observe_prefill(3, in, wd.span());
  });
  add("prefill: workspace too small", errc::workspace_too_small, "ws", 1,
      [](world& wd) { return wd.state.observe_prefill(3, wd.prefill(), world::tiny()); });
  // observe_decode
  add("decode before prefill", errc::invalid_state, "state", 1,
      [](world& wd) { return wd.state.observe_decode(3, 0, wd.decode(0), wd.span()); });
  add("decode: wrong layer", errc::invalid_state, "layer", 2,
      [](world& wd) { return wd.state.observe_decode(4, 0, wd.decode(0), wd.span()); });
  add("decode: step skipped", errc::invalid_state, "step", 2,
      [](world& wd) { return wd.state.observe_decode(3, 1, wd.decode(1), wd.span()); });
  add("decode: step repeated", errc::invalid_state, "step", 3,
      [](world& wd) { return wd.state.observe_decode(3, 0, wd.decode(0), wd.span()); });
  add("decode: negative step", errc::invalid_state, "step", 2,
      [](world& wd) { return wd.state.observe_decode(3, -1, wd.decode(0), wd.span()); });
  add("decode: cache of the wrong length (wrong layer's cache?)", errc::invalid_shape, "keys.num_tokens", 2,
      [](world& wd) { return wd.state.observe_decode(3, 0, wd.decode(1), wd.span()); });
  add("decode: two queries, one new token in the cache", errc::invalid_shape, "keys.num_tokens", 2, [](world& wd) {
    kvevict::layer_inputs<float> in = wd.decode(0);
    in.queries.num_queries = 2;
    return wd.state.observe_decode(3, 0, in, wd.span());
  });
  add("decode: no queries", errc::invalid_shape, "queries.num_queries", 2, [](world& wd) {
    kvevict::layer_inputs<float> in = wd.decode(0);
    in.queries.num_queries = 0;
    return wd.state.observe_decode(3, 0, in, wd.span());
  });
  add("decode: other KV head count", errc::invalid_shape, "keys.num_heads", 2, [](world& wd) {
    kvevict::layer_inputs<float> in = wd.decode(0);
    in.keys.num_heads = 1;
    in.queries.num_heads = 2;
    return wd.state.observe_decode(3, 0, in, wd.span());
  });
  add("decode: other query head count", errc::invalid_shape, "keys.num_heads", 2, [](world& wd) {
    kvevict::layer_inputs<float> in = wd.decode(0);
    in.queries.num_heads = 2;
    return wd.state.observe_decode(3, 0, in, wd.span());
  });
  add("decode: head_dim mismatch", errc::invalid_shape, "queries.head_dim", 2, [](world& wd) {
    kvevict::layer_inputs<float> in = wd.decode(0);
    in.queries.head_dim = 4;
    return wd.state.observe_decode(3, 0, in, wd.span());
  });
  add("decode: workspace too small", errc::workspace_too_small, "ws", 2,
      [](world& wd) { return wd.state.observe_decode(3, 0, wd.decode(0), world::tiny()); });
  add("decode: past the delay", errc::invalid_state, "state", 4,
      [](world& wd) { return wd.state.observe_decode(3, 2, wd.decode(1), wd.span()); });
  add("decode: after eviction", errc::invalid_state, "state", 5,
      [](world& wd) { return wd.state.observe_decode(3, 2, wd.decode(1), wd.span()); });
  // scores / mark_evicted
  add("scores before prefill", errc::invalid_state, "state", 1, [](world& wd) {
    return wd.state.scores({wd.scores.data(), world::hkv, world::l, world::l}, wd.span());
  });
  add("scores before the delay", errc::invalid_state, "state", 3, [](world& wd) {
    return wd.state.scores({wd.scores.data(), world::hkv, world::l, world::l}, wd.span());
  });
  add("scores of the wrong shape", errc::invalid_shape, "out", 4, [](world& wd) {
    return wd.state.scores({wd.scores.data(), world::hkv, world::l, world::l}, wd.span());
  });
  add("scores: workspace too small", errc::workspace_too_small, "ws", 4, [](world& wd) {
    return wd.state.scores({wd.flat.data(), world::hkv, world::l + 2, world::l + 2}, world::tiny());
  });
  add("scores after eviction", errc::invalid_state, "state", 5, [](world& wd) {
    return wd.state.scores({wd.flat.data(), world::hkv, world::l + 2, world::l + 2}, wd.span());
  });
  add("mark_evicted before ready", errc::invalid_state, "state", 3, [](world& wd) { return wd.state.mark_evicted(); });
  add("mark_evicted twice", errc::invalid_state, "state", 5, [](world& wd) { return wd.state.mark_evicted(); });
  run_table("deferkv_state", rows);

  // Bad configurations are reported by observe_prefill (the first call that uses them).
  struct config_row {
    const char* name;
    std::function<void(kvevict::deferkv_config&)> mutate;
    errc code;
    const char* argument;
  };
  const std::vector<config_row> configs = {
      {"eta 0", [](kvevict::deferkv_config& cf) { cf.eta = 0.0; }, errc::invalid_argument, "config.eta"},
      {"eta above 1", [](kvevict::deferkv_config& cf) { cf.eta = 1.5; }, errc::invalid_argument, "config.eta"},
      {"NaN eta", [](kvevict::deferkv_config& cf) { cf.eta = std::nan(""); }, errc::invalid_argument, "config.eta"},
      {"negative window", [](kvevict::deferkv_config& cf) { cf.window = -1; }, errc::invalid_argument, "config.window"},
      {"negative delay", [](kvevict::deferkv_config& cf) { cf.delay = -1; }, errc::invalid_argument, "config.delay"},
      {"max GQA", [](kvevict::deferkv_config& cf) { cf.gqa = kvevict::gqa_reduction::max; }, errc::unsupported,
       "config.gqa"},
      {"even kernel", [](kvevict::deferkv_config& cf) { cf.pool.kernel = 2; }, errc::invalid_argument,
       "params.pool.kernel"},
      {"bad domain", [](kvevict::deferkv_config& cf) { cf.domain = static_cast<kvevict::softmax_domain>(9); },
       errc::invalid_argument, "params.domain"},
      {"window 0 (no prompt observation)", [](kvevict::deferkv_config& cf) { cf.window = 0; }, errc::invalid_shape,
       "queries.num_queries"},
  };
  for (const config_row& r : configs) {
    world wd;
    kvevict::deferkv_config cfg = world::make_dcfg();
    r.mutate(cfg);
    kvevict::deferkv_state<float> st(cfg, 3);
    REQUIRE(st.reserve(world::hkv, world::l).ok());
    const std::uint64_t before = wd.checksum();
    const kvevict::status s = st.observe_prefill(3, wd.prefill(), wd.span());
    INFO(r.name << ": " << s.message());
    CHECK(s.code() == r.code);
    CHECK(std::string(s.argument()) == r.argument);
    CHECK(wd.checksum() == before);
    CHECK_FALSE(st.ready());
    CHECK(st.prompt_tokens() == 0);
  }
}

// ---------------------------------------------------------------------------------------
// DapQ pseudo tokens and the RoPE helpers
// ---------------------------------------------------------------------------------------
TEST_CASE("bad input: dapq helpers and rope", "[errors]") {
  auto c = [](std::string n, errc e, std::string arg, std::function<kvevict::status(world&)> call) {
    return bad_case{std::move(n), e, std::move(arg),
                    [call](world& wd) -> call_fn { return [&wd, call] { return call(wd); }; }};
  };
  auto rope = [] {
    kvevict::rope_config r;
    r.head_dim = world::d;
    return r;
  };
  auto rerotate = [](world& wd, const kvevict::query_view<const float>& q, const kvevict::rope_config& r) {
    return kvevict::dapq_rerotate(q, r, 4, wd.rot.data(), wd.rot_pos.data());
  };
  run_table(
      "dapq/rope",
      {
          c("first_last: empty prompt", errc::invalid_argument, "prompt_tokens",
            [](world& wd) {
              return kvevict::dapq_pseudo_tokens_first_last(wd.prompt_ids.data(), 0, 8, 24, wd.pseudo_ids.data());
            }),
          c("first_last: null prompt", errc::null_pointer, "prompt",
            [](world& wd) { return kvevict::dapq_pseudo_tokens_first_last(nullptr, 24, 8, 24, wd.pseudo_ids.data()); }),
          c("first_last: negative first", errc::invalid_argument, "first",
            [](world& wd) {
              return kvevict::dapq_pseudo_tokens_first_last(wd.prompt_ids.data(), 24, -1, 24, wd.pseudo_ids.data());
            }),
          c("first_last: negative last", errc::invalid_argument, "first",
            [](world& wd) {
              return kvevict::dapq_pseudo_tokens_first_last(wd.prompt_ids.data(), 24, 8, -2, wd.pseudo_ids.data());
            }),
          c("first_last: nothing to take", errc::invalid_argument, "first",
            [](world& wd) {
              return kvevict::dapq_pseudo_tokens_first_last(wd.prompt_ids.data(), 24, 0, 0, wd.pseudo_ids.data());
            }),
          c("first_last: null out", errc::null_pointer, "out",
            [](world& wd) { return kvevict::dapq_pseudo_tokens_first_last(wd.prompt_ids.data(), 24, 8, 24, nullptr); }),
          c("phrase: empty", errc::invalid_argument, "phrase",
            [](world& wd) {
              return kvevict::dapq_pseudo_tokens_phrase(wd.prompt_ids.data(), 0, 32, wd.pseudo_ids.data());
            }),
          c("phrase: null", errc::invalid_argument, "phrase",
            [](world& wd) { return kvevict::dapq_pseudo_tokens_phrase(nullptr, 3, 32, wd.pseudo_ids.data()); }),
          c("phrase: zero count", errc::invalid_argument, "count",
            [](world& wd) {
              return kvevict::dapq_pseudo_tokens_phrase(wd.prompt_ids.data(), 3, 0, wd.pseudo_ids.data());
            }),
          c("phrase: null out", errc::null_pointer, "out",
            [](world& wd) { return kvevict::dapq_pseudo_tokens_phrase(wd.prompt_ids.data(), 3, 32, nullptr); }),
          c("rerotate: null queries", errc::null_pointer, "queries.data",
            [=](world& wd) {
              auto q = wd.queries();
              q.data = nullptr;
              return rerotate(wd, q, rope());
            }),
          c("rerotate: null positions", errc::null_pointer, "queries.positions",
            [=](world& wd) {
              auto q = wd.queries();
              q.positions = nullptr;
              return rerotate(wd, q, rope());
            }),
          c("rerotate: overlapping queries", errc::invalid_stride, "queries.query_stride",
            [=](world& wd) {
              auto q = wd.queries();
              q.query_stride = 2;
              return rerotate(wd, q, rope());
            }),
          c("rerotate: rope for another head_dim", errc::invalid_shape, "rope.head_dim",
            [=](world& wd) {
              kvevict::rope_config r = rope();
              r.head_dim = 16;
              return rerotate(wd, wd.queries(), r);
            }),
          c("rerotate: head_dim 1", errc::invalid_argument, "rope.head_dim",
            [=](world& wd) {
              kvevict::rope_config r = rope();
              r.head_dim = 1;
              return rerotate(wd, wd.queries(), r);
            }),
          c("rerotate: odd rotary_dim", errc::invalid_argument, "rope.rotary_dim",
            [=](world& wd) {
              kvevict::rope_config r = rope();
              r.rotary_dim = 3;
              return rerotate(wd, wd.queries(), r);
            }),
          c("rerotate: rotary_dim above head_dim", errc::invalid_argument, "rope.rotary_dim",
            [=](world& wd) {
              kvevict::rope_config r = rope();
              r.rotary_dim = 10;
              return rerotate(wd, wd.queries(), r);
            }),
          c("rerotate: negative rotary_dim", errc::invalid_argument, "rope.rotary_dim",
            [=](world& wd) {
              kvevict::rope_config r = rope();
              r.rotary_dim = -2;
              return rerotate(wd, wd.queries(), r);
            }),
          c("rerotate: theta 1", errc::invalid_argument, "rope.theta",
            [=](world& wd) {
              kvevict::rope_config r = rope();
              r.theta = 1.0;
              return rerotate(wd, wd.queries(), r);
            }),
          c("rerotate: NaN theta", errc::invalid_argument, "rope.theta",
            [=](world& wd) {
              kvevict::rope_config r = rope();
              r.theta = std::nan("");
              return rerotate(wd, wd.queries(), r);
            }),
          c("rerotate: infinite theta", errc::invalid_argument, "rope.theta",
            [=](world& wd) {
              kvevict::rope_config r = rope();
              r.theta = std::numeric_limits<double>::infinity();
              return rerotate(wd, wd.queries(), r);
            }),
          c("rerotate: llama3 factor below 1", errc::invalid_argument, "rope.llama3",
            [=](world& wd) {
              kvevict::rope_config r = rope();
              r.llama3.enabled = true;
              r.llama3.factor = 0.5;
              return rerotate(wd, wd.queries(), r);
            }),
          c("rerotate: llama3 low >= high frequency factor", errc::invalid_argument, "rope.llama3",
            [=](world& wd) {
              kvevict::rope_config r = rope();
              r.llama3.enabled = true;
              r.llama3.low_freq_factor = 4.0;
              return rerotate(wd, wd.queries(), r);
            }),
          c("rerotate: llama3 NaN original length", errc::invalid_argument, "rope.llama3",
            [=](world& wd) {
              kvevict::rope_config r = rope();
              r.llama3.enabled = true;
              r.llama3.original_max_position = std::nan("");
              return rerotate(wd, wd.queries(), r);
            }),
          c("rerotate: null out", errc::null_pointer, "out",
            [=](world& wd) {
              return kvevict::dapq_rerotate(wd.queries(), rope(), 4, static_cast<float*>(nullptr), wd.rot_pos.data());
            }),
          c("rerotate: null out positions", errc::null_pointer, "out_positions",
            [=](world& wd) { return kvevict::dapq_rerotate(wd.queries(), rope(), 4, wd.rot.data(), nullptr); }),
          c("rerotate: head_dim 1026", errc::unsupported, "queries.head_dim",
            [](world& wd) {
              static std::vector<float> big(1026);
              kvevict::rope_config r;
              r.head_dim = 1026;
              const auto q = kvevict::contiguous_queries<const float>(big.data(), 1, 1, 1026, wd.qpos.data());
              return kvevict::dapq_rerotate(q, r, 4, wd.rot.data(), wd.rot_pos.data());
            }),
          c("rotate_to: head_dim 2^40 claimed", errc::unsupported, "queries.head_dim",
            [](world& wd) {
              kvevict::rope_config r;
              r.head_dim = i64{1} << 40;
              const auto q = kvevict::contiguous_queries<const float>(wd.q.data(), 1, 1, i64{1} << 40, wd.qpos.data());
              return kvevict::dapq_rotate_to(q, r, 24, wd.rot.data(), wd.rot_pos.data());
            }),
          c("rotate_to: negative position", errc::out_of_range, "queries.positions[0]",
            [=](world& wd) {
              static std::vector<i64> pos{-5, 1, 2, 3};
              auto q = wd.queries();
              q.positions = pos.data();
              return kvevict::dapq_rotate_to(q, rope(), 24, wd.rot.data(), wd.rot_pos.data());
            }),
          c("validate_rope_config: rotary_dim 0 with head_dim 0", errc::invalid_argument, "rope.head_dim",
            [](world&) {
              kvevict::rope_config r;
              r.head_dim = 0;
              return kvevict::validate_rope_config(r, "kvevict::validate_rope_config");
            }),
      });
}

// ---------------------------------------------------------------------------------------
// evict, evict_batch, flatten_varlen, keep_list_positions
// ---------------------------------------------------------------------------------------
TEST_CASE("bad input: evict", "[errors]") {
  using A = evict_args;
  auto c = [](std::string n, errc e, std::string arg, std::function<void(world&, A&)> m) {
    return make_case<A>(std::move(n), e, std::move(arg), ev, std::move(m));
  };
  auto cp = [](std::string n, errc e, std::string arg, std::function<void(world&, A&)> m) {
    return make_case<A>(std::move(n), e, std::move(arg), ev_paged, std::move(m));
  };
  auto set_keep = [](world& wd, A& a, std::vector<i64> offsets, std::vector<i64> indices) {
    wd.keep_offsets = std::move(offsets);
    wd.keep_indices = std::move(indices);
    a.keep = wd.keep();
  };
  run_table(
      "evict",
      {
          c("null keys", errc::null_pointer, "keys.data", [](world&, A& a) { a.k.data = nullptr; }),
          c("null values", errc::null_pointer, "values.data", [](world&, A& a) { a.v.data = nullptr; }),
          c("V with other heads", errc::invalid_shape, "values.num_heads", [](world&, A& a) { a.v.num_heads = 1; }),
          c("V with other tokens", errc::invalid_shape, "values.num_tokens",
            [](world&, A& a) { a.v.num_tokens = world::l - 1; }),
          c("V is K", errc::invalid_argument, "values.data", [](world& wd, A& a) { a.v.data = wd.k.data(); }),
          c("overlapping V rows", errc::invalid_stride, "values.token_stride",
            [](world&, A& a) { a.v.token_stride = 7; }),
          c("negative K head stride", errc::invalid_stride, "keys.head_stride",
            [](world&, A& a) { a.k.head_stride = -world::l * world::d; }),
          c("keep-list for other heads", errc::invalid_shape, "keep.num_heads",
            [](world&, A& a) { a.keep.num_heads = 3; }),
          c("null offsets", errc::null_pointer, "keep.offsets", [](world&, A& a) { a.keep.offsets = nullptr; }),
          c("offsets[0] != 0", errc::invalid_keep_list, "keep.offsets",
            [=](world& wd, A& a) {
              set_keep(wd, a, {1, 5, 9}, {1, 3, 7, 8, 23, 0, 2, 4, 22});
            }),
          c("decreasing offsets", errc::invalid_keep_list, "keep.offsets",
            [=](world& wd, A& a) {
              set_keep(wd, a, {0, 5, 4}, {1, 3, 7, 8, 23, 0, 2, 4, 22});
            }),
          c("offsets past the capacity", errc::invalid_keep_list, "keep.offsets",
            [](world&, A& a) { a.keep.capacity = 8; }),
          c("null indices", errc::null_pointer, "keep.indices", [](world&, A& a) { a.keep.indices = nullptr; }),
          c("unsorted indices", errc::invalid_keep_list, "keep.indices",
            [=](world& wd, A& a) {
              set_keep(wd, a, {0, 5, 9}, {1, 3, 8, 7, 23, 0, 2, 4, 22});
            }),
          c("duplicate indices", errc::invalid_keep_list, "keep.indices",
            [=](world& wd, A& a) {
              set_keep(wd, a, {0, 5, 9}, {1, 3, 7, 7, 23, 0, 2, 4, 22});
            }),
          c("index == L", errc::invalid_keep_list, "keep.indices",
            [=](world& wd, A& a) {
              set_keep(wd, a, {0, 5, 9}, {1, 3, 7, 8, 24, 0, 2, 4, 22});
            }),
          c("negative index", errc::invalid_keep_list, "keep.indices",
            [=](world& wd, A& a) {
              set_keep(wd, a, {0, 5, 9}, {1, 3, 7, 8, 23, -1, 2, 4, 22});
            }),
          c("index 2^31", errc::invalid_keep_list, "keep.indices",
            [=](world& wd, A& a) {
              set_keep(wd, a, {0, 5, 9}, {1, 3, 7, 8, kTwo31, 0, 2, 4, 22});
            }),
          c("second head unsorted", errc::invalid_keep_list, "keep.indices",
            [=](world& wd, A& a) {
              set_keep(wd, a, {0, 5, 9}, {1, 3, 7, 8, 23, 0, 4, 2, 22});
            }),
          c("L = 2^31 + 7 claimed, keep past it", errc::invalid_keep_list, "keep.indices",
            [=](world& wd, A& a) {
              a.k = huge_keys(wd, kTwo31 + 7);
              a.v = kvevict::hf_contiguous(wd.v.data(), world::hkv, kTwo31 + 7, world::d);
              set_keep(wd, a, {0, 1, 2}, {kTwo31 + 7, 0});
            }),
          c("L = 2^31 + 7 claimed, unsorted keep", errc::invalid_keep_list, "keep.indices",
            [=](world& wd, A& a) {
              a.k = huge_keys(wd, kTwo31 + 7);
              a.v = kvevict::hf_contiguous(wd.v.data(), world::hkv, kTwo31 + 7, world::d);
              set_keep(wd, a, {0, 2, 3}, {kTwo31 + 5, kTwo31 + 4, 0});
            }),
          c("L = 2^32 + 1 claimed, V shorter", errc::invalid_shape, "values.num_tokens",
            [](world& wd, A& a) {
              a.k = huge_keys(wd, kTwo32 + 1);
              a.v = kvevict::hf_contiguous(wd.v.data(), world::hkv, kTwo32, world::d);
            }),
          cp("paged: block id past the pool", errc::out_of_range, "keys.block_table[1]",
             [](world& wd, A& a) {
               wd.table_k[1] = 5;
               a.k = wd.paged_keys();
             }),
          cp("paged: V block id negative", errc::out_of_range, "values.block_table[0]",
             [](world& wd, A& a) {
               wd.table_v[0] = -2;
               a.v = wd.paged_values();
             }),
          cp("paged: repeated block id", errc::invalid_argument, "keys.block_table[2]",
             [](world& wd, A& a) {
               wd.table_k = {3, 0, 3};
               a.k = wd.paged_keys();
             }),
          cp("paged: V repeats a block", errc::invalid_argument, "values.block_table[1]",
             [](world& wd, A& a) {
               wd.table_v = {2, 2, 1};
               a.v = wd.paged_values();
             }),
          cp("paged: K and V share a block of one pool", errc::invalid_argument, "values.block_table[0]",
             [](world& wd, A& a) {
               wd.table_v = {4, 1, 2};
               a.v = kvevict::paged_nhd(wd.pool_k.data(), world::pool_blocks, world::block, world::hkv, world::d,
                                        wd.table_v.data(), world::l);
             }),
          cp("paged: workspace too small", errc::workspace_too_small, "ws", [](world&, A& a) { a.ws = world::tiny(); }),
          cp("paged: no workspace", errc::workspace_too_small, "ws", [](world&, A& a) { a.ws = {}; }),
          cp("paged: zero block size", errc::invalid_shape, "keys.block_size",
             [](world&, A& a) { a.k.block_size = 0; }),
          cp("paged: overlapping blocks", errc::invalid_stride, "values.block_stride",
             [](world&, A& a) { a.v.block_stride = world::d; }),
      });
}

TEST_CASE("bad input: evict_batch", "[errors]") {
  using A = batch_args;
  auto c = [](std::string n, errc e, std::string arg, std::function<void(world&, A&)> m) {
    return make_case<A>(std::move(n), e, std::move(arg), batch, std::move(m));
  };
  auto cp = [](std::string n, errc e, std::string arg, std::function<void(world&, A&)> m) {
    return make_case<A>(std::move(n), e, std::move(arg), paged_batch, std::move(m));
  };
  run_table(
      "evict_batch",
      {
          c("negative sequence count", errc::invalid_shape, "keys.num_seqs", [](world&, A& a) { a.k.num_seqs = -1; }),
          c("null sequence lengths", errc::null_pointer, "keys.seq_lens", [](world&, A& a) { a.k.seq_lens = nullptr; }),
          c("negative sequence length", errc::invalid_shape, "keys.seq_lens[1]",
            [](world& wd, A& a) {
              wd.seq_lens[1] = -1;
              a.v.seq_lens = nullptr;
            }),
          c("V null sequence lengths", errc::null_pointer, "values.seq_lens",
            [](world&, A& a) { a.v.seq_lens = nullptr; }),
          c("V with other sequence count", errc::invalid_shape, "values.num_seqs",
            [](world&, A& a) { a.v.num_seqs = 2; }),
          c("V with other lengths", errc::invalid_shape, "values.seq_lens[1]",
            [](world&, A& a) {
              static std::vector<i64> lens{24, 9, 0};
              a.v.seq_lens = lens.data();
            }),
          c("null keep-lists", errc::null_pointer, "keeps", [](world&, A& a) { a.keeps = nullptr; }),
          c("null results", errc::null_pointer, "results", [](world&, A& a) { a.results = nullptr; }),
          c("overlapping sequences", errc::invalid_stride, "keys.seq_stride",
            [](world&, A& a) { a.k.seq_stride = 100; }),
          c("negative sequence stride", errc::invalid_stride, "values.seq_stride",
            [](world&, A& a) { a.v.seq_stride = -1; }),
          c("sequence 1: unsorted keep-list", errc::invalid_keep_list, "keeps[1].indices",
            [](world& wd, A&) {
              wd.bkeep_indices[1][0] = 9;
              wd.bkeep_indices[1][1] = 0;
            }),
          c("sequence 1: index == its length", errc::invalid_keep_list, "keeps[1].indices",
            [](world& wd, A&) { wd.bkeep_indices[1][1] = 10; }),
          c("sequence 2: keep-list for other heads", errc::invalid_shape, "keeps[2].num_heads",
            [](world& wd, A&) { wd.bkeeps[2].num_heads = 1; }),
          c("sequence 0: null keys", errc::null_pointer, "keys[0].data",
            [](world&, A& a) { a.k.layout.data = nullptr; }),
          c("layout with zero heads", errc::invalid_shape, "keys[0].num_heads",
            [](world&, A& a) { a.k.layout.num_heads = 0; }),
          cp("paged: block table rows overlap", errc::invalid_stride, "keys.block_table_stride",
             [](world&, A& a) { a.k.block_table_stride = 2; }),
          cp("paged: zero block size", errc::invalid_shape, "values.layout.block_size",
             [](world&, A& a) { a.v.layout.block_size = 0; }),
          cp("paged: block id past the pool", errc::out_of_range, "keys[1].block_table[1]",
             [](world& wd, A&) { wd.btable_k[4] = 9; }),
          cp("paged: a block shared by two sequences", errc::invalid_argument, "keys[2].block_table[0]",
             [](world& wd, A&) { wd.btable_k[6] = 1; }),
          cp("paged: a block repeated in one sequence", errc::invalid_argument, "values[0].block_table[2]",
             [](world& wd, A&) { wd.btable_v[2] = 8; }),
          cp("paged: workspace too small", errc::workspace_too_small, "ws", [](world&, A& a) { a.ws = world::tiny(); }),
          cp("paged CSR: short indptr", errc::invalid_shape, "keys.block_indptr[2]",
             [](world& wd, A& a) {
               wd.indptr = {0, 3, 4, 5};
               a.k.block_indptr = wd.indptr.data();
               a.k.block_table_stride = 0;
             }),
          cp("paged CSR: negative indptr", errc::invalid_shape, "keys.block_indptr[1]",
             [](world& wd, A& a) {
               wd.indptr = {-1, 3, 5, 6};
               a.k.block_indptr = wd.indptr.data();
             }),
      });
}

TEST_CASE("bad input: flatten_varlen and keep_list_positions", "[errors]") {
  using A = flat_args;
  auto c = [](std::string n, errc e, std::string arg, std::function<void(world&, A&)> m) {
    return make_case<A>(std::move(n), e, std::move(arg), flat, std::move(m));
  };
  run_table("flatten_varlen",
            {
                c("null source", errc::null_pointer, "src.data", [](world&, A& a) { a.src.data = nullptr; }),
                c("overlapping source", errc::invalid_stride, "src.token_stride",
                  [](world&, A& a) { a.src.token_stride = 4; }),
                c("keep-list for other heads", errc::invalid_shape, "keep.num_heads",
                  [](world&, A& a) { a.keep.num_heads = 1; }),
                c("unsorted keep-list", errc::invalid_keep_list, "keep.indices",
                  [](world& wd, A& a) {
                    wd.keep_indices[1] = 0;
                    a.keep = wd.keep();
                  }),
                c("too few rows", errc::invalid_shape, "dst_rows", [](world&, A& a) { a.rows = 8; }),
                c("null dst", errc::null_pointer, "dst", [](world&, A& a) { a.dst = nullptr; }),
                c("row stride below d", errc::invalid_stride, "dst_row_stride", [](world&, A& a) { a.stride = 7; }),
                c("negative row stride", errc::invalid_stride, "dst_row_stride", [](world&, A& a) { a.stride = -8; }),
                c("dst overlapping the source, shifted", errc::invalid_argument, "dst",
                  [](world& wd, A& a) { a.dst = wd.k.data() + 1; }),
                c("in place with another row stride", errc::invalid_argument, "dst",
                  [](world& wd, A& a) {
                    a.dst = wd.k.data();
                    a.stride = world::d * 2;
                    a.rows = 9;
                  }),
                c("in place over a transposed source", errc::invalid_argument, "dst",
                  [](world& wd, A& a) {
                    a.src = kvevict::strided_cache<const float>(wd.k.data(), world::hkv, world::l, world::d,
                                                                world::l * world::d, 1, world::l);
                    a.dst = wd.k.data();
                  }),
                c("L = 2^31 + 7 claimed, keep past it", errc::invalid_keep_list, "keep.indices",
                  [](world& wd, A& a) {
                    a.src = huge_keys(wd, kTwo31 + 7);
                    wd.keep_indices[4] = kTwo31 + 7;
                    a.keep = wd.keep();
                  }),
            });

  auto p = [](std::string n, errc e, std::string arg, std::function<kvevict::status(world&)> call) {
    return bad_case{std::move(n), e, std::move(arg),
                    [call](world& wd) -> call_fn { return [&wd, call] { return call(wd); }; }};
  };
  run_table("keep_list_positions",
            {
                p("negative token count", errc::invalid_shape, "num_tokens",
                  [](world& wd) { return kvevict::keep_list_positions(wd.keep(), -1, nullptr, wd.positions.data()); }),
                p("no heads", errc::invalid_shape, "keep.num_heads",
                  [](world& wd) {
                    auto k = wd.keep();
                    k.num_heads = 0;
                    return kvevict::keep_list_positions(k, world::l, nullptr, wd.positions.data());
                  }),
                p("null offsets", errc::null_pointer, "keep.offsets",
                  [](world& wd) {
                    auto k = wd.keep();
                    k.offsets = nullptr;
                    return kvevict::keep_list_positions(k, world::l, nullptr, wd.positions.data());
                  }),
                p("index == L", errc::invalid_keep_list, "keep.indices",
                  [](world& wd) { return kvevict::keep_list_positions(wd.keep(), 23, nullptr, wd.positions.data()); }),
                bad_case{"duplicate index", errc::invalid_keep_list, "keep.indices",
                         [](world& wd) -> call_fn {
                           wd.keep_indices[6] = 0;
                           return [&wd] {
                             return kvevict::keep_list_positions(wd.keep(), world::l, wd.kpos.data(),
                                                                 wd.positions.data());
                           };
                         }},
                p("null output", errc::null_pointer, "positions_out",
                  [](world& wd) { return kvevict::keep_list_positions(wd.keep(), world::l, nullptr, nullptr); }),
                bad_case{"2^40 tokens, index past them", errc::invalid_keep_list, "keep.indices",
                         [](world& wd) -> call_fn {
                           wd.keep_indices[8] = i64{1} << 40;
                           return [&wd] {
                             return kvevict::keep_list_positions(wd.keep(), i64{1} << 40, nullptr, wd.positions.data());
                           };
                         }},
            });
}

// ---------------------------------------------------------------------------------------
// Every cache layout and storage type: each malformed view field is named, for every entry
// point that takes a cache view, and nothing moves.
// ---------------------------------------------------------------------------------------
TEMPLATE_TEST_CASE("bad input: malformed cache views of every layout and type", "[errors]", float, kvevict::fp16,
                   kvevict::bf16, kvevict::fp8_e4m3, kvevict::fp8_e5m2) {
  using T = TestType;
  using Q = kvevict::default_query_type_t<T>;  // fp8 caches: bf16 queries
  const i64 hkv = 2, l = 20, d = 8, hq = 4, w = 3;
  struct mutation {
    const char* field;
    errc code;
    std::function<bool(kvevict::cache_view<T>&, test::layout)> apply;  // false: not applicable
  };
  const std::vector<mutation> mutations = {
      {"data", errc::null_pointer,
       [](kvevict::cache_view<T>& v, test::layout) {
         v.data = nullptr;
         return true;
       }},
      {"num_heads", errc::invalid_shape,
       [](kvevict::cache_view<T>& v, test::layout) {
         v.num_heads = 0;
         return true;
       }},
      {"head_dim", errc::invalid_shape,
       [](kvevict::cache_view<T>& v, test::layout) {
         v.head_dim = -1;
         return true;
       }},
      {"num_tokens", errc::invalid_shape,
       [](kvevict::cache_view<T>& v, test::layout) {
         v.num_tokens = -3;
         return true;
       }},
      {"head_stride", errc::invalid_stride,
       [](kvevict::cache_view<T>& v, test::layout) {
         v.head_stride = -1;
         return true;
       }},
      {"token_stride", errc::invalid_stride,
       [](kvevict::cache_view<T>& v, test::layout) {
         v.token_stride = -5;
         return true;
       }},
      {"dim_stride", errc::invalid_stride,
       [](kvevict::cache_view<T>& v, test::layout) {
         v.dim_stride = -1;
         return true;
       }},
      {"token_stride", errc::invalid_stride,
       [](kvevict::cache_view<T>& v, test::layout) {
         if (v.is_paged() && v.block_size == 1) return false;  // one token per block: no token stride
         v.token_stride = 0;
         return true;
       }},  // every token on one row
      {"block_size", errc::invalid_shape,
       [](kvevict::cache_view<T>& v, test::layout) {
         if (!v.is_paged()) return false;
         v.block_size = 0;
         return true;
       }},
      {"scale", errc::invalid_argument,  // a dequantisation scale must be finite and > 0
       [](kvevict::cache_view<T>& v, test::layout) {
         v.scale = -0.5f;
         return true;
       }},
      {"num_pool_blocks", errc::invalid_shape,
       [](kvevict::cache_view<T>& v, test::layout) {
         if (!v.is_paged()) return false;
         v.num_pool_blocks = 0;
         return true;
       }},
      {"block_stride", errc::invalid_stride,
       [](kvevict::cache_view<T>& v, test::layout) {
         if (!v.is_paged()) return false;
         v.block_stride = 0;  // every block at the same place
         return true;
       }},
      {"block_table[1]", errc::out_of_range,
       [](kvevict::cache_view<T>& v, test::layout) {
         if (!v.is_paged()) return false;
         if (v.block_table.width() == 8)  // paged_int64
           const_cast<std::int64_t*>(v.block_table.int64())[1] = v.num_pool_blocks;
         else
           const_cast<std::int32_t*>(v.block_table.int32())[1] = static_cast<std::int32_t>(v.num_pool_blocks);
         return true;
       }},
      {"", errc::overflow,  // a view spanning more than 2^63 elements
       [](kvevict::cache_view<T>& v, test::layout kind) {
         if (v.is_paged()) {
           v.block_stride = i64{1} << 62;
         } else if (kind == test::layout::transposed) {
           v.dim_stride = i64{1} << 61;
         } else {
           v.token_stride = i64{1} << 61;
         }
         return true;
       }},
  };
  std::vector<double> dense = test::normal(static_cast<std::size_t>(hkv * l * d), 3);
  std::vector<double> qdense = test::normal(static_cast<std::size_t>(hq * w * d), 4);
  for (test::layout kind : test::kAllLayouts) {
    for (const mutation& m : mutations) {
      for (int target = 0; target < 5; ++target) {
        // 0: observation_scores keys, 1: evict keys, 2: evict values, 3: flatten_varlen src, 4: knorm keys
        auto kc = test::make_cache<T>(kind, hkv, l, d, dense, 8, 11);
        auto vc = test::make_cache<T>(kind, hkv, l, d, dense, 8, 12);
        auto queries = test::make_queries<Q>(hq, w, d, qdense, {17, 18, 19}, false, test::int32_positions(kind));
        std::vector<float> scores(static_cast<std::size_t>(hkv * l), 5.0f);
        std::vector<T> dst(static_cast<std::size_t>(hkv * l * d), test::store<T>(-1.0));
        std::vector<i64> off{0, 3, 5}, idx{2, 7, 19, 0, 1};
        const kvevict::const_keep_list_view keep{hkv, off.data(), idx.data(), 5};
        kvevict::eviction_result result;
        std::vector<unsigned char> ws(1 << 20);
        const kvevict::workspace_span span{ws.data(), ws.size()};
        kvevict::cache_view<T> kv = kc.view, vv = vc.view;
        const std::string prefix = target == 2 ? "values" : (target == 3 ? "src" : "keys");
        if (!m.apply(target == 2 ? vv : kv, kind)) continue;
        const std::uint64_t before =
            fnv_sized(fnv_sized(fnv_sized(fnv_sized(fnv_sized(test::fnv_seed, kc.buffer), vc.buffer), scores), dst),
                      queries.buffer);
        kvevict::status st;
        switch (target) {
          case 0:
            st = kvevict::observation_scores(queries.view, kv, kvevict::scoring_params{}, {scores.data(), hkv, l, l},
                                             span);
            break;
          case 1:
          case 2:
            st = kvevict::evict(kv, vv, keep, result, span);
            break;
          case 3:
            st = kvevict::flatten_varlen(kv, keep, dst.data(), hkv * l, d);
            break;
          default: {
            kvevict::layer_inputs<T> in;
            in.keys = kv;
            st = kvevict::knorm<T>().score(in, {scores.data(), hkv, l, l}, span);
          }
        }
        const std::string want = m.field[0] != '\0' ? prefix + "." + m.field : prefix;
        INFO(test::name(kind) << " / target " << target << " / " << want << " -> " << st.message());
        CHECK(st.code() == m.code);
        CHECK(std::string(st.argument()) == want);
        CHECK(fnv_sized(fnv_sized(fnv_sized(fnv_sized(fnv_sized(test::fnv_seed, kc.buffer), vc.buffer), scores), dst),
                        queries.buffer) == before);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Documented defined results at the edges (not errors): budget 0, budget > L, W > L, L = 0,
// kernel 1, empty keep-lists, capacity >= L for the budget allocators.
// ---------------------------------------------------------------------------------------
TEST_CASE("edge inputs with documented results", "[errors]") {
  world wd;
  const i64 hkv = world::hkv, L = world::l;
  std::vector<unsigned char>& ws = wd.ws;
  const kvevict::workspace_span span{ws.data(), ws.size()};

  SECTION("budget 0 keeps only the protected tail; budget > L keeps everything") {
    kvevict::keep_list keep(hkv, hkv * L);
    REQUIRE(kvevict::select(wd.sel_in(), kvevict::budget::tokens(0), {3, kvevict::protected_mode::inside_budget}, keep,
                            span)
                .ok());
    for (i64 h = 0; h < hkv; ++h) REQUIRE(keep.head(h) == std::vector<i64>{21, 22, 23});
    REQUIRE(kvevict::select(wd.sel_in(), kvevict::budget::tokens(0), {0, kvevict::protected_mode::inside_budget}, keep,
                            span)
                .ok());
    for (i64 h = 0; h < hkv; ++h) REQUIRE(keep.head(h).empty());
    REQUIRE(kvevict::select(wd.sel_in(), kvevict::budget::tokens(1000), {3, kvevict::protected_mode::on_top_of_budget},
                            keep, span)
                .ok());
    std::vector<i64> all(static_cast<std::size_t>(L));
    for (i64 j = 0; j < L; ++j) all[static_cast<std::size_t>(j)] = j;
    for (i64 h = 0; h < hkv; ++h) REQUIRE(keep.head(h) == all);
    REQUIRE(kvevict::select(wd.sel_in(), kvevict::budget::ratio(0.0), {}, keep, span).ok());
    for (i64 h = 0; h < hkv; ++h) REQUIRE(keep.head(h) == all);
    REQUIRE(kvevict::select(wd.sel_in(), kvevict::budget::ratio(1.0), {}, keep, span).ok());
    for (i64 h = 0; h < hkv; ++h) REQUIRE(keep.head(h).empty());
    // Protected tail longer than L: everything is protected.
    REQUIRE(kvevict::select(wd.sel_in(), kvevict::budget::tokens(2), {100, kvevict::protected_mode::inside_budget},
                            keep, span)
                .ok());
    for (i64 h = 0; h < hkv; ++h) REQUIRE(keep.head(h) == all);
  }
  SECTION("L = 0: scoring, selection and eviction succeed and do nothing") {
    auto a = obs(wd);
    a.k.num_tokens = 0;
    a.s = {wd.scores.data(), hkv, 0, 0};
    REQUIRE(a.run().ok());
    REQUIRE(wd.scores == std::vector<float>(static_cast<std::size_t>(hkv * L), 42.0f));
    kvevict::keep_list keep(hkv, 0);
    REQUIRE(
        kvevict::select(kvevict::const_score_view{wd.sel.data(), hkv, 0, 0}, kvevict::budget::tokens(5), {}, keep, span)
            .ok());
    REQUIRE(keep.size(0) == 0);
    std::vector<i64> zeros(static_cast<std::size_t>(hkv + 1), 0);
    const kvevict::const_keep_list_view empty{hkv, zeros.data(), nullptr, 0};
    const std::vector<float> k_before = wd.k;
    kvevict::eviction_result r;
    REQUIRE(kvevict::evict(wd.keys().first_tokens(0), wd.values().first_tokens(0), empty, r).ok());
    REQUIRE(r.max_length == 0);
    REQUIRE(wd.k == k_before);
    REQUIRE(kvevict::keep_list_positions(empty, 0, nullptr, nullptr).ok());
  }
  SECTION("W > L and a window longer than the cache: every token protected") {
    kvevict::window_config cfg = kvevict::presets::kvpress_snapkv();  // W = 64 > L = 24
    REQUIRE(kvevict::snapkv<float>(cfg).score(wd.layer(), wd.score_out(), span).ok());
    for (float x : wd.scores) REQUIRE(x == std::numeric_limits<float>::infinity());
    kvevict::deferkv_config dc;
    dc.window = 64;
    dc.decode_feedback = false;
    kvevict::deferkv_state<float> st(dc, 0);
    REQUIRE(st.reserve(hkv, L).ok());
    REQUIRE(st.observe_prefill(0, wd.prefill(), span).ok());
    REQUIRE(st.ready());
    REQUIRE(st.selection().protected_tail == L);
    REQUIRE(st.scores(wd.score_out(), span).ok());
    for (float x : wd.scores) REQUIRE(x == std::numeric_limits<float>::infinity());
  }
  SECTION("pooling kernel 1 is the identity, kernels longer than the row are fine") {
    auto a = obs(wd);
    a.p.pool = {kvevict::pooling_kind::max, 1, true};
    REQUIRE(a.run().ok());
    const std::vector<float> k1 = wd.scores;
    a.p.pool = {kvevict::pooling_kind::none, 1, true};
    REQUIRE(a.run().ok());
    REQUIRE(wd.scores == k1);
    a.p.pool = {kvevict::pooling_kind::avg, 101, false};
    REQUIRE(a.run().ok());
  }
  SECTION("identity keep-list and empty heads evict nothing / everything") {
    std::vector<i64> off{0, L, L}, idx;
    for (i64 j = 0; j < L; ++j) idx.push_back(j);
    const std::vector<float> k_before = wd.k;
    kvevict::eviction_result r;
    REQUIRE(kvevict::evict(wd.keys(), wd.values(), {hkv, off.data(), idx.data(), L}, r).ok());
    REQUIRE(r.max_length == L);
    REQUIRE(wd.k == k_before);  // head 0 unchanged, head 1 keeps nothing: rows stale, untouched
  }
  SECTION("budget allocators at the edges") {
    std::vector<i64> out(8, -1);
    REQUIRE(kvevict::pyramidkv_layer_budgets(100, 4, 8, L, out.data()).ok());  // capacity > L: uniform, all
    for (i64 x : out) REQUIRE(x == L - 4);
    REQUIRE(kvevict::pyramidkv_layer_budgets(10, 4, 1, L, out.data()).ok());
    REQUIRE(out[0] == 6);
    REQUIRE(kvevict::pyramidkv_layer_budgets(4, 4, 3, L, out.data()).ok());  // capacity == window: 0 each
    REQUIRE((out[0] == 0 && out[1] == 0 && out[2] == 0));
    std::vector<i64> b(static_cast<std::size_t>(hkv), -1);
    REQUIRE(kvevict::adakv_head_budgets(wd.sel_in(), 4, 1000, {}, b.data(), span).ok());
    for (i64 x : b) REQUIRE(x == L - 4);
    REQUIRE(kvevict::adakv_head_budgets(wd.sel_in(), 4, 0, {}, b.data(), span).ok());
    for (i64 x : b) REQUIRE(x == 0);
    REQUIRE(kvevict::adakv_head_budgets(wd.sel_in(), 100, 3, {}, b.data(), span).ok());  // no candidates
    for (i64 x : b) REQUIRE(x == 0);
  }
  SECTION("size queries for huge shapes do not overflow below the true need") {
    kvevict::scoring_params p;
    const std::size_t s31 = kvevict::observation_scores_workspace_size({4, 2, 128, kTwo31 + 7, 32}, p);
    REQUIRE(s31 >= static_cast<std::size_t>(kTwo31 + 7) * 4 * 2);  // acc [G, C] floats at least
    REQUIRE(kvevict::select_workspace_size(kTwo32 - 1) >= static_cast<std::size_t>(kTwo32 - 1) * 12);
    REQUIRE(kvevict::adakv_workspace_size(2, kTwo31) >= static_cast<std::size_t>(kTwo32) * 4);
  }
}

// ---------------------------------------------------------------------------------------
// Regressions: library bugs this matrix and the fuzzers found, now fixed (docs/reliability.md,
// "Bugs found and fixed"). Each states what went wrong and checks the fixed behaviour.
// ---------------------------------------------------------------------------------------
namespace {
std::string arg_of(const kvevict::status& s) {
  return s.argument() != nullptr ? s.argument() : "";
}
}  // namespace

TEST_CASE("regression: workspace size queries saturate instead of wrapping for huge shapes", "[errors]") {
  // detail::arena::take computed count * sizeof(T) and its rounding unchecked, and
  // detail/observe.hpp multiplied G*W, R*d, G*C unchecked: L = 2^62 wrapped to a few KB.
  kvevict::scoring_params p;
  p.pool = {kvevict::pooling_kind::none, 1, true};
  const i64 L = i64{1} << 62;
  CHECK(kvevict::observation_scores_workspace_size({1, 1, 1, L, 1}, p) >= (std::size_t{1} << 62));
  CHECK(kvevict::attention_scores_workspace_size({1, 1, 1, L, 1}, p) >= (std::size_t{1} << 62));
  // Head counts and head dims near 2^63: no signed overflow (UBSan), a saturated size.
  const i64 big = std::numeric_limits<i64>::max();
  const std::size_t max_size = std::numeric_limits<std::size_t>::max();
  CHECK(kvevict::observation_scores_workspace_size({big, 1, 1, 8, 4}, p) == max_size);
  CHECK(kvevict::observation_scores_workspace_size({1, 1, big, 8, 4}, p) == max_size);
  CHECK(kvevict::observation_scores_workspace_size({4, 1, 8, 8, big}, p) == max_size);
  CHECK(kvevict::attention_scores_workspace_size({big, 1, 1, big, 1}, p) == max_size);
  CHECK(kvevict::adakv_workspace_size(big, big) == max_size);
  // A saturated size cannot be allocated: workspace::reserve reports it, it does not wrap.
  kvevict::workspace ws;
  CHECK_FALSE(ws.reserve(max_size));
  CHECK(ws.size() == 0);
}

TEST_CASE("regression: observation_scores with L = 2^62 claimed is rejected, nothing written", "[errors]") {
  // Keys [1, 2^62, 1] and scores [1, 2^62] over 16-float buffers pass validation (no element
  // is addressed yet); the wrapped workspace size let observe_head write acc[0, 2^62) past a
  // 64 KiB workspace. Now the workspace check sees the saturated need.
  std::vector<float> k(16, 0.5f), q(16, 0.5f), s(16, 7.0f);
  std::vector<unsigned char> ws(1 << 16, 0xAB);
  const i64 L = i64{1} << 62;
  i64 pos[1] = {L};
  kvevict::scoring_params p;
  p.pool = {kvevict::pooling_kind::none, 1, true};
  const kvevict::status st = kvevict::observation_scores(
      kvevict::contiguous_queries<const float>(q.data(), 1, 1, 1, pos),
      kvevict::hf_contiguous<const float>(k.data(), 1, L, 1), p, {s.data(), 1, L, L}, {ws.data(), ws.size()});
  INFO(st.message());
  CHECK(st.code() == errc::workspace_too_small);
  CHECK(arg_of(st) == "ws");
  for (float x : s) CHECK(x == 7.0f);
  std::vector<float> a(16, 0.25f);
  std::vector<i64> apos{L - 1};
  const kvevict::status sa = kvevict::attention_scores({a.data(), 1, 1, L, L, L, apos.data()}, 1, p,
                                                       {s.data(), 1, L, L}, {ws.data(), ws.size()});
  INFO(sa.message());
  CHECK(sa.code() == errc::workspace_too_small);
  CHECK(arg_of(sa) == "ws");
  for (float x : s) CHECK(x == 7.0f);
}

TEST_CASE("regression: flatten_varlen rejects a dst extent past 2^63 (huge dst_row_stride)", "[errors]") {
  // dst_extent = (total - 1) * dst_row_stride + d overflowed int64 (UB), defeating the overlap
  // test; the copy then wrote rows dst_row_stride apart, far past dst.
  std::vector<float> src(2 * 4 * 2, 1.0f), dst(64, 0.0f);
  std::vector<i64> off = {0, 2, 4}, idx = {0, 1, 0, 1};
  const kvevict::const_keep_list_view keep{2, off.data(), idx.data(), 4};
  std::vector<i64> cu(3, -1);
  const kvevict::status st = kvevict::flatten_varlen(kvevict::hf_contiguous<const float>(src.data(), 2, 4, 2), keep,
                                                     dst.data(), 4, std::numeric_limits<i64>::max() / 2, cu.data());
  INFO(st.message());
  CHECK(st.code() == errc::overflow);
  CHECK(arg_of(st) == "dst_row_stride");
  for (float x : dst) CHECK(x == 0.0f);
  for (i64 x : cu) CHECK(x == -1);
  // An extent that fits int64 but not an address space (3 * 2^61 floats) is rejected too.
  const kvevict::status big = kvevict::flatten_varlen(kvevict::hf_contiguous<const float>(src.data(), 2, 4, 2), keep,
                                                      dst.data(), 4, i64{1} << 61);
  CHECK(big.code() == errc::overflow);  // 3 * 2^61 floats: more bytes than an address space
  CHECK(arg_of(big) == "dst_row_stride");
}

TEST_CASE("regression: deferkv_state::reserve checks Hkv * L and reports allocation failure", "[errors]") {
  // num_kv_heads * max_prompt_tokens was unchecked int64: reserve(2^33, 2^31) wrapped to 0,
  // returned ok with an empty state, and the next prefill wrote through a null buffer. And
  // std::vector::assign threw out of a status-returning call for sizes it cannot allocate.
  kvevict::deferkv_config cfg;
  cfg.window = 4;
  kvevict::deferkv_state<float> st(cfg, 0);
  REQUIRE(st.reserve(2, 24).ok());
  kvevict::status s = st.reserve(i64{1} << 33, kTwo31);
  INFO(s.message());
  CHECK(s.code() == errc::overflow);
  CHECK(arg_of(s) == "max_prompt_tokens");
  s = st.reserve(std::numeric_limits<i64>::max(), std::numeric_limits<i64>::max());
  CHECK(s.code() == errc::overflow);
  // Too large for any allocator (2^62 floats): a status, not an exception or an abort.
  s = st.reserve(1, i64{1} << 62);
  CHECK(s.code() == errc::overflow);
  CHECK(arg_of(s) == "max_prompt_tokens");
  // The old reservation (2 x 24) is kept: a prefill of that size still works.
  std::vector<float> k(2 * 24 * 8, 0.1f), q(2 * 4 * 8, 0.1f);
  std::vector<i64> pos = {20, 21, 22, 23};
  kvevict::layer_inputs<float> in;
  in.keys = kvevict::hf_contiguous<const float>(k.data(), 2, 24, 8);
  in.queries = kvevict::contiguous_queries<const float>(q.data(), 2, 4, 8, pos.data());
  kvevict::workspace ws(st.workspace_size({2, 2, 8, 25, 4}));
  CHECK(st.observe_prefill(0, in, ws).ok());
}

TEST_CASE("regression: deferkv_state::workspace_size covers observe_decode", "[errors]") {
  // workspace_size() sized for shape.num_queries = W rows only. When G*W > 16 (the prefill
  // keeps no cached logits) and G <= 16, a decode step takes the cached-logit path
  // (detail::cached_logit_rows), which needs G*L floats: more than the prefill's tiles once L
  // is large (G = 1, W = 32, d = 64, Lp = 100000 asked for 1333440 bytes, got 1005632).
  const i64 hkv = 1, hq = 1, d = 64, lp = 100000, w = 32;
  kvevict::deferkv_config cfg;
  cfg.window = w;
  cfg.delay = 1;
  kvevict::deferkv_state<float> st(cfg, 0);
  REQUIRE(st.reserve(hkv, lp).ok());
  std::vector<float> k(static_cast<std::size_t>(hkv * (lp + 1) * d), 0.01f);
  std::vector<float> q(static_cast<std::size_t>(hq * w * d), 0.02f);
  std::vector<i64> pos(static_cast<std::size_t>(w));
  for (i64 t = 0; t < w; ++t) pos[static_cast<std::size_t>(t)] = lp - w + t;
  const std::size_t need = st.workspace_size({hq, hkv, d, lp + 1, w});
  kvevict::workspace ws(need);
  const kvevict::workspace_span span{ws.span().data, need};
  kvevict::layer_inputs<float> in;
  in.keys = kvevict::hf_contiguous<const float>(k.data(), hkv, lp, d);
  in.queries = kvevict::contiguous_queries<const float>(q.data(), hq, w, d, pos.data());
  REQUIRE(st.observe_prefill(0, in, span).ok());
  i64 p1[1] = {lp};
  in.keys = kvevict::hf_contiguous<const float>(k.data(), hkv, lp + 1, d);
  in.queries = kvevict::contiguous_queries<const float>(q.data(), hq, 1, d, p1);
  const kvevict::status s = st.observe_decode(0, 0, in, span);
  INFO(s.message());
  CHECK(s.ok());
}

TEST_CASE("regression: argument checks of adakv, pyramidkv and dapq do not overflow", "[errors]") {
  // adakv: the 2^32 guard `heads * candidates` itself overflowed (rows 2^33, cols 2^31 wrapped
  // to 0 and the scores were read out of bounds). pyramidkv: `total` and `num_layers * mean`
  // overflowed for capacities near 2^62 (ok, with budgets that do not average C - w). dapq:
  // `first + last` overflowed for first = INT64_MAX. Under UBSan each aborted.
  std::vector<float> sc(16, 1.0f);
  std::vector<i64> out(4, -1);
  std::vector<unsigned char> ws(1 << 16);
  volatile i64 rows = i64{1} << 33, cols = kTwo31;  // opaque to the optimiser
  const kvevict::const_score_view s{sc.data(), rows, cols, cols};
  kvevict::status st = kvevict::adakv_head_budgets(s, 0, 0, {}, out.data(), {ws.data(), ws.size()});
  INFO(st.message());
  CHECK(st.code() == errc::overflow);
  CHECK(arg_of(st) == "scores");
  const kvevict::const_score_view s2{sc.data(), std::numeric_limits<i64>::max(), 2, 2};
  st = kvevict::adakv_head_budgets(s2, 0, 0, {}, out.data(), {ws.data(), ws.size()});
  CHECK(st.code() == errc::overflow);
  for (i64 x : out) CHECK(x == -1);

  st = kvevict::pyramidkv_layer_budgets(i64{1} << 62, 0, 4, std::numeric_limits<i64>::max(), out.data());
  INFO(st.message());
  CHECK(st.code() == errc::overflow);
  CHECK(arg_of(st) == "capacity");
  for (i64 x : out) CHECK(x == -1);
  // The largest schedule that fits is met exactly: 4 layers averaging 2^60.
  st = kvevict::pyramidkv_layer_budgets(i64{1} << 60, 0, 4, std::numeric_limits<i64>::max(), out.data());
  REQUIRE(st.ok());
  i64 total = 0;
  bool overflowed = false;
  for (i64 x : out) {
    CHECK(x >= 0);
    overflowed = overflowed || __builtin_add_overflow(total, x, &total);
  }
  CHECK_FALSE(overflowed);
  CHECK(total == i64{1} << 62);

  std::int32_t prompt[3] = {1, 2, 3}, ids[4] = {-1, -1, -1, -1};
  st = kvevict::dapq_pseudo_tokens_first_last(prompt, 3, std::numeric_limits<i64>::max(), 1, ids);
  INFO(st.message());
  CHECK(st.code() == errc::invalid_argument);
  CHECK(arg_of(st) == "first");
  for (std::int32_t x : ids) CHECK(x == -1);
}

TEST_CASE("regression: window weights with a sum below FLT_MIN are rejected, not turned into NaN", "[errors]") {
  // Weights with a positive sum below ~3e-39 passed validation, but the window normaliser
  // float(1 / sum) was +inf: unseen keys scored 0 * inf = NaN, seen keys +inf. Such sums are
  // now invalid_argument naming the weights (documented: sum >= FLT_MIN); a sum of exactly
  // FLT_MIN is accepted and gives finite scores.
  const i64 d = 4, l = 8;
  std::vector<float> k(static_cast<std::size_t>(l * d), 0.5f), q(static_cast<std::size_t>(d), 0.5f);
  std::vector<float> out(static_cast<std::size_t>(l), 7.0f);
  i64 pos[1] = {3};
  float weights[1] = {1e-40f};
  kvevict::scoring_params p;
  p.window = kvevict::window_aggregation::weighted;
  p.pool = {kvevict::pooling_kind::none, 1, true};
  kvevict::observation_inputs in;
  in.weights = weights;
  kvevict::workspace ws(kvevict::observation_scores_workspace_size({1, 1, d, l, 1}, p));
  const auto run = [&] {
    return kvevict::observation_scores(kvevict::contiguous_queries<const float>(q.data(), 1, 1, d, pos),
                                       kvevict::hf_contiguous<const float>(k.data(), 1, l, d), p, {out.data(), 1, l, l},
                                       ws, in);
  };
  kvevict::status st = run();
  INFO(st.message());
  CHECK(st.code() == errc::invalid_argument);
  CHECK(arg_of(st) == "inputs.weights");
  for (float x : out) CHECK(x == 7.0f);

  std::vector<float> attn(static_cast<std::size_t>(l), 0.0f);
  for (i64 j = 0; j <= 3; ++j) attn[static_cast<std::size_t>(j)] = 0.25f;
  kvevict::workspace aws(kvevict::attention_scores_workspace_size({1, 1, d, l, 1}, p));
  st = kvevict::attention_scores(kvevict::contiguous_attention(attn.data(), 1, 1, l, pos), 1, p, {out.data(), 1, l, l},
                                 aws, nullptr, weights);
  INFO(st.message());
  CHECK(st.code() == errc::invalid_argument);
  CHECK(arg_of(st) == "weights");
  for (float x : out) CHECK(x == 7.0f);

  weights[0] = std::numeric_limits<float>::min();
  REQUIRE(run().ok());
  for (i64 j = 0; j < l; ++j) {
    INFO("token " << j << " score " << out[static_cast<std::size_t>(j)]);
    CHECK(out[static_cast<std::size_t>(j)] == (j <= 3 ? 0.25f : 0.0f));
  }
  REQUIRE(kvevict::attention_scores(kvevict::contiguous_attention(attn.data(), 1, 1, l, pos), 1, p,
                                    {out.data(), 1, l, l}, aws, nullptr, weights)
              .ok());
  for (i64 j = 0; j < l; ++j) CHECK(out[static_cast<std::size_t>(j)] == (j <= 3 ? 0.25f : 0.0f));
}

TEST_CASE("regression: attention_scores accepts the empty attention view of an empty cache", "[errors]") {
  // For L = 0, contiguous_attention gives zero strides, which the overlap check rejected
  // ("attention.head_stride: expected a stride > 0"), and a null attention.data was rejected
  // too, while every other entry point accepts empty caches.
  std::vector<float> attn(1), scores(1, 3.0f);
  std::vector<i64> pos{0, 0};
  kvevict::scoring_params p;
  kvevict::workspace ws(kvevict::attention_scores_workspace_size({4, 2, 1, 0, 2}, p));
  kvevict::status st = kvevict::attention_scores(kvevict::contiguous_attention(attn.data(), 4, 2, 0, pos.data()), 2, p,
                                                 {scores.data(), 2, 0, 0}, ws);
  INFO(st.message());
  CHECK(st.ok());
  CHECK(scores[0] == 3.0f);
  st = kvevict::attention_scores(kvevict::contiguous_attention(nullptr, 4, 2, 0, pos.data()), 2, p, {nullptr, 2, 0, 0},
                                 ws);
  INFO(st.message());
  CHECK(st.ok());
  // A non-empty view still needs its data.
  st = kvevict::attention_scores(kvevict::contiguous_attention(nullptr, 4, 2, 1, pos.data()), 2, p,
                                 {scores.data(), 2, 1, 1}, ws);
  CHECK(st.code() == errc::null_pointer);
  CHECK(arg_of(st) == "attention.data");
}

TEST_CASE("regression: attention_scores without weights (the default) scores every aggregation", "[errors]") {
  // With the default weights = nullptr, GCC 12 warned -Warray-bounds at -O3 inside
  // attention_scores (weights[t] read on the weighted branch), which broke -Werror call sites
  // like this one (the tests build with -Werror).
  const i64 hq = 4, hkv = 2, w = 3, l = 30;
  std::vector<float> attn(static_cast<std::size_t>(hq * w * l), 0.125f);
  std::vector<i64> qpos{l - 3, l - 2, l - 1};
  for (auto win : {kvevict::window_aggregation::mean, kvevict::window_aggregation::sum,
                   kvevict::window_aggregation::max, kvevict::window_aggregation::visible_mean}) {
    kvevict::scoring_params p;
    p.window = win;
    p.pool = {kvevict::pooling_kind::none, 1, true};
    std::vector<float> out(static_cast<std::size_t>(hkv * l), -1.0f);
    kvevict::workspace ws(kvevict::attention_scores_workspace_size({hq, hkv, 1, l, w}, p));
    REQUIRE(kvevict::attention_scores(kvevict::contiguous_attention(attn.data(), hq, w, l, qpos.data()), hkv, p,
                                      {out.data(), hkv, l, l}, ws)
                .ok());
    for (i64 j = 0; j < hkv * l; ++j) {
      // Rows of 0.125: their sum over W = 3 is 0.375; visible_mean divides by the queries that
      // see key j (3, then 2 and 1 for the last two keys).
      const i64 seen = std::min<i64>(w, l - j % l);
      const float want = win == kvevict::window_aggregation::sum            ? 0.375f
                         : win == kvevict::window_aggregation::visible_mean ? 0.375f / static_cast<float>(seen)
                                                                            : 0.125f;
      CHECK(out[static_cast<std::size_t>(j)] == want);
    }
  }
  kvevict::scoring_params p;
  p.window = kvevict::window_aggregation::weighted;
  std::vector<float> out(static_cast<std::size_t>(hkv * l), -1.0f);
  kvevict::workspace ws(kvevict::attention_scores_workspace_size({hq, hkv, 1, l, w}, p));
  const kvevict::status st = kvevict::attention_scores(
      kvevict::contiguous_attention(attn.data(), hq, w, l, qpos.data()), hkv, p, {out.data(), hkv, l, l}, ws);
  CHECK(st.code() == errc::null_pointer);
  CHECK(arg_of(st) == "weights");
  for (float x : out) CHECK(x == -1.0f);
}

TEST_CASE("regression: a paged view with num_tokens near 2^63 gets its block-table check", "[errors]") {
  // num_used_blocks() computed (num_tokens + block_size - 1) / block_size, which overflowed
  // when num_tokens + block_size > 2^63 (found by fuzz_validate through evict_workspace_size,
  // a size query documented to be safe on malformed views); validate_cache_view then got a
  // negative count and skipped the block-table loop. View: 1 head, d = 1, block_size = 2^62,
  // num_tokens = INT64_MAX (two used blocks), a one-block pool, table {0, 7}.
  std::vector<float> k(4, 1.0f), v(4, 2.0f);
  std::vector<std::int32_t> table{0, 7};
  kvevict::cache_view<float> keys = kvevict::strided_cache(k.data(), 1, std::numeric_limits<i64>::max(), 1, 1, 1);
  keys.block_table = table.data();
  keys.block_size = i64{1} << 62;
  keys.block_stride = 0;
  keys.num_pool_blocks = 1;
  CHECK(keys.num_used_blocks() == 2);
  const auto values = kvevict::strided_cache(v.data(), 1, std::numeric_limits<i64>::max(), 1, 1, 1);
  CHECK(kvevict::evict_workspace_size(keys, values) >= 2 * sizeof(std::int32_t));
  std::vector<i64> off{0, 1}, idx{0};
  kvevict::eviction_result result;
  result.max_length = -5;
  std::vector<unsigned char> ws(4096);
  const kvevict::status st =
      kvevict::evict(keys, values, {1, off.data(), idx.data(), 1}, result, {ws.data(), ws.size()});
  INFO(st.message());
  CHECK(st.code() == errc::out_of_range);
  CHECK(arg_of(st) == "keys.block_table[1]");
  CHECK(result.max_length == -5);
  for (float x : k) CHECK(x == 1.0f);
  for (float x : v) CHECK(x == 2.0f);
}

TEST_CASE("regression: evict on an empty paged view with block_size 0 frees nothing", "[errors]") {
  // Validation accepts any view with num_tokens == 0 (no element is addressed), but
  // report_eviction then divided by block_size to compute result.freed_blocks (SIGFPE).
  std::vector<float> pool(64), v(64);
  std::vector<std::int32_t> table{0};
  kvevict::cache_view<float> keys = kvevict::paged_nhd(pool.data(), 4, 0, 2, 8, table.data(), 0);
  CHECK(keys.num_used_blocks() == 0);
  std::vector<i64> off{0, 0, 0};
  kvevict::eviction_result result;
  result.freed_blocks = -1;
  std::vector<unsigned char> ws(4096);
  const kvevict::status st = kvevict::evict(keys, kvevict::hf_contiguous(v.data(), 2, 0, 8),
                                            {2, off.data(), nullptr, 0}, result, {ws.data(), ws.size()});
  INFO(st.message());
  CHECK(st.ok());
  CHECK(result.freed_blocks == 0);
  CHECK(result.max_length == 0);
}

TEST_CASE("regression: flatten_varlen forms no dst pointer for heads that keep nothing", "[errors]") {
  // Every head computed dst + begin * row_stride before looking at its row count: past the
  // caller's dst for trailing empty heads, and a pointer overflow (UB, UBSan
  // "pointer-overflow") for large valid strides. Here: 1 kept row, dst of d elements,
  // dst_row_stride 2^61, second head empty. (Fully checked under -fsanitize=undefined.)
  std::vector<float> src(2 * 4 * 2), dst(2, 0.0f);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i);
  std::vector<i64> off = {0, 1, 1}, idx = {3};
  const kvevict::const_keep_list_view keep{2, off.data(), idx.data(), 1};
  std::vector<i64> cu(3, -1);
  const kvevict::status st = kvevict::flatten_varlen(kvevict::hf_contiguous<const float>(src.data(), 2, 4, 2), keep,
                                                     dst.data(), 1, i64{1} << 61, cu.data());
  INFO(st.message());
  REQUIRE(st.ok());
  CHECK(dst[0] == 6.0f);  // head 0, token 3
  CHECK(dst[1] == 7.0f);
  CHECK((cu[0] == 0 && cu[1] == 1 && cu[2] == 1));
}

TEST_CASE("regression: flatten_varlen walks no channel of heads that keep nothing", "[errors]") {
  // For a source with dim_stride != 1 it walked every channel of every head, including heads
  // that keep nothing: an empty source (num_tokens == 0, valid whatever its dims) claiming a
  // head_dim of 2^32 ran for seconds to hours with nothing to copy (fuzz_validate, 12 s unit).
  std::vector<float> src(4);
  std::vector<i64> off = {0, 0, 0, 0};
  const kvevict::const_keep_list_view keep{3, off.data(), nullptr, 0};
  const i64 d = kTwo32;
  const auto view = kvevict::strided_cache<const float>(src.data(), 3, 0, d, 1, 1, 3);  // transposed-V strides
  std::vector<i64> cu(4, -1);
  const kvevict::status st = kvevict::flatten_varlen(view, keep, static_cast<float*>(nullptr), 0, d, cu.data());
  INFO(st.message());
  CHECK(st.ok());
  CHECK((cu[0] == 0 && cu[3] == 0));
  // An empty paged source: its paged fields are never validated (nothing is addressed), so
  // the overlap test must not compute an extent from them (block_size INT64_MIN overflowed
  // there; found by fuzz_validate once the steering above was removed).
  std::vector<std::int32_t> table{0};
  kvevict::cache_view<const float> paged = kvevict::strided_cache<const float>(src.data(), 3, 0, 1, 1, 1, 1);
  paged.block_table = table.data();
  paged.block_size = std::numeric_limits<i64>::min();
  std::vector<float> dst(1, 5.0f);
  CHECK(kvevict::flatten_varlen(paged, keep, dst.data(), 0, 1).ok());
  CHECK(dst[0] == 5.0f);
}

TEST_CASE("regression: a view whose last offset is exactly INT64_MAX is rejected", "[errors]") {
  // check_box computed `*span = reach + 1` unchecked: for a view whose largest offset is
  // exactly INT64_MAX (2 heads, head_stride = INT64_MAX) it overflowed (UB; fuzz_validate),
  // and the view -- 2^63 elements, more than the overflow check allows -- was accepted.
  std::vector<float> k(4, 1.0f), v(4, 2.0f);
  const i64 big = std::numeric_limits<i64>::max();
  kvevict::cache_view<float> keys = kvevict::strided_cache(k.data(), 2, 1, 1, big, 1);
  kvevict::cache_view<float> values = kvevict::strided_cache(v.data(), 2, 1, 1, 1, 1);
  std::vector<i64> off{0, 1, 1}, idx{0};
  kvevict::eviction_result result;
  result.max_length = -5;
  const kvevict::status st = kvevict::evict(keys, values, {2, off.data(), idx.data(), 1}, result);
  INFO(st.message());
  CHECK(st.code() == errc::overflow);
  CHECK(arg_of(st) == "keys");
  CHECK(result.max_length == -5);
  // One element less is a valid (if sparse) view: the largest offset is INT64_MAX - 1.
  keys = kvevict::strided_cache(k.data(), 2, 1, 1, big - 1, 1);
  CHECK(kvevict::evict(keys, values, {2, off.data(), idx.data(), 1}, result).ok());
  CHECK(result.max_length == 1);
}

TEST_CASE("regression: scores of an empty cache form no row pointer past the scores view", "[errors]") {
  // A scores view [Hkv, 0] is valid with any row_stride >= 0, but matrix_view::row(h) formed
  // data + h * row_stride for every head, a pointer overflow (UBSan) for a huge stride (found
  // by fuzz_validate once the steering of huge shapes was removed).
  std::vector<float> k(8, 0.5f), q(8, 0.5f), s(1, 3.0f);
  i64 pos[1] = {0};
  kvevict::scoring_params p;
  kvevict::workspace ws(kvevict::observation_scores_workspace_size({2, 2, 2, 0, 1}, p));
  const kvevict::score_view scores{s.data(), 2, 0, i64{1} << 62};
  CHECK(scores.row(1) == s.data());
  const kvevict::status st =
      kvevict::observation_scores(kvevict::contiguous_queries<const float>(q.data(), 2, 1, 2, pos),
                                  kvevict::hf_contiguous<const float>(k.data(), 2, 0, 2), p, scores, ws);
  INFO(st.message());
  CHECK(st.ok());
  CHECK(s[0] == 3.0f);
}
