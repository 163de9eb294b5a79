// The pure logic of the CUDA kernels, compiled by the host compiler and checked here, where
// CI runs (it has nvcc but no GPU): the radix select emulated pass by pass on the host with
// the kernel's own digit, bucket-search and slot functions against a full sort and the CPU
// selection; the finalisation emulated tile by tile (halo windows) with the kernel's
// element functions against the CPU's finalize_head, bit for bit; softmax partials combined
// in the kernels' order; tile coverage, grid and 32-bit limits; workspace carving; the
// staged compaction emulated over every test cache layout; device flag decoding.
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

#include "kvevict/cuda/detail/compact_logic.hpp"
#include "kvevict/cuda/detail/radix_logic.hpp"
#include "kvevict/cuda/detail/score_logic.hpp"
#include "kvevict/cuda/detail/tiling.hpp"
#include "kvevict/cuda/detail/workspace_plan.hpp"
#include "kvevict/cuda/device_flags.hpp"
#include "kvevict/cuda/select_row.hpp"
#include "kvevict/detail/finalize.hpp"
#include "kvevict/detail/pooling.hpp"
#include "kvevict/detail/topk.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/selection/select.hpp"
#include "reference/reference.hpp"
#include "support/test_cache.hpp"

namespace cd = kvevict::cuda::detail;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

bool same_bits(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  std::uint32_t x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y;
}

enum class fill { random, ties, all_equal, specials, sorted_up, sorted_down, tiny_range };

std::vector<float> make_row(fill f, std::int64_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t j = 0; j < n; ++j) {
    float x = u(rng);
    switch (f) {
      case fill::random:
        break;
      case fill::ties:
        x = static_cast<float>(static_cast<int>((x + 1.0f) * 3.0f));
        break;
      case fill::all_equal:
        x = 0.5f;
        break;
      case fill::specials: {
        const std::uint64_t r = rng() % 8;
        if (r == 0) x = kNaN;
        if (r == 1) x = kInf;
        if (r == 2) x = -kInf;
        if (r == 3) x = -0.0f;
        if (r == 4) x = 0.0f;
        break;
      }
      case fill::sorted_up:
        x = static_cast<float>(j);
        break;
      case fill::sorted_down:
        x = static_cast<float>(n - j);
        break;
      case fill::tiny_range:
        x = 1.0f + static_cast<float>(rng() % 4) * std::numeric_limits<float>::epsilon();
        break;
    }
    v[static_cast<std::size_t>(j)] = x;
  }
  return v;
}

/// The GPU radix select of select_rows_kernel, run on the host: the same state machine, the
/// same lane decomposition of the bucket search, the same tile-wise emission with an
/// exclusive scan over 512 "threads" of 8 consecutive keys each.
std::vector<std::int64_t> emulate_radix_select(const std::vector<float>& x, std::int64_t k, int* passes_run) {
  const std::int64_t n = static_cast<std::int64_t>(x.size());
  cd::radix_state st = cd::radix_start(static_cast<std::uint32_t>(k));
  *passes_run = 0;
  for (int pass = 0; pass < cd::radix_passes; ++pass) {
    ++*passes_run;
    std::uint32_t hist[cd::radix_buckets] = {};
    std::uint32_t matching = 0;
    for (float v : x) {
      const std::uint32_t key = cd::radix_key(v);
      if (cd::radix_matches(key, st)) {
        ++hist[cd::radix_digit(key, pass)];
        ++matching;
      }
    }
    REQUIRE(st.remaining >= 1);
    REQUIRE(st.remaining <= matching);
    std::uint32_t greater = 0;
    int owners = 0;
    cd::radix_state next = st;
    for (int lane = 0; lane < 32; ++lane) {
      const std::uint32_t sum = cd::radix_lane_sum(hist, lane);
      if (cd::radix_lane_owns(greater, sum, st.remaining)) {
        ++owners;
        next = cd::radix_advance(hist, lane, greater, st, pass);
      }
      greater += sum;  // the warp's exclusive prefix
    }
    REQUIRE(greater == matching);
    REQUIRE(owners == 1);
    st = next;
    if (st.done) break;
  }
  std::vector<std::int64_t> out(static_cast<std::size_t>(k), -1);
  const int threads = 512, items = 8;
  std::int64_t above_run = 0, tie_run = 0;
  for (std::int64_t base = 0; base < n; base += threads * items) {
    std::vector<std::uint32_t> packed(threads);
    std::vector<int> cls(static_cast<std::size_t>(threads * items));
    for (int t = 0; t < threads; ++t) {
      std::uint32_t a = 0, ti = 0;
      for (int i = 0; i < items; ++i) {
        const std::int64_t j = base + t * items + i;
        const int c = j < n ? cd::radix_class(cd::radix_key(x[static_cast<std::size_t>(j)]), st) : 0;
        cls[static_cast<std::size_t>(t * items + i)] = c;
        a += c == 2 ? 1u : 0u;
        ti += c == 1 ? 1u : 0u;
      }
      packed[static_cast<std::size_t>(t)] = cd::radix_pack(a, ti);
    }
    std::uint32_t running = 0;
    for (int t = 0; t < threads; ++t) {
      const std::uint32_t excl = running;
      running += packed[static_cast<std::size_t>(t)];
      std::int64_t ab = above_run + cd::radix_packed_above(excl), tb = tie_run + cd::radix_packed_ties(excl);
      for (int i = 0; i < items; ++i) {
        const int c = cls[static_cast<std::size_t>(t * items + i)];
        const std::int64_t j = base + t * items + i;
        if (c == 2 || (c == 1 && tb < static_cast<std::int64_t>(st.remaining))) {
          const std::int64_t slot = cd::radix_output_slot(ab, tb, st.remaining);
          REQUIRE(slot < k);
          REQUIRE(out[static_cast<std::size_t>(slot)] == -1);
          out[static_cast<std::size_t>(slot)] = j;
        }
        if (c == 2) ++ab;
        if (c == 1) ++tb;
      }
    }
    above_run += cd::radix_packed_above(running);
    tie_run += cd::radix_packed_ties(running);
    if (cd::radix_output_slot(above_run, tie_run, st.remaining) >= k) break;
  }
  return out;
}

std::vector<double> as_double(const std::vector<float>& v) {
  return {v.begin(), v.end()};
}

}  // namespace

TEST_CASE("radix_key is the CPU's score_key", "[cuda_logic]") {
  std::mt19937 rng(3);
  for (int i = 0; i < 200000; ++i) {
    const auto bits = static_cast<std::uint32_t>(rng());
    float x;
    std::memcpy(&x, &bits, 4);
    REQUIRE(cd::radix_key(x) == kvevict::detail::score_key(x));
  }
  const float specials[] = {0.0f, -0.0f, kInf, -kInf, kNaN, -kNaN, 1e-45f, -1e-45f, 3.4e38f, -3.4e38f};
  for (float x : specials) REQUIRE(cd::radix_key(x) == kvevict::detail::score_key(x));
  REQUIRE(cd::radix_key(0.0f) == cd::radix_key(-0.0f));
  REQUIRE(cd::radix_key(kNaN) == 0u);
  REQUIRE(cd::radix_key(-kInf) > 0u);
  REQUIRE(cd::radix_key(-1.0f) < cd::radix_key(-0.5f));
  REQUIRE(cd::radix_key(0.5f) < cd::radix_key(1.0f));
}

TEST_CASE("radix digits, masks and packing", "[cuda_logic]") {
  REQUIRE(cd::radix_shift(0) == 24);
  REQUIRE(cd::radix_shift(3) == 0);
  REQUIRE(cd::radix_digit(0xA1B2C3D4u, 0) == 0xA1u);
  REQUIRE(cd::radix_digit(0xA1B2C3D4u, 1) == 0xB2u);
  REQUIRE(cd::radix_digit(0xA1B2C3D4u, 3) == 0xD4u);
  // Lanes own the 256 digits exactly once, descending.
  std::vector<int> seen(256, 0);
  int previous = 256;
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < cd::radix_digits_per_lane; ++i) {
      const int d = cd::radix_lane_digit(lane, i);
      REQUIRE(d < previous);
      previous = d;
      ++seen[static_cast<std::size_t>(d)];
    }
  REQUIRE(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
  const std::uint32_t p = cd::radix_pack(4095, 4096);
  REQUIRE(cd::radix_packed_above(p) == 4095u);
  REQUIRE(cd::radix_packed_ties(p) == 4096u);
  REQUIRE(cd::radix_packed_above(p + cd::radix_pack(1, 2)) == 4096u);
  REQUIRE(cd::radix_output_slot(10, 3, 5) == 13);
  REQUIRE(cd::radix_output_slot(10, 7, 5) == 15);
}

TEST_CASE("emulated radix select equals a full sort and the CPU selection", "[cuda_logic]") {
  const fill fills[] = {fill::random,    fill::ties,        fill::all_equal, fill::specials,
                        fill::sorted_up, fill::sorted_down, fill::tiny_range};
  const std::int64_t lengths[] = {2, 3, 17, 511, 513, 4095, 4096, 4097, 9000};
  std::uint64_t seed = 1;
  for (fill f : fills)
    for (std::int64_t n : lengths) {
      const std::vector<float> row = make_row(f, n, ++seed);
      const std::int64_t ks[] = {1, 2, n / 3, n / 2, n - 1};
      for (std::int64_t k : ks) {
        if (k < 1 || k >= n) continue;
        INFO("fill " << static_cast<int>(f) << " n " << n << " k " << k);
        int passes = 0;
        const std::vector<std::int64_t> got = emulate_radix_select(row, k, &passes);
        REQUIRE(got == ref::top_k(as_double(row), k));
        // The CPU library's selection on the same row.
        kvevict::keep_list keep(1, k);
        kvevict::workspace ws(kvevict::select_workspace_size(n));
        const kvevict::const_score_view scores{row.data(), 1, n, n};
        REQUIRE(kvevict::select(scores, kvevict::budget::tokens(k), {}, keep, ws).ok());
        REQUIRE(got == keep.head(0));
        if (f == fill::all_equal) REQUIRE(passes == 4);  // every digit ties: no early exit
      }
    }
}

TEST_CASE("radix select stops early when a bucket is taken whole", "[cuda_logic]") {
  // Powers of two 2^-90 .. 2^109: a key's top byte is the sign bit and the top 7 exponent
  // bits, so each first-pass bucket holds two consecutive exponents, and the largest (biased
  // exponent 236) is alone. The 11 largest fill whole buckets: one pass decides them.
  std::vector<float> row;
  for (int e = -90; e < 110; ++e) row.push_back(std::ldexp(1.0f, e));
  std::shuffle(row.begin(), row.end(), std::mt19937_64(4));
  int passes = 0;
  const auto got = emulate_radix_select(row, 11, &passes);
  REQUIRE(got == ref::top_k(as_double(row), 11));
  REQUIRE(passes == 1);
  REQUIRE(emulate_radix_select(row, 12, &passes) == ref::top_k(as_double(row), 12));
  REQUIRE(passes > 1);
}

TEST_CASE("the DeferKV decay rounds twice on the host branch, as the device's __fmul_rn/__fadd_rn", "[cuda_logic]") {
  // The device branch runs in the CPU simulator; this is the branch nvcc's host pass compiles.
  // Operands chosen so that a fused multiply-add would round differently from two roundings.
  // (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 rounds (to even) to 1 + 2^-11; minus 1 leaves 2^-11, where
  // a fused multiply-add keeps 2^-11 + 2^-24.
  const float eta = 1.0f + 0x1p-12f, old = 1.0f + 0x1p-12f, v = -1.0f;
  REQUIRE(cd::decayed(old, eta, v) == 0x1p-11f);
  REQUIRE(static_cast<float>(static_cast<double>(eta) * old + v) == 0x1p-11f + 0x1p-24f);
  REQUIRE(cd::decayed(old, 0.0f, v) == v);
  REQUIRE(cd::decayed(std::numeric_limits<float>::quiet_NaN(), 0.0f, 2.5f) == 2.5f);  // eta 0 overwrites
  REQUIRE(cd::decayed(3.0f, 0.5f, 1.0f) == 2.5f);
}

TEST_CASE("host-device budget arithmetic equals budget.hpp", "[cuda_logic]") {
  for (std::int64_t budget = 0; budget < 12; ++budget)
    for (std::int64_t n = 0; n < 10; ++n)
      for (std::int64_t p = 0; p < 12; ++p)
        for (int mode = 0; mode < 2; ++mode) {
          const kvevict::selection_params sp{p, static_cast<kvevict::protected_mode>(mode)};
          REQUIRE(cd::select_candidates_kept(budget, n, p, mode) == kvevict::candidates_kept(budget, n, sp));
          REQUIRE(cd::select_tokens_kept(budget, n, p, mode) == kvevict::tokens_kept(budget, n, sp));
          kvevict::cuda::select_row r;
          r.length = n;
          r.budget = budget;
          r.protected_tail = p;
          r.mode = sp.mode;
          REQUIRE(kvevict::cuda::kept_tokens(r) == kvevict::tokens_kept(budget, n, sp));
        }
}

TEST_CASE("tiles cover a range without gaps or overlap", "[cuda_logic]") {
  for (std::int64_t n : {0, 1, 63, 64, 65, 255, 256, 257, 1000, 4096, 32768}) {
    for (std::int64_t tile : {1, 16, 64, 256, 4096}) {
      const std::int64_t t = cd::num_tiles(n, tile);
      std::int64_t next = 0;
      for (std::int64_t i = 0; i < t; ++i) {
        const cd::index_range r = cd::tile_range(i, tile, n);
        REQUIRE(r.begin == next);
        REQUIRE(r.size() >= 1);
        REQUIRE(r.size() <= tile);
        if (i + 1 < t) REQUIRE(r.size() == tile);
        next = r.end;
      }
      REQUIRE(next == n);
      REQUIRE(cd::tile_range(t, tile, n).size() == 0);
    }
  }
}

TEST_CASE("halo windows hold every input a pooled tile reads", "[cuda_logic]") {
  for (std::int64_t n : {1, 5, 255, 256, 257, 700})
    for (std::int64_t radius : {0, 1, 2, 3, 300})
      for (std::int64_t t = 0; t < cd::num_tiles(n, 256); ++t) {
        const cd::index_range own = cd::tile_range(t, 256, n);
        const cd::index_range halo = cd::halo_range(own, radius, n);
        REQUIRE(halo.begin == std::max<std::int64_t>(0, own.begin - radius));
        REQUIRE(halo.end == std::min<std::int64_t>(n, own.end + radius));
        REQUIRE(halo.size() <= 256 + 2 * radius);
      }
}

TEST_CASE("32-bit and grid limits", "[cuda_logic]") {
  REQUIRE(cd::fits_int32(0));
  REQUIRE(cd::fits_int32(2147483646));
  REQUIRE_FALSE(cd::fits_int32(2147483647));
  REQUIRE(cd::fits_int32(2147483647 - 128, 128));
  REQUIRE_FALSE(cd::fits_int32(2147483647 - 127, 128));
  REQUIRE_FALSE(cd::fits_int32(-1));
  // The last tile's end index stays representable.
  const std::int64_t n = 2147483647 - 4096;
  REQUIRE(cd::fits_int32(n, 4096));
  REQUIRE(cd::num_tiles(n, 4096) * 4096 <= 2147483647);
  REQUIRE(cd::grid_fits(2147483647, 65535));
  REQUIRE_FALSE(cd::grid_fits(2147483648LL, 1));
  REQUIRE_FALSE(cd::grid_fits(1, 65536));
  REQUIRE_FALSE(cd::grid_fits(1, 0));
  REQUIRE(cd::stride_grid(0, 256) == 1);
  REQUIRE(cd::stride_grid(257, 256) == 2);
  REQUIRE(cd::stride_grid(std::int64_t{1} << 40, 256, 8192) == 8192);
}

TEST_CASE("vector loads only where every row start is 16-byte aligned", "[cuda_logic]") {
  // bf16, d = 128, contiguous [Hkv, L, d].
  REQUIRE(cd::vector_width(4096, 2, 128, 1, 128 * 100, 128, 0) == 8);
  REQUIRE(cd::vector_width(4096, 4, 128, 1, 128 * 100, 128, 0) == 4);
  REQUIRE(cd::vector_width(4098, 2, 128, 1, 128 * 100, 128, 0) == 1);  // base misaligned
  REQUIRE(cd::vector_width(4096, 2, 100, 1, 100 * 100, 100, 0) == 1);  // d not a multiple of 8
  REQUIRE(cd::vector_width(4096, 2, 128, 1, 128 * 100, 132, 0) == 1);  // padded rows
  REQUIRE(cd::vector_width(4096, 2, 128, 7, 128, 1, 0) == 1);          // transposed
  REQUIRE(cd::vector_width(4096, 2, 128, 1, 128, 1024, 12) == 1);      // block stride misaligned
  // fp8 loaded 8 bytes at a time (the decode kernel): d % 16 == 8 rows qualify, 8-byte aligned.
  REQUIRE(cd::vector_width(4096, 1, 40, 1, 40 * 100, 40, 0, 8) == 8);
  REQUIRE(cd::vector_width(4104, 1, 40, 1, 40 * 100, 40, 0, 8) == 8);  // 8- but not 16-byte aligned
  REQUIRE(cd::vector_width(4096, 1, 40, 1, 40 * 100, 40, 0) == 1);     // 16-byte loads: d % 16 != 0
  REQUIRE(cd::vector_width(4100, 1, 40, 1, 40 * 100, 40, 0, 8) == 1);  // base misaligned
  REQUIRE(cd::vector_width(4096, 1, 44, 1, 44 * 100, 44, 0, 8) == 1);  // d % 8 != 0
  REQUIRE(cd::vector_width(4096, 1, 40, 1, 40, 8 * 40, 36, 8) == 1);   // block stride misaligned
}

TEST_CASE("pool_at equals the CPU pooling bit for bit, through halo windows", "[cuda_logic]") {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (std::int64_t n : {1, 2, 3, 6, 257, 600}) {
    std::vector<float> x(static_cast<std::size_t>(n));
    for (auto& v : x) {
      v = u(rng);
      const auto r = rng() % 23;
      if (r == 0) v = kNaN;
      if (r == 1) v = kInf;
    }
    for (auto kind : {kvevict::pooling_kind::none, kvevict::pooling_kind::avg, kvevict::pooling_kind::max})
      for (std::int64_t kernel : {1, 3, 5, 7, 13})
        for (bool count_padding : {true, false}) {
          const kvevict::pooling p{kind, kernel, count_padding};
          std::vector<float> want(static_cast<std::size_t>(n));
          kvevict::detail::pool_row(x.data(), n, p, want.data());
          const std::int64_t radius = kind == kvevict::pooling_kind::none ? 0 : kernel / 2;
          for (std::int64_t t = 0; t < cd::num_tiles(n, 256); ++t) {
            const cd::index_range own = cd::tile_range(t, 256, n);
            const cd::index_range halo = cd::halo_range(own, radius, n);
            const std::vector<float> window(x.begin() + halo.begin, x.begin() + halo.end);  // the staged copy
            for (std::int64_t j = own.begin; j < own.end; ++j) {
              INFO("n " << n << " kind " << static_cast<int>(kind) << " k " << kernel << " j " << j);
              REQUIRE(same_bits(cd::pool_at(window.data(), halo.begin, n, j, p), want[static_cast<std::size_t>(j)]));
            }
          }
        }
  }
}

namespace {
/// finalize_kernel on the host: tile by tile, each tile's halo window staged, the same
/// element functions in the same order.
std::vector<float> emulate_finalize(const std::vector<float>& acc, std::int64_t rows_per_head, std::int64_t group,
                                    std::int64_t c, std::int64_t l, const kvevict::scoring_params& params, float scale,
                                    const std::vector<float>* counts) {
  std::vector<float> out(static_cast<std::size_t>(l));
  const std::int64_t radius = params.pool.kind == kvevict::pooling_kind::none ? 0 : params.pool.kernel / 2;
  for (std::int64_t t = 0; t < cd::num_tiles(l, 256); ++t) {
    const cd::index_range tile = cd::tile_range(t, 256, l);
    if (tile.begin >= c) {
      for (std::int64_t j = tile.begin; j < tile.end; ++j) out[static_cast<std::size_t>(j)] = kInf;
      continue;
    }
    const cd::index_range own{tile.begin, std::min(tile.end, c)};
    const cd::index_range halo = cd::halo_range(own, radius, c);
    auto cnt = [&](std::int64_t i) { return counts != nullptr ? (*counts)[static_cast<std::size_t>(i)] : 0.0f; };
    std::vector<float> win(static_cast<std::size_t>(halo.size()));
    if (params.order == kvevict::gqa_order::before_pooling) {
      for (std::int64_t i = halo.begin; i < halo.end; ++i) {
        float v = 0.0f;
        for (std::int64_t g = 0; g < rows_per_head; ++g)
          v = cd::gqa_step(v, acc[static_cast<std::size_t>(g * c + i)], params.gqa, g == 0);
        v = cd::normalise(v, scale, counts != nullptr, cnt(i));
        win[static_cast<std::size_t>(i - halo.begin)] = cd::gqa_mean_scale(v, params.gqa, group);
      }
      for (std::int64_t j = own.begin; j < own.end; ++j)
        out[static_cast<std::size_t>(j)] = cd::pool_at(win.data(), halo.begin, c, j, params.pool);
    } else {
      std::vector<float> o(static_cast<std::size_t>(own.size()), 0.0f);
      for (std::int64_t g = 0; g < rows_per_head; ++g) {
        for (std::int64_t i = halo.begin; i < halo.end; ++i)
          win[static_cast<std::size_t>(i - halo.begin)] =
              cd::normalise(acc[static_cast<std::size_t>(g * c + i)], scale, counts != nullptr, cnt(i));
        for (std::int64_t j = own.begin; j < own.end; ++j) {
          float& r = o[static_cast<std::size_t>(j - own.begin)];
          r = cd::gqa_step(r, cd::pool_at(win.data(), halo.begin, c, j, params.pool), params.gqa, g == 0);
        }
      }
      for (std::int64_t j = own.begin; j < own.end; ++j)
        out[static_cast<std::size_t>(j)] =
            cd::gqa_mean_scale(o[static_cast<std::size_t>(j - own.begin)], params.gqa, group);
    }
    for (std::int64_t j = own.end; j < tile.end; ++j) out[static_cast<std::size_t>(j)] = kInf;
  }
  return out;
}
}  // namespace

TEST_CASE("emulated GPU finalisation equals finalize_head bit for bit", "[cuda_logic]") {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> u(0.0f, 2.0f);
  for (std::int64_t group : {1, 3, 4})
    for (std::int64_t l : {1, 7, 300, 520})
      for (std::int64_t p : {0, 3})
        for (auto order : {kvevict::gqa_order::before_pooling, kvevict::gqa_order::after_pooling})
          for (auto red : {kvevict::gqa_reduction::mean, kvevict::gqa_reduction::max, kvevict::gqa_reduction::sum})
            for (auto kind : {kvevict::pooling_kind::none, kvevict::pooling_kind::avg, kvevict::pooling_kind::max})
              for (int norm = 0; norm < 3; ++norm) {
                const std::int64_t c = std::max<std::int64_t>(0, l - p);
                std::vector<float> acc(static_cast<std::size_t>(group * std::max<std::int64_t>(c, 1)));
                for (auto& v : acc) v = (rng() % 31 == 0) ? kNaN : u(rng);
                std::vector<float> counts(static_cast<std::size_t>(std::max<std::int64_t>(c, 1)));
                for (auto& v : counts) v = static_cast<float>(rng() % 4);
                kvevict::scoring_params params;
                params.order = order;
                params.gqa = red;
                params.pool = {kind, 5, rng() % 2 == 0};
                params.protected_tail = p;
                kvevict::detail::window_normaliser wn;
                float scale = 1.0f;
                if (norm == 1) scale = wn.scale = 1.0f / 7.0f;
                if (norm == 2) wn.per_key_count = counts.data();
                std::vector<float> cpu_acc = acc, tmp(acc.size()), want(static_cast<std::size_t>(l));
                kvevict::detail::finalize_head(cpu_acc.data(), group, c, l, params, wn, tmp.data(), want.data());
                const std::vector<float> got =
                    emulate_finalize(acc, group, group, c, l, params, scale, norm == 2 ? &counts : nullptr);
                for (std::int64_t j = 0; j < l; ++j) {
                  INFO("G " << group << " L " << l << " P " << p << " order " << static_cast<int>(order) << " gqa "
                            << static_cast<int>(red) << " pool " << static_cast<int>(kind) << " norm " << norm << " j "
                            << j);
                  REQUIRE(same_bits(got[static_cast<std::size_t>(j)], want[static_cast<std::size_t>(j)]));
                }
                // Pre-reduced rows (DeferKV's state): finalize_reduced_row.
                if (order == kvevict::gqa_order::before_pooling && norm != 2) {
                  std::vector<float> reduced(acc.begin(), acc.begin() + std::max<std::int64_t>(c, 1));
                  std::vector<float> want2(static_cast<std::size_t>(l));
                  std::vector<float> cpu_row = reduced;
                  kvevict::detail::finalize_reduced_row(cpu_row.data(), group, c, l, params, wn, want2.data());
                  const std::vector<float> got2 = emulate_finalize(reduced, 1, group, c, l, params, scale, nullptr);
                  for (std::int64_t j = 0; j < l; ++j)
                    REQUIRE(same_bits(got2[static_cast<std::size_t>(j)], want2[static_cast<std::size_t>(j)]));
                }
              }
}

TEST_CASE("softmax partials combined in the kernels' order give the row's log-sum-exp", "[cuda_logic]") {
  std::mt19937_64 rng(9);
  std::normal_distribution<float> nd(0.0f, 4.0f);
  for (std::int64_t n : {1, 5, 64, 65, 1000, 5000}) {
    std::vector<float> x(static_cast<std::size_t>(n));
    std::vector<bool> vis(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      x[i] = nd(rng);
      vis[i] = rng() % 5 != 0;
      if (rng() % 50 == 0) x[i] = kNaN;  // NaN logits get no attention
    }
    // Tiles of 64 keys; within a tile, 16 lanes of 4 keys reduce by butterfly.
    const std::int64_t tiles = cd::num_tiles(n, 64);
    std::vector<cd::softmax_partial> parts(static_cast<std::size_t>(tiles));
    for (std::int64_t t = 0; t < tiles; ++t) {
      float m[16], s[16];
      float xm[16][4];
      for (int lane = 0; lane < 16; ++lane) {
        m[lane] = cd::neg_infinity();
        for (int k = 0; k < 4; ++k) {
          const std::int64_t j = t * 64 + lane + 16 * k;
          xm[lane][k] = cd::masked_logit(j < n ? x[static_cast<std::size_t>(j)] : 0.0f,
                                         j < n && vis[static_cast<std::size_t>(j)]);
          m[lane] = xm[lane][k] > m[lane] ? xm[lane][k] : m[lane];
        }
      }
      float mm = cd::neg_infinity();
      for (float v : m) mm = std::max(mm, v);
      for (int lane = 0; lane < 16; ++lane) {
        s[lane] = 0.0f;
        for (int k = 0; k < 4; ++k) s[lane] += cd::softmax_term(xm[lane][k], mm);
      }
      float ss = 0.0f;
      for (float v : s) ss += v;
      parts[static_cast<std::size_t>(t)] = {mm, ss};
    }
    // The combine kernel: 32 lanes stride over tiles, then a butterfly.
    cd::softmax_partial lane_p[32];
    for (std::int64_t i = 0; i < tiles; ++i)
      lane_p[i % 32] = cd::combine(lane_p[i % 32], parts[static_cast<std::size_t>(i)]);
    for (int o = 16; o > 0; o /= 2) {
      cd::softmax_partial next[32];
      for (int lane = 0; lane < 32; ++lane) next[lane] = cd::combine(lane_p[lane], lane_p[lane ^ o]);
      for (int lane = 0; lane < 32; ++lane) lane_p[lane] = next[lane];
    }
    for (int lane = 1; lane < 32; ++lane) REQUIRE(same_bits(lane_p[lane].sum, lane_p[0].sum));
    const float lse = cd::partial_lse(lane_p[0]);
    double m = -INFINITY;
    for (std::size_t i = 0; i < x.size(); ++i)
      if (vis[i] && !std::isnan(x[i])) m = std::max(m, static_cast<double>(x[i]));
    double z = 0;
    for (std::size_t i = 0; i < x.size(); ++i)
      if (vis[i] && !std::isnan(x[i])) z += std::exp(static_cast<double>(x[i]) - m);
    if (m == -INFINITY) {
      REQUIRE(lse == -kInf);
    } else {
      REQUIRE(std::fabs(lse - (m + std::log(z))) <= 1e-5 * (1.0 + std::fabs(m)));
    }
  }
}

TEST_CASE("softmax special cases follow the CPU", "[cuda_logic]") {
  cd::softmax_partial empty;
  REQUIRE(cd::partial_lse(empty) == -kInf);
  REQUIRE(cd::partial_lse(cd::combine(empty, empty)) == -kInf);
  const cd::softmax_partial one{2.0f, 1.0f};
  REQUIRE(same_bits(cd::partial_lse(cd::combine(empty, one)), 2.0f));
  REQUIRE(same_bits(cd::partial_lse(cd::combine(one, empty)), 2.0f));
  // A +inf logit: exp(inf - inf) is NaN, so the row's lse is NaN, as on the CPU.
  const cd::softmax_partial inf_tile{kInf, cd::softmax_term(kInf, kInf)};
  REQUIRE(std::isnan(cd::partial_lse(cd::combine(one, inf_tile))));
  REQUIRE(cd::masked_logit(kNaN, true) == -kInf);
  REQUIRE(cd::masked_logit(1.0f, false) == -kInf);
  REQUIRE(cd::attention_prob(1.0f, -kInf) == 0.0f);
  REQUIRE(cd::attention_prob(-kInf, 0.0f) == 0.0f);
  // A NaN lse (a +inf logit in the row): the visible keys' probabilities are NaN and a masked
  // key's is exactly 0, as the CPU's accumulate_row gives them.
  REQUIRE(std::isnan(cd::attention_prob(1.0f, kNaN)));
  REQUIRE(std::isnan(cd::attention_prob(kInf, kNaN)));
  REQUIRE(cd::attention_prob(-kInf, kNaN) == 0.0f);
  REQUIRE(cd::window_step(0.0f, 0.25f, 1.0f, false) == 0.25f);
  REQUIRE(cd::window_step(1.0f, 0.25f, 2.0f, false) == 1.5f);
  REQUIRE(std::isnan(cd::window_step(0.5f, kNaN, 1.0f, true)));
  REQUIRE(cd::window_step(0.5f, 0.25f, 1.0f, true) == 0.5f);
  const std::int64_t qpos[] = {3, 5, 9};
  REQUIRE(cd::visible_count(0, qpos, 3) == 3.0f);
  REQUIRE(cd::visible_count(5, qpos, 3) == 2.0f);
  REQUIRE(cd::visible_count(10, qpos, 3) == 0.0f);
  REQUIRE(cd::normalise(3.0f, 1.0f, true, 0.0f) == 0.0f);
  REQUIRE(cd::normalise(3.0f, 1.0f, true, 2.0f) == 1.5f);
}

TEST_CASE("workspace plans: the size query covers the run, buffers are disjoint and aligned", "[cuda_logic]") {
  struct piece {
    std::uintptr_t begin, end;
  };
  auto check_disjoint = [](std::vector<piece> v) {
    std::sort(v.begin(), v.end(), [](const piece& a, const piece& b) { return a.begin < b.begin; });
    for (std::size_t i = 1; i < v.size(); ++i) REQUIRE(v[i - 1].end <= v[i].begin);
    for (const piece& p : v) REQUIRE(p.begin % kvevict::workspace_alignment == 0);
  };
  for (bool lse : {false, true})
    for (std::int64_t l : {0, 1, 100, 32768}) {
      kvevict::scoring_params sp;
      sp.protected_tail = 32;
      const cd::obs_dims d = cd::make_obs_dims(8, 32, 32, l, sp);
      REQUIRE(d.group == 4);
      REQUIRE(d.candidates == std::max<std::int64_t>(0, l - 32));
      kvevict::detail::arena measure;
      cd::obs_workspace w;
      cd::carve_obs_workspace(measure, d, lse, &w);
      std::vector<unsigned char> mem(measure.used() + 3);
      kvevict::detail::arena run(kvevict::workspace_span{mem.data() + 3, measure.used()});  // misaligned base
      cd::carve_obs_workspace(run, d, lse, &w);
      REQUIRE_FALSE(run.overflowed());
      std::vector<piece> pieces;
      pieces.push_back(
          {reinterpret_cast<std::uintptr_t>(w.acc), reinterpret_cast<std::uintptr_t>(w.acc + 8 * 4 * d.candidates)});
      if (!lse) {
        REQUIRE(w.partials != nullptr);
        pieces.push_back({reinterpret_cast<std::uintptr_t>(w.partials),
                          reinterpret_cast<std::uintptr_t>(w.partials + 8 * d.rows() * d.stat_tiles())});
        pieces.push_back(
            {reinterpret_cast<std::uintptr_t>(w.row_lse), reinterpret_cast<std::uintptr_t>(w.row_lse + 8 * d.rows())});
      } else {
        REQUIRE(w.partials == nullptr);
      }
      check_disjoint(pieces);
      // Too small a workspace is detected.
      kvevict::detail::arena small(kvevict::workspace_span{mem.data(), measure.used() / 2});
      cd::carve_obs_workspace(small, d, lse, &w);
      if (measure.used() > 2 * kvevict::workspace_alignment * 3) REQUIRE(small.overflowed());
    }
  // Decode: logits over the softmax domain; nothing with an engine LSE.
  kvevict::scoring_params cand;
  cand.domain = kvevict::softmax_domain::candidates;
  cand.protected_tail = 10;
  const cd::obs_dims dd = cd::make_obs_dims(2, 6, 1, 1000, cand);
  REQUIRE(dd.softmax_end() == 990);
  kvevict::detail::arena m1, m2;
  cd::decode_workspace dw;
  cd::carve_decode_workspace(m1, dd, false, &dw);
  REQUIRE(m1.used() >= 6 * 990 * sizeof(float) + 6 * static_cast<std::size_t>(cd::decode_tiles(dd)) * 8);
  cd::carve_decode_workspace(m2, dd, true, &dw);
  REQUIRE(m2.used() == 0);
  // Select: one descriptor per row.
  kvevict::detail::arena ms;
  cd::select_workspace sw;
  cd::carve_select_workspace(ms, 256, &sw);
  REQUIRE(ms.used() >= 256 * sizeof(kvevict::cuda::select_row) + 4);
  // Impossible shapes saturate the size query instead of wrapping to a small size.
  const std::int64_t huge = std::int64_t{1} << 62;
  kvevict::detail::arena mh1, mh2, mh3;
  cd::obs_workspace ow;
  cd::carve_obs_workspace(mh1, cd::make_obs_dims(8, 32, 32, huge, kvevict::scoring_params{}), false, &ow);
  REQUIRE(mh1.used() == std::numeric_limits<std::size_t>::max());
  cd::carve_decode_workspace(mh2, cd::make_obs_dims(huge, huge, 1, huge, kvevict::scoring_params{}), false, &dw);
  REQUIRE(mh2.used() == std::numeric_limits<std::size_t>::max());
  cd::compact_dims cdims;
  cdims.capacity = huge;
  cdims.key_row_bytes = 256;
  cdims.value_row_bytes = 256;
  cd::compact_workspace cw;
  cd::carve_compact_workspace(mh3, cdims, &cw);
  REQUIRE(mh3.used() == std::numeric_limits<std::size_t>::max());
}

TEST_CASE("compaction workspace and block-table relations", "[cuda_logic]") {
  std::vector<kvevict::bf16> pool(4 * 16 * 2 * 8);
  std::vector<float> pool32(4 * 16 * 2 * 8);
  const std::int32_t table_a[] = {2, 0}, table_b[] = {1, 3};
  const auto k = kvevict::paged_nhd(pool.data(), 4, 16, 2, 8, table_a, 20);
  // vLLM: one table, two pools.
  const auto v_other = kvevict::paged_nhd(pool32.data(), 4, 16, 2, 8, table_a, 20);
  auto rel = cd::relate_tables(k, v_other);
  REQUIRE(rel.same_table);
  REQUIRE_FALSE(rel.shared_pool);
  cd::compact_dims d = cd::make_compact_dims(k, v_other, 40);
  REQUIRE(d.key_bitmap_ids == 4);
  REQUIRE(d.value_bitmap_ids == 0);
  REQUIRE(d.key_row_bytes == 16);
  REQUIRE(d.value_row_bytes == 32);
  // TensorRT-LLM: one pool, separate K and V block lists -> one bitmap for both.
  const auto v_shared = kvevict::paged_nhd(pool.data(), 4, 16, 2, 8, table_b, 20);
  rel = cd::relate_tables(k, v_shared);
  REQUIRE(rel.shared_pool);
  REQUIRE_FALSE(rel.same_table);
  REQUIRE(cd::make_compact_dims(k, v_shared, 40).value_bitmap_ids == 0);
  // The shared bitmap covers the view with more blocks (V's ids are checked against V's count).
  const auto v_shared_larger = kvevict::paged_nhd(pool.data(), 4000, 16, 2, 8, table_b, 20);
  REQUIRE(cd::relate_tables(k, v_shared_larger).shared_pool);
  REQUIRE(cd::make_compact_dims(k, v_shared_larger, 40).key_bitmap_ids == 4000);
  REQUIRE(cd::make_compact_dims(v_shared_larger, k, 40).key_bitmap_ids == 4000);
  // One pool *and* one table is K aliasing V: the shared bitmap flags every block twice.
  REQUIRE(cd::relate_tables(k, k).shared_pool);
  // Separate pools, separate tables: two bitmaps.
  const auto v_sep = kvevict::paged_nhd(pool32.data(), 4, 16, 2, 8, table_b, 20);
  REQUIRE(cd::make_compact_dims(k, v_sep, 40).value_bitmap_ids == 4);
  kvevict::detail::arena a;
  cd::compact_workspace w;
  cd::carve_compact_workspace(a, cd::make_compact_dims(k, v_sep, 40), &w);
  REQUIRE(a.used() >= 4 + 40 * 16 + 40 * 32 + 2 * 4);
  REQUIRE(cd::bitmap_words(0) == 0);
  REQUIRE(cd::bitmap_words(32) == 1);
  REQUIRE(cd::bitmap_words(33) == 2);
  REQUIRE(cd::bitmap_word(37) == 1);
  REQUIRE(cd::bitmap_bit(37) == (1u << 5));
}

TEST_CASE("keep-list checks of the validation kernel agree with the CPU validator", "[cuda_logic]") {
  std::mt19937_64 rng(17);
  for (int trial = 0; trial < 2000; ++trial) {
    const std::int64_t heads = 1 + static_cast<std::int64_t>(rng() % 4), tokens = static_cast<std::int64_t>(rng() % 12);
    std::vector<std::int64_t> offsets(static_cast<std::size_t>(heads + 1), 0), indices;
    for (std::int64_t h = 0; h < heads; ++h) {
      std::vector<std::int64_t> row;
      for (std::int64_t j = 0; j < tokens; ++j)
        if (rng() % 2) row.push_back(j);
      indices.insert(indices.end(), row.begin(), row.end());
      offsets[static_cast<std::size_t>(h + 1)] = static_cast<std::int64_t>(indices.size());
    }
    std::int64_t capacity = static_cast<std::int64_t>(indices.size()) + static_cast<std::int64_t>(rng() % 2);
    switch (rng() % 6) {  // corrupt sometimes
      case 0:
        if (!indices.empty()) indices[rng() % indices.size()] = static_cast<std::int64_t>(rng() % 14) - 1;
        break;
      case 1:
        offsets[static_cast<std::size_t>(rng() % offsets.size())] += 1;
        break;
      case 2:
        capacity = std::max<std::int64_t>(0, capacity - 2);
        break;
      default:
        break;
    }
    indices.resize(static_cast<std::size_t>(std::max<std::int64_t>(capacity, 1)), 0);
    const kvevict::const_keep_list_view keep{heads, offsets.data(), indices.data(), capacity};
    const bool cpu_ok = kvevict::detail::validate_keep_list(keep, heads, tokens, "t", "keep").ok();
    // The kernel's checks, run over every head and entry as the kernel runs them: no
    // short-circuit, so an entry check that would read out of range does it here too.
    bool gpu_ok = true;
    for (std::int64_t h = 0; h < heads; ++h) gpu_ok = cd::offsets_ok(offsets.data(), h, capacity) && gpu_ok;
    const std::int64_t total = std::clamp<std::int64_t>(offsets[static_cast<std::size_t>(heads)], 0, capacity);
    for (std::int64_t e = 0; e < total; ++e) {
      const std::int64_t h = cd::head_of_entry(offsets.data(), heads, e);
      REQUIRE(h >= 0);
      REQUIRE(h < heads);
      const bool first = cd::entry_starts_head(offsets.data(), h, e);
      gpu_ok = cd::entry_ok(indices[static_cast<std::size_t>(e)], first ? -1 : indices[static_cast<std::size_t>(e - 1)],
                            first, tokens) &&
               gpu_ok;
    }
    INFO("trial " << trial);
    REQUIRE(gpu_ok == cpu_ok);
  }
}

TEST_CASE("head_of_entry finds the owning head, skipping empty heads", "[cuda_logic]") {
  const std::int64_t offsets[] = {0, 0, 3, 3, 3, 7, 8};
  for (std::int64_t e = 0; e < 8; ++e) {
    std::int64_t want = 0;
    while (!(offsets[want] <= e && e < offsets[want + 1])) ++want;
    REQUIRE(cd::head_of_entry(offsets, 6, e) == want);
  }
}

namespace {
/// compact_move_kernel (gather, then scatter) on the host through the byte views, both copy
/// modes, over a test cache; returns the buffer afterwards.
template <class T>
void emulate_compact(test::test_cache<T>& c, const std::vector<std::int64_t>& offsets,
                     const std::vector<std::int64_t>& indices) {
  const cd::byte_view v = cd::make_byte_view(c.view);
  const std::int64_t total = offsets.back();
  std::vector<unsigned char> stage(static_cast<std::size_t>(std::max<std::int64_t>(total, 1) * v.row_bytes));
  for (int gather = 1; gather >= 0; --gather)
    for (std::int64_t e = 0; e < total; ++e) {
      const std::int64_t h = cd::head_of_entry(offsets.data(), c.view.num_heads, e);
      const std::int64_t i = e - offsets[static_cast<std::size_t>(h)], src = indices[static_cast<std::size_t>(e)];
      if (!cd::entry_moves(src, i)) continue;
      for (std::int64_t ch = 0; ch < v.head_dim; ++ch) {
        unsigned char* cell = v.data + v.row_offset(h, gather ? src : i) + ch * v.dim_stride;
        unsigned char* staged = stage.data() + e * v.row_bytes + ch * v.element_bytes;
        if (gather) {
          std::memcpy(staged, cell, static_cast<std::size_t>(v.element_bytes));
        } else {
          std::memcpy(cell, staged, static_cast<std::size_t>(v.element_bytes));
        }
      }
    }
}
}  // namespace

TEST_CASE("staged compaction through byte views matches the definition in every layout", "[cuda_logic]") {
  std::mt19937_64 rng(23);
  const std::int64_t heads = 3, tokens = 45, dim = 8;
  for (test::layout lay : test::kAllLayouts) {
    if (lay == test::layout::paged_per_head) continue;  // the CUDA path takes one block table per view
    const std::vector<double> dense = test::normal(static_cast<std::size_t>(heads * tokens * dim), 31);
    auto c = test::make_cache<kvevict::fp16>(lay, heads, tokens, dim, dense);
    const auto before = c.buffer;
    std::vector<std::int64_t> offsets{0}, indices;
    for (std::int64_t h = 0; h < heads; ++h) {
      for (std::int64_t j = 0; j < tokens; ++j)
        if (h == 2 ? j < 10 : rng() % 3 != 0) indices.push_back(j);  // head 2: identity prefix only
      offsets.push_back(static_cast<std::int64_t>(indices.size()));
    }
    const cd::byte_view bv = cd::make_byte_view(c.view);
    INFO(test::name(lay));
    if (lay == test::layout::transposed || lay == test::layout::cells_transposed) {
      REQUIRE(bv.unit == 0);
    } else {
      REQUIRE(bv.unit >= 2);
    }
    emulate_compact(c, offsets, indices);
    // Expected: row i of head h holds old row keep[h][i]; every other element unchanged.
    auto expect = test::make_cache<kvevict::fp16>(lay, heads, tokens, dim, dense);
    for (std::size_t x = 0; x < before.size(); ++x) REQUIRE(expect.buffer[x].bits == before[x].bits);
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t i = 0; i < offsets[static_cast<std::size_t>(h + 1)] - offsets[static_cast<std::size_t>(h)]; ++i)
        for (std::int64_t ch = 0; ch < dim; ++ch) {
          const std::int64_t src = indices[static_cast<std::size_t>(offsets[static_cast<std::size_t>(h)] + i)];
          expect.at(h, i, ch) = before[static_cast<std::size_t>(expect.offset(h, src, ch))];
        }
    for (std::size_t x = 0; x < before.size(); ++x) REQUIRE(c.buffer[x].bits == expect.buffer[x].bits);
  }
}

TEST_CASE("copy units follow alignment", "[cuda_logic]") {
  REQUIRE(cd::copy_unit(4096, 256, 256 * 10, 256, 0, 2) == 16);
  REQUIRE(cd::copy_unit(4096, 24, 240, 24, 0, 2) == 8);
  REQUIRE(cd::copy_unit(4100, 256, 2560, 256, 0, 2) == 4);
  REQUIRE(cd::copy_unit(4098, 256, 2560, 256, 0, 2) == 2);
  REQUIRE(cd::copy_unit(4098, 6, 60, 6, 0, 2) == 2);
  REQUIRE(cd::copy_unit(4100, 12, 120, 12, 0, 4) == 4);
}

TEST_CASE("device flags decode to a status naming the problem", "[cuda_logic]") {
  using namespace kvevict::cuda;
  REQUIRE(device_flags_status(0).ok());
  REQUIRE(device_flags_status(flag_block_id_out_of_range).code() == kvevict::errc::out_of_range);
  REQUIRE(device_flags_status(flag_duplicate_block).code() == kvevict::errc::invalid_argument);
  REQUIRE(device_flags_status(flag_invalid_keep_list).code() == kvevict::errc::invalid_keep_list);
  REQUIRE(device_flags_status(flag_capacity_exceeded).code() == kvevict::errc::invalid_keep_list);
  REQUIRE(device_flags_status(flag_invalid_row).code() == kvevict::errc::invalid_argument);
  REQUIRE(device_flags_status(flag_negative_position).code() == kvevict::errc::out_of_range);
  REQUIRE(device_flags_status(flag_invalid_weights).code() == kvevict::errc::invalid_argument);
  REQUIRE(device_flags_status(flag_shared_block).code() == kvevict::errc::invalid_argument);
  const auto pseudo = device_flags_status(flag_query_position);
  REQUIRE(pseudo.code() == kvevict::errc::out_of_range);
  REQUIRE(std::string(pseudo.argument()) == "queries.positions");
  const auto length = device_flags_status(flag_length_out_of_range);
  REQUIRE(length.code() == kvevict::errc::out_of_range);
  REQUIRE(std::string(length.message()).find("num_tokens") != std::string::npos);
  REQUIRE(device_flags_status(1u << 20).code() == kvevict::errc::device_error);
  // Several bits: the block-table problem is reported first.
  const auto s = device_flags_status(flag_invalid_row | flag_block_id_out_of_range, "kvevict::cuda::compact");
  REQUIRE(s.code() == kvevict::errc::out_of_range);
  REQUIRE(std::string(s.message()).find("kvevict::cuda::compact") == 0);
}
