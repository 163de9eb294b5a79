// Ragged-batch eviction: HF padded batches, vLLM 2-D block tables and FlashInfer CSR page
// tables, each laid out by hand. Every sequence is validated before any moves: one bad
// keep-list (or a block shared between sequences) leaves the whole batch as it was.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvevict/eviction/evict_batch.hpp"
#include "kvevict/views/layouts.hpp"
#include "support/eviction_check.hpp"
#include "support/test_cache.hpp"

using kvevict::bf16;
using kvevict::fp16;

namespace {

using offset_fn = std::function<std::int64_t(std::int64_t s, std::int64_t h, std::int64_t j, std::int64_t c)>;

const std::vector<std::int64_t> kSeqLens = {20, 7, 0, 13};
constexpr std::int64_t kHeads = 2, kMaxLen = 20, kDimK = 6, kDimV = 4, kBlock = 4;

std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

template <class T>
std::vector<T> random_buffer(std::size_t n, std::uint64_t seed) {
  const std::vector<double> v = test::normal(n, seed);
  std::vector<T> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = test::store<T>(v[i]);
  return out;
}

std::vector<test::host_keep> random_keeps(std::uint64_t seed) {
  std::vector<test::host_keep> keeps;
  for (std::size_t s = 0; s < kSeqLens.size(); ++s) keeps.push_back(test::random_keep(kHeads, kSeqLens[s], seed + s));
  return keeps;
}

std::vector<kvevict::const_keep_list_view> views_of(const std::vector<test::host_keep>& keeps) {
  std::vector<kvevict::const_keep_list_view> v;
  for (const auto& k : keeps) v.push_back(k.view());
  return v;
}

// A block table over `pool_blocks` with distinct shuffled ids for every used block.
std::vector<std::int32_t> shuffled_ids(std::int64_t pool_blocks, std::uint64_t seed) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(pool_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  return ids;
}

kvevict::executor reverse_executor() {
  kvevict::executor exec;
  exec.num_workers = 3;
  exec.parallel_for = +[](void*, std::int64_t n, kvevict::task_fn fn, void* arg) {
    for (std::int64_t i = n - 1; i >= 0; --i) fn(arg, i, static_cast<int>(i % 3));
  };
  return exec;
}

// Runs evict_batch and checks every buffer against the expected state and every result.
template <class T>
void check_batch(kvevict::batch_cache_view<T> kb, kvevict::batch_cache_view<T> vb, std::vector<T>& kbuf,
                 std::vector<T>& vbuf, const offset_fn& koff, const offset_fn& voff, bool paged, bool parallel,
                 std::uint64_t seed) {
  const std::vector<test::host_keep> keeps = random_keeps(seed);
  const auto keep_views = views_of(keeps);
  const std::vector<T> kbefore = kbuf, vbefore = vbuf;
  std::vector<std::vector<std::int64_t>> lengths, positions;
  std::vector<kvevict::eviction_result> results(kSeqLens.size());
  std::vector<std::vector<std::int64_t>> kpos(kSeqLens.size());
  std::vector<std::vector<std::int32_t>> kpos32(kSeqLens.size());  // int32 positions, as llama.cpp keeps them
  std::vector<kvevict::index_ptr> kpos_ptrs;
  for (std::size_t s = 0; s < kSeqLens.size(); ++s) {
    lengths.emplace_back(kHeads, -1);
    positions.emplace_back(keeps[s].indices.size(), -1);
    results[s].head_lengths = lengths[s].data();
    results[s].positions = positions[s].data();
    for (std::int64_t j = 0; j < kSeqLens[s]; ++j) kpos[s].push_back(100 * static_cast<std::int64_t>(s) + 2 * j);
    for (const std::int64_t p : kpos[s]) kpos32[s].push_back(static_cast<std::int32_t>(p));
    // One sequence at positions j, one with int32 positions, the others int64.
    kpos_ptrs.push_back(s == 1 ? kvevict::index_ptr{} : s == 3 ? kvevict::index_ptr{kpos32[s].data()} : kpos[s].data());
  }
  const kvevict::executor exec = parallel ? reverse_executor() : kvevict::executor{};
  const std::size_t ws_size = kvevict::evict_batch_workspace_size(kb, vb, exec);
  if (!paged) REQUIRE(ws_size == 0);
  kvevict::workspace ws(ws_size);
  const kvevict::status st =
      kvevict::evict_batch(kb, vb, keep_views.data(), results.data(), ws, kpos_ptrs.data(), exec);
  INFO(st.message());
  REQUIRE(st.ok());

  std::vector<T> kexp = kbefore, vexp = vbefore;
  for (std::size_t s = 0; s < kSeqLens.size(); ++s) {
    const std::int64_t si = static_cast<std::int64_t>(s);
    test::apply_expected(kexp, kbefore, keeps[s], kDimK,
                         [&](std::int64_t h, std::int64_t j, std::int64_t c) { return koff(si, h, j, c); });
    test::apply_expected(vexp, vbefore, keeps[s], kDimV,
                         [&](std::int64_t h, std::int64_t j, std::int64_t c) { return voff(si, h, j, c); });
    for (std::int64_t h = 0; h < kHeads; ++h) REQUIRE(lengths[s][static_cast<std::size_t>(h)] == keeps[s].size(h));
    for (std::size_t k = 0; k < keeps[s].indices.size(); ++k) {
      const std::int64_t j = keeps[s].indices[k];
      REQUIRE(positions[s][k] == (s == 1 ? j : kpos[s][static_cast<std::size_t>(j)]));
    }
    REQUIRE(results[s].max_length == keeps[s].max_size());
    REQUIRE(results[s].freed_blocks ==
            (paged ? ceil_div(kSeqLens[s], kBlock) - ceil_div(results[s].max_length, kBlock) : 0));
  }
  test::require_same_bits(kbuf, kexp);
  test::require_same_bits(vbuf, vexp);
}

// Runs evict_batch expecting a rejection and an untouched batch.
template <class T>
void expect_batch_rejected(kvevict::batch_cache_view<T> kb, kvevict::batch_cache_view<T> vb,
                           const std::vector<kvevict::const_keep_list_view>& keeps, const std::vector<T>& kbuf,
                           const std::vector<T>& vbuf, const char* argument, kvevict::errc code) {
  const std::uint64_t k0 = test::checksum(kbuf), v0 = test::checksum(vbuf);
  std::vector<kvevict::eviction_result> results(keeps.size());
  for (auto& r : results) r.max_length = -9;
  kvevict::workspace ws(kvevict::evict_batch_workspace_size(kb, vb));
  const kvevict::status st = kvevict::evict_batch(kb, vb, keeps.data(), results.data(), ws);
  INFO(st.message());
  REQUIRE_FALSE(st.ok());
  CHECK(st.code() == code);
  CHECK(std::string(st.argument()) == argument);
  REQUIRE(test::checksum(kbuf) == k0);
  REQUIRE(test::checksum(vbuf) == v0);
  for (const auto& r : results) REQUIRE(r.max_length == -9);
}

}  // namespace

TEMPLATE_TEST_CASE("evict_batch: HF padded batch [batch, Hkv, max_len, d]", "[eviction]", float, fp16, bf16) {
  const std::int64_t S = static_cast<std::int64_t>(kSeqLens.size());
  for (int rep = 0; rep < 2; ++rep) {
    std::vector<TestType> kbuf = random_buffer<TestType>(static_cast<std::size_t>(S * kHeads * kMaxLen * kDimK), 1);
    std::vector<TestType> vbuf = random_buffer<TestType>(static_cast<std::size_t>(S * kHeads * kMaxLen * kDimV), 2);
    const offset_fn koff = [](std::int64_t s, std::int64_t h, std::int64_t j, std::int64_t c) {
      return ((s * kHeads + h) * kMaxLen + j) * kDimK + c;
    };
    const offset_fn voff = [](std::int64_t s, std::int64_t h, std::int64_t j, std::int64_t c) {
      return ((s * kHeads + h) * kMaxLen + j) * kDimV + c;
    };
    auto kb = kvevict::hf_contiguous_batch(kbuf.data(), S, kHeads, kMaxLen, kDimK, kSeqLens.data());
    auto vb = kvevict::hf_contiguous_batch(vbuf.data(), S, kHeads, kMaxLen, kDimV, kSeqLens.data());
    check_batch(kb, vb, kbuf, vbuf, koff, voff, false, rep == 1, 10 + static_cast<std::uint64_t>(rep));
  }
}

TEMPLATE_TEST_CASE("evict_batch: vLLM paged batch with a 2-D block table", "[eviction]", float, bf16) {
  const std::int64_t S = static_cast<std::int64_t>(kSeqLens.size()), max_blocks = 6, pool_blocks = 24;
  for (int rep = 0; rep < 2; ++rep) {
    // [num_seqs, max_blocks] table; entries past a sequence's used blocks are -1 and never read.
    std::vector<std::int32_t> table(static_cast<std::size_t>(S * max_blocks), -1);
    const std::vector<std::int32_t> ids = shuffled_ids(pool_blocks, 3 + static_cast<std::uint64_t>(rep));
    std::size_t next = 0;
    for (std::int64_t s = 0; s < S; ++s)
      for (std::int64_t b = 0; b < ceil_div(kSeqLens[static_cast<std::size_t>(s)], kBlock); ++b)
        table[static_cast<std::size_t>(s * max_blocks + b)] = ids[next++];
    std::vector<TestType> kpool =
        random_buffer<TestType>(static_cast<std::size_t>(pool_blocks * kBlock * kHeads * kDimK), 4);
    std::vector<TestType> vpool =
        random_buffer<TestType>(static_cast<std::size_t>(pool_blocks * kBlock * kHeads * kDimV), 5);
    auto block_of = [&table](std::int64_t s, std::int64_t j) {
      return static_cast<std::int64_t>(table[static_cast<std::size_t>(s * max_blocks + j / kBlock)]);
    };
    const offset_fn koff = [&](std::int64_t s, std::int64_t h, std::int64_t j, std::int64_t c) {
      return ((block_of(s, j) * kBlock + j % kBlock) * kHeads + h) * kDimK + c;
    };
    const offset_fn voff = [&](std::int64_t s, std::int64_t h, std::int64_t j, std::int64_t c) {
      return ((block_of(s, j) * kBlock + j % kBlock) * kHeads + h) * kDimV + c;
    };
    auto kb = kvevict::vllm_paged_batch(
        kvevict::vllm_paged(kpool.data(), pool_blocks, kBlock, kHeads, kDimK, table.data(), 0), S, table.data(),
        max_blocks, kSeqLens.data());
    auto vb = kvevict::vllm_paged_batch(
        kvevict::vllm_paged(vpool.data(), pool_blocks, kBlock, kHeads, kDimV, table.data(), 0), S, table.data(),
        max_blocks, kSeqLens.data());
    check_batch(kb, vb, kpool, vpool, koff, voff, true, rep == 1, 20 + static_cast<std::uint64_t>(rep));
  }
}

TEMPLATE_TEST_CASE("evict_batch: FlashInfer HND batch with a CSR page table", "[eviction]", float, fp16) {
  const std::int64_t S = static_cast<std::int64_t>(kSeqLens.size()), pool_blocks = 16;
  std::vector<std::int32_t> indptr = {0};
  std::vector<std::int32_t> indices;
  const std::vector<std::int32_t> ids = shuffled_ids(pool_blocks, 6);
  for (std::int64_t s = 0; s < S; ++s) {
    for (std::int64_t b = 0; b < ceil_div(kSeqLens[static_cast<std::size_t>(s)], kBlock); ++b)
      indices.push_back(ids[indices.size()]);
    indptr.push_back(static_cast<std::int32_t>(indices.size()));
  }
  std::vector<TestType> kpool =
      random_buffer<TestType>(static_cast<std::size_t>(pool_blocks * kHeads * kBlock * kDimK), 7);
  std::vector<TestType> vpool =
      random_buffer<TestType>(static_cast<std::size_t>(pool_blocks * kHeads * kBlock * kDimV), 8);
  auto block_of = [&](std::int64_t s, std::int64_t j) {
    return static_cast<std::int64_t>(
        indices[static_cast<std::size_t>(indptr[static_cast<std::size_t>(s)] + j / kBlock)]);
  };
  const offset_fn koff = [&](std::int64_t s, std::int64_t h, std::int64_t j, std::int64_t c) {
    return ((block_of(s, j) * kHeads + h) * kBlock + j % kBlock) * kDimK + c;
  };
  const offset_fn voff = [&](std::int64_t s, std::int64_t h, std::int64_t j, std::int64_t c) {
    return ((block_of(s, j) * kHeads + h) * kBlock + j % kBlock) * kDimV + c;
  };
  auto kb = kvevict::flashinfer_paged_batch(
      kvevict::flashinfer_paged_hnd(kpool.data(), pool_blocks, kBlock, kHeads, kDimK, indices.data(), 0), S,
      indptr.data(), indices.data(), kSeqLens.data());
  auto vb = kvevict::flashinfer_paged_batch(
      kvevict::flashinfer_paged_hnd(vpool.data(), pool_blocks, kBlock, kHeads, kDimV, indices.data(), 0), S,
      indptr.data(), indices.data(), kSeqLens.data());
  check_batch(kb, vb, kpool, vpool, koff, voff, true, false, 30);
  check_batch(kb, vb, kpool, vpool, koff, voff, true, true, 31);
}

TEST_CASE("evict_batch validates every sequence before moving any", "[eviction][errors]") {
  using kvevict::errc;
  const std::int64_t S = static_cast<std::int64_t>(kSeqLens.size()), max_blocks = 6, pool_blocks = 24;

  SECTION("HF padded batch") {
    std::vector<bf16> kbuf = random_buffer<bf16>(static_cast<std::size_t>(S * kHeads * kMaxLen * kDimK), 1);
    std::vector<bf16> vbuf = random_buffer<bf16>(static_cast<std::size_t>(S * kHeads * kMaxLen * kDimV), 2);
    auto kb = kvevict::hf_contiguous_batch(kbuf.data(), S, kHeads, kMaxLen, kDimK, kSeqLens.data());
    auto vb = kvevict::hf_contiguous_batch(vbuf.data(), S, kHeads, kMaxLen, kDimV, kSeqLens.data());
    std::vector<test::host_keep> keeps = random_keeps(50);
    keeps[3].indices.assign({2, 1, 5, 6});  // the last sequence's keep-list is unsorted
    keeps[3].offsets.assign({0, 2, 4});
    expect_batch_rejected(kb, vb, views_of(keeps), kbuf, vbuf, "keeps[3].indices", errc::invalid_keep_list);

    keeps = random_keeps(51);
    keeps[3].offsets.assign({0, 1, 2});
    keeps[3].indices.assign({4, kSeqLens[3]});  // past the last sequence's length
    expect_batch_rejected(kb, vb, views_of(keeps), kbuf, vbuf, "keeps[3].indices", errc::invalid_keep_list);

    keeps = random_keeps(52);
    std::vector<std::int64_t> other_lens = kSeqLens;
    other_lens[1] += 1;
    auto vb_other = kvevict::hf_contiguous_batch(vbuf.data(), S, kHeads, kMaxLen, kDimV, other_lens.data());
    expect_batch_rejected(kb, vb_other, views_of(keeps), kbuf, vbuf, "values.seq_lens[1]", errc::invalid_shape);

    auto vb_short = vb;
    vb_short.num_seqs = S - 1;
    expect_batch_rejected(kb, vb_short, views_of(keeps), kbuf, vbuf, "values.num_seqs", errc::invalid_shape);

    auto kb_overlap = kb;
    kb_overlap.seq_stride = kHeads * kMaxLen * kDimK - 1;  // sequences overlap
    expect_batch_rejected(kb_overlap, vb, views_of(keeps), kbuf, vbuf, "keys.seq_stride", errc::invalid_stride);

    auto kb_long = kb;
    std::vector<std::int64_t> long_lens = kSeqLens;
    long_lens[2] = kMaxLen + 1;  // spills into the next head
    kb_long.seq_lens = long_lens.data();
    auto vb_long = vb;
    vb_long.seq_lens = long_lens.data();
    expect_batch_rejected(kb_long, vb_long, views_of(keeps), kbuf, vbuf, "keys.head_stride", errc::invalid_stride);

    const kvevict::status st = kvevict::evict_batch(kb, vb, nullptr, nullptr);
    REQUIRE(std::string(st.argument()) == "keeps");
  }

  SECTION("vLLM paged batch") {
    std::vector<std::int32_t> table(static_cast<std::size_t>(S * max_blocks), -1);
    const std::vector<std::int32_t> ids = shuffled_ids(pool_blocks, 9);
    std::size_t next = 0;
    for (std::int64_t s = 0; s < S; ++s)
      for (std::int64_t b = 0; b < ceil_div(kSeqLens[static_cast<std::size_t>(s)], kBlock); ++b)
        table[static_cast<std::size_t>(s * max_blocks + b)] = ids[next++];
    std::vector<float> kpool = random_buffer<float>(static_cast<std::size_t>(pool_blocks * kBlock * kHeads * kDimK), 4);
    std::vector<float> vpool = random_buffer<float>(static_cast<std::size_t>(pool_blocks * kBlock * kHeads * kDimV), 5);
    auto make = [&](std::vector<float>& pool, std::int64_t d, const std::int32_t* t, std::int64_t stride) {
      return kvevict::vllm_paged_batch(kvevict::vllm_paged(pool.data(), pool_blocks, kBlock, kHeads, d, t, 0), S, t,
                                       stride, kSeqLens.data());
    };
    auto kb = make(kpool, kDimK, table.data(), max_blocks);
    auto vb = make(vpool, kDimV, table.data(), max_blocks);
    std::vector<test::host_keep> keeps = random_keeps(60);
    if (keeps[3].indices.empty()) {
      keeps[3] = test::uniform_keep(kHeads, {-3});
    } else {
      keeps[3].indices[0] = -3;
    }
    expect_batch_rejected(kb, vb, views_of(keeps), kpool, vpool, "keeps[3].indices", errc::invalid_keep_list);

    keeps = random_keeps(61);
    // Sequence 1 reuses a block of sequence 0 (prefix sharing not resolved).
    std::vector<std::int32_t> shared = table;
    shared[static_cast<std::size_t>(1 * max_blocks + 0)] = shared[2];
    auto kb_shared = make(kpool, kDimK, shared.data(), max_blocks);
    auto vb_shared = make(vpool, kDimV, shared.data(), max_blocks);
    expect_batch_rejected(kb_shared, vb_shared, views_of(keeps), kpool, vpool, "keys[1].block_table[0]",
                          errc::invalid_argument);
    // Only V's table repeats an id.
    expect_batch_rejected(kb, vb_shared, views_of(keeps), kpool, vpool, "values[1].block_table[0]",
                          errc::invalid_argument);

    std::vector<std::int32_t> outside = table;
    outside[static_cast<std::size_t>(3 * max_blocks + 1)] = static_cast<std::int32_t>(pool_blocks);
    auto kb_outside = make(kpool, kDimK, outside.data(), max_blocks);
    expect_batch_rejected(kb_outside, vb, views_of(keeps), kpool, vpool, "keys[3].block_table[1]", errc::out_of_range);

    auto kb_rows = make(kpool, kDimK, table.data(), 4);  // rows shorter than sequence 0's 5 blocks
    expect_batch_rejected(kb_rows, vb, views_of(keeps), kpool, vpool, "keys.block_table_stride", errc::invalid_stride);

    std::vector<kvevict::eviction_result> results(kSeqLens.size());
    std::vector<std::uint8_t> small(8);
    const auto k0 = test::checksum(kpool);
    const kvevict::status st =
        kvevict::evict_batch(kb, vb, views_of(keeps).data(), results.data(), {small.data(), small.size()});
    REQUIRE(st.code() == errc::workspace_too_small);
    REQUIRE(std::string(st.argument()) == "ws");
    REQUIRE(test::checksum(kpool) == k0);
  }

  SECTION("FlashInfer CSR batch") {
    const std::int64_t fi_pool = 16;
    std::vector<std::int32_t> indptr = {0, 5, 7, 7, 11};
    std::vector<std::int32_t> indices = shuffled_ids(fi_pool, 12);
    indices.resize(11);
    std::vector<fp16> kpool = random_buffer<fp16>(static_cast<std::size_t>(fi_pool * kHeads * kBlock * kDimK), 7);
    std::vector<fp16> vpool = random_buffer<fp16>(static_cast<std::size_t>(fi_pool * kHeads * kBlock * kDimV), 8);
    auto make = [&](std::vector<fp16>& pool, std::int64_t d, const std::vector<std::int32_t>& ptr) {
      return kvevict::flashinfer_paged_batch(
          kvevict::flashinfer_paged_hnd(pool.data(), fi_pool, kBlock, kHeads, d, indices.data(), 0), S, ptr.data(),
          indices.data(), kSeqLens.data());
    };
    auto kb = make(kpool, kDimK, indptr);
    auto vb = make(vpool, kDimV, indptr);
    std::vector<test::host_keep> keeps = random_keeps(70);
    keeps[3] = test::uniform_keep(kHeads, {3, 3});
    expect_batch_rejected(kb, vb, views_of(keeps), kpool, vpool, "keeps[3].indices", errc::invalid_keep_list);

    keeps = random_keeps(71);
    const std::vector<std::int32_t> short_ptr = {0, 5, 6, 6, 10};  // sequence 1 needs 2 pages, gets 1
    auto kb_short = make(kpool, kDimK, short_ptr);
    expect_batch_rejected(kb_short, vb, views_of(keeps), kpool, vpool, "keys.block_indptr[2]", errc::invalid_shape);
  }
}
