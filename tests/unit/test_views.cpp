// Every view factory against offsets computed by hand from each engine's documented layout.
#include <catch2/catch.hpp>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "kvevict/views/batch_cache_view.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/layouts.hpp"
#include "kvevict/views/probe.hpp"
#include "kvevict/views/query_view.hpp"
#include "support/test_cache.hpp"

using kvevict::bf16;
using kvevict::fp16;

namespace {
struct shape {
  std::int64_t heads, tokens, dim;
};
const shape kShapes[] = {{1, 1, 1}, {2, 7, 4}, {8, 33, 64}, {3, 130, 128}};
}  // namespace

TEST_CASE("views are small trivially copyable values", "[views]") {
  STATIC_REQUIRE(std::is_trivially_copyable<kvevict::cache_view<float>>::value);
  STATIC_REQUIRE(std::is_trivially_copyable<kvevict::cache_view<const bf16>>::value);
  STATIC_REQUIRE(std::is_trivially_copyable<kvevict::batch_cache_view<fp16>>::value);
  STATIC_REQUIRE(std::is_trivially_copyable<kvevict::query_view<const float>>::value);
  STATIC_REQUIRE(std::is_standard_layout<kvevict::cache_view<float>>::value);
  // A mutable view converts to a read-only one, not the other way round.
  STATIC_REQUIRE(std::is_convertible<kvevict::cache_view<bf16>, kvevict::cache_view<const bf16>>::value);
  STATIC_REQUIRE(!std::is_convertible<kvevict::cache_view<const bf16>, kvevict::cache_view<bf16>>::value);
}

TEST_CASE("HF contiguous [batch, Hkv, max_len, d]", "[views]") {
  for (const shape& s : kShapes) {
    const std::int64_t max_len = s.tokens + 5;
    std::vector<float> buf(static_cast<std::size_t>(2 * s.heads * max_len * s.dim));
    const std::int64_t lens[2] = {s.tokens, max_len};
    auto batch = kvevict::hf_contiguous_batch(buf.data(), 2, s.heads, max_len, s.dim, lens);
    for (std::int64_t b = 0; b < 2; ++b) {
      auto v = batch.sequence(b);
      REQUIRE(v.num_tokens == lens[b]);
      for (std::int64_t h = 0; h < s.heads; ++h)
        for (std::int64_t j = 0; j < v.num_tokens; ++j)
          for (std::int64_t c = 0; c < s.dim; c += 3)
            REQUIRE(&v.at(h, j, c) - buf.data() == ((b * s.heads + h) * max_len + j) * s.dim + c);
    }
    auto single = kvevict::hf_contiguous(buf.data(), s.heads, s.tokens, s.dim);
    REQUIRE(single.offset(s.heads - 1, s.tokens - 1, s.dim - 1) == s.heads * s.tokens * s.dim - 1);
  }
}

TEST_CASE("paged NHD and HND (FlashInfer, vLLM)", "[views]") {
  const std::int64_t block_sizes[] = {1, 4, 16};
  for (const shape& s : kShapes) {
    for (std::int64_t bs : block_sizes) {
      const std::int64_t used = (s.tokens + bs - 1) / bs, pool_blocks = used + 3;
      std::vector<std::int32_t> table;
      for (std::int64_t i = 0; i < used; ++i) table.push_back(static_cast<std::int32_t>((i * 7 + 2) % pool_blocks));
      std::vector<bf16> pool(static_cast<std::size_t>(pool_blocks * bs * s.heads * s.dim));
      const auto nhd =
          kvevict::flashinfer_paged_nhd(pool.data(), pool_blocks, bs, s.heads, s.dim, table.data(), s.tokens);
      const auto hnd =
          kvevict::flashinfer_paged_hnd(pool.data(), pool_blocks, bs, s.heads, s.dim, table.data(), s.tokens);
      const auto vllm = kvevict::vllm_paged(pool.data(), pool_blocks, bs, s.heads, s.dim, table.data(), s.tokens);
      const auto vllm_hnd =
          kvevict::vllm_paged_hnd(pool.data(), pool_blocks, bs, s.heads, s.dim, table.data(), s.tokens);
      REQUIRE(nhd.num_used_blocks() == used);
      for (std::int64_t h = 0; h < s.heads; ++h)
        for (std::int64_t j = 0; j < s.tokens; ++j)
          for (std::int64_t c = 0; c < s.dim; c += 5) {
            const std::int64_t page = table[static_cast<std::size_t>(j / bs)], r = j % bs;
            const std::int64_t want_nhd = ((page * bs + r) * s.heads + h) * s.dim + c;
            const std::int64_t want_hnd = ((page * s.heads + h) * bs + r) * s.dim + c;
            REQUIRE(nhd.offset(h, j, c) == want_nhd);
            REQUIRE(vllm.offset(h, j, c) == want_nhd);
            REQUIRE(hnd.offset(h, j, c) == want_hnd);
            REQUIRE(vllm_hnd.offset(h, j, c) == want_hnd);
          }
    }
  }
}

TEST_CASE("paged ragged batches: vLLM 2-D block table and FlashInfer CSR", "[views]") {
  const std::int64_t heads = 2, dim = 8, bs = 4, pool_blocks = 12;
  std::vector<fp16> pool(static_cast<std::size_t>(pool_blocks * bs * heads * dim));
  const auto layout = kvevict::paged_nhd(pool.data(), pool_blocks, bs, heads, dim, nullptr, 0);
  const std::int64_t lens[3] = {5, 0, 11};
  // vLLM: [num_seqs, max_blocks=3]
  const std::int32_t tables[9] = {3, 9, -1, -1, -1, -1, 0, 11, 4};
  auto vb = kvevict::vllm_paged_batch(layout, 3, tables, 3, lens);
  // FlashInfer CSR: seq 0 pages {3, 9}, seq 1 none, seq 2 {0, 11, 4}
  const std::int32_t indptr[4] = {0, 2, 2, 5};
  const std::int32_t indices[5] = {3, 9, 0, 11, 4};
  auto fb = kvevict::flashinfer_paged_batch(layout, 3, indptr, indices, lens);
  for (std::int64_t s = 0; s < 3; ++s) {
    const auto a = vb.sequence(s), b = fb.sequence(s);
    REQUIRE(a.num_tokens == lens[s]);
    REQUIRE(b.num_tokens == lens[s]);
    for (std::int64_t j = 0; j < lens[s]; ++j)
      for (std::int64_t h = 0; h < heads; ++h) {
        const std::int64_t page = tables[s * 3 + j / bs];
        const std::int64_t want = ((page * bs + j % bs) * heads + h) * dim + 1;
        REQUIRE(a.offset(h, j, 1) == want);
        REQUIRE(b.offset(h, j, 1) == want);
      }
  }
}

TEST_CASE("index arrays in int32 or int64: positions, block tables, CSR offsets", "[views]") {
  STATIC_REQUIRE(std::is_trivially_copyable<kvevict::index_ptr>::value);
  const std::int32_t narrow[4] = {5, -1, 7, 2147483647};
  const std::int64_t wide[4] = {5, -1, 7, std::int64_t{1} << 40};
  const kvevict::index_ptr n = narrow, w = wide, none = nullptr;
  REQUIRE(n.width() == 4);
  REQUIRE(w.width() == 8);
  REQUIRE(none.width() == 0);
  REQUIRE(none == nullptr);
  REQUIRE(!none);
  REQUIRE(n != nullptr);
  REQUIRE(n.int32() == narrow);
  REQUIRE(n.int64() == nullptr);
  REQUIRE(w.int64() == wide);
  for (std::int64_t i = 0; i < 4; ++i) {
    REQUIRE(n[i] == narrow[i]);  // widened exactly, sign included
    REQUIRE(w[i] == wide[i]);
  }
  REQUIRE((n + 2)[1] == 2147483647);
  REQUIRE((w + 3)[-1] == 7);
  kvevict::index_ptr m = n;
  m += 1;
  REQUIRE(m == kvevict::index_ptr(narrow + 1));
  REQUIRE(m != n);
  // Same address, other width: not the same indices.
  REQUIRE(kvevict::index_ptr(reinterpret_cast<const std::int64_t*>(narrow)) != n);

  // The same batch through int32 and int64 tables and CSR offsets.
  const std::int64_t heads = 2, dim = 8, bs = 4, pool_blocks = 12;
  std::vector<float> pool(static_cast<std::size_t>(pool_blocks * bs * heads * dim));
  const auto layout = kvevict::paged_nhd(pool.data(), pool_blocks, bs, heads, dim, nullptr, 0);
  const std::int64_t lens[3] = {5, 0, 11};
  const std::int32_t tables32[9] = {3, 9, -1, -1, -1, -1, 0, 11, 4};
  const std::int64_t tables64[9] = {3, 9, -1, -1, -1, -1, 0, 11, 4};
  const std::int64_t indptr64[4] = {0, 2, 2, 5};
  const std::int64_t indices64[5] = {3, 9, 0, 11, 4};
  const auto a = kvevict::vllm_paged_batch(layout, 3, tables32, 3, lens);
  const auto b = kvevict::vllm_paged_batch(layout, 3, tables64, 3, lens);
  const auto c = kvevict::flashinfer_paged_batch(layout, 3, indptr64, indices64, lens);
  for (std::int64_t s = 0; s < 3; ++s)
    for (std::int64_t j = 0; j < lens[s]; ++j)
      for (std::int64_t h = 0; h < heads; ++h) {
        REQUIRE(b.sequence(s).offset(h, j, 3) == a.sequence(s).offset(h, j, 3));
        REQUIRE(c.sequence(s).offset(h, j, 3) == a.sequence(s).offset(h, j, 3));
      }
  // Queries with int32 positions (llama.cpp's llama_pos).
  std::vector<float> q(2 * 3 * 8);
  const std::int32_t qpos[3] = {4, 9, 10};
  const auto qv = kvevict::contiguous_queries(q.data(), 2, 3, 8, qpos);
  REQUIRE(qv.positions[2] == 10);
}

TEST_CASE("TensorRT-LLM blocks [Hkv][tokens_per_block][d] with separate K and V offsets", "[views]") {
  const std::int64_t heads = 3, dim = 16, tpb = 8, tokens = 19, pool_blocks = 8;
  std::vector<float> pool(static_cast<std::size_t>(pool_blocks * heads * tpb * dim));
  // TensorRT-LLM interleaves a sequence's K and V blocks in one pool.
  const std::int32_t k_offsets[3] = {0, 2, 6};
  const std::int32_t v_offsets[3] = {1, 3, 7};
  const auto k = kvevict::trtllm_paged(pool.data(), pool_blocks, tpb, heads, dim, k_offsets, tokens);
  const auto v = kvevict::trtllm_paged(pool.data(), pool_blocks, tpb, heads, dim, v_offsets, tokens);
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t j = 0; j < tokens; ++j)
      for (std::int64_t c = 0; c < dim; c += 7) {
        REQUIRE(k.offset(h, j, c) == ((k_offsets[j / tpb] * heads + h) * tpb + j % tpb) * dim + c);
        REQUIRE(v.offset(h, j, c) == ((v_offsets[j / tpb] * heads + h) * tpb + j % tpb) * dim + c);
      }
}

TEST_CASE("llama.cpp K rows and transposed V", "[views]") {
  for (const shape& s : kShapes) {
    const std::int64_t kv_size = s.tokens + 9;  // the cell buffer is larger than the sequence
    const std::int64_t n_embd = s.heads * s.dim;
    std::vector<fp16> kbuf(static_cast<std::size_t>(kv_size * (n_embd + 2)));
    std::vector<fp16> vbuf(static_cast<std::size_t>(kv_size * n_embd));
    const auto k = kvevict::llamacpp_k(kbuf.data(), s.heads, s.tokens, s.dim);
    const auto kpad = kvevict::llamacpp_k(kbuf.data(), s.heads, s.tokens, s.dim, n_embd + 2);
    const auto vt = kvevict::llamacpp_v_transposed(vbuf.data(), kv_size, s.heads, s.tokens, s.dim);
    const auto v = kvevict::llamacpp_v(vbuf.data(), s.heads, s.tokens, s.dim);
    for (std::int64_t h = 0; h < s.heads; ++h)
      for (std::int64_t j = 0; j < s.tokens; ++j)
        for (std::int64_t c = 0; c < s.dim; c += 3) {
          const std::int64_t channel = h * s.dim + c;
          REQUIRE(k.offset(h, j, c) == j * n_embd + channel);
          REQUIRE(v.offset(h, j, c) == j * n_embd + channel);
          REQUIRE(kpad.offset(h, j, c) == j * (n_embd + 2) + channel);
          REQUIRE(vt.offset(h, j, c) == channel * kv_size + j);
        }
  }
}

TEST_CASE("query views: [Hq, W, d] and token-major [W, Hq, d]", "[views]") {
  const std::int64_t hq = 8, w = 5, d = 16;
  std::vector<float> buf(static_cast<std::size_t>(hq * w * d));
  std::vector<std::int64_t> pos = {10, 11, 12, 13, 14};
  const auto a = kvevict::contiguous_queries(buf.data(), hq, w, d, pos.data());
  const auto b = kvevict::token_major_queries(buf.data(), hq, w, d, pos.data());
  for (std::int64_t q = 0; q < hq; ++q)
    for (std::int64_t t = 0; t < w; ++t) {
      REQUIRE(a.offset(q, t, 3) == (q * w + t) * d + 3);
      REQUIRE(b.offset(q, t, 3) == (t * hq + q) * d + 3);
    }
  kvevict::query_view<const float> ro = a;
  REQUIRE(ro.positions[4] == 14);
}

TEST_CASE("probe_address: the address each layout factory computes, and null outside the view", "[views]") {
  // Every layout of the test caches against the test's own flat indexing of its buffer.
  for (test::layout kind : test::kAllLayouts) {
    INFO(test::name(kind));
    const std::int64_t heads = 3, tokens = 21, dim = 5;
    auto c = test::make_cache<kvevict::bf16>(kind, heads, tokens, dim,
                                             test::normal(static_cast<std::size_t>(heads * tokens * dim), 5), 4, 9);
    const kvevict::cache_view<kvevict::bf16>& v = c.view;
    for (std::int64_t j = 0; j < tokens; ++j)
      for (std::int64_t h = 0; h < heads; ++h)
        for (std::int64_t ch = 0; ch < dim; ++ch)
          REQUIRE(kvevict::probe_address(v, j, h, ch) == c.buffer.data() + c.offset(h, j, ch));
    CHECK(kvevict::probe_address(v, tokens, 0, 0) == nullptr);
    CHECK(kvevict::probe_address(v, -1, 0, 0) == nullptr);
    CHECK(kvevict::probe_address(v, 0, heads, 0) == nullptr);
    CHECK(kvevict::probe_address(v, 0, 0, dim) == nullptr);
    CHECK(kvevict::probe_address(v, 0, 0, -1) == nullptr);
    if (v.is_paged() && v.num_pool_blocks > 0) {  // a table entry outside the pool
      c.set_table(0, static_cast<std::int32_t>(v.num_pool_blocks));
      CHECK(kvevict::probe_address(c.view, 0, 0, 0) == nullptr);
      c.set_table(0, -1);
      CHECK(kvevict::probe_address(c.view, 0, 0, 0) == nullptr);
    }
  }
  // The two block orders of a packed pool have the same extents; the probe tells them apart.
  std::vector<float> pool(4 * 2 * 8 * 2 * 3, 0.0f);
  const std::int32_t table[] = {2, 0};
  const auto hnd = kvevict::vllm_packed_kv(pool.data(), 4, 8, 2, 3, table, 10, kvevict::block_order::hnd);
  const auto nhd = kvevict::vllm_packed_kv(pool.data(), 4, 8, 2, 3, table, 10, kvevict::block_order::nhd);
  CHECK(hnd.keys.num_heads == nhd.keys.num_heads);
  CHECK(hnd.keys.num_tokens == nhd.keys.num_tokens);
  CHECK(kvevict::probe_address(hnd.keys, 1, 1, 0) == pool.data() + ((2 * 2 + 1) * 8 + 1) * 6);
  CHECK(kvevict::probe_address(nhd.keys, 1, 1, 0) == pool.data() + ((2 * 8 + 1) * 2 + 1) * 6);
  CHECK(kvevict::probe_address(hnd.values, 1, 1, 0) == pool.data() + ((2 * 2 + 1) * 8 + 1) * 6 + 3);
}
