// In-place eviction for every cache layout and storage type, against the expected state of
// the raw buffers computed from explicit offset formulas: kept rows gathered, every other
// element (stale rows, padding gaps, unused pool blocks) bit-for-bit unchanged. Also the
// keep-list-only mode, flatten_varlen, and rejection of bad input with the cache untouched.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kvevict/eviction/evict.hpp"
#include "kvevict/eviction/flatten_varlen.hpp"
#include "kvevict/eviction/keep_positions.hpp"
#include "kvevict/views/layouts.hpp"
#include "support/eviction_check.hpp"
#include "support/test_cache.hpp"

using kvevict::bf16;
using kvevict::fp16;
using test::layout;

namespace {

struct shape {
  std::int64_t heads, tokens, kdim, vdim, block;
};
const shape kShapes[] = {{3, 53, 8, 12, 16}, {2, 16, 5, 3, 4}, {1, 1, 4, 4, 16}, {4, 100, 16, 8, 7}, {2, 0, 4, 4, 16}};

// Two workers, tasks in reverse order: results must not depend on scheduling.
kvevict::executor reverse_executor() {
  kvevict::executor exec;
  exec.num_workers = 2;
  exec.parallel_for = +[](void*, std::int64_t n, kvevict::task_fn fn, void* arg) {
    for (std::int64_t i = n - 1; i >= 0; --i) fn(arg, i, static_cast<int>(i % 2));
  };
  return exec;
}

using test::is_paged;

std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

template <class T>
void check_evict(layout kl, layout vl, const shape& s, std::uint64_t seed, bool with_positions, bool parallel,
                 const test::host_keep* given = nullptr) {
  const std::int64_t H = s.heads, L = s.tokens;
  INFO("K " << test::name(kl) << " V " << test::name(vl) << " H " << H << " L " << L << " seed " << seed);
  // An empty hf_contiguous view has head_stride 0, which validate_cache_view reads as
  // overlapping heads; empty caches are covered by the other layouts.
  if (L == 0 && (kl == layout::contiguous || vl == layout::contiguous)) return;
  auto keys = test::make_cache<T>(kl, H, L, s.kdim, test::normal(static_cast<std::size_t>(H * L * s.kdim), seed),
                                  s.block, seed);
  auto values = test::make_cache<T>(vl, H, L, s.vdim, test::normal(static_cast<std::size_t>(H * L * s.vdim), seed + 1),
                                    s.block, seed + 2);
  const std::vector<T> kbefore = keys.buffer, vbefore = values.buffer;
  const std::vector<double> kdense = keys.dense(L), vdense = values.dense(L);
  const test::host_keep keep = given != nullptr ? *given : test::random_keep(H, L, seed + 3);
  std::vector<std::int64_t> kpos;
  if (with_positions)
    for (std::int64_t j = 0; j < L; ++j) kpos.push_back(1000 + 3 * j + (j % 2));

  std::vector<std::int64_t> lengths(static_cast<std::size_t>(H), -1);
  std::vector<std::int64_t> positions(keep.indices.size() + 1, -1);
  kvevict::eviction_result r;
  r.head_lengths = lengths.data();
  r.positions = positions.data();
  const kvevict::executor exec = parallel ? reverse_executor() : kvevict::executor{};
  const std::size_t ws_size = kvevict::evict_workspace_size(keys.view, values.view, exec);
  if (!is_paged(kl) && !is_paged(vl)) REQUIRE(ws_size == 0);
  kvevict::workspace ws(ws_size);
  const kvevict::status st =
      kvevict::evict(keys.view, values.view, keep.view(), r, ws, with_positions ? kpos.data() : nullptr, exec);
  INFO(st.message());
  REQUIRE(st.ok());

  std::vector<T> kexp = kbefore, vexp = vbefore;
  test::apply_expected(kexp, kbefore, keep, s.kdim,
                       [&](std::int64_t h, std::int64_t j, std::int64_t c) { return keys.offset(h, j, c); });
  test::apply_expected(vexp, vbefore, keep, s.vdim,
                       [&](std::int64_t h, std::int64_t j, std::int64_t c) { return values.offset(h, j, c); });
  test::require_same_bits(keys.buffer, kexp);
  test::require_same_bits(values.buffer, vexp);

  // The same rows against a gather from the dense copy.
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t i = 0; i < keep.size(h); ++i) {
      const std::int64_t j = keep.at(h, i);
      for (std::int64_t c = 0; c < s.kdim; ++c)
        REQUIRE(test::load(keys.at(h, i, c)) == kdense[static_cast<std::size_t>((h * L + j) * s.kdim + c)]);
      for (std::int64_t c = 0; c < s.vdim; ++c)
        REQUIRE(test::load(values.at(h, i, c)) == vdense[static_cast<std::size_t>((h * L + j) * s.vdim + c)]);
    }

  for (std::int64_t h = 0; h < H; ++h) REQUIRE(lengths[static_cast<std::size_t>(h)] == keep.size(h));
  for (std::size_t k = 0; k < keep.indices.size(); ++k) {
    const std::int64_t j = keep.indices[k];
    REQUIRE(positions[k] == (with_positions ? kpos[static_cast<std::size_t>(j)] : j));
  }
  REQUIRE(positions.back() == -1);  // nothing past keep.total()
  REQUIRE(r.max_length == keep.max_size());
  if (is_paged(kl) || is_paged(vl)) {
    const std::int64_t bs = is_paged(kl) ? keys.view.block_size : values.view.block_size;  // cells: 1
    REQUIRE(r.freed_blocks == ceil_div(L, bs) - ceil_div(r.max_length, bs));
  } else {
    REQUIRE(r.freed_blocks == 0);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("evict compacts every layout in place and leaves everything else as it was", "[eviction]", float,
                   fp16, bf16) {
  std::uint64_t seed = 11;
  for (layout l : test::kAllLayouts)
    for (const shape& s : kShapes)
      for (int rep = 0; rep < 3; ++rep) {
        check_evict<TestType>(l, l, s, seed, rep == 1, rep == 2);
        seed += 17;
      }
}

TEMPLATE_TEST_CASE("evict takes K and V in different layouts", "[eviction]", float, fp16, bf16) {
  // llama.cpp (token-major K, transposed V), mixed paged, and contiguous K with transposed V.
  const std::pair<layout, layout> pairs[] = {{layout::token_major, layout::transposed},
                                             {layout::paged_nhd, layout::paged_hnd},
                                             {layout::contiguous, layout::transposed},
                                             {layout::padded, layout::paged_nhd}};
  std::uint64_t seed = 5;
  for (const auto& p : pairs)
    for (const shape& s : kShapes) {
      check_evict<TestType>(p.first, p.second, s, seed, true, false);
      check_evict<TestType>(p.first, p.second, s, seed + 1, false, true);
      seed += 7;
    }
}

TEST_CASE("evict: keep everything, keep nothing, keep one head's prefix", "[eviction]") {
  const shape s{3, 37, 8, 8, 8};
  std::vector<std::int64_t> all, none, prefix;
  for (std::int64_t j = 0; j < s.tokens; ++j) all.push_back(j);
  for (std::int64_t j = 0; j < 9; ++j) prefix.push_back(j);
  for (layout l : test::kAllLayouts) {
    const test::host_keep keep_all = test::uniform_keep(s.heads, all), keep_none = test::uniform_keep(s.heads, none),
                          keep_prefix = test::uniform_keep(s.heads, prefix);
    check_evict<bf16>(l, l, s, 3, false, false, &keep_all);
    check_evict<bf16>(l, l, s, 4, true, false, &keep_none);
    check_evict<bf16>(l, l, s, 5, true, true, &keep_prefix);
    // A tail-only keep-list (the protected window alone).
    test::host_keep tail;
    for (std::int64_t h = 0; h < s.heads; ++h) tail.add_head({s.tokens - 2, s.tokens - 1});
    check_evict<float>(l, l, s, 6, false, false, &tail);
  }
}

TEST_CASE("evict: workspace is needed for paged caches only", "[eviction]") {
  const std::vector<double> dense = test::normal(2 * 40 * 8, 1);
  auto strided = test::make_cache<float>(layout::padded, 2, 40, 8, dense);
  auto paged = test::make_cache<float>(layout::paged_hnd, 2, 40, 8, dense, 8);
  REQUIRE(kvevict::evict_workspace_size(strided.view, strided.view) == 0);
  const std::size_t need = kvevict::evict_workspace_size(paged.view, paged.view);
  REQUIRE(need >= 2 * 5 * sizeof(std::int32_t));
  // The size only grows with the sequence, so a view at the longest length bounds them all.
  REQUIRE(kvevict::evict_workspace_size(paged.view.first_tokens(8), paged.view.first_tokens(8)) <= need);

  auto values = test::make_cache<float>(layout::paged_nhd, 2, 40, 8, dense, 8, 99);
  const test::host_keep keep = test::random_keep(2, 40, 3);
  kvevict::eviction_result r;
  const auto before = test::checksum(paged.buffer);
  const kvevict::status st = kvevict::evict(paged.view, values.view, keep.view(), r);
  REQUIRE(st.code() == kvevict::errc::workspace_too_small);
  REQUIRE(std::string(st.argument()) == "ws");
  REQUIRE(test::checksum(paged.buffer) == before);
}

TEMPLATE_TEST_CASE("evict: TensorRT-LLM K and V blocks in one pool", "[eviction]", float, bf16) {
  // Pool of [Hkv][tokens_per_block][d] blocks; K and V of the sequence have their own block
  // offsets into the same pool.
  const std::int64_t H = 2, L = 45, d = 8, bs = 8, pool_blocks = 16, used = 6;
  std::vector<TestType> pool(static_cast<std::size_t>(pool_blocks * H * bs * d));
  const std::vector<double> fill = test::normal(pool.size(), 21);
  for (std::size_t i = 0; i < pool.size(); ++i) pool[i] = test::store<TestType>(fill[i]);
  std::vector<std::int32_t> k_offsets = {9, 2, 14, 5, 0, 11}, v_offsets = {3, 12, 7, 1, 15, 8};
  auto off = [&](const std::vector<std::int32_t>& table, std::int64_t h, std::int64_t j, std::int64_t c) {
    return ((table[static_cast<std::size_t>(j / bs)] * H + h) * bs + j % bs) * d + c;
  };
  auto kv = kvevict::trtllm_paged(pool.data(), pool_blocks, bs, H, d, k_offsets.data(), L);
  auto vv = kvevict::trtllm_paged(pool.data(), pool_blocks, bs, H, d, v_offsets.data(), L);
  const test::host_keep keep = test::random_keep(H, L, 77);
  const std::vector<TestType> before = pool;

  // An id in both tables is caught before anything moves.
  std::vector<std::int32_t> clash = v_offsets;
  clash[4] = k_offsets[2];
  auto bad = vv;
  bad.block_table = clash.data();
  kvevict::workspace ws(kvevict::evict_workspace_size(kv, vv));
  kvevict::eviction_result r;
  kvevict::status st = kvevict::evict(kv, bad, keep.view(), r, ws);
  REQUIRE(st.code() == kvevict::errc::invalid_argument);
  REQUIRE(std::string(st.argument()) == "values.block_table[4]");
  test::require_same_bits(pool, before);

  st = kvevict::evict(kv, vv, keep.view(), r, ws);
  INFO(st.message());
  REQUIRE(st.ok());
  std::vector<TestType> expected = before;
  test::apply_expected(expected, before, keep, d,
                       [&](std::int64_t h, std::int64_t j, std::int64_t c) { return off(k_offsets, h, j, c); });
  test::apply_expected(expected, before, keep, d,
                       [&](std::int64_t h, std::int64_t j, std::int64_t c) { return off(v_offsets, h, j, c); });
  test::require_same_bits(pool, expected);
  REQUIRE(r.freed_blocks == used - ceil_div(r.max_length, bs));
}

namespace {

// A paged K (vLLM NHD) and a llama.cpp transposed V, with a keep-list, a workspace and a
// result whose fields hold markers; each rejection case mutates a copy of the views.
struct fixture {
  static constexpr std::int64_t H = 3, L = 40, dk = 8, dv = 6, bs = 8;
  test::test_cache<bf16> keys = test::make_cache<bf16>(layout::paged_nhd, H, L, dk, test::normal(H* L* dk, 1), bs);
  test::test_cache<bf16> values = test::make_cache<bf16>(layout::transposed, H, L, dv, test::normal(H* L* dv, 2));
  test::host_keep keep;
  kvevict::workspace ws;
  kvevict::cache_view<bf16> kv, vv;
  kvevict::const_keep_list_view kl;
  kvevict::workspace_span span;

  fixture() {
    keep.add_head({0, 3, 5, 9, 20, 39});
    keep.add_head({1, 2, 30});
    keep.add_head({});
    kv = keys.view;
    vv = values.view;
    kl = keep.view();
    ws.reserve(kvevict::evict_workspace_size(kv, vv));
    span = ws.span();
  }
  void refresh_keep() { kl = keep.view(); }
};

void expect_rejected(fixture& f, const char* argument, kvevict::errc code) {
  const std::uint64_t k0 = test::checksum(f.keys.buffer), v0 = test::checksum(f.values.buffer),
                      t0 = test::checksum(f.keys.table), o0 = test::checksum(f.keep.offsets),
                      i0 = test::checksum(f.keep.indices);
  std::vector<std::int64_t> lengths(8, 77), positions(32, 77);
  kvevict::eviction_result r;
  r.head_lengths = lengths.data();
  r.positions = positions.data();
  r.max_length = -5;
  r.freed_blocks = -6;
  const kvevict::status st = kvevict::evict(f.kv, f.vv, f.kl, r, f.span);
  INFO(st.message());
  REQUIRE_FALSE(st.ok());
  CHECK(st.code() == code);
  CHECK(std::string(st.argument()) == argument);
  CHECK(std::string(st.message()).find("kvevict::evict: ") == 0);
  REQUIRE(test::checksum(f.keys.buffer) == k0);
  REQUIRE(test::checksum(f.values.buffer) == v0);
  REQUIRE(test::checksum(f.keys.table) == t0);
  REQUIRE(test::checksum(f.keep.offsets) == o0);
  REQUIRE(test::checksum(f.keep.indices) == i0);
  REQUIRE(r.max_length == -5);
  REQUIRE(r.freed_blocks == -6);
  for (std::int64_t x : lengths) REQUIRE(x == 77);
  for (std::int64_t x : positions) REQUIRE(x == 77);
}

}  // namespace

TEST_CASE("evict rejects bad input and leaves the cache exactly as it was", "[eviction][errors]") {
  using kvevict::errc;
  SECTION("the fixture itself is accepted") {
    fixture f;
    kvevict::eviction_result r;
    REQUIRE(kvevict::evict(f.kv, f.vv, f.kl, r, f.span).ok());
  }
  SECTION("unsorted keep-list") {
    fixture f;
    std::swap(f.keep.indices[1], f.keep.indices[2]);
    expect_rejected(f, "keep.indices", errc::invalid_keep_list);
  }
  SECTION("duplicate index") {
    fixture f;
    f.keep.indices[7] = f.keep.indices[6];
    expect_rejected(f, "keep.indices", errc::invalid_keep_list);
  }
  SECTION("index >= L") {
    fixture f;
    f.keep.indices[8] = fixture::L;
    expect_rejected(f, "keep.indices", errc::invalid_keep_list);
  }
  SECTION("negative index") {
    fixture f;
    f.keep.indices[0] = -1;
    expect_rejected(f, "keep.indices", errc::invalid_keep_list);
  }
  SECTION("offsets beyond capacity") {
    fixture f;
    f.kl.capacity = 4;
    expect_rejected(f, "keep.offsets", errc::invalid_keep_list);
  }
  SECTION("null offsets") {
    fixture f;
    f.kl.offsets = nullptr;
    expect_rejected(f, "keep.offsets", errc::null_pointer);
  }
  SECTION("keep-list heads differ from the cache's") {
    fixture f;
    f.kl.num_heads = fixture::H - 1;
    expect_rejected(f, "keep.num_heads", errc::invalid_shape);
  }
  SECTION("K and V token counts differ") {
    fixture f;
    f.vv.num_tokens = fixture::L - 1;
    expect_rejected(f, "values.num_tokens", errc::invalid_shape);
  }
  SECTION("K and V head counts differ") {
    fixture f;
    f.vv.num_heads = fixture::H - 1;
    expect_rejected(f, "values.num_heads", errc::invalid_shape);
  }
  SECTION("block id outside the pool") {
    fixture f;
    f.keys.table[2] = static_cast<std::int32_t>(f.keys.pool_blocks);
    expect_rejected(f, "keys.block_table[2]", errc::out_of_range);
  }
  SECTION("negative block id") {
    fixture f;
    f.keys.table[4] = -1;
    expect_rejected(f, "keys.block_table[4]", errc::out_of_range);
  }
  SECTION("duplicate block ids") {
    fixture f;
    f.keys.table[3] = f.keys.table[1];
    expect_rejected(f, "keys.block_table[3]", errc::invalid_argument);
  }
  SECTION("null K data") {
    fixture f;
    f.kv.data = nullptr;
    expect_rejected(f, "keys.data", errc::null_pointer);
  }
  SECTION("null V data") {
    fixture f;
    f.vv.data = nullptr;
    expect_rejected(f, "values.data", errc::null_pointer);
  }
  SECTION("overlapping token stride inside a block") {
    fixture f;
    f.kv.token_stride = fixture::dk - 1;
    expect_rejected(f, "keys.token_stride", errc::invalid_stride);
  }
  SECTION("overlapping transposed-V token stride") {
    fixture f;
    f.vv.token_stride = 0;
    expect_rejected(f, "values.token_stride", errc::invalid_stride);
  }
  SECTION("overlapping blocks") {
    fixture f;
    f.kv.block_stride = 8;
    expect_rejected(f, "keys.block_stride", errc::invalid_stride);
  }
  SECTION("block size 0") {
    fixture f;
    f.kv.block_size = 0;
    expect_rejected(f, "keys.block_size", errc::invalid_shape);
  }
  SECTION("negative stride") {
    fixture f;
    f.vv.head_stride = -1;
    expect_rejected(f, "values.head_stride", errc::invalid_stride);
  }
  SECTION("workspace too small") {
    fixture f;
    f.span.size = 8;
    expect_rejected(f, "ws", errc::workspace_too_small);
  }
  SECTION("no workspace for a paged cache") {
    fixture f;
    f.span = {};
    expect_rejected(f, "ws", errc::workspace_too_small);
  }
}

TEST_CASE("evict rejects K and V over the same memory", "[eviction][errors]") {
  auto keys = test::make_cache<float>(layout::contiguous, 2, 10, 4, test::normal(80, 3));
  const test::host_keep keep = test::random_keep(2, 10, 4);
  const auto before = test::checksum(keys.buffer);
  kvevict::eviction_result r;
  const kvevict::status st = kvevict::evict(keys.view, keys.view, keep.view(), r);
  REQUIRE(st.code() == kvevict::errc::invalid_argument);
  REQUIRE(std::string(st.argument()) == "values.data");
  REQUIRE(test::checksum(keys.buffer) == before);
}

TEST_CASE("keep_list_positions: the keep-list-only mode", "[eviction]") {
  test::host_keep keep;
  keep.add_head({0, 4, 7});
  keep.add_head({});
  keep.add_head({1, 2, 3, 9});
  const std::vector<std::int64_t> cells = {50, 51, 52, 53, 70, 71, 72, 73, 74, 90};
  std::vector<std::int64_t> out(7, -1);
  REQUIRE(kvevict::keep_list_positions(keep.view(), 10, nullptr, out.data()).ok());
  REQUIRE(out == std::vector<std::int64_t>{0, 4, 7, 1, 2, 3, 9});
  REQUIRE(kvevict::keep_list_positions(keep.view(), 10, cells.data(), out.data()).ok());
  REQUIRE(out == std::vector<std::int64_t>{50, 70, 73, 51, 52, 53, 90});

  std::fill(out.begin(), out.end(), -1);
  kvevict::status st = kvevict::keep_list_positions(keep.view(), 9, cells.data(), out.data());
  REQUIRE(st.code() == kvevict::errc::invalid_keep_list);
  REQUIRE(std::string(st.argument()) == "keep.indices");
  st = kvevict::keep_list_positions(keep.view(), 10, cells.data(), nullptr);
  REQUIRE(st.code() == kvevict::errc::null_pointer);
  REQUIRE(std::string(st.argument()) == "positions_out");
  keep.indices[5] = 1;
  st = kvevict::keep_list_positions(keep.view(), 10, cells.data(), out.data());
  REQUIRE(std::string(st.argument()) == "keep.indices");
  for (std::int64_t x : out) REQUIRE(x == -1);
}

TEMPLATE_TEST_CASE("flatten_varlen out of place, every layout", "[eviction]", float, fp16, bf16) {
  std::uint64_t seed = 31;
  for (layout l : test::kAllLayouts)
    for (const shape& s : kShapes) {
      INFO(test::name(l) << " H " << s.heads << " L " << s.tokens);
      if (s.tokens == 0 && l == layout::contiguous) continue;  // see check_evict
      const std::int64_t H = s.heads, L = s.tokens, d = s.kdim, stride = d + 3;
      auto src = test::make_cache<TestType>(l, H, L, d, test::normal(static_cast<std::size_t>(H * L * d), seed),
                                            s.block, seed);
      const auto src_sum = test::checksum(src.buffer);
      const std::vector<double> dense = src.dense(L);
      const test::host_keep keep = test::random_keep(H, L, seed + 1);
      const std::int64_t total = static_cast<std::int64_t>(keep.indices.size());
      std::vector<TestType> dst(static_cast<std::size_t>((total + 2) * stride), test::sentinel<TestType>());
      std::vector<std::int64_t> cu(static_cast<std::size_t>(H + 1), -1);
      const kvevict::status st =
          kvevict::flatten_varlen(src.view, keep.view(), dst.data(), total + 2, stride, cu.data(), reverse_executor());
      INFO(st.message());
      REQUIRE(st.ok());
      REQUIRE(cu == keep.offsets);
      REQUIRE(test::checksum(src.buffer) == src_sum);
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < keep.size(h); ++i) {
          const std::int64_t row = cu[static_cast<std::size_t>(h)] + i;
          for (std::int64_t c = 0; c < stride; ++c) {
            const double got = test::load(dst[static_cast<std::size_t>(row * stride + c)]);
            if (c < d) {
              REQUIRE(got == dense[static_cast<std::size_t>((h * L + keep.at(h, i)) * d + c)]);
            } else {
              REQUIRE(got == test::load(test::sentinel<TestType>()));  // row padding untouched
            }
          }
        }
      for (std::size_t k = static_cast<std::size_t>(total * stride); k < dst.size(); ++k)
        REQUIRE(test::load(dst[k]) == test::load(test::sentinel<TestType>()));
      seed += 3;
    }
}

TEMPLATE_TEST_CASE("flatten_varlen in place over an HF-contiguous cache", "[eviction]", float, bf16) {
  for (std::int64_t spare : {0, 4}) {
    const std::int64_t H = 4, L = 33, d = 6, cap = L + spare;
    std::vector<TestType> buf(static_cast<std::size_t>(H * cap * d), test::sentinel<TestType>());
    const std::vector<double> dense = test::rounded<TestType>(test::normal(static_cast<std::size_t>(H * L * d), 8));
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t j = 0; j < L; ++j)
        for (std::int64_t c = 0; c < d; ++c)
          buf[static_cast<std::size_t>((h * cap + j) * d + c)] =
              test::store<TestType>(dense[static_cast<std::size_t>((h * L + j) * d + c)]);
    test::host_keep keep;
    keep.add_head({0, 1, 2, 3, 4, 5});  // identity prefix
    keep.add_head({});
    std::vector<std::int64_t> all;
    for (std::int64_t j = 0; j < L; ++j) all.push_back(j);
    keep.add_head(all);  // lands on rows that still hold head 0 and 2's data
    keep.add_head({3, 17, 32});
    std::vector<std::int64_t> cu(static_cast<std::size_t>(H + 1));
    const auto view = kvevict::hf_contiguous(buf.data(), H, L, d, cap);
    const kvevict::status st = kvevict::flatten_varlen(view, keep.view(), buf.data(), H * cap, d, cu.data());
    INFO(st.message());
    REQUIRE(st.ok());
    REQUIRE(cu == keep.offsets);
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < keep.size(h); ++i)
        for (std::int64_t c = 0; c < d; ++c)
          REQUIRE(test::load(buf[static_cast<std::size_t>((cu[static_cast<std::size_t>(h)] + i) * d + c)]) ==
                  dense[static_cast<std::size_t>((h * L + keep.at(h, i)) * d + c)]);
  }
}

TEST_CASE("flatten_varlen rejects unsafe overlaps and short buffers", "[eviction][errors]") {
  const std::int64_t H = 2, L = 12, d = 4;
  auto hf = test::make_cache<float>(layout::contiguous, H, L, d, test::normal(H * L * d, 5));
  auto tm = test::make_cache<float>(layout::token_major, H, L, d, test::normal(H * L * d, 6));
  auto pg = test::make_cache<float>(layout::paged_nhd, H, L, d, test::normal(H * L * d, 7), 4);
  test::host_keep keep;
  keep.add_head({0, 3, 7, 11});
  keep.add_head({2, 5});
  const std::int64_t total = static_cast<std::int64_t>(keep.indices.size());
  auto expect = [&](kvevict::status st, const char* argument, kvevict::errc code) {
    INFO(st.message());
    REQUIRE(st.code() == code);
    REQUIRE(std::string(st.argument()) == argument);
  };
  const auto sums =
      std::vector<std::uint64_t>{test::checksum(hf.buffer), test::checksum(tm.buffer), test::checksum(pg.buffer)};
  using kvevict::errc;
  // Shifted by one row: not the forward-safe case.
  expect(kvevict::flatten_varlen(hf.view, keep.view(), hf.buffer.data() + d, H * L - 1, d), "dst",
         errc::invalid_argument);
  // In place with a different row stride.
  expect(kvevict::flatten_varlen(hf.view, keep.view(), hf.buffer.data(), H * L / 2, 2 * d), "dst",
         errc::invalid_argument);
  // Token-major heads interleave: head_stride < L * token_stride.
  expect(kvevict::flatten_varlen(tm.view, keep.view(), tm.buffer.data(), L, H * d), "dst", errc::invalid_argument);
  // Paged sources are never flattened in place.
  expect(kvevict::flatten_varlen(pg.view, keep.view(), pg.buffer.data(), total, d), "dst", errc::invalid_argument);
  std::vector<float> out(static_cast<std::size_t>(total * d));
  expect(kvevict::flatten_varlen(hf.view, keep.view(), out.data(), total - 1, d), "dst_rows", errc::invalid_shape);
  expect(kvevict::flatten_varlen(hf.view, keep.view(), out.data(), total, d - 1), "dst_row_stride",
         errc::invalid_stride);
  expect(kvevict::flatten_varlen(hf.view, keep.view(), static_cast<float*>(nullptr), total, d), "dst",
         errc::null_pointer);
  auto bad = keep;
  std::swap(bad.indices[0], bad.indices[1]);
  expect(kvevict::flatten_varlen(hf.view, bad.view(), out.data(), total, d), "keep.indices", errc::invalid_keep_list);
  REQUIRE(sums ==
          std::vector<std::uint64_t>{test::checksum(hf.buffer), test::checksum(tm.buffer), test::checksum(pg.buffer)});
}

TEST_CASE("removed_position_ranges: the complement of a keep set as [p0, p1) ranges", "[eviction]") {
  std::mt19937_64 rng(91);
  for (int trial = 0; trial < 400; ++trial) {
    const std::int64_t begin = static_cast<std::int64_t>(rng() % 5), span = static_cast<std::int64_t>(rng() % 40);
    const std::int64_t end = begin + span;
    std::vector<std::int64_t> kept;
    const unsigned density = static_cast<unsigned>(rng() % 4);  // none, sparse, half, almost all kept
    for (std::int64_t p = begin; p < end; ++p)
      if (density != 0 && rng() % 4 < density) kept.push_back(p);
    // Reference: mark every position, then read the runs of unmarked ones.
    std::vector<char> keep(static_cast<std::size_t>(span), 0);
    for (std::int64_t p : kept) keep[static_cast<std::size_t>(p - begin)] = 1;
    std::vector<std::int64_t> expect;
    for (std::int64_t p = begin; p < end;) {
      if (keep[static_cast<std::size_t>(p - begin)]) {
        ++p;
        continue;
      }
      std::int64_t q = p;
      while (q < end && !keep[static_cast<std::size_t>(q - begin)]) ++q;
      expect.push_back(p);
      expect.push_back(q);
      p = q;
    }
    const auto n_kept = static_cast<std::int64_t>(kept.size());
    std::vector<std::int64_t> ranges(static_cast<std::size_t>(2 * (n_kept + 1)), -7);
    std::int64_t n = -1;
    REQUIRE(kvevict::removed_position_ranges(kept.data(), n_kept, begin, end, ranges.data(), n_kept + 1, &n).ok());
    REQUIRE(n == static_cast<std::int64_t>(expect.size() / 2));
    ranges.resize(static_cast<std::size_t>(2 * n));
    REQUIRE(ranges == expect);
    if (n > 0) {  // one range too few: refused by name, nothing written
      std::vector<std::int64_t> short_ranges(static_cast<std::size_t>(2 * n), -7);
      std::int64_t m = -1;
      const kvevict::status st =
          kvevict::removed_position_ranges(kept.data(), n_kept, begin, end, short_ranges.data(), n - 1, &m);
      REQUIRE(st.code() == kvevict::errc::invalid_shape);
      REQUIRE(std::string(st.argument()) == "capacity");
      REQUIRE(m == -1);
      REQUIRE(std::all_of(short_ranges.begin(), short_ranges.end(), [](std::int64_t x) { return x == -7; }));
    }
  }
}

TEST_CASE("removed_position_ranges refuses bad input by name and writes nothing", "[eviction][errors]") {
  const std::int64_t kept[] = {2, 5, 5};
  std::int64_t ranges[8] = {-7, -7, -7, -7, -7, -7, -7, -7};
  std::int64_t n = -1;
  const auto argument_of = [&](const kvevict::status& st) { return std::string(st.ok() ? "" : st.argument()); };
  REQUIRE(argument_of(kvevict::removed_position_ranges(kept, 3, 0, 8, ranges, 4, &n)) == "kept");  // not ascending
  REQUIRE(argument_of(kvevict::removed_position_ranges(kept, 2, 3, 8, ranges, 4, &n)) == "kept");  // below begin
  REQUIRE(argument_of(kvevict::removed_position_ranges(kept, 2, 0, 5, ranges, 4, &n)) == "kept");  // at end
  REQUIRE(argument_of(kvevict::removed_position_ranges(nullptr, 2, 0, 8, ranges, 4, &n)) == "kept");
  REQUIRE(argument_of(kvevict::removed_position_ranges(kept, -1, 0, 8, ranges, 4, &n)) == "num_kept");
  REQUIRE(argument_of(kvevict::removed_position_ranges(kept, 2, 4, 3, ranges, 4, &n)) == "end");
  REQUIRE(argument_of(kvevict::removed_position_ranges(kept, 2, 0, 8, ranges, 4, nullptr)) == "num_ranges");
  REQUIRE(argument_of(kvevict::removed_position_ranges(kept, 2, 0, 8, nullptr, 4, &n)) == "ranges");
  REQUIRE(argument_of(kvevict::removed_position_ranges(kept, 2, 0, 8, ranges, -1, &n)) == "capacity");
  REQUIRE(n == -1);
  REQUIRE(std::all_of(ranges, ranges + 8, [](std::int64_t x) { return x == -7; }));
  // Nothing removed: no range, and no array needed.
  const std::int64_t all[] = {0, 1, 2};
  REQUIRE(kvevict::removed_position_ranges(all, 3, 0, 3, nullptr, 0, &n).ok());
  REQUIRE(n == 0);
}
