// Engine integration, end to end: a buffer laid out exactly as the engine lays out one
// layer (offsets written here by hand, from each engine's documented layout), then
// observation scoring (SnapKV-like, protected window) -> selection -> eviction through the
// library's factory views, checked against the double-precision reference keep-list and a
// gather of the original buffer. These are the recipes of docs/integration.md.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvevict/eviction/evict.hpp"
#include "kvevict/eviction/evict_batch.hpp"
#include "kvevict/eviction/keep_positions.hpp"
#include "kvevict/scoring/observation_scores.hpp"
#include "kvevict/selection/select.hpp"
#include "kvevict/views/layouts.hpp"
#include "reference/reference.hpp"
#include "support/compare.hpp"
#include "support/eviction_check.hpp"
#include "support/test_cache.hpp"

using kvevict::bf16;
using kvevict::fp16;

namespace {

constexpr std::int64_t kHkv = 4, kGroup = 2, kHq = kHkv * kGroup, kDim = 32, kWindow = 16, kBudget = 40;

// SnapKV as kvpress runs it: mean over the window, avg-pool k=5 counting padding, GQA mean
// after pooling; the window is protected and kept on top of the budget.
kvevict::scoring_params scoring() {
  kvevict::scoring_params p;
  p.domain = kvevict::softmax_domain::visible;
  p.window = kvevict::window_aggregation::mean;
  p.gqa = kvevict::gqa_reduction::mean;
  p.order = kvevict::gqa_order::after_pooling;
  p.pool = {kvevict::pooling_kind::avg, 5, true};
  p.protected_tail = kWindow;
  return p;
}
ref::params reference_params() {
  ref::params p;
  p.dom = ref::domain::visible;
  p.window = ref::agg::mean;
  p.reduce = ref::gqa::mean;
  p.reduce_before_pool = false;
  p.kind = ref::pool::avg;
  p.kernel = 5;
  p.count_padding = true;
  p.protected_tail = kWindow;
  return p;
}
const kvevict::selection_params kSelection{kWindow, kvevict::protected_mode::on_top_of_budget};

// One sequence's layer: dense K, V and window queries (already rounded to T).
template <class T>
struct layer {
  std::int64_t tokens = 0;
  ref::problem problem;  // q, k dense; qpos, kpos
  std::vector<double> v;
  test::test_queries<T> queries;
};

template <class T>
layer<T> make_layer(std::int64_t tokens, std::uint64_t seed, std::vector<std::int64_t> kpos = {}) {
  layer<T> l;
  l.tokens = tokens;
  ref::problem& p = l.problem;
  p.hq = kHq;
  p.hkv = kHkv;
  p.w = kWindow;
  p.l = tokens;
  p.d = kDim;
  p.q = test::rounded<T>(test::normal(static_cast<std::size_t>(kHq * kWindow * kDim), seed, 1.5));
  p.k = test::rounded<T>(test::normal(static_cast<std::size_t>(kHkv * tokens * kDim), seed + 1));
  l.v = test::rounded<T>(test::normal(static_cast<std::size_t>(kHkv * tokens * kDim), seed + 2));
  p.kpos = kpos;
  // The window: the last W prompt tokens, at their own positions.
  for (std::int64_t t = 0; t < kWindow; ++t) {
    const std::int64_t j = tokens - kWindow + t;
    p.qpos.push_back(kpos.empty() ? j : kpos[static_cast<std::size_t>(j)]);
  }
  l.queries = test::make_queries<T>(kHq, kWindow, kDim, p.q, p.qpos);
  return l;
}

// Score -> select through the library, on the engine's own K view.
template <class T>
kvevict::keep_list score_and_select(const layer<T>& l, kvevict::cache_view<T> keys, const std::int64_t* key_positions) {
  const std::int64_t L = keys.num_tokens;
  std::vector<float> scores(static_cast<std::size_t>(kHkv * L));
  const kvevict::score_view sv{scores.data(), kHkv, L, L};
  const kvevict::layer_shape shape{kHq, kHkv, kDim, L, kWindow};
  kvevict::workspace ws(kvevict::observation_scores_workspace_size(shape, scoring()));
  kvevict::observation_inputs in;
  in.key_positions = key_positions;
  kvevict::status st = kvevict::observation_scores(l.queries.view, keys, scoring(), sv, ws, in);
  INFO(st.message());
  REQUIRE(st.ok());
  kvevict::keep_list keep(kHkv, kvevict::select_capacity(kHkv, L, kvevict::budget::tokens(kBudget), kSelection));
  kvevict::workspace sws(kvevict::select_workspace_size(L));
  st = kvevict::select(sv, kvevict::budget::tokens(kBudget), kSelection, keep, sws);
  REQUIRE(st.ok());
  return keep;
}

// The library's keep-list equals the reference's wherever the reference boundary is not a
// near tie; returns it as a host keep-list for the gather checks.
template <class T>
test::host_keep check_reference(const layer<T>& l, const kvevict::keep_list& keep) {
  const std::vector<ref::vec> want = ref::scores(l.problem, reference_params());
  const std::int64_t candidates = l.tokens - kWindow;
  const std::int64_t k = kvevict::candidates_kept(kBudget, l.tokens, kSelection);
  int compared = 0;
  test::host_keep out;
  for (std::int64_t h = 0; h < kHkv; ++h) {
    out.add_head(keep.head(h));
    const ref::vec& row = want[static_cast<std::size_t>(h)];
    if (test::near_tie_at(row, candidates, k)) continue;
    INFO("head " << h);
    REQUIRE(keep.head(h) == ref::keep(row, kBudget, kWindow, false));
    ++compared;
  }
  REQUIRE(compared >= kHkv / 2);
  return out;
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

}  // namespace

TEMPLATE_TEST_CASE("integration: HF transformers contiguous [batch, Hkv, L, d]", "[integration]", float, fp16, bf16) {
  using T = TestType;
  const std::int64_t batch = 2, L = 150, seq = 1;  // compress sequence 1 of the batch
  const layer<T> l = make_layer<T>(L, 100);
  const std::vector<double> other = test::normal(static_cast<std::size_t>(kHkv * L * kDim), 7);
  auto off = [&](std::int64_t b, std::int64_t h, std::int64_t j, std::int64_t c) {
    return ((b * kHkv + h) * L + j) * kDim + c;
  };
  std::vector<T> kbuf(static_cast<std::size_t>(batch * kHkv * L * kDim)), vbuf(kbuf.size());
  for (std::int64_t h = 0; h < kHkv; ++h)
    for (std::int64_t j = 0; j < L; ++j)
      for (std::int64_t c = 0; c < kDim; ++c) {
        const std::size_t dense = static_cast<std::size_t>((h * L + j) * kDim + c);
        kbuf[static_cast<std::size_t>(off(seq, h, j, c))] = test::store<T>(l.problem.k[dense]);
        vbuf[static_cast<std::size_t>(off(seq, h, j, c))] = test::store<T>(l.v[dense]);
        kbuf[static_cast<std::size_t>(off(0, h, j, c))] = test::store<T>(other[dense]);
        vbuf[static_cast<std::size_t>(off(0, h, j, c))] = test::store<T>(-other[dense]);
      }
  const std::vector<T> kbefore = kbuf, vbefore = vbuf;

  // Engine side: views of sequence `seq` of the [batch, Hkv, L, d] tensors.
  auto keys = kvevict::hf_contiguous(kbuf.data() + seq * kHkv * L * kDim, kHkv, L, kDim);
  auto values = kvevict::hf_contiguous(vbuf.data() + seq * kHkv * L * kDim, kHkv, L, kDim);
  const kvevict::keep_list keep = score_and_select(l, keys, nullptr);
  std::vector<std::int64_t> positions(static_cast<std::size_t>(keep.view().total()));
  kvevict::eviction_result r;
  r.positions = positions.data();
  const kvevict::status st = kvevict::evict(keys, values, keep, r);  // strided: no workspace
  REQUIRE(st.ok());
  REQUIRE(r.max_length == kBudget + kWindow);  // the new cache length (uniform budget)
  REQUIRE(r.freed_blocks == 0);

  const test::host_keep want = check_reference(l, keep);
  std::vector<T> kexp = kbefore, vexp = vbefore;
  auto seq_off = [&](std::int64_t h, std::int64_t j, std::int64_t c) { return off(seq, h, j, c); };
  test::apply_expected(kexp, kbefore, want, kDim, seq_off);
  test::apply_expected(vexp, vbefore, want, kDim, seq_off);
  test::require_same_bits(kbuf, kexp);  // sequence 0 and the stale tail untouched
  test::require_same_bits(vbuf, vexp);
  REQUIRE(positions == want.indices);
}

TEMPLATE_TEST_CASE("integration: vLLM paged [num_blocks, block_size, Hkv, d] with a block table", "[integration]",
                   float, bf16) {
  using T = TestType;
  const std::int64_t L = 150, bs = 16, pool_blocks = 20, used = ceil_div(L, bs);
  const layer<T> l = make_layer<T>(L, 200);
  std::vector<std::int32_t> block_table(static_cast<std::size_t>(pool_blocks));
  std::iota(block_table.begin(), block_table.end(), 0);
  std::shuffle(block_table.begin(), block_table.end(), std::mt19937_64(5));
  block_table.resize(static_cast<std::size_t>(used));
  auto off = [&](std::int64_t h, std::int64_t j, std::int64_t c) {
    const std::int64_t block = block_table[static_cast<std::size_t>(j / bs)];
    return ((block * bs + j % bs) * kHkv + h) * kDim + c;
  };
  // Unused pool blocks hold another sequence's data; it must survive.
  std::vector<T> kpool(static_cast<std::size_t>(pool_blocks * bs * kHkv * kDim), test::sentinel<T>());
  std::vector<T> vpool(kpool.size(), test::sentinel<T>());
  for (std::int64_t h = 0; h < kHkv; ++h)
    for (std::int64_t j = 0; j < L; ++j)
      for (std::int64_t c = 0; c < kDim; ++c) {
        const std::size_t dense = static_cast<std::size_t>((h * L + j) * kDim + c);
        kpool[static_cast<std::size_t>(off(h, j, c))] = test::store<T>(l.problem.k[dense]);
        vpool[static_cast<std::size_t>(off(h, j, c))] = test::store<T>(l.v[dense]);
      }
  const std::vector<T> kbefore = kpool, vbefore = vpool;

  auto keys = kvevict::vllm_paged(kpool.data(), pool_blocks, bs, kHkv, kDim, block_table.data(), L);
  auto values = kvevict::vllm_paged(vpool.data(), pool_blocks, bs, kHkv, kDim, block_table.data(), L);
  const kvevict::keep_list keep = score_and_select(l, keys, nullptr);
  kvevict::workspace ws(kvevict::evict_workspace_size(keys, values));
  kvevict::eviction_result r;
  const kvevict::status st = kvevict::evict(keys, values, keep, r, ws);
  INFO(st.message());
  REQUIRE(st.ok());

  const test::host_keep want = check_reference(l, keep);
  std::vector<T> kexp = kbefore, vexp = vbefore;
  test::apply_expected(kexp, kbefore, want, kDim, off);
  test::apply_expected(vexp, vbefore, want, kDim, off);
  test::require_same_bits(kpool, kexp);
  test::require_same_bits(vpool, vexp);

  // Reclaiming: the trailing freed_blocks entries go back to the allocator; the sequence's
  // length becomes max_length.
  REQUIRE(r.max_length == kBudget + kWindow);
  REQUIRE(r.freed_blocks == used - ceil_div(kBudget + kWindow, bs));
  const std::vector<std::int32_t> kept_blocks(block_table.begin(), block_table.end() - r.freed_blocks);
  auto after = kvevict::vllm_paged(kpool.data(), pool_blocks, bs, kHkv, kDim, kept_blocks.data(), r.max_length);
  for (std::int64_t h = 0; h < kHkv; ++h)
    for (std::int64_t i = 0; i < r.max_length; ++i)
      REQUIRE(test::load(after.at(h, i, 3)) ==
              l.problem.k[static_cast<std::size_t>((h * L + want.at(h, i)) * kDim + 3)]);
}

TEMPLATE_TEST_CASE("integration: FlashInfer HND pages with a CSR page table, two sequences", "[integration]", float,
                   bf16) {
  using T = TestType;
  const std::int64_t page = 8, pool_pages = 40;
  const std::vector<std::int32_t> seq_lens = {150, 97};  // FlashInfer's int32, as it is
  const layer<T> layers[2] = {make_layer<T>(seq_lens[0], 300), make_layer<T>(seq_lens[1], 400)};
  // indptr / indices as FlashInfer's BatchDecodeWithPagedKVCacheWrapper takes them.
  std::vector<std::int32_t> indptr = {0}, indices(static_cast<std::size_t>(pool_pages));
  std::iota(indices.begin(), indices.end(), 0);
  std::shuffle(indices.begin(), indices.end(), std::mt19937_64(9));
  for (std::int64_t len : seq_lens) indptr.push_back(indptr.back() + static_cast<std::int32_t>(ceil_div(len, page)));
  indices.resize(static_cast<std::size_t>(indptr.back()));
  auto off = [&](std::size_t s, std::int64_t h, std::int64_t j, std::int64_t c) {
    const std::int64_t p = indices[static_cast<std::size_t>(indptr[s] + j / page)];
    return ((p * kHkv + h) * page + j % page) * kDim + c;  // HND: [pages, Hkv, page_size, d]
  };
  std::vector<T> kpool(static_cast<std::size_t>(pool_pages * kHkv * page * kDim), test::sentinel<T>());
  std::vector<T> vpool(kpool.size(), test::sentinel<T>());
  for (std::size_t s = 0; s < 2; ++s)
    for (std::int64_t h = 0; h < kHkv; ++h)
      for (std::int64_t j = 0; j < seq_lens[s]; ++j)
        for (std::int64_t c = 0; c < kDim; ++c) {
          const std::size_t dense = static_cast<std::size_t>((h * seq_lens[s] + j) * kDim + c);
          kpool[static_cast<std::size_t>(off(s, h, j, c))] = test::store<T>(layers[s].problem.k[dense]);
          vpool[static_cast<std::size_t>(off(s, h, j, c))] = test::store<T>(layers[s].v[dense]);
        }
  const std::vector<T> kbefore = kpool, vbefore = vpool;

  auto kpool_layout = kvevict::flashinfer_paged_hnd(kpool.data(), pool_pages, page, kHkv, kDim, indices.data(), 0);
  auto vpool_layout = kvevict::flashinfer_paged_hnd(vpool.data(), pool_pages, page, kHkv, kDim, indices.data(), 0);
  auto keys = kvevict::flashinfer_paged_batch(kpool_layout, 2, indptr.data(), indices.data(), seq_lens.data());
  auto values = kvevict::flashinfer_paged_batch(vpool_layout, 2, indptr.data(), indices.data(), seq_lens.data());
  // Score and select per sequence, evict the batch in one call.
  std::vector<kvevict::keep_list> keeps;
  for (std::int64_t s = 0; s < 2; ++s) keeps.push_back(score_and_select(layers[s], keys.sequence(s), nullptr));
  const kvevict::const_keep_list_view keep_views[2] = {keeps[0], keeps[1]};
  kvevict::eviction_result results[2];
  kvevict::workspace ws(kvevict::evict_batch_workspace_size(keys, values));
  const kvevict::status st = kvevict::evict_batch(keys, values, keep_views, results, ws);
  INFO(st.message());
  REQUIRE(st.ok());

  std::vector<T> kexp = kbefore, vexp = vbefore;
  for (std::size_t s = 0; s < 2; ++s) {
    const test::host_keep want = check_reference(layers[s], keeps[s]);
    auto seq_off = [&](std::int64_t h, std::int64_t j, std::int64_t c) { return off(s, h, j, c); };
    test::apply_expected(kexp, kbefore, want, kDim, seq_off);
    test::apply_expected(vexp, vbefore, want, kDim, seq_off);
    REQUIRE(results[s].max_length == kBudget + kWindow);
    REQUIRE(results[s].freed_blocks == ceil_div(seq_lens[s], page) - ceil_div(kBudget + kWindow, page));
  }
  test::require_same_bits(kpool, kexp);
  test::require_same_bits(vpool, vexp);
}

TEMPLATE_TEST_CASE("integration: llama.cpp cells, K rows and transposed V", "[integration]", float, fp16) {
  using T = TestType;
  const std::int64_t L = 150, kv_size = 176;  // cells [L, kv_size) are free
  std::vector<std::int64_t> cell_pos(static_cast<std::size_t>(L));
  std::iota(cell_pos.begin(), cell_pos.end(), 0);  // cell i holds the token at position i
  const layer<T> l = make_layer<T>(L, 500, cell_pos);
  // K: ggml tensor [n_embd_k_gqa, kv_size]: one row of Hkv*d per cell.
  // V (no flash attention): [kv_size, n_embd_v_gqa] transposed, (cell i, channel c) at c*kv_size + i.
  auto koff = [&](std::int64_t h, std::int64_t i, std::int64_t c) { return i * (kHkv * kDim) + h * kDim + c; };
  auto voff = [&](std::int64_t h, std::int64_t i, std::int64_t c) { return (h * kDim + c) * kv_size + i; };
  std::vector<T> kbuf(static_cast<std::size_t>(kv_size * kHkv * kDim), test::sentinel<T>());
  std::vector<T> vbuf(kbuf.size(), test::sentinel<T>());
  for (std::int64_t h = 0; h < kHkv; ++h)
    for (std::int64_t j = 0; j < L; ++j)
      for (std::int64_t c = 0; c < kDim; ++c) {
        const std::size_t dense = static_cast<std::size_t>((h * L + j) * kDim + c);
        kbuf[static_cast<std::size_t>(koff(h, j, c))] = test::store<T>(l.problem.k[dense]);
        vbuf[static_cast<std::size_t>(voff(h, j, c))] = test::store<T>(l.v[dense]);
      }
  const std::vector<T> kbefore = kbuf, vbefore = vbuf;

  auto keys = kvevict::llamacpp_k(kbuf.data(), kHkv, L, kDim);
  auto values = kvevict::llamacpp_v_transposed(vbuf.data(), kv_size, kHkv, L, kDim);
  const kvevict::keep_list keep = score_and_select(l, keys, cell_pos.data());
  const test::host_keep want = check_reference(l, keep);

  // Keep-list-only mode: the engine learns the kept positions without moving anything.
  std::vector<std::int64_t> only(want.indices.size());
  REQUIRE(kvevict::keep_list_positions(keep, L, cell_pos.data(), only.data()).ok());
  REQUIRE(test::checksum(kbuf) == test::checksum(kbefore));

  std::vector<std::int64_t> positions(want.indices.size()), lengths(kHkv);
  kvevict::eviction_result r;
  r.positions = positions.data();
  r.head_lengths = lengths.data();
  const kvevict::status st = kvevict::evict(keys, values, keep, r, {}, cell_pos.data());
  INFO(st.message());
  REQUIRE(st.ok());
  REQUIRE(positions == only);
  for (std::size_t k = 0; k < positions.size(); ++k)
    REQUIRE(positions[k] == cell_pos[static_cast<std::size_t>(want.indices[k])]);
  for (std::int64_t len : lengths) REQUIRE(len == kBudget + kWindow);
  // RoPE positions are untouched: the next token still decodes at position L.
  REQUIRE(*std::max_element(positions.begin(), positions.end()) == L - 1);

  std::vector<T> kexp = kbefore, vexp = vbefore;
  test::apply_expected(kexp, kbefore, want, kDim, koff);
  test::apply_expected(vexp, vbefore, want, kDim, voff);
  test::require_same_bits(kbuf, kexp);  // free cells [L, kv_size) untouched
  test::require_same_bits(vbuf, vexp);
}
