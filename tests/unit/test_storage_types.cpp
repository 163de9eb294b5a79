// Storage types engines use beyond float/fp16/bf16: fp8 caches (e4m3, e5m2) with a per-tensor
// scale and queries in the model's dtype, through the building blocks and the compressor; and
// the runtime-dtype entry (any_sequence_io: views with erased element types, tagged by the
// plan), which must equal the typed call bit for bit and fail the same way.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "reference/reference.hpp"
#include "support/checksum.hpp"
#include "support/compare.hpp"
#include "support/test_cache.hpp"

using kvevict::bf16;
using kvevict::fp16;
using kvevict::fp8_e4m3;
using kvevict::fp8_e5m2;

namespace {

using i64 = std::int64_t;
constexpr i64 kLayers = 2, kHkv = 2, kGroup = 3, kHq = kHkv * kGroup, kDim = 40, kWindow = 8, kBudget = 17;

/// One layer of one sequence: K/V stored as T (k / scale), the last kWindow prompt queries as Q.
template <class T, class Q>
struct layer_data {
  test::test_cache<T> k, v;
  test::test_queries<Q> q;
};

template <class T, class Q>
layer_data<T, Q> make_layer(test::layout lay, i64 tokens, std::uint64_t seed, float scale) {
  layer_data<T, Q> d;
  d.k = test::make_cache<T>(lay, kHkv, tokens, kDim, test::normal(kHkv * tokens * kDim, seed, 1.0 / scale), 8, seed);
  d.v = test::make_cache<T>(lay, kHkv, tokens, kDim, test::normal(kHkv * tokens * kDim, seed + 1, 1.0 / scale), 8,
                            seed + 1);
  d.k.view.scale = scale;
  d.v.view.scale = scale * 2;  // V's own scale: compaction copies bytes and never reads it
  std::vector<i64> pos;
  for (i64 t = tokens - kWindow; t < tokens; ++t) pos.push_back(t);
  d.q = test::make_queries<Q>(kHq, kWindow, kDim, test::normal(kHq * kWindow * kDim, seed + 2, 1.5), pos, false,
                              test::int32_positions(lay));
  return d;
}

template <class T>
std::uint64_t cache_sum(const test::test_cache<T>& c) {
  return test::fnv(test::fnv_seed, c.buffer.data(), c.buffer.size() * sizeof(T));
}

kvevict::compressor plan_snapkv(kvevict::dtype storage, kvevict::dtype queries) {
  kvevict::compressor_options opt;
  opt.model = {kLayers, kHq, kHkv, kDim, 0, storage, queries};
  opt.sharing = kvevict::block_sharing::none;  // no block is shared between sequences
  kvevict::window_config w = kvevict::presets::kvpress_snapkv();
  w.window = kWindow;
  opt.policy = kvevict::policy::snapkv(w);
  opt.per_head = kvevict::budget::tokens(kBudget);
  opt.limits.max_sequences = 2;
  opt.limits.max_tokens = 128;
  kvevict::compressor c;
  const kvevict::status st = kvevict::compressor::plan(opt, &c);
  INFO(st.message());
  REQUIRE(st.ok());
  return c;
}

/// SnapKV at the end of prefill, by hand: score -> select -> evict with the building blocks.
template <class T, class Q>
void evict_by_hand(layer_data<T, Q>& d, std::vector<i64>* kept_positions) {
  kvevict::window_config w = kvevict::presets::kvpress_snapkv();
  w.window = kWindow;
  const kvevict::snapkv<T, Q> policy(w);
  const i64 l = d.k.view.num_tokens;
  kvevict::layer_inputs<T, Q> in;
  in.keys = d.k.view;
  in.queries = d.q.view;
  std::vector<float> scores(static_cast<std::size_t>(kHkv * l));
  kvevict::workspace sws(policy.workspace_size({kHq, kHkv, kDim, l, kWindow}));
  REQUIRE(policy.score(in, {scores.data(), kHkv, l, l}, sws).ok());
  const kvevict::budget b = kvevict::budget::tokens(kBudget);
  kvevict::keep_list keep(kHkv, kvevict::select_capacity(kHkv, l, b, policy.selection()));
  kvevict::workspace selws(kvevict::select_workspace_size(l));
  REQUIRE(
      kvevict::select(kvevict::const_score_view{scores.data(), kHkv, l, l}, b, policy.selection(), keep, selws).ok());
  std::vector<i64> lengths(kHkv);
  kept_positions->assign(static_cast<std::size_t>(keep.view().total()), -1);
  kvevict::eviction_result r;
  r.head_lengths = lengths.data();
  r.positions = kept_positions->data();
  kvevict::workspace ews(kvevict::evict_workspace_size(d.k.view, d.v.view));
  REQUIRE(kvevict::evict(d.k.view, d.v.view, const_cast<const kvevict::keep_list&>(keep).view(), r, ews).ok());
}

template <class T, class Q>
kvevict::sequence_io<T, Q> io_of(layer_data<T, Q>& d) {
  kvevict::sequence_io<T, Q> io;
  io.event = kvevict::sequence_event::prefill_end;
  io.keys = d.k.view;
  io.values = d.v.view;
  io.queries = d.q.view;
  return io;
}

kvevict::any_sequence_io erase(const kvevict::sequence_io<fp8_e4m3, bf16>& io) {
  kvevict::any_sequence_io a;
  a.event = io.event;
  a.keys = io.keys.with_element<kvevict::any_element>();
  a.values = io.values.with_element<kvevict::any_element>();
  a.queries = io.queries.with_element<const kvevict::any_element>();
  a.kept_positions = io.kept_positions;
  a.head_lengths = io.head_lengths;
  return a;
}

/// Every sequence x layer through the compressor (typed, or the runtime-dtype entry), then by
/// hand on copies: the same bytes, lengths and kept positions.
template <class T, class Q>
void compressor_equals_building_blocks(kvevict::dtype storage, kvevict::dtype queries, float scale) {
  const kvevict::compressor c = plan_snapkv(storage, queries);
  const i64 lens[2] = {61, 40};
  for (test::layout lay :
       {test::layout::contiguous, test::layout::paged_nhd, test::layout::cells_transposed, test::layout::paged_int64}) {
    INFO("layout " << test::name(lay));
    for (i64 layer = 0; layer < kLayers; ++layer) {
      std::vector<layer_data<T, Q>> mine, hand;
      for (std::uint64_t s = 0; s < 2; ++s) {
        mine.push_back(make_layer<T, Q>(lay, lens[s], 100 * s + static_cast<std::uint64_t>(layer), scale));
        hand.push_back(make_layer<T, Q>(lay, lens[s], 100 * s + static_cast<std::uint64_t>(layer), scale));
      }
      std::vector<kvevict::sequence_io<T, Q>> seqs;
      std::vector<std::vector<i64>> kept(2, std::vector<i64>(static_cast<std::size_t>(c.keep_capacity()), -1));
      for (std::size_t s = 0; s < 2; ++s) {
        seqs.push_back(io_of(mine[s]));
        seqs.back().kept_positions = kept[s].data();
      }
      kvevict::sequence_report reports[2];
      kvevict::workspace ws(c.workspace_size());
      const kvevict::status st = c.run(layer, seqs.data(), 2, reports, ws);
      INFO(st.message());
      REQUIRE(st.ok());
      for (std::size_t s = 0; s < 2; ++s) {
        std::vector<i64> want;
        evict_by_hand(hand[s], &want);
        REQUIRE(reports[s].action == kvevict::sequence_action::evicted);
        REQUIRE(cache_sum(mine[s].k) == cache_sum(hand[s].k));  // kept rows copied as bytes
        REQUIRE(cache_sum(mine[s].v) == cache_sum(hand[s].v));
        kept[s].resize(static_cast<std::size_t>(reports[s].kept));
        REQUIRE(kept[s] == want);
      }
    }
  }
}

}  // namespace

TEST_CASE("fp8 caches through the compressor equal the building blocks, bytes copied", "[fp8][compressor]") {
  compressor_equals_building_blocks<fp8_e4m3, bf16>(kvevict::dtype::f8_e4m3, kvevict::dtype_query_default, 0.02f);
  compressor_equals_building_blocks<fp8_e5m2, fp16>(kvevict::dtype::f8_e5m2, kvevict::dtype::f16, 1.0f);
  compressor_equals_building_blocks<fp8_e4m3, float>(kvevict::dtype::f8_e4m3, kvevict::dtype::f32, 3.5f);
}

TEST_CASE("fp8: kept rows are the original bytes at the kept positions", "[fp8]") {
  auto d = make_layer<fp8_e4m3, bf16>(test::layout::paged_hnd, 53, 9, 0.05f);
  const auto before = d.k;  // a copy of the buffer and its table (the view still reads d.k)
  std::vector<i64> kept;
  evict_by_hand(d, &kept);
  REQUIRE(static_cast<i64>(kept.size()) == kHkv * kBudget);
  for (i64 h = 0; h < kHkv; ++h)
    for (i64 i = 0; i < kBudget; ++i) {
      const i64 from = kept[static_cast<std::size_t>(h * kBudget + i)];
      for (i64 c = 0; c < kDim; ++c) REQUIRE(d.k.at(h, i, c).bits == before.at(h, from, c).bits);
    }
}

TEST_CASE("KNorm on fp8 keys scores -||scale * k||", "[fp8][policies]") {
  const i64 l = 29;
  for (const float scale : {1.0f, 0.125f, 0.0371f}) {
    auto d = make_layer<fp8_e5m2, bf16>(test::layout::token_major, l, 4, scale);
    kvevict::knorm<fp8_e5m2> policy({3, kvevict::protected_mode::inside_budget});
    kvevict::layer_inputs<fp8_e5m2> in;
    in.keys = d.k.view;
    std::vector<float> out(static_cast<std::size_t>(kHkv * l));
    kvevict::workspace ws(policy.workspace_size({kHq, kHkv, kDim, l, 0}));
    REQUIRE(policy.score(in, {out.data(), kHkv, l, l}, ws).ok());
    std::vector<ref::vec> want(kHkv, ref::vec(static_cast<std::size_t>(l), INFINITY));
    for (i64 h = 0; h < kHkv; ++h)
      for (i64 j = 0; j < l - 3; ++j) {
        double s = 0;
        for (i64 c = 0; c < kDim; ++c) s += std::pow(test::load(d.k.at(h, j, c)) * static_cast<double>(scale), 2);
        want[static_cast<std::size_t>(h)][static_cast<std::size_t>(j)] = -std::sqrt(s);
      }
    test::require_scores_close({out.data(), kHkv, l, l}, want);
  }
}

TEST_CASE("bad scales and query types are refused by name, nothing changes", "[fp8][bad_input]") {
  const kvevict::compressor c = plan_snapkv(kvevict::dtype::f8_e4m3, kvevict::dtype_query_default);
  REQUIRE(c.options().model.query_storage == kvevict::dtype::bf16);  // fp8's default: the model's bf16
  for (const float bad : {0.0f, -1.0f, NAN, INFINITY}) {
    auto d = make_layer<fp8_e4m3, bf16>(test::layout::paged_nhd, 50, 3, 0.1f);
    const std::uint64_t k0 = cache_sum(d.k), v0 = cache_sum(d.v);
    auto io = io_of(d);
    io.values.scale = bad;
    kvevict::sequence_report r;
    kvevict::workspace ws(c.workspace_size());
    const kvevict::status st = c.run(0, &io, 1, &r, ws);
    INFO(st.message());
    REQUIRE(st.code() == kvevict::errc::invalid_argument);
    REQUIRE(std::string(st.argument()) == "seqs[0].values.scale");
    REQUIRE(cache_sum(d.k) == k0);
    REQUIRE(cache_sum(d.v) == v0);
    // The building blocks name it too.
    kvevict::layer_inputs<fp8_e4m3> in;
    in.keys = d.k.view;
    in.keys.scale = bad;
    in.queries = d.q.view;
    std::vector<float> out(static_cast<std::size_t>(kHkv * 50));
    const kvevict::snapkv<fp8_e4m3> p;
    kvevict::workspace sws(p.workspace_size({kHq, kHkv, kDim, 50, kWindow}));
    const kvevict::status sst = p.score(in, {out.data(), kHkv, 50, 50}, sws);
    REQUIRE(sst.code() == kvevict::errc::invalid_argument);
    REQUIRE(std::string(sst.argument()) == "keys.scale");
  }
  // Queries of another type than the plan's.
  auto d = make_layer<fp8_e4m3, fp16>(test::layout::contiguous, 30, 5, 0.1f);
  auto io = io_of(d);
  kvevict::sequence_report r;
  kvevict::workspace ws(c.workspace_size());
  const kvevict::status st = c.run(0, &io, 1, &r, ws);
  REQUIRE(st.code() == kvevict::errc::invalid_argument);
  REQUIRE(std::string(st.message()).find("query_storage") != std::string::npos);
  // A plan with queries that do not go with the storage.
  kvevict::compressor_options opt = c.options();
  opt.model.storage = kvevict::dtype::f16;
  opt.model.query_storage = kvevict::dtype::bf16;
  kvevict::compressor bad;
  kvevict::status pst = kvevict::compressor::plan(opt, &bad);
  REQUIRE(pst.code() == kvevict::errc::invalid_argument);
  REQUIRE(std::string(pst.argument()) == "model.query_storage");
  opt.model.storage = kvevict::dtype::f8_e5m2;
  opt.model.query_storage = kvevict::dtype::f8_e4m3;  // queries are never fp8
  pst = kvevict::compressor::plan(opt, &bad);
  REQUIRE(std::string(pst.argument()) == "model.query_storage");
  REQUIRE(!bad.planned());
}

TEST_CASE("the runtime-dtype entry equals the typed call, and fails as it does", "[compressor][runtime_dtype]") {
  const kvevict::compressor c = plan_snapkv(kvevict::dtype::f8_e4m3, kvevict::dtype_query_default);
  REQUIRE(c.any_workspace_size() > c.workspace_size());
  for (test::layout lay : {test::layout::padded, test::layout::paged_per_head, test::layout::cells}) {
    INFO("layout " << test::name(lay));
    const i64 lens[2] = {45, 70};
    std::vector<layer_data<fp8_e4m3, bf16>> typed, erased;
    for (std::uint64_t s = 0; s < 2; ++s) {
      typed.push_back(make_layer<fp8_e4m3, bf16>(lay, lens[s], 7 + s, 0.03f));
      erased.push_back(make_layer<fp8_e4m3, bf16>(lay, lens[s], 7 + s, 0.03f));
    }
    std::vector<std::vector<i64>> kt(2, std::vector<i64>(static_cast<std::size_t>(c.keep_capacity()), -1)), ke = kt;
    std::vector<std::vector<i64>> ht(2, std::vector<i64>(kHkv, -1)), he = ht;
    std::vector<kvevict::sequence_io<fp8_e4m3, bf16>> ts;
    std::vector<kvevict::any_sequence_io> es;
    for (std::size_t s = 0; s < 2; ++s) {
      ts.push_back(io_of(typed[s]));
      ts.back().kept_positions = kt[s].data();
      ts.back().head_lengths = ht[s].data();
      auto e = io_of(erased[s]);
      e.kept_positions = ke[s].data();
      e.head_lengths = he[s].data();
      es.push_back(erase(e));
    }
    kvevict::sequence_report rt[2], re[2];
    kvevict::workspace wt(c.workspace_size()), we(c.any_workspace_size());

    // Too little workspace: refused naming ws, nothing moved.
    const std::uint64_t before = cache_sum(erased[0].k);
    const kvevict::status small = c.run(0, es.data(), 2, re, {we.span().data, c.workspace_size()});
    REQUIRE(small.code() == kvevict::errc::workspace_too_small);
    REQUIRE(std::string(small.argument()) == "ws");
    REQUIRE(cache_sum(erased[0].k) == before);
    const kvevict::status too_many = c.run(0, es.data(), 3, re, we);
    REQUIRE(std::string(too_many.argument()) == "num_seqs");

    REQUIRE(c.run(0, ts.data(), 2, rt, wt).ok());
    const kvevict::status st = c.run(0, es.data(), 2, re, we);
    INFO(st.message());
    REQUIRE(st.ok());
    for (std::size_t s = 0; s < 2; ++s) {
      REQUIRE(cache_sum(typed[s].k) == cache_sum(erased[s].k));
      REQUIRE(cache_sum(typed[s].v) == cache_sum(erased[s].v));
      REQUIRE(kt[s] == ke[s]);
      REQUIRE(ht[s] == he[s]);
      REQUIRE(rt[s].length == re[s].length);
      REQUIRE(rt[s].kept == re[s].kept);
      REQUIRE(rt[s].next_position == re[s].next_position);
    }
    // A bad view inside the erased batch is named as in the typed call.
    es[1].keys.scale = 0.0f;
    const kvevict::status bad = c.run(1, es.data(), 2, re, we);
    INFO(bad.message());
    REQUIRE(bad.code() == kvevict::errc::invalid_argument);
    REQUIRE(std::string(bad.argument()) == "seqs[1].keys.scale");
  }
}
