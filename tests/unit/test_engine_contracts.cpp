// Keep-sets engines can serve (design.md §14):
//   - selection scope: combine_head_scores against a double-precision definition; layer- and
//     sequence-shared keep sets through the compressor equal the building blocks bit for bit,
//     and every head (and layer) really keeps the same tokens;
//   - length modes: the plan refuses what one length per sequence cannot serve;
//   - prefix-shared blocks: a vLLM-style paged pool where two sequences share their first
//     blocks: in-place eviction is refused naming the block and nothing changes; eviction out
//     of place into fresh blocks leaves the other sequence's bytes unchanged and equals in-place
//     eviction of a private copy; the changed-block list names exactly the blocks written;
//   - evict_into against the definition for every layout and type;
//   - the outputs engines consume: -1-padded indices with valid lengths, the dropped count.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/checksum.hpp"
#include "support/eviction_check.hpp"
#include "support/test_cache.hpp"

using kvevict::bf16;
using kvevict::fp16;

namespace {

using i64 = std::int64_t;
constexpr float kInf = std::numeric_limits<float>::infinity();

/// The combining rule, written out in double: normalise each row's candidates by the sum of
/// their finite |values| (1 when that is 0), then max or mean over rows; the tail as it is.
std::vector<double> reference_combine(const std::vector<float>& s, i64 rows, i64 cols, i64 tail,
                                      kvevict::scope_combine rule) {
  const i64 cand = std::max<i64>(0, cols - tail);
  const bool norm = rule == kvevict::scope_combine::normalized_max || rule == kvevict::scope_combine::normalized_mean;
  const bool by_max = rule == kvevict::scope_combine::normalized_max || rule == kvevict::scope_combine::max;
  std::vector<double> out(static_cast<std::size_t>(cols), by_max ? -HUGE_VAL : 0.0);
  for (i64 h = 0; h < rows; ++h) {
    double sum = 0;
    for (i64 j = 0; j < cand; ++j) {
      const double x = s[static_cast<std::size_t>(h * cols + j)];
      if (std::isfinite(x)) sum += std::fabs(x);
    }
    const double scale = norm && sum > 0 ? 1.0 / sum : 1.0;
    for (i64 j = 0; j < cols; ++j) {
      const double x = s[static_cast<std::size_t>(h * cols + j)] * (j < cand ? scale : 1.0);
      double& o = out[static_cast<std::size_t>(j)];
      o = by_max ? std::max(o, x) : o + x;
    }
  }
  if (!by_max)
    for (i64 j = 0; j < cand; ++j) out[static_cast<std::size_t>(j)] /= static_cast<double>(rows);
  return out;
}

}  // namespace

TEST_CASE("combine_head_scores equals its definition for every rule", "[contracts]") {
  std::mt19937 rng(3);
  std::exponential_distribution<float> mass(4.0f);
  for (i64 rows : {1, 3, 8})
    for (i64 cols : {1, 17, 300})
      for (auto rule : {kvevict::scope_combine::normalized_max, kvevict::scope_combine::normalized_mean,
                        kvevict::scope_combine::max, kvevict::scope_combine::mean}) {
        const i64 tail = cols / 5;
        std::vector<float> s(static_cast<std::size_t>(rows * cols));
        for (i64 h = 0; h < rows; ++h)
          for (i64 j = 0; j < cols; ++j)
            s[static_cast<std::size_t>(h * cols + j)] = j >= cols - tail ? kInf : mass(rng) * static_cast<float>(h + 1);
        std::vector<float> got(static_cast<std::size_t>(cols), -1.0f);
        REQUIRE(kvevict::combine_head_scores({s.data(), rows, cols, cols}, tail, rule, got.data()).ok());
        const auto want = reference_combine(s, rows, cols, tail, rule);
        for (i64 j = 0; j < cols; ++j) {
          INFO(kvevict::to_string(rule) << " rows " << rows << " j " << j);
          const double w = want[static_cast<std::size_t>(j)], g = got[static_cast<std::size_t>(j)];
          if (std::isinf(w)) {
            REQUIRE(g == w);
          } else {
            REQUIRE(std::fabs(g - w) <= 1e-6 * std::fabs(w) + 1e-12);
          }
        }
      }
}

namespace {

__extension__ using u128 = unsigned __int128;  // GCC and clang; the test's exact reference

/// The exact sum of |x| rounded to double by the library's bins (detail/exact_sum.hpp).
double exact_magnitude_sum(const std::vector<float>& x) {
  std::vector<std::uint64_t> bins(kvevict::detail::magnitude_bins, 0);
  for (float v : x) {
    int bin = 0;
    std::uint64_t s = 0;
    if (kvevict::detail::magnitude_parts(v, &bin, &s)) bins[static_cast<std::size_t>(bin)] += s;
  }
  return kvevict::detail::bins_to_double(bins.data());
}

}  // namespace

TEST_CASE("the scope normaliser's sum is exact, rounded once, whatever the order", "[contracts]") {
  const float one = 1.0f, h53 = std::ldexp(1.0f, -53), h80 = std::ldexp(1.0f, -80);
  // Ties to even, and a tie broken by a bit far below (a sequential double sum loses it).
  REQUIRE(exact_magnitude_sum({one, h53}) == 1.0);
  REQUIRE(exact_magnitude_sum({h80, one, h53}) == 1.0 + std::ldexp(1.0, -52));
  REQUIRE(exact_magnitude_sum({1.0f + std::ldexp(1.0f, -23), -h53}) == 1.0 + std::ldexp(1.0, -23));
  REQUIRE(exact_magnitude_sum({1.0f + std::ldexp(1.0f, -23), h53, std::ldexp(1.0f, -100)}) ==
          1.0 + std::ldexp(1.0, -23) + std::ldexp(1.0, -52));
  // Subnormals, the largest float, and what is not summed (inf, NaN).
  const float tiny = std::numeric_limits<float>::denorm_min(), big = std::numeric_limits<float>::max();
  REQUIRE(exact_magnitude_sum({tiny, tiny, -tiny}) == 3.0 * static_cast<double>(tiny));
  REQUIRE(exact_magnitude_sum(std::vector<float>(1000, big)) == 1000.0 * static_cast<double>(big));
  REQUIRE(exact_magnitude_sum({kInf, std::numeric_limits<float>::quiet_NaN(), 2.0f}) == 2.0);
  REQUIRE(exact_magnitude_sum({0.0f, -0.0f}) == 0.0);
  // A head whose mass is too small for a finite float factor keeps its scores (no inf * 0).
  REQUIRE(kvevict::detail::reciprocal_of_sum(static_cast<double>(tiny) * 8) == 1.0f);
  REQUIRE(kvevict::detail::reciprocal_of_sum(0.0) == 1.0f);
  REQUIRE(kvevict::detail::reciprocal_of_sum(0.5) == 2.0f);
  const std::vector<float> heads = {8 * tiny, 0.0f, 1e-40f, 0.5f, 0.25f, 0.25f};
  std::vector<float> combined(3);
  REQUIRE(
      kvevict::combine_head_scores({heads.data(), 2, 3, 3}, 0, kvevict::scope_combine::normalized_max, combined.data())
          .ok());
  for (float x : combined) REQUIRE(std::isfinite(x));
  // Against 128-bit integer sums: x = k * 2^(s - 40), k < 2^24, s in [0, 60]; the sum of
  // k << s is exact in 128 bits and converts to double with one rounding.
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 3000);
    const int spread = 1 + static_cast<int>(rng() % 61);
    std::vector<float> x(static_cast<std::size_t>(n));
    u128 sum = 0;
    for (float& v : x) {
      const std::uint64_t k = rng() & 0xffffffu;
      const int sh = static_cast<int>(rng() % static_cast<std::uint64_t>(spread));
      v = std::ldexp(static_cast<float>(k), sh - 40);
      sum += static_cast<u128>(k) << sh;
    }
    const double want = std::ldexp(static_cast<double>(sum), -40);
    REQUIRE(exact_magnitude_sum(x) == want);
    std::shuffle(x.begin(), x.end(), rng);
    REQUIRE(exact_magnitude_sum(x) == want);
    REQUIRE(kvevict::detail::normaliser_of(x.data(), n) == (want > 0.0 ? static_cast<float>(1.0 / want) : 1.0f));
  }
}

TEST_CASE("normalised combining gives every head the same weight", "[contracts]") {
  // Head 1 has 50 times head 0's mass: raw max follows head 1 alone; normalised max keeps
  // head 0's favourite too.
  const i64 cols = 6;
  std::vector<float> s = {0.9f, 0.02f, 0.02f, 0.02f, 0.02f, 0.02f, 2.0f, 3.0f, 40.f, 3.0f, 3.0f, 3.0f};
  std::vector<float> raw(cols), norm(cols);
  REQUIRE(kvevict::combine_head_scores({s.data(), 2, cols, cols}, 0, kvevict::scope_combine::max, raw.data()).ok());
  REQUIRE(
      kvevict::combine_head_scores({s.data(), 2, cols, cols}, 0, kvevict::scope_combine::normalized_max, norm.data())
          .ok());
  auto top2 = [](const std::vector<float>& r) {
    std::vector<i64> idx(r.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + 2, idx.end(), [&](i64 a, i64 b) { return r[a] > r[b]; });
    std::sort(idx.begin(), idx.begin() + 2);
    return std::vector<i64>(idx.begin(), idx.begin() + 2);
  };
  CHECK(top2(raw) != std::vector<i64>{0, 2});
  CHECK(top2(norm) == std::vector<i64>{0, 2});
}

// ---- the shared scopes through the compressor, against the building blocks --------------

namespace {

constexpr i64 kLayers = 3, kHkv = 2, kGroup = 2, kHq = kHkv * kGroup, kDim = 16;

template <class T>
struct model_data {
  i64 prompt = 0;
  std::vector<test::test_cache<T>> k, v;
  std::vector<test::test_queries<T>> q;
};

template <class T>
model_data<T> make_model(i64 prompt, test::layout lay, std::uint64_t seed) {
  model_data<T> m;
  m.prompt = prompt;
  std::vector<i64> pos;
  for (i64 t = 0; t < prompt; ++t) pos.push_back(t);
  for (i64 l = 0; l < kLayers; ++l) {
    const std::uint64_t s = seed + static_cast<std::uint64_t>(l) * 7;
    m.k.push_back(test::make_cache<T>(lay, kHkv, prompt, kDim, test::normal(kHkv * prompt * kDim, s), 8, s));
    m.v.push_back(test::make_cache<T>(lay, kHkv, prompt, kDim, test::normal(kHkv * prompt * kDim, s + 1), 8, s + 1));
    m.q.push_back(test::make_queries<T>(kHq, prompt, kDim, test::normal(kHq * prompt * kDim, s + 2, 1.5), pos));
  }
  return m;
}

kvevict::window_config small_snapkv() {
  kvevict::window_config c = kvevict::presets::snapkv_paper();
  c.window = 5;
  return c;
}

/// Building blocks: per layer scores -> combine heads -> (sequence scope: fold layers) ->
/// select one row -> every head keeps it -> evict each layer.
template <class T>
std::vector<std::vector<i64>> by_hand(model_data<T>& m, kvevict::selection_scope scope, kvevict::scope_combine rule,
                                      kvevict::budget b) {
  const kvevict::snapkv<T> policy(small_snapkv());
  const i64 l = m.prompt;
  std::vector<std::vector<float>> rows;
  for (i64 layer = 0; layer < kLayers; ++layer) {
    kvevict::layer_inputs<T> in;
    in.keys = m.k[static_cast<std::size_t>(layer)].view;
    in.queries = m.q[static_cast<std::size_t>(layer)].view;
    in.queries.data += (l - 5) * in.queries.query_stride;
    in.queries.positions += l - 5;
    in.queries.num_queries = 5;
    std::vector<float> scores(static_cast<std::size_t>(kHkv * l));
    kvevict::workspace ws(policy.workspace_size({kHq, kHkv, kDim, l, 5}));
    REQUIRE(policy.score(in, {scores.data(), kHkv, l, l}, ws).ok());
    std::vector<float> row(static_cast<std::size_t>(l));
    REQUIRE(kvevict::combine_head_scores({scores.data(), kHkv, l, l}, 5, rule, row.data()).ok());
    rows.push_back(row);
  }
  if (scope == kvevict::selection_scope::per_sequence) {  // layers fold as more heads
    const bool by_max = rule == kvevict::scope_combine::normalized_max || rule == kvevict::scope_combine::max;
    for (i64 j = 0; j < l; ++j) {
      float acc = rows[0][static_cast<std::size_t>(j)];
      for (i64 layer = 1; layer < kLayers; ++layer) {
        const float x = rows[static_cast<std::size_t>(layer)][static_cast<std::size_t>(j)];
        acc = by_max ? ((x != x || x > acc) ? x : acc) : acc + x;
      }
      if (!by_max && j < l - 5) acc *= 1.0f / static_cast<float>(kLayers);
      for (auto& r : rows) r[static_cast<std::size_t>(j)] = acc;
    }
  }
  std::vector<std::vector<i64>> kept;
  for (i64 layer = 0; layer < kLayers; ++layer) {
    const auto& row = rows[static_cast<std::size_t>(layer)];
    kvevict::keep_list one(1, kvevict::select_capacity(1, l, b, policy.selection()));
    kvevict::workspace sws(kvevict::select_workspace_size(l));
    REQUIRE(kvevict::select({row.data(), 1, l, l}, b, policy.selection(), one, sws).ok());
    test::host_keep keep;
    for (i64 h = 0; h < kHkv; ++h) keep.add_head(one.head(0));
    kvevict::eviction_result r;
    kvevict::workspace ews(kvevict::evict_workspace_size(m.k[static_cast<std::size_t>(layer)].view,
                                                         m.v[static_cast<std::size_t>(layer)].view));
    REQUIRE(kvevict::evict(m.k[static_cast<std::size_t>(layer)].view, m.v[static_cast<std::size_t>(layer)].view,
                           keep.view(), r, ews)
                .ok());
    kept.push_back(one.head(0));
  }
  return kept;
}

template <class T>
std::vector<std::vector<i64>> by_compressor(model_data<T>& m, kvevict::selection_scope scope,
                                            kvevict::scope_combine rule, kvevict::budget b, kvevict::compaction compact,
                                            std::vector<kvevict::sequence_report>* out) {
  kvevict::compressor_options opt;
  opt.model = {kLayers, kHq, kHkv, kDim, 0, kvevict::dtype_of<T>::value};
  opt.sharing = kvevict::block_sharing::none;  // no block is shared between sequences
  opt.policy = kvevict::policy::snapkv(small_snapkv());
  opt.per_head = b;
  opt.scope = scope;
  opt.combine = rule;
  opt.compact = compact;
  opt.limits.max_tokens = m.prompt;
  kvevict::compressor c;
  REQUIRE(kvevict::compressor::plan(opt, &c).ok());
  kvevict::workspace ws(c.workspace_size());
  std::vector<std::uint64_t> state(c.sequence_state_size() / 8 + 1);
  REQUIRE(c.reset_sequence(state.data(), state.size() * 8).ok());
  std::vector<kvevict::layer_cache<T>> layers;
  for (i64 l = 0; l < kLayers; ++l)
    layers.emplace_back(m.k[static_cast<std::size_t>(l)].view, m.v[static_cast<std::size_t>(l)].view);
  std::vector<std::vector<i64>> kept(kLayers);
  std::vector<i64> padded(static_cast<std::size_t>(kHkv * c.keep_capacity_per_head()));
  for (i64 l = 0; l < kLayers; ++l) {
    kvevict::sequence_io<T> io;
    io.event = kvevict::sequence_event::prefill_end;
    io.keys = m.k[static_cast<std::size_t>(l)].view;
    io.values = m.v[static_cast<std::size_t>(l)].view;
    io.queries = m.q[static_cast<std::size_t>(l)].view;
    io.state = state.empty() ? nullptr : state.data();
    io.layers = layers.data();
    io.padded_indices = padded.data();
    std::vector<i64> lengths(kHkv);
    io.head_lengths = lengths.data();
    kvevict::sequence_report r;
    const kvevict::status st = c.run(l, &io, 1, &r, ws);
    INFO(st.message());
    REQUIRE(st.ok());
    out->push_back(r);
    if (r.action == kvevict::sequence_action::evicted) {
      REQUIRE(lengths[0] == lengths[1]);  // one keep set for the heads
      for (i64 h = 0; h < kHkv; ++h) {
        std::vector<i64> row(padded.begin() + h * c.keep_capacity_per_head(),
                             padded.begin() + (h + 1) * c.keep_capacity_per_head());
        for (i64 i = lengths[static_cast<std::size_t>(h)]; i < c.keep_capacity_per_head(); ++i)
          REQUIRE(row[static_cast<std::size_t>(i)] == -1);
        row.resize(static_cast<std::size_t>(lengths[static_cast<std::size_t>(h)]));
        if (h == 0) kept[static_cast<std::size_t>(l)] = row;
        REQUIRE(row == kept[static_cast<std::size_t>(l)]);
      }
      if (scope == kvevict::selection_scope::per_sequence)
        for (auto& k : kept) k = kept[static_cast<std::size_t>(l)];
    }
  }
  return kept;
}

template <class T>
std::uint64_t checksum(const model_data<T>& m) {
  std::uint64_t x = test::fnv_seed;
  for (i64 l = 0; l < kLayers; ++l) {
    x = test::fnv(x, m.k[static_cast<std::size_t>(l)].buffer);
    x = test::fnv(x, m.v[static_cast<std::size_t>(l)].buffer);
  }
  return x;
}

}  // namespace

TEMPLATE_TEST_CASE("layer- and sequence-shared keep sets: compressor == building blocks", "[contracts]", float, bf16,
                   fp16) {
  for (auto lay : {test::layout::contiguous, test::layout::paged_nhd, test::layout::transposed})
    for (auto scope : {kvevict::selection_scope::per_layer, kvevict::selection_scope::per_sequence})
      for (auto rule : {kvevict::scope_combine::normalized_max, kvevict::scope_combine::normalized_mean,
                        kvevict::scope_combine::max, kvevict::scope_combine::mean})
        for (kvevict::budget b : {kvevict::budget::tokens(11), kvevict::budget::ratio(0.7)}) {
          INFO(test::name(lay) << " " << kvevict::to_string(scope) << " " << kvevict::to_string(rule));
          auto hand = make_model<TestType>(43, lay, 5);
          auto comp = make_model<TestType>(43, lay, 5);
          const auto want = by_hand(hand, scope, rule, b);
          std::vector<kvevict::sequence_report> reports;
          const auto got = by_compressor(comp, scope, rule, b, kvevict::compaction::in_place, &reports);
          REQUIRE(got == want);
          REQUIRE(checksum(comp) == checksum(hand));
          if (scope == kvevict::selection_scope::per_sequence) {
            REQUIRE(reports[0].action == kvevict::sequence_action::observed);
            REQUIRE(reports[1].action == kvevict::sequence_action::observed);
            REQUIRE(reports[2].action == kvevict::sequence_action::evicted);
          }
          REQUIRE(reports.back().dropped == 43 - reports.back().length);
          // keep_list_only: the same keep set reported, nothing moved.
          auto still = make_model<TestType>(43, lay, 5);
          const std::uint64_t before = checksum(still);
          std::vector<kvevict::sequence_report> r2;
          REQUIRE(by_compressor(still, scope, rule, b, kvevict::compaction::keep_list_only, &r2) == want);
          REQUIRE(checksum(still) == before);
        }
}

TEST_CASE("length modes: the plan refuses what one length per sequence cannot serve", "[contracts]") {
  kvevict::compressor_options opt;
  opt.model = {2, 4, 2, 8, 0, kvevict::dtype::f32};
  opt.limits.max_tokens = 64;
  opt.lengths = kvevict::length_mode::uniform;
  kvevict::compressor c;
  REQUIRE(kvevict::compressor::plan(opt, &c).ok());
  opt.heads = kvevict::head_allocation::adakv;
  kvevict::status st = kvevict::compressor::plan(opt, &c);
  CHECK(st.code() == kvevict::errc::unsupported);
  CHECK(std::string(st.argument()) == "heads");
  opt.heads = kvevict::head_allocation::uniform;
  opt.layers = kvevict::layer_allocation::pyramidkv;
  st = kvevict::compressor::plan(opt, &c);
  CHECK(st.code() == kvevict::errc::unsupported);
  CHECK(std::string(st.argument()) == "layers");
  opt.lengths = kvevict::length_mode::per_head;
  opt.scope = kvevict::selection_scope::per_sequence;
  st = kvevict::compressor::plan(opt, &c);
  CHECK(st.code() == kvevict::errc::unsupported);
  opt.layers = kvevict::layer_allocation::uniform;
  opt.heads = kvevict::head_allocation::adakv;
  opt.scope = kvevict::selection_scope::per_layer;
  st = kvevict::compressor::plan(opt, &c);
  CHECK(st.code() == kvevict::errc::unsupported);
  CHECK(std::string(st.argument()) == "heads");  // the options' field, not the layer_budget's
}

// ---- prefix-shared blocks ---------------------------------------------------------------

namespace {

/// A vLLM-style pool [blocks, block_size, Hkv, d] (K and V pools) with two sequences: x owns
/// blocks {0, 1, 2, 3, 4}, y shares x's first two blocks (prefix caching) and owns {5, 6}.
struct shared_pool {
  static constexpr i64 blocks = 12, bs = 4, hkv = 2, d = 8;
  std::vector<bf16> k, v;
  std::vector<std::int32_t> table_x{0, 1, 2, 3, 4}, table_y{0, 1, 5, 6}, fresh{7, 8, 9, 10, 11};
  std::vector<std::int32_t> refcounts;
  i64 len_x = 19, len_y = 15;

  shared_pool() {
    const auto kd = test::normal(blocks * bs * hkv * d, 71), vd = test::normal(blocks * bs * hkv * d, 72);
    for (double x : kd) k.push_back(bf16(static_cast<float>(x)));
    for (double x : vd) v.push_back(bf16(static_cast<float>(x)));
    refcounts.assign(blocks, 0);
    for (auto id : table_x) ++refcounts[static_cast<std::size_t>(id)];
    for (auto id : table_y) ++refcounts[static_cast<std::size_t>(id)];
  }
  kvevict::cache_view<bf16> view(std::vector<bf16>& pool, const std::vector<std::int32_t>& table, i64 n) {
    return kvevict::vllm_paged(pool.data(), blocks, bs, hkv, d, table.data(), n);
  }
  /// Every element sequence y reads.
  std::uint64_t y_bytes() {
    std::uint64_t x = test::fnv_seed;
    for (auto* pool : {&k, &v}) {
      const auto yv = view(*pool, table_y, len_y);
      for (i64 h = 0; h < hkv; ++h)
        for (i64 j = 0; j < len_y; ++j) x = test::fnv(x, yv.row(h, j), sizeof(bf16) * static_cast<std::size_t>(d));
    }
    return x;
  }
  std::uint64_t all_bytes() const { return test::fnv(test::fnv(test::fnv_seed, k), v); }
};

/// Keeps token 3 (inside the shared prefix) and a few after it: compaction in place would
/// write rows 1.. of x, i.e. shared block 0.
test::host_keep keep_for_x() {
  test::host_keep keep;
  keep.add_head({0, 3, 9, 14, 18});
  keep.add_head({1, 2, 3, 11, 17});
  return keep;
}

}  // namespace

TEST_CASE("prefix-shared blocks: in place is refused naming the block; nothing changes", "[contracts]") {
  shared_pool p;
  const std::uint64_t before = p.all_bytes();
  const auto keep = keep_for_x();
  kvevict::eviction_result r;
  kvevict::eviction_options opt;
  opt.block_refcounts = p.refcounts.data();
  kvevict::workspace ws(
      kvevict::evict_workspace_size(p.view(p.k, p.table_x, p.len_x), p.view(p.v, p.table_x, p.len_x)));
  const kvevict::status st =
      kvevict::evict(p.view(p.k, p.table_x, p.len_x), p.view(p.v, p.table_x, p.len_x), keep.view(), r, ws, opt);
  INFO(st.message());
  CHECK(st.code() == kvevict::errc::invalid_argument);
  CHECK(std::string(st.argument()) == "keys.block_table[0]");
  CHECK(std::string(st.message()).find("shared") != std::string::npos);
  CHECK(p.all_bytes() == before);
  // The bitmap form says the same.
  std::vector<std::uint32_t> bits(1, 0b11u);
  kvevict::eviction_options opt2;
  opt2.shared_blocks = bits.data();
  CHECK(kvevict::evict(p.view(p.k, p.table_x, p.len_x), p.view(p.v, p.table_x, p.len_x), keep.view(), r, ws, opt2)
            .code() == kvevict::errc::invalid_argument);
  CHECK(p.all_bytes() == before);
}

TEST_CASE("prefix-shared blocks: in place is allowed when no shared block is written", "[contracts]") {
  shared_pool p;
  test::host_keep keep;  // rows 0..7 (blocks 0 and 1) stay where they are
  keep.add_head({0, 1, 2, 3, 4, 5, 6, 7, 10, 12, 15});
  keep.add_head({0, 1, 2, 3, 4, 5, 6, 7, 9, 18});
  const std::uint64_t y_before = p.y_bytes();
  std::vector<std::int32_t> changed(10, -1);
  kvevict::eviction_result r;
  r.changed_blocks = changed.data();
  kvevict::eviction_options opt;
  opt.block_refcounts = p.refcounts.data();
  kvevict::workspace ws(
      kvevict::evict_workspace_size(p.view(p.k, p.table_x, p.len_x), p.view(p.v, p.table_x, p.len_x)));
  REQUIRE(
      kvevict::evict(p.view(p.k, p.table_x, p.len_x), p.view(p.v, p.table_x, p.len_x), keep.view(), r, ws, opt).ok());
  CHECK(p.y_bytes() == y_before);
  // Rows 8 .. 10 were written: logical block 2 only (K and V share the table: listed once).
  REQUIRE(r.num_changed_blocks == 1);
  CHECK(changed[0] == 2);
  CHECK(r.max_length == 11);
  CHECK(r.freed_blocks == 5 - 3);
}

TEST_CASE("prefix-shared blocks: out of place into fresh blocks keeps the other sequence intact", "[contracts]") {
  shared_pool p, privat;  // `privat`: the same data where x's blocks are its own
  const auto keep = keep_for_x();
  const std::uint64_t y_before = p.y_bytes();
  std::vector<std::int32_t> changed(10, -1);
  std::vector<i64> pos(keep.indices.size());
  kvevict::eviction_result r;
  r.changed_blocks = changed.data();
  r.positions = pos.data();
  kvevict::eviction_options opt;
  opt.block_refcounts = p.refcounts.data();
  const auto sk = p.view(p.k, p.table_x, p.len_x), sv = p.view(p.v, p.table_x, p.len_x);
  const auto dk = p.view(p.k, p.fresh, 5), dv = p.view(p.v, p.fresh, 5);
  kvevict::workspace ws(kvevict::evict_into_workspace_size(sk, sv, dk, dv));
  const kvevict::status st = kvevict::evict_into(sk, sv, dk, dv, keep.view(), r, ws, opt);
  INFO(st.message());
  REQUIRE(st.ok());
  CHECK(p.y_bytes() == y_before);  // the shared blocks are unchanged
  CHECK(r.max_length == 5);
  CHECK(r.freed_blocks == 5);          // x releases all five of its old blocks
  REQUIRE(r.num_changed_blocks == 2);  // 5 rows of block size 4: fresh blocks 7 and 8
  CHECK(changed[0] == 7);
  CHECK(changed[1] == 8);
  // The destination equals in-place eviction of x's private copy.
  kvevict::eviction_result pr;
  kvevict::workspace pws(kvevict::evict_workspace_size(privat.view(privat.k, privat.table_x, privat.len_x),
                                                       privat.view(privat.v, privat.table_x, privat.len_x)));
  REQUIRE(kvevict::evict(privat.view(privat.k, privat.table_x, privat.len_x),
                         privat.view(privat.v, privat.table_x, privat.len_x), keep.view(), pr, pws)
              .ok());
  for (auto pools : {std::make_pair(&p.k, &privat.k), std::make_pair(&p.v, &privat.v)}) {
    const auto out = p.view(*pools.first, p.fresh, 5), in_place = privat.view(*pools.second, privat.table_x, 5);
    for (i64 h = 0; h < shared_pool::hkv; ++h)
      for (i64 i = 0; i < keep.size(h); ++i)
        for (i64 c = 0; c < shared_pool::d; ++c) REQUIRE(out.at(h, i, c).bits == in_place.at(h, i, c).bits);
  }
  // Fresh blocks that are not fresh are refused: block 0 is shared (two references).
  p.fresh[1] = 0;
  const std::uint64_t now = p.all_bytes();
  CHECK(kvevict::evict_into(sk, sv, p.view(p.k, p.fresh, 5), p.view(p.v, p.fresh, 5), keep.view(), r, ws, opt).code() ==
        kvevict::errc::invalid_argument);
  p.fresh[1] = 1;  // and one of x's own: reading it while writing it
  CHECK(kvevict::evict_into(sk, sv, p.view(p.k, p.fresh, 5), p.view(p.v, p.fresh, 5), keep.view(), r, ws, opt).code() ==
        kvevict::errc::invalid_argument);
  CHECK(p.all_bytes() == now);
}

TEST_CASE("prefix-shared blocks through the compressor: refused in place, served out of place", "[contracts]") {
  shared_pool p;
  kvevict::compressor_options opt;
  opt.model = {1, 4, shared_pool::hkv, shared_pool::d, 0, kvevict::dtype::bf16};
  opt.sharing = kvevict::block_sharing::marked;  // the refcounts come with every call
  kvevict::window_config w = kvevict::presets::kvpress_snapkv();
  w.window = 3;
  opt.policy = kvevict::policy::snapkv(w);
  opt.per_head = kvevict::budget::tokens(6);
  opt.limits.max_tokens = 32;
  kvevict::compressor c;
  REQUIRE(kvevict::compressor::plan(opt, &c).ok());
  std::vector<bf16> q(4 * 3 * shared_pool::d, bf16(0.3f));
  std::vector<i64> qpos{16, 17, 18};
  kvevict::sequence_io<bf16> io;
  io.event = kvevict::sequence_event::prefill_end;
  io.keys = p.view(p.k, p.table_x, p.len_x);
  io.values = p.view(p.v, p.table_x, p.len_x);
  io.queries = kvevict::contiguous_queries<const bf16>(q.data(), 4, 3, shared_pool::d, qpos.data());
  io.block_refcounts = p.refcounts.data();
  kvevict::workspace ws(c.workspace_size());
  kvevict::sequence_report r;
  const std::uint64_t before = p.all_bytes();
  kvevict::status st = c.run(0, &io, 1, &r, ws);
  // In a batch the keep set is not known before anything moves: a sequence with a shared
  // block is refused in place (the first one named), whatever rows it would keep.
  INFO(st.message());
  CHECK(st.code() == kvevict::errc::invalid_argument);
  CHECK(std::string(st.argument()) == "seqs[0].keys.block_table[0]");
  CHECK(p.all_bytes() == before);

  opt.compact = kvevict::compaction::out_of_place;
  REQUIRE(kvevict::compressor::plan(opt, &c).ok());
  io.dst_keys = p.view(p.k, p.fresh, 20);
  io.dst_values = p.view(p.v, p.fresh, 20);
  std::vector<std::int32_t> changed(c.changed_blocks_capacity());
  io.changed_blocks = changed.data();
  const std::uint64_t y_before = p.y_bytes();
  st = c.run(0, &io, 1, &r, ws);
  INFO(st.message());
  REQUIRE(st.ok());
  CHECK(r.action == kvevict::sequence_action::evicted);
  CHECK(r.length == 6);
  CHECK(r.dropped == p.len_x - 6);
  CHECK(r.num_changed_blocks == 2);
  CHECK(p.y_bytes() == y_before);
  opt.compact = kvevict::compaction::out_of_place;
  io.dst_keys = {};
  io.dst_values = {};
  st = c.run(0, &io, 1, &r, ws);
  CHECK(st.code() == kvevict::errc::null_pointer);
}

namespace {
/// SnapKV (W = 3, 6 tokens per head) over shared_pool's two sequences, as an engine with
/// prefix caching would call it: x and y share blocks 0 and 1.
struct shared_batch {
  shared_pool p;
  kvevict::compressor_options opt;
  std::vector<bf16> q = std::vector<bf16>(4 * 3 * shared_pool::d, bf16(0.3f));
  std::vector<i64> qpos_x{16, 17, 18}, qpos_y{12, 13, 14};
  std::vector<kvevict::sequence_report> reports = std::vector<kvevict::sequence_report>(2);

  explicit shared_batch(kvevict::block_sharing sharing) {
    opt.model = {1, 4, shared_pool::hkv, shared_pool::d, 0, kvevict::dtype::bf16};
    kvevict::window_config w = kvevict::presets::kvpress_snapkv();
    w.window = 3;
    opt.policy = kvevict::policy::snapkv(w);
    opt.per_head = kvevict::budget::tokens(6);
    opt.limits.max_sequences = 2;
    opt.limits.max_tokens = 32;
    opt.sharing = sharing;
  }
  std::vector<kvevict::sequence_io<bf16>> batch(kvevict::sequence_event x_event, kvevict::sequence_event y_event) {
    std::vector<kvevict::sequence_io<bf16>> io(2);
    io[0].event = x_event;
    io[0].keys = p.view(p.k, p.table_x, p.len_x);
    io[0].values = p.view(p.v, p.table_x, p.len_x);
    io[0].queries = kvevict::contiguous_queries<const bf16>(q.data(), 4, 3, shared_pool::d, qpos_x.data());
    io[1].event = y_event;
    io[1].keys = p.view(p.k, p.table_y, p.len_y);
    io[1].values = p.view(p.v, p.table_y, p.len_y);
    io[1].queries = kvevict::contiguous_queries<const bf16>(q.data(), 4, 3, shared_pool::d, qpos_y.data());
    return io;
  }
  kvevict::status run(const std::vector<kvevict::sequence_io<bf16>>& io) {
    kvevict::compressor c;
    REQUIRE(kvevict::compressor::plan(opt, &c).ok());
    kvevict::workspace ws(c.workspace_size());
    return c.run(0, io.data(), static_cast<i64>(io.size()), reports.data(), ws);
  }
};
}  // namespace

// Issue 26: two sequences of one call sharing prefix blocks, no refcounts: run() returned ok
// and rewrote the shared blocks the other sequence reads.
TEST_CASE("prefix sharing inside one call: refused in place, marked or not, naming both sequences", "[contracts]") {
  using ev = kvevict::sequence_event;
  for (const auto sharing : {kvevict::block_sharing::none, kvevict::block_sharing::marked}) {
    // y at prefill_end (both compact), decoding or idle (only x compacts): x's blocks 0 and 1
    // are y's too.
    for (const ev y_event : {ev::prefill_end, ev::decode, ev::idle}) {
      INFO("sharing " << static_cast<int>(sharing) << ", y's event " << static_cast<int>(y_event));
      shared_batch b(sharing);
      auto io = b.batch(ev::prefill_end, y_event);
      std::vector<std::int32_t> unshared(shared_pool::blocks, 1);  // marks that miss the sharing
      if (sharing == kvevict::block_sharing::marked)
        for (auto& s : io) s.block_refcounts = unshared.data();
      const std::uint64_t before = b.p.all_bytes();
      const kvevict::status st = b.run(io);
      INFO(st.message());
      CHECK(st.code() == kvevict::errc::invalid_argument);
      CHECK(std::string(st.argument()) == "seqs[0].keys.block_table[0]");
      CHECK(std::string(st.message()).find("also at seqs[1].keys.block_table[0]") != std::string::npos);
      CHECK(b.p.all_bytes() == before);
    }
  }
  // Sharing is fine where nothing is compacted in place: both decoding (SnapKV evicts at
  // prefill_end only), or out of place (the sources stay as they were).
  {
    shared_batch b(kvevict::block_sharing::none);
    const std::uint64_t before = b.p.all_bytes();
    CHECK(b.run(b.batch(ev::decode, ev::decode)).ok());
    CHECK(b.p.all_bytes() == before);
  }
  {
    shared_batch b(kvevict::block_sharing::none);
    b.opt.compact = kvevict::compaction::out_of_place;
    auto io = b.batch(ev::prefill_end, ev::decode);
    io[0].dst_keys = b.p.view(b.p.k, b.p.fresh, 20);
    io[0].dst_values = b.p.view(b.p.v, b.p.fresh, 20);
    const std::uint64_t y_before = b.p.y_bytes();
    const kvevict::status st = b.run(io);
    INFO(st.message());
    CHECK(st.ok());
    CHECK(b.reports[0].action == kvevict::sequence_action::evicted);
    CHECK(b.p.y_bytes() == y_before);
  }
  // The same block ids in another pool are other blocks: no refusal.
  {
    shared_batch b(kvevict::block_sharing::none);
    shared_pool other;
    auto io = b.batch(ev::prefill_end, ev::decode);
    io[1].keys = other.view(other.k, other.table_y, other.len_y);
    io[1].values = other.view(other.v, other.table_y, other.len_y);
    const kvevict::status st = b.run(io);
    INFO(st.message());
    CHECK(st.ok());
    CHECK(b.reports[0].action == kvevict::sequence_action::evicted);
  }
}

TEST_CASE("block sharing outside the call: a paged in-place run needs the engine's choice", "[contracts]") {
  using ev = kvevict::sequence_event;
  std::vector<std::int32_t> refs;
  {  // not declared: refused by the option's name, whether or not marks come with the call
    shared_batch b(kvevict::block_sharing::undeclared);
    auto io = b.batch(ev::prefill_end, ev::decode);
    io.resize(1);
    const std::uint64_t before = b.p.all_bytes();
    kvevict::status st = b.run(io);
    INFO(st.message());
    CHECK(st.code() == kvevict::errc::invalid_argument);
    CHECK(std::string(st.argument()) == "sharing");
    CHECK(std::string(st.message()).find("seqs[0].keys") != std::string::npos);
    refs.assign(shared_pool::blocks, 1);
    io[0].block_refcounts = refs.data();
    CHECK(b.run(io).code() == kvevict::errc::invalid_argument);
    CHECK(b.p.all_bytes() == before);
  }
  {  // marked: each compacted paged sequence carries the marks
    shared_batch b(kvevict::block_sharing::marked);
    auto io = b.batch(ev::prefill_end, ev::decode);
    io.resize(1);
    const std::uint64_t before = b.p.all_bytes();
    kvevict::status st = b.run(io);
    CHECK(st.code() == kvevict::errc::null_pointer);
    CHECK(std::string(st.argument()) == "seqs[0].block_refcounts");
    CHECK(b.p.all_bytes() == before);
    io[0].block_refcounts = refs.data();  // x's blocks private (y not running)
    st = b.run(io);
    INFO(st.message());
    CHECK(st.ok());
    CHECK(b.reports[0].action == kvevict::sequence_action::evicted);
  }
  {  // none: accepted without marks
    shared_batch b(kvevict::block_sharing::none);
    auto io = b.batch(ev::prefill_end, ev::decode);
    io.resize(1);
    CHECK(b.run(io).ok());
  }
  {  // strided caches and keep-lists move no block: no choice needed (as before)
    shared_batch b(kvevict::block_sharing::undeclared);
    b.opt.compact = kvevict::compaction::keep_list_only;
    auto io = b.batch(ev::prefill_end, ev::decode);
    io.resize(1);
    CHECK(b.run(io).ok());
    std::vector<bf16> k(2 * 19 * shared_pool::d, bf16(0.5f)), v = k;
    b.opt.compact = kvevict::compaction::in_place;
    io[0].keys = kvevict::hf_contiguous(k.data(), 2, 19, shared_pool::d, 19);
    io[0].values = kvevict::hf_contiguous(v.data(), 2, 19, shared_pool::d, 19);
    CHECK(b.run(io).ok());
  }
}

// Issue 26: with chunked prefill the last chunk held 16 of the window's 64 queries and
// run() scored with those 16.
TEST_CASE("chunked prefill: fewer queries than the window are refused; a shorter prompt is not", "[contracts]") {
  using ev = kvevict::sequence_event;
  shared_batch b(kvevict::block_sharing::none);
  auto io = b.batch(ev::prefill_end, ev::decode);
  io.resize(1);
  io[0].queries.num_queries = 2;  // the last chunk's 2 of W = 3
  io[0].queries.positions += 1;
  const std::uint64_t before = b.p.all_bytes();
  kvevict::status st = b.run(io);
  INFO(st.message());
  CHECK(st.code() == kvevict::errc::invalid_shape);
  CHECK(std::string(st.argument()) == "seqs[0].queries.num_queries");
  CHECK(std::string(st.message()).find("observation_window() = 3") != std::string::npos);
  CHECK(b.p.all_bytes() == before);
  // A 2-token prompt has only 2 queries: its whole window.
  io[0].keys.num_tokens = io[0].values.num_tokens = 2;
  std::vector<i64> early{0, 1};
  io[0].queries.positions = early.data();
  st = b.run(io);
  INFO(st.message());
  CHECK(st.ok());
}

namespace {
/// One sequence of one layer for the chunked-prefill contracts: K/V of `tokens` tokens, every
/// prompt query with its position.
struct chunk_sequence {
  static constexpr i64 hkv = 2, hq = 4, d = 8;
  i64 tokens;
  test::test_cache<bf16> k, v;
  test::test_queries<bf16> q;
  explicit chunk_sequence(i64 n, std::uint64_t seed = 1)
      : tokens(n),
        k(test::make_cache<bf16>(test::layout::contiguous, hkv, n, d, test::normal(hkv * n * d, seed), 4, seed)),
        v(test::make_cache<bf16>(test::layout::contiguous, hkv, n, d, test::normal(hkv * n * d, seed + 1), 4,
                                 seed + 1)) {
    std::vector<i64> pos(static_cast<std::size_t>(n));
    std::iota(pos.begin(), pos.end(), i64{0});
    q = test::make_queries<bf16>(hq, n, d, test::normal(hq * n * d, seed + 2), pos);
  }
  /// The call for prompt tokens [from, to): the cache holds the first `to`.
  kvevict::sequence_io<bf16> chunk(i64 from, i64 to, kvevict::sequence_event e, void* state) const {
    kvevict::sequence_io<bf16> io;
    io.event = e;
    io.keys = k.view.first_tokens(to);
    io.values = v.view.first_tokens(to);
    io.queries = q.view;
    io.queries.data += from * io.queries.query_stride;
    io.queries.positions += from;
    io.queries.num_queries = to - from;
    io.state = state;
    return io;
  }
  std::uint64_t bytes() const { return test::fnv(test::fnv(test::fnv_seed, k.buffer), v.buffer); }
};
}  // namespace

// Issue 26: chunked prefill is served through prefill_chunk; what cannot be served right is
// refused by name, and a refused call changes neither the cache nor the state.
TEST_CASE("chunked prefill: chunks the plan did not ask for, out of order or after prefill_end are refused",
          "[contracts]") {
  using ev = kvevict::sequence_event;
  using seq = chunk_sequence;
  const seq x(20);
  kvevict::compressor_options o;
  o.model = {1, seq::hq, seq::hkv, seq::d, 0, kvevict::dtype::bf16};
  kvevict::window_config w = kvevict::presets::kvpress_snapkv();
  w.window = 4;
  o.policy = kvevict::policy::snapkv(w);
  o.per_head = kvevict::budget::tokens(6);
  o.limits.max_tokens = 32;
  const auto call = [&](const kvevict::compressor& c, const kvevict::sequence_io<bf16>& io,
                        kvevict::sequence_report* r) {
    kvevict::workspace ws(c.workspace_size());
    return c.run(0, &io, 1, r, ws);
  };
  kvevict::sequence_report r;
  {  // the plan said nothing of chunks
    kvevict::compressor c;
    REQUIRE(kvevict::compressor::plan(o, &c).ok());
    const kvevict::status st = call(c, x.chunk(0, 8, ev::prefill_chunk, nullptr), &r);
    INFO(st.message());
    CHECK(st.code() == kvevict::errc::invalid_argument);
    CHECK(std::string(st.argument()) == "seqs[0].event");
    CHECK(std::string(st.message()).find("chunked_prefill") != std::string::npos);
  }
  o.chunked_prefill = true;
  kvevict::compressor c;
  REQUIRE(kvevict::compressor::plan(o, &c).ok());
  // The state holds each layer's window: positions and [Hq, W, d] bf16 queries.
  CHECK(c.sequence_state_size() >= 64 + 4 * 8 + seq::hq * 4 * seq::d * 2);
  std::vector<std::uint64_t> state(c.sequence_state_size() / 8 + 1);
  REQUIRE(c.reset_sequence(state.data(), c.sequence_state_size()).ok());
  {
    const kvevict::status st = call(c, x.chunk(0, 8, ev::prefill_chunk, state.data()), &r);
    INFO(st.message());
    REQUIRE(st.ok());
    CHECK(r.action == kvevict::sequence_action::observed);
    CHECK(r.length == 8);
  }
  const std::uint64_t cache_before = x.bytes();
  const std::vector<std::uint64_t> state_before = state;
  {  // the same chunk twice, or an earlier one: its queries are not after the window's newest
    for (i64 from : {0, 4, 7}) {
      const kvevict::status st = call(c, x.chunk(from, 12, ev::prefill_chunk, state.data()), &r);
      INFO(st.message());
      CHECK(st.code() == kvevict::errc::invalid_argument);
      CHECK(std::string(st.argument()) == "seqs[0].queries.positions[0]");
      CHECK(state == state_before);
    }
    // prefill_end with a query the window already holds: refused too
    const kvevict::status st = call(c, x.chunk(6, 20, ev::prefill_end, state.data()), &r);
    CHECK(std::string(st.argument()) == "seqs[0].queries.positions[0]");
    CHECK(state == state_before);
    CHECK(x.bytes() == cache_before);
  }
  {  // a chunk of the wrong shape
    auto io = x.chunk(8, 12, ev::prefill_chunk, state.data());
    io.queries.num_heads = 2;
    const kvevict::status st = call(c, io, &r);
    CHECK(std::string(st.argument()) == "seqs[0].queries");
    CHECK(state == state_before);
  }
  REQUIRE(call(c, x.chunk(8, 19, ev::prefill_chunk, state.data()), &r).ok());
  {  // the last chunk holds 1 of the window's 4 queries: served from the state
    const kvevict::status st = call(c, x.chunk(19, 20, ev::prefill_end, state.data()), &r);
    INFO(st.message());
    REQUIRE(st.ok());
    CHECK(r.action == kvevict::sequence_action::evicted);
    CHECK(r.length == 6);
  }
  {  // DeferKV: a chunk after this sequence's prefill_end is a new prompt: reset_sequence()
    kvevict::compressor_options od = o;
    kvevict::deferkv_config dc;
    dc.window = 4;
    dc.delay = 2;
    od.policy = kvevict::policy::deferkv(dc);
    kvevict::compressor cd;
    REQUIRE(kvevict::compressor::plan(od, &cd).ok());
    std::vector<std::uint64_t> sd(cd.sequence_state_size() / 8 + 1);
    REQUIRE(cd.reset_sequence(sd.data(), cd.sequence_state_size()).ok());
    const seq y(12);
    REQUIRE(call(cd, y.chunk(0, 9, ev::prefill_chunk, sd.data()), &r).ok());
    REQUIRE(call(cd, y.chunk(9, 11, ev::prefill_end, sd.data()), &r).ok());
    CHECK(r.action == kvevict::sequence_action::observed);
    const std::vector<std::uint64_t> before = sd;
    const kvevict::status st = call(cd, y.chunk(11, 12, ev::prefill_chunk, sd.data()), &r);
    INFO(st.message());
    CHECK(st.code() == kvevict::errc::invalid_state);
    CHECK(std::string(st.argument()) == "seqs[0].state");
    CHECK(sd == before);
  }
  {  // H2O observes with every prompt query: a prompt past limits.max_queries lost some
    kvevict::compressor_options oh = o;
    oh.policy = kvevict::policy::h2o();
    oh.limits.max_queries = 10;
    kvevict::compressor ch;
    REQUIRE(kvevict::compressor::plan(oh, &ch).ok());
    std::vector<std::uint64_t> sh(ch.sequence_state_size() / 8 + 1);
    REQUIRE(ch.reset_sequence(sh.data(), ch.sequence_state_size()).ok());
    const seq y(16);
    REQUIRE(call(ch, y.chunk(0, 8, ev::prefill_chunk, sh.data()), &r).ok());
    REQUIRE(call(ch, y.chunk(8, 14, ev::prefill_chunk, sh.data()), &r).ok());
    const std::uint64_t yb = y.bytes();
    const kvevict::status st = call(ch, y.chunk(14, 16, ev::prefill_end, sh.data()), &r);
    INFO(st.message());
    CHECK(st.code() == kvevict::errc::invalid_shape);
    CHECK(std::string(st.argument()) == "seqs[0].queries.num_queries");
    CHECK(y.bytes() == yb);
  }
  {  // DapQ's N pseudo queries come whole with prefill_end: prompt chunks do not count for them
    kvevict::compressor_options op = o;
    kvevict::dapq_config dq;
    dq.pseudo_tokens = 4;
    op.policy = kvevict::policy::dapq(dq);
    kvevict::compressor cp;
    REQUIRE(kvevict::compressor::plan(op, &cp).ok());
    std::vector<std::uint64_t> sp(cp.sequence_state_size() / 8 + 1);
    REQUIRE(cp.reset_sequence(sp.data(), cp.sequence_state_size()).ok());
    const seq y(14);  // a 12-token prompt and its pseudo tokens at 12, 13 (of N = 4)
    REQUIRE(call(cp, y.chunk(0, 12, ev::prefill_chunk, sp.data()), &r).ok());
    const std::uint64_t yb = y.bytes();
    const kvevict::status st = call(cp, y.chunk(12, 14, ev::prefill_end, sp.data()), &r);
    INFO(st.message());
    CHECK(st.code() == kvevict::errc::invalid_shape);
    CHECK(std::string(st.argument()) == "seqs[0].queries.num_queries");
    CHECK(y.bytes() == yb);
  }
  {  // a window header the chunks did not leave: refused, nothing read through it
    std::vector<std::uint64_t> s2(c.sequence_state_size() / 8 + 1);
    REQUIRE(c.reset_sequence(s2.data(), c.sequence_state_size()).ok());
    const seq y(20);
    REQUIRE(call(c, y.chunk(0, 8, ev::prefill_chunk, s2.data()), &r).ok());
    s2[8] = 100000;  // the layer's buffered-row count (after the 64-byte sequence header)
    const std::vector<std::uint64_t> corrupted = s2;
    const std::uint64_t yb = y.bytes();
    for (const auto e : {ev::prefill_chunk, ev::prefill_end}) {
      const kvevict::status st = call(c, y.chunk(8, 20, e, s2.data()), &r);
      INFO(st.message());
      CHECK(st.code() == kvevict::errc::invalid_state);
      CHECK(std::string(st.argument()) == "seqs[0].state");
      CHECK(s2 == corrupted);
      CHECK(y.bytes() == yb);
    }
  }
}

// The engine's log-sum-exp of the queries applies when the last chunk holds the whole window:
// the chunked call then equals the unchunked call with the same LSE rows.
TEST_CASE("chunked prefill: a last chunk holding the whole window uses the engine's LSE", "[contracts]") {
  using ev = kvevict::sequence_event;
  using seq = chunk_sequence;
  const seq x(20);
  std::vector<float> lse(static_cast<std::size_t>(seq::hq * x.tokens));  // [Hq, 20] made up, finite
  for (std::size_t i = 0; i < lse.size(); ++i) lse[i] = 3.0f * static_cast<float>(i % 5);
  std::vector<i64> kept[2];
  for (int chunked = 0; chunked < 2; ++chunked) {
    kvevict::compressor_options o;
    o.model = {1, seq::hq, seq::hkv, seq::d, 0, kvevict::dtype::bf16};
    kvevict::window_config w = kvevict::presets::kvpress_snapkv();
    w.window = 4;
    o.policy = kvevict::policy::snapkv(w);
    o.per_head = kvevict::budget::tokens(6);
    o.limits.max_tokens = 32;
    o.limits.max_queries = 20;
    o.compact = kvevict::compaction::keep_list_only;
    o.chunked_prefill = chunked == 1;
    kvevict::compressor c;
    REQUIRE(kvevict::compressor::plan(o, &c).ok());
    kvevict::workspace ws(c.workspace_size());
    std::vector<std::uint64_t> state(c.sequence_state_size() / 8 + 1);
    REQUIRE(c.reset_sequence(state.data(), c.sequence_state_size()).ok());
    kvevict::sequence_report r;
    const i64 from = chunked == 1 ? 8 : 0;
    if (chunked == 1) {
      const auto io = x.chunk(0, 8, ev::prefill_chunk, state.data());
      REQUIRE(c.run(0, &io, 1, &r, ws).ok());
    }
    auto io = x.chunk(from, 20, ev::prefill_end, state.data());
    io.lse = lse.data() + from;  // this call's rows of each head's [20] LSE
    io.lse_head_stride = 20;
    std::vector<i64> positions(static_cast<std::size_t>(c.keep_capacity()));
    io.kept_positions = positions.data();
    const kvevict::status st = c.run(0, &io, 1, &r, ws);
    INFO(st.message());
    REQUIRE(st.ok());
    positions.resize(static_cast<std::size_t>(r.kept));
    kept[chunked] = positions;
  }
  REQUIRE(kept[1] == kept[0]);
  // (the LSE matters here: without it the keep set is another one)
}

// The keep set one sequence shares across its layers (llama.cpp cells) folds every layer's
// scores at prefill_end: with chunks, each layer's window comes from the state.
TEST_CASE("chunked prefill under a keep set shared by every layer equals the unchunked one", "[contracts]") {
  using ev = kvevict::sequence_event;
  using seq = chunk_sequence;
  const seq layer_data[2] = {seq(23, 11), seq(23, 21)};  // each layer its own K, V and queries
  kvevict::window_config w = kvevict::presets::kvpress_snapkv();
  w.window = 5;
  kvevict::deferkv_config dc;
  dc.window = 5;
  dc.delay = 1;
  for (const kvevict::policy_config& pc :
       {kvevict::policy::snapkv(w), kvevict::policy::h2o(), kvevict::policy::deferkv(dc)}) {
    for (i64 chunk : {1, 4, 5, 22}) {
      INFO(kvevict::to_string(pc.kind()) << " chunk " << chunk);
      std::vector<i64> kept[2];
      for (int chunked = 0; chunked < 2; ++chunked) {
        kvevict::compressor_options o;
        o.model = {2, seq::hq, seq::hkv, seq::d, 0, kvevict::dtype::bf16};
        o.policy = pc;
        o.per_head = kvevict::budget::tokens(7);
        o.scope = kvevict::selection_scope::per_sequence;
        o.compact = kvevict::compaction::keep_list_only;
        o.limits.max_tokens = 32;
        o.chunked_prefill = chunked == 1;
        kvevict::compressor c;
        REQUIRE(kvevict::compressor::plan(o, &c).ok());
        kvevict::workspace ws(c.workspace_size());
        std::vector<std::uint64_t> state(c.sequence_state_size() / 8 + 1);
        REQUIRE(c.reset_sequence(state.data(), c.sequence_state_size()).ok());
        std::vector<i64> positions(static_cast<std::size_t>(c.keep_capacity()), -1);
        const i64 prompt = pc.kind() == kvevict::policy_kind::deferkv ? layer_data[0].tokens - 1 : layer_data[0].tokens;
        const i64 last = chunked == 1 ? (prompt - 1) / chunk * chunk : 0;
        for (i64 from = 0; from < last; from += chunk)
          for (i64 l = 0; l < 2; ++l) {
            const auto io = layer_data[l].chunk(from, from + chunk, ev::prefill_chunk, state.data());
            kvevict::sequence_report r;
            REQUIRE(c.run(l, &io, 1, &r, ws).ok());
          }
        for (i64 l = 0; l < 2; ++l) {
          auto io = layer_data[l].chunk(last, prompt, ev::prefill_end, state.data());
          io.kept_positions = positions.data();
          kvevict::sequence_report r;
          const kvevict::status st = c.run(l, &io, 1, &r, ws);
          INFO(st.message());
          REQUIRE(st.ok());
          if (l == 1 && pc.kind() != kvevict::policy_kind::deferkv) {
            REQUIRE(r.action == kvevict::sequence_action::evicted);
            positions.resize(static_cast<std::size_t>(r.kept));
          }
        }
        if (pc.kind() == kvevict::policy_kind::deferkv)
          for (i64 l = 0; l < 2; ++l) {  // step d = 1 evicts
            auto io = layer_data[l].chunk(prompt, layer_data[l].tokens, ev::decode, state.data());
            io.kept_positions = positions.data();
            kvevict::sequence_report r;
            REQUIRE(c.run(l, &io, 1, &r, ws).ok());
            if (l == 1) {
              REQUIRE(r.action == kvevict::sequence_action::evicted);
              positions.resize(static_cast<std::size_t>(r.kept));
            }
          }
        kept[chunked] = positions;
      }
      REQUIRE(kept[0].size() >= 7 * seq::hkv);  // (DeferKV keeps its decoded token on top)
      REQUIRE(kept[0].size() < static_cast<std::size_t>(layer_data[0].tokens * seq::hkv));
      REQUIRE(kept[1] == kept[0]);
    }
  }
}

TEST_CASE("errors name what the caller wrote: the workspace figure is workspace_size()'s", "[contracts]") {
  using ev = kvevict::sequence_event;
  shared_batch b(kvevict::block_sharing::none);
  kvevict::compressor c;
  REQUIRE(kvevict::compressor::plan(b.opt, &c).ok());
  auto io = b.batch(ev::prefill_end, ev::decode);
  io.resize(1);
  std::vector<unsigned char> ws(c.workspace_size());
  const kvevict::status st = c.run(0, io.data(), 1, b.reports.data(), {ws.data(), ws.size() / 2});
  INFO(st.message());
  CHECK(st.code() == kvevict::errc::workspace_too_small);
  CHECK(std::string(st.message()).find("workspace_size() = " + std::to_string(c.workspace_size()) + " bytes") !=
        std::string::npos);
}

TEMPLATE_TEST_CASE("evict_into copies the kept rows for every layout, type and length", "[contracts]", float, bf16,
                   fp16) {
  for (auto src_lay : test::kAllLayouts)
    for (auto dst_lay : {test::layout::contiguous, test::layout::paged_hnd, test::layout::transposed})
      for (i64 l : {1, 9, 40}) {
        INFO(test::name(src_lay) << " -> " << test::name(dst_lay) << " L=" << l);
        const i64 heads = 3, d = 5;
        const auto dense = test::normal(static_cast<std::size_t>(heads * l * d), 11);
        auto src = test::make_cache<TestType>(src_lay, heads, l, d, dense, 4, 3);
        auto srcv = test::make_cache<TestType>(src_lay, heads, l, d, test::normal(heads * l * d, 12), 4, 4);
        auto dst = test::make_cache<TestType>(dst_lay, heads, l, d, test::normal(heads * l * d, 13), 4, 5);
        auto dstv = test::make_cache<TestType>(dst_lay, heads, l, d, test::normal(heads * l * d, 14), 4, 6);
        const auto keep = test::random_keep(heads, l, static_cast<std::uint64_t>(l) * 31);
        const std::uint64_t src_before = test::fnv(test::fnv(test::fnv_seed, src.buffer), srcv.buffer);
        kvevict::eviction_result r;
        std::vector<i64> lengths(heads);
        r.head_lengths = lengths.data();
        kvevict::workspace ws(kvevict::evict_into_workspace_size(src.view, srcv.view, dst.view, dstv.view));
        const auto cdst = dst, cdstv = dstv;  // what the destination held
        REQUIRE(kvevict::evict_into(src.view, srcv.view, dst.view, dstv.view, keep.view(), r, ws).ok());
        REQUIRE(test::fnv(test::fnv(test::fnv_seed, src.buffer), srcv.buffer) == src_before);
        for (i64 h = 0; h < heads; ++h) {
          REQUIRE(lengths[static_cast<std::size_t>(h)] == keep.size(h));
          for (i64 i = 0; i < l; ++i)
            for (i64 c = 0; c < d; ++c) {
              if (i < keep.size(h)) {
                REQUIRE(test::load(dst.at(h, i, c)) == test::load(src.at(h, keep.at(h, i), c)));
                REQUIRE(test::load(dstv.at(h, i, c)) == test::load(srcv.at(h, keep.at(h, i), c)));
              } else {  // rows past the kept ones are not written
                REQUIRE(test::load(dst.at(h, i, c)) == test::load(cdst.at(h, i, c)));
                REQUIRE(test::load(dstv.at(h, i, c)) == test::load(cdstv.at(h, i, c)));
              }
            }
        }
      }
}

// ---- layouts that hold K and V together, and caches shared by sequences -----------------

namespace {

/// Expected pool after in-place compaction through `view` (offsets computed by `at`).
template <class T, class At>
void expect_compacted(std::vector<T>& pool, const std::vector<T>& before, const test::host_keep& keep, i64 d, At at) {
  for (i64 h = 0; h < keep.heads(); ++h)
    for (i64 i = 0; i < keep.size(h); ++i)
      for (i64 c = 0; c < d; ++c)
        pool[static_cast<std::size_t>(at(h, i, c))] = before[static_cast<std::size_t>(at(h, keep.at(h, i), c))];
}

}  // namespace

TEST_CASE("vLLM packed K|V and FlashInfer's single tensor: both halves compact in their shared blocks", "[contracts]") {
  const i64 blocks = 9, bs = 4, hkv = 3, d = 6, l = 21;
  std::vector<std::int32_t> table{7, 2, 5, 0, 8, 3};
  for (int kind = 0; kind < 3; ++kind) {
    INFO("kind " << kind);
    std::vector<bf16> pool;
    for (double x : test::normal(blocks * bs * hkv * 2 * d, 90 + kind)) pool.push_back(bf16(static_cast<float>(x)));
    const std::vector<bf16> before = pool;
    kvevict::layer_cache<bf16> kv;
    std::function<i64(bool, i64, i64, i64)> at;  // (is_v, h, j, c) -> element offset, by formula
    if (kind == 0) {
      kv = kvevict::vllm_packed_kv(pool.data(), blocks, bs, hkv, d, table.data(), l, kvevict::block_order::hnd);
      at = [&](bool v, i64 h, i64 j, i64 c) {
        return ((table[j / bs] * hkv + h) * bs + j % bs) * (2 * d) + (v ? d : 0) + c;
      };
    } else if (kind == 1) {
      kv = kvevict::vllm_packed_kv(pool.data(), blocks, bs, hkv, d, table.data(), l, kvevict::block_order::nhd);
      at = [&](bool v, i64 h, i64 j, i64 c) {
        return ((table[j / bs] * bs + j % bs) * hkv + h) * (2 * d) + (v ? d : 0) + c;
      };
    } else {
      kv = kvevict::flashinfer_paged_kv(pool.data(), blocks, bs, hkv, d, table.data(), l, kvevict::block_order::nhd);
      at = [&](bool v, i64 h, i64 j, i64 c) {
        return table[j / bs] * (2 * bs * hkv * d) + (v ? bs * hkv * d : 0) + ((j % bs) * hkv + h) * d + c;
      };
    }
    const auto keep = test::random_keep(hkv, l, 17 + static_cast<std::uint64_t>(kind));
    kvevict::eviction_result r;
    kvevict::workspace ws(kvevict::evict_workspace_size(kv.keys, kv.values));
    const kvevict::status st = kvevict::evict(kv.keys, kv.values, keep.view(), r, ws);
    INFO(st.message());
    REQUIRE(st.ok());
    std::vector<bf16> want = before;
    for (bool v : {false, true})
      expect_compacted(want, before, keep, d, [&](i64 h, i64 j, i64 c) { return at(v, h, j, c); });
    for (std::size_t x = 0; x < pool.size(); ++x) REQUIRE(pool[x].bits == want[x].bits);
  }
}

TEST_CASE("llama.cpp cells shared by two sequences, transposed V: one sequence's eviction leaves the other's cells",
          "[contracts]") {
  const i64 kv_size = 64, hkv = 2, d = 5;
  std::vector<fp16> k, v;
  for (double x : test::normal(kv_size * hkv * d, 101)) k.push_back(fp16(static_cast<float>(x)));
  for (double x : test::normal(kv_size * hkv * d, 102)) v.push_back(fp16(static_cast<float>(x)));
  std::vector<std::int32_t> seq_a, seq_b;  // interleaved cells, as llama.cpp's unified cache fills them
  for (std::int32_t c = 0; c < 60; ++c) (c % 3 == 1 ? seq_b : seq_a).push_back(c);
  const i64 la = static_cast<i64>(seq_a.size());
  auto b_cells = [&] {
    std::vector<float> out;
    for (std::int32_t c : seq_b)
      for (i64 ch = 0; ch < hkv * d; ++ch) {
        out.push_back(static_cast<float>(k[static_cast<std::size_t>(c * hkv * d + ch)]));
        out.push_back(static_cast<float>(v[static_cast<std::size_t>(ch * kv_size + c)]));
      }
    return out;
  };
  const auto b_before = b_cells();
  const std::vector<fp16> kbefore = k, vbefore = v;
  test::host_keep keep;
  std::vector<i64> kept;
  for (i64 j = 0; j < la; ++j)
    if (j % 4 != 2) kept.push_back(j);
  keep.add_head(kept);
  keep.add_head(kept);  // every head the same tokens: cells can go
  auto keys = kvevict::llamacpp_cells_k(k.data(), kv_size, hkv, d, seq_a.data(), la);
  auto values = kvevict::llamacpp_cells_v_transposed(v.data(), kv_size, hkv, d, seq_a.data(), la);
  // Keep-list only (llama.cpp frees cells itself): nothing moves, the positions are reported.
  std::vector<i64> cell_pos(static_cast<std::size_t>(la));
  for (i64 j = 0; j < la; ++j) cell_pos[static_cast<std::size_t>(j)] = 1000 + j;
  std::vector<i64> kept_pos(keep.indices.size());
  REQUIRE(kvevict::keep_list_positions(keep.view(), la, cell_pos.data(), kept_pos.data()).ok());
  CHECK(kept_pos[2] == 1000 + kept[2]);
  // In place: sequence a's kept tokens move to its first cells; b's cells are untouched.
  kvevict::eviction_result r;
  kvevict::workspace ws(kvevict::evict_workspace_size(keys, values));
  const kvevict::status st = kvevict::evict(keys, values, keep.view(), r, ws);
  INFO(st.message());
  REQUIRE(st.ok());
  CHECK(b_cells() == b_before);
  for (i64 h = 0; h < hkv; ++h)
    for (i64 i = 0; i < static_cast<i64>(kept.size()); ++i)
      for (i64 c = 0; c < d; ++c) {
        const std::int32_t to = seq_a[static_cast<std::size_t>(i)],
                           from = seq_a[static_cast<std::size_t>(kept[static_cast<std::size_t>(i)])];
        REQUIRE(k[static_cast<std::size_t>(to * hkv * d + h * d + c)].bits ==
                kbefore[static_cast<std::size_t>(from * hkv * d + h * d + c)].bits);
        REQUIRE(v[static_cast<std::size_t>((h * d + c) * kv_size + to)].bits ==
                vbefore[static_cast<std::size_t>((h * d + c) * kv_size + from)].bits);
      }
  CHECK(r.freed_blocks == la - static_cast<i64>(kept.size()));  // one-token blocks: cells to free
}

TEST_CASE("TensorRT-LLM KVCacheIndex: a block flagged for the secondary pool is refused, not read", "[contracts]") {
  const i64 blocks = 6, tpb = 4, hkv = 2, d = 4, l = 10;
  std::vector<float> pool(static_cast<std::size_t>(blocks * hkv * tpb * d), 1.0f);
  std::vector<std::int32_t> k_offsets{4, 0, static_cast<std::int32_t>(0x80000000u | 3u)}, v_offsets{1, 5, 2};
  const auto keys = kvevict::trtllm_paged(pool.data(), blocks, tpb, hkv, d, k_offsets.data(), l);
  const auto values = kvevict::trtllm_paged(pool.data(), blocks, tpb, hkv, d, v_offsets.data(), l);
  test::host_keep keep;
  keep.add_head({0, 9});
  keep.add_head({1, 9});
  const std::uint64_t before = test::fnv(test::fnv_seed, pool);
  kvevict::eviction_result r;
  kvevict::workspace ws(kvevict::evict_workspace_size(keys, values));
  const kvevict::status st = kvevict::evict(keys, values, keep.view(), r, ws);
  CHECK(st.code() == kvevict::errc::out_of_range);
  CHECK(std::string(st.argument()) == "keys.block_table[2]");
  CHECK(std::string(st.message()).find("secondary-pool") != std::string::npos);
  CHECK(test::fnv(test::fnv_seed, pool) == before);
}

TEST_CASE("int64 block tables: ids past the pool and pools past int32 are refused, nothing moves", "[contracts]") {
  const i64 blocks = 6, bs = 4, hkv = 2, d = 4, l = 10;
  std::vector<float> kpool(static_cast<std::size_t>(blocks * bs * hkv * d)), vpool(kpool.size());
  for (std::size_t i = 0; i < kpool.size(); ++i) {
    kpool[i] = static_cast<float>(i);
    vpool[i] = -static_cast<float>(i);
  }
  std::vector<std::int64_t> table{4, 0, std::int64_t{1} << 33};  // beyond int32: must not wrap to block 0
  auto keys = kvevict::vllm_paged(kpool.data(), blocks, bs, hkv, d, table.data(), l);
  auto values = kvevict::vllm_paged(vpool.data(), blocks, bs, hkv, d, table.data(), l);
  test::host_keep keep;
  keep.add_head({0, 9});
  keep.add_head({1, 9});
  const std::uint64_t before = test::fnv(test::fnv(test::fnv_seed, kpool), vpool);
  kvevict::eviction_result r;
  kvevict::workspace ws(kvevict::evict_workspace_size(keys, values));
  kvevict::status st = kvevict::evict(keys, values, keep.view(), r, ws);
  CHECK(st.code() == kvevict::errc::out_of_range);
  CHECK(std::string(st.argument()) == "keys.block_table[2]");
  CHECK(std::string(st.message()).find("8589934592") != std::string::npos);
  CHECK(test::fnv(test::fnv(test::fnv_seed, kpool), vpool) == before);

  table[2] = 5;
  keys.num_pool_blocks = std::int64_t{1} << 31;  // ids are reported as int32 (changed-block lists)
  st = kvevict::evict(keys, values, keep.view(), r, ws);
  CHECK(st.code() == kvevict::errc::out_of_range);
  CHECK(std::string(st.argument()) == "keys.num_pool_blocks");
  CHECK(test::fnv(test::fnv(test::fnv_seed, kpool), vpool) == before);

  keys.num_pool_blocks = blocks;  // the valid int64 table compacts as the int32 one does
  std::vector<float> kcopy = kpool, vcopy = vpool;
  std::vector<std::int32_t> table32(table.begin(), table.end());
  auto keys32 = kvevict::vllm_paged(kcopy.data(), blocks, bs, hkv, d, table32.data(), l);
  auto values32 = kvevict::vllm_paged(vcopy.data(), blocks, bs, hkv, d, table32.data(), l);
  kvevict::eviction_result r32;
  REQUIRE(kvevict::evict(keys, values, keep.view(), r, ws).ok());
  REQUIRE(kvevict::evict(keys32, values32, keep.view(), r32, ws).ok());
  CHECK(kcopy == kpool);
  CHECK(vcopy == vpool);
  CHECK(r.max_length == r32.max_length);
}

namespace {
/// One strided float sequence of `l` tokens (room for `cap`) and its last `w` queries.
struct strided_sequence {
  static constexpr i64 hq = 4, hkv = 2, d = 8;
  i64 l, cap;
  std::vector<float> k, v, q;
  std::vector<i64> qpos;
  strided_sequence(i64 tokens, i64 capacity, i64 w, std::uint64_t seed) : l(tokens), cap(capacity) {
    const auto kd = test::normal(static_cast<std::size_t>(hkv * cap * d), seed);
    const auto vd = test::normal(static_cast<std::size_t>(hkv * cap * d), seed + 1);
    const auto qd = test::normal(static_cast<std::size_t>(hq * w * d), seed + 2, 1.5);
    k.assign(kd.begin(), kd.end());
    v.assign(vd.begin(), vd.end());
    q.assign(qd.begin(), qd.end());
    for (i64 t = 0; t < w; ++t) qpos.push_back(l - w + t);
  }
  kvevict::sequence_io<float> io(kvevict::sequence_event event) {
    kvevict::sequence_io<float> s;
    s.event = event;
    s.keys = kvevict::hf_contiguous(k.data(), hkv, l, d, cap);
    s.values = kvevict::hf_contiguous(v.data(), hkv, l, d, cap);
    s.queries = kvevict::contiguous_queries<const float>(q.data(), hq, static_cast<i64>(qpos.size()), d, qpos.data());
    return s;
  }
};
}  // namespace

// Issue 26: a 300-token sequence keeping 150 rows per head was refused out of place unless
// its destination had room for 300 (a bound from limits.max_tokens, not from its length).
TEST_CASE("out of place: the destination needs room for what this sequence can keep", "[contracts]") {
  constexpr i64 l = 300, w = 4;
  for (const auto heads : {kvevict::head_allocation::uniform, kvevict::head_allocation::adakv}) {
    INFO("heads " << static_cast<int>(heads));
    kvevict::compressor_options opt;
    opt.model = {1, strided_sequence::hq, strided_sequence::hkv, strided_sequence::d, 0, kvevict::dtype::f32};
    kvevict::window_config wc = kvevict::presets::kvpress_snapkv();
    wc.window = w;
    opt.policy = kvevict::policy::snapkv(wc);
    opt.per_head = kvevict::budget::ratio(0.5);
    opt.heads = heads;
    opt.compact = kvevict::compaction::out_of_place;
    opt.limits.max_tokens = 1024;
    kvevict::compressor c;
    REQUIRE(kvevict::compressor::plan(opt, &c).ok());
    const i64 room = c.keep_capacity_per_head(l);
    CHECK(room <= c.keep_capacity_per_head());
    CHECK(room <= l);
    if (heads == kvevict::head_allocation::uniform) CHECK(room <= l / 2 + w);
    CHECK(c.keep_capacity_per_head(0) == 0);
    CHECK(c.keep_capacity_per_head(5000) == c.keep_capacity_per_head());

    strided_sequence seq(l, l, w, 91);
    std::vector<float> dk(static_cast<std::size_t>(strided_sequence::hkv * room * strided_sequence::d), -1.0f), dv = dk;
    auto io = seq.io(kvevict::sequence_event::prefill_end);
    std::vector<i64> lengths(strided_sequence::hkv);
    io.head_lengths = lengths.data();
    kvevict::workspace ws(c.workspace_size());
    kvevict::sequence_report r;
    // One row short: refused, nothing written.
    io.dst_keys = kvevict::hf_contiguous(dk.data(), strided_sequence::hkv, room - 1, strided_sequence::d, room);
    io.dst_values = kvevict::hf_contiguous(dv.data(), strided_sequence::hkv, room - 1, strided_sequence::d, room);
    const std::uint64_t before = test::fnv(test::fnv(test::fnv(test::fnv_seed, seq.k), dk), dv);
    kvevict::status st = c.run(0, &io, 1, &r, ws);
    CHECK(st.code() == kvevict::errc::invalid_shape);
    CHECK(std::string(st.argument()) == "seqs[0].dst_keys.num_tokens");
    CHECK(test::fnv(test::fnv(test::fnv(test::fnv_seed, seq.k), dk), dv) == before);
    // Exactly `room` rows: served, and the rows are the in-place result's.
    io.dst_keys.num_tokens = io.dst_values.num_tokens = room;
    st = c.run(0, &io, 1, &r, ws);
    INFO(st.message());
    REQUIRE(st.ok());
    REQUIRE(r.action == kvevict::sequence_action::evicted);
    CHECK(r.length <= room);

    strided_sequence same(l, l, w, 91);
    kvevict::compressor in_place;
    opt.compact = kvevict::compaction::in_place;
    REQUIRE(kvevict::compressor::plan(opt, &in_place).ok());
    auto io2 = same.io(kvevict::sequence_event::prefill_end);
    std::vector<i64> lengths2(strided_sequence::hkv);
    io2.head_lengths = lengths2.data();
    kvevict::workspace ws2(in_place.workspace_size());
    REQUIRE(in_place.run(0, &io2, 1, &r, ws2).ok());
    CHECK(lengths2 == lengths);
    const auto moved = kvevict::hf_contiguous(same.k.data(), strided_sequence::hkv, l, strided_sequence::d, l);
    const auto copied = kvevict::hf_contiguous(dk.data(), strided_sequence::hkv, room, strided_sequence::d, room);
    for (i64 h = 0; h < strided_sequence::hkv; ++h)
      for (i64 j = 0; j < lengths[static_cast<std::size_t>(h)]; ++j)
        CHECK(std::memcmp(moved.row(h, j), copied.row(h, j), sizeof(float) * strided_sequence::d) == 0);
  }
}

// Issue 26: NaN queries are absorbed by design, but nothing told the engine.
TEST_CASE("reports count the non-finite queries, keys and scores a call scored with", "[contracts]") {
  constexpr i64 l = 40, w = 4;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  {  // SnapKV at prefill_end: the window's queries and every key
    kvevict::compressor_options opt;
    opt.model = {1, strided_sequence::hq, strided_sequence::hkv, strided_sequence::d, 0, kvevict::dtype::f32};
    kvevict::window_config wc = kvevict::presets::kvpress_snapkv();
    wc.window = w;
    opt.policy = kvevict::policy::snapkv(wc);
    opt.per_head = kvevict::budget::tokens(12);
    opt.limits.max_tokens = l;
    opt.limits.max_queries = w + 2;
    kvevict::compressor c;
    REQUIRE(kvevict::compressor::plan(opt, &c).ok());
    kvevict::workspace ws(c.workspace_size());
    kvevict::sequence_report r;
    strided_sequence clean(l, l, w + 2, 5);
    auto io = clean.io(kvevict::sequence_event::prefill_end);
    REQUIRE(c.run(0, &io, 1, &r, ws).ok());
    CHECK(r.nonfinite_queries == 0);
    CHECK(r.nonfinite_keys == 0);

    strided_sequence bad(l, l, w + 2, 5);
    const auto q = kvevict::contiguous_queries<float>(bad.q.data(), strided_sequence::hq, w + 2, strided_sequence::d,
                                                      bad.qpos.data());
    q.at(0, 0, 1) = nan;  // before the window: not read
    q.at(1, 3, 2) = inf;
    q.at(3, 5, 0) = nan;
    const auto k = kvevict::hf_contiguous(bad.k.data(), strided_sequence::hkv, l, strided_sequence::d, l);
    k.at(1, 7, 3) = nan;
    k.at(0, 39, 0) = -inf;
    io = bad.io(kvevict::sequence_event::prefill_end);
    const kvevict::status st = c.run(0, &io, 1, &r, ws);
    INFO(st.message());
    REQUIRE(st.ok());
    CHECK(r.action == kvevict::sequence_action::evicted);
    CHECK(r.nonfinite_queries == 2);
    CHECK(r.nonfinite_keys == 2);
  }
  {  // DeferKV (d = 2): the first decode step is observed: its query and its new key
    kvevict::deferkv_config dc;
    dc.window = w;
    dc.delay = 2;
    kvevict::compressor_options opt;
    opt.model = {1, strided_sequence::hq, strided_sequence::hkv, strided_sequence::d, 0, kvevict::dtype::f32};
    opt.policy = kvevict::policy::deferkv(dc);
    opt.per_head = kvevict::budget::tokens(12);
    opt.limits.max_tokens = l + 2;
    kvevict::compressor c;
    REQUIRE(kvevict::compressor::plan(opt, &c).ok());
    kvevict::workspace ws(c.workspace_size());
    std::vector<std::uint64_t> state(c.sequence_state_size() / 8 + 1);
    REQUIRE(c.reset_sequence(state.data(), state.size() * 8).ok());
    strided_sequence seq(l, l + 2, w, 8);
    seq.k[static_cast<std::size_t>(5 * strided_sequence::d)] = nan;  // head 0, token 5: counted at prefill
    auto io = seq.io(kvevict::sequence_event::prefill_end);
    io.state = state.data();
    kvevict::sequence_report r;
    REQUIRE(c.run(0, &io, 1, &r, ws).ok());
    CHECK(r.action == kvevict::sequence_action::observed);
    CHECK(r.nonfinite_keys == 1);
    CHECK(r.nonfinite_queries == 0);
    std::vector<float> dq(strided_sequence::hq * strided_sequence::d, 0.25f);
    dq[3] = inf;
    std::vector<i64> dpos{l};
    io.event = kvevict::sequence_event::decode;
    io.keys.num_tokens = io.values.num_tokens = l + 1;
    io.keys.at(1, l, 2) = nan;  // the step's new key
    io.queries =
        kvevict::contiguous_queries<const float>(dq.data(), strided_sequence::hq, 1, strided_sequence::d, dpos.data());
    const kvevict::status st = c.run(0, &io, 1, &r, ws);
    INFO(st.message());
    REQUIRE(st.ok());
    CHECK(r.action == kvevict::sequence_action::observed);
    CHECK(r.nonfinite_queries == 1);
    CHECK(r.nonfinite_keys == 1);  // only the newest key is read at a decode step
  }
  // KNorm scores a NaN key NaN and an infinite one -inf: candidates counted, the protected
  // tail (scored +inf by design) not; a clean cache counts none; a shared keep set counts
  // each layer's scores.
  for (const auto scope : {kvevict::selection_scope::per_head, kvevict::selection_scope::per_sequence}) {
    INFO("scope " << static_cast<int>(scope));
    kvevict::compressor_options opt;
    opt.model = {1, strided_sequence::hq, strided_sequence::hkv, strided_sequence::d, 0, kvevict::dtype::f32};
    opt.policy = kvevict::policy::knorm({3});
    opt.per_head = kvevict::budget::tokens(12);
    opt.scope = scope;
    opt.limits.max_tokens = l;
    kvevict::compressor c;
    REQUIRE(kvevict::compressor::plan(opt, &c).ok());
    kvevict::workspace ws(c.workspace_size());
    std::vector<std::uint64_t> state(c.sequence_state_size() / 8 + 1);
    kvevict::sequence_report r;
    for (int dirty = 0; dirty < 2; ++dirty) {
      REQUIRE(c.reset_sequence(state.data(), c.sequence_state_size()).ok());
      strided_sequence seq(l, l, w, 9);
      const auto k = kvevict::hf_contiguous(seq.k.data(), strided_sequence::hkv, l, strided_sequence::d, l);
      if (dirty == 1) {
        k.at(0, 2, 0) = nan;
        k.at(1, 5, 3) = inf;
        k.at(1, 6, 1) = -inf;
        k.at(0, l - 1, 2) = nan;  // in the protected tail of 3
      }
      auto io = seq.io(kvevict::sequence_event::prefill_end);
      io.state = c.sequence_state_size() > 0 ? state.data() : nullptr;
      std::vector<kvevict::layer_cache<float>> layers{io.cache()};
      io.layers = layers.data();
      const kvevict::status st = c.run(0, &io, 1, &r, ws);
      INFO(st.message());
      REQUIRE(st.ok());
      CHECK(r.action == kvevict::sequence_action::evicted);
      CHECK(r.nonfinite_keys == (dirty == 1 ? 4 : 0));
      CHECK(r.nonfinite_scores == (dirty == 1 ? 3 : 0));
    }
    // StreamingLLM scores its sinks +inf, kvevict's "always keep": nothing is wrong, none counted.
    opt.policy = kvevict::policy::streaming_llm({4});
    REQUIRE(kvevict::compressor::plan(opt, &c).ok());
    kvevict::workspace ws2(c.workspace_size());
    state.assign(c.sequence_state_size() / 8 + 1, 0);
    REQUIRE(c.reset_sequence(state.data(), c.sequence_state_size()).ok());
    strided_sequence clean(l, l, w, 10);
    auto io = clean.io(kvevict::sequence_event::prefill_end);
    io.state = c.sequence_state_size() > 0 ? state.data() : nullptr;
    std::vector<kvevict::layer_cache<float>> layers{io.cache()};
    io.layers = layers.data();
    REQUIRE(c.run(0, &io, 1, &r, ws2).ok());
    CHECK(r.action == kvevict::sequence_action::evicted);
    CHECK(r.nonfinite_scores == 0);
  }
}
