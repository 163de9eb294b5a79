// CPU paths (docs/cpu-dispatch.md): the process's path follows KVEVICT_ISA; the kernel sets
// agree with each other as the docs promise. Every set this CPU can run is called directly
// (detail::isa_*), whatever path the process itself runs, so one run of the suite compares
// them all:
//   - AVX2 and AVX-512 (float32 products) give bit-identical aggregated attention, hence
//     identical scores and keep-lists, for every storage type;
//   - the portable set, and bf16 x bf16 pair products (VDPBF16PS), agree with them and with
//     the double-precision reference within the scoring tolerance (support/compare.hpp), and
//     their keep-lists are identical except at near-ties;
//   - widening and the top-k survivor sweep give the same results on every path.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kvevict/cpu_isa.hpp"
#include "kvevict/detail/observe.hpp"
#include "kvevict/detail/topk.hpp"
#include "kvevict/detail/widen.hpp"
#include "kvevict/selection/select.hpp"
#include "reference/reference.hpp"
#include "support/near_tie.hpp"
#include "support/scoring_config.hpp"
#include "support/test_cache.hpp"

using kvevict::bf16;
using kvevict::cpu_isa;
using kvevict::fp16;
namespace detail = kvevict::detail;

namespace {

using i64 = std::int64_t;

bool supported(cpu_isa isa) {
  return kvevict::cpu_isa_supported(isa);
}

template <class T>
const char* dtype_name() {
  return kvevict::to_string(kvevict::dtype_of<T>::value);
}

TEST_CASE("the process's CPU path follows KVEVICT_ISA", "[isa]") {
  const kvevict::cpu_isa_report& r = kvevict::cpu_isa_details();
  INFO("supported " << kvevict::to_string(r.supported) << ", active " << kvevict::to_string(r.active) << ", note '"
                    << r.note << "'");
  REQUIRE(static_cast<int>(r.active) <= static_cast<int>(r.supported));
  REQUIRE(kvevict::active_cpu_isa() == r.active);
  REQUIRE(kvevict::supported_cpu_isa() == r.supported);
  const char* env = std::getenv("KVEVICT_ISA");
  if (env == nullptr || env[0] == '\0' || std::string(env) == "auto") {
    REQUIRE_FALSE(r.requested);
    REQUIRE((r.active == r.supported || r.amx_refused));
    return;
  }
  REQUIRE(r.requested);
  cpu_isa want = cpu_isa::scalar;
  REQUIRE(r.request_valid == kvevict::parse_cpu_isa(env, &want));
  if (!r.request_valid) {
    REQUIRE(r.active == r.supported);
    REQUIRE(std::string(r.note).find("is not one of") != std::string::npos);
  } else if (!supported(want)) {
    REQUIRE(r.active == r.supported);
    REQUIRE(std::string(r.note).find("beyond this CPU") != std::string::npos);
  } else if (want == cpu_isa::amx && r.amx_refused) {
    REQUIRE(r.active == cpu_isa::avx512bf16);
  } else {
    // A forced run of the suite (scripts/test) must really run the path it names.
    REQUIRE(r.active == want);
    REQUIRE(r.note[0] == '\0');
  }
}

TEST_CASE("path names round-trip and order the paths", "[isa]") {
  for (int i = 0; i <= static_cast<int>(cpu_isa::amx); ++i) {
    const auto isa = static_cast<cpu_isa>(i);
    cpu_isa back = cpu_isa::amx;
    REQUIRE(kvevict::parse_cpu_isa(kvevict::to_string(isa), &back));
    REQUIRE(back == isa);
    if (i > 0 && supported(isa)) REQUIRE(supported(static_cast<cpu_isa>(i - 1)));
  }
  cpu_isa x = cpu_isa::avx2;
  REQUIRE_FALSE(kvevict::parse_cpu_isa("avx512f", &x));
  REQUIRE_FALSE(kvevict::parse_cpu_isa(nullptr, &x));
  REQUIRE(x == cpu_isa::avx2);
  REQUIRE(supported(cpu_isa::scalar));
}

// ---- observation kernels across sets ------------------------------------------------------

enum class kernel_set { scalar, avx2, avx512, avx512_pairs };

const char* name(kernel_set k) {
  switch (k) {
    case kernel_set::scalar:
      return "scalar";
    case kernel_set::avx2:
      return "avx2";
    case kernel_set::avx512:
      return "avx512";
    case kernel_set::avx512_pairs:
      return "avx512bf16 (VDPBF16PS)";
  }
  return "?";
}

bool runnable(kernel_set k) {
  switch (k) {
    case kernel_set::scalar:
      return true;
    case kernel_set::avx2:
      return supported(cpu_isa::avx2);
    case kernel_set::avx512:
      return supported(cpu_isa::avx512);
    case kernel_set::avx512_pairs:
      return supported(cpu_isa::avx512bf16);
  }
  return false;
}

struct head_case {
  i64 group, window, dim, tokens, protected_tail;
  test::layout lay;
  bool lse = false;            ///< engine LSE (one sweep)
  bool weighted = false;       ///< per-observation weights
  bool max_window = false;     ///< max over the window instead of the sum
  bool shuffled_kpos = false;  ///< key positions in no particular order (llama.cpp cells)
};

std::string describe(const head_case& c) {
  return "G=" + std::to_string(c.group) + " W=" + std::to_string(c.window) + " d=" + std::to_string(c.dim) +
         " L=" + std::to_string(c.tokens) + " P=" + std::to_string(c.protected_tail) + " " + test::name(c.lay) +
         (c.lse ? " lse" : "") + (c.weighted ? " weighted" : "") + (c.max_window ? " max" : "") +
         (c.shuffled_kpos ? " shuffled-positions" : "");
}

/// Everything one head's observation needs, with the double-precision reference of acc.
template <class T>
struct head_problem {
  head_case c;
  ref::problem rp;
  test::test_cache<T> keys;
  test::test_queries<T> queries;
  std::vector<float> weights, lse;
  detail::observation_problem p;
  std::vector<double> want;  ///< [G, C] reference acc of head 0

  head_problem(const head_case& hc, std::uint64_t seed) : c(hc) {
    rp.hq = c.group;
    rp.hkv = 1;
    rp.w = c.window;
    rp.l = c.tokens;
    rp.d = c.dim;
    rp.q = test::rounded<T>(test::normal(static_cast<std::size_t>(c.group * c.window * c.dim), seed, 1.5));
    rp.k = test::rounded<T>(test::normal(static_cast<std::size_t>(c.tokens * c.dim), seed + 1));
    for (i64 t = 0; t < c.window; ++t) rp.qpos.push_back(c.tokens - c.window + t);
    if (c.shuffled_kpos) {
      for (i64 j = 0; j < c.tokens; ++j) rp.kpos.push_back(j);
      std::mt19937_64 rng(seed + 2);
      std::shuffle(rp.kpos.begin(), rp.kpos.end(), rng);
    }
    keys = test::make_cache<T>(c.lay, 1, c.tokens, c.dim, rp.k, 16, seed);
    queries = test::make_queries<T>(c.group, c.window, c.dim, rp.q, rp.qpos);
    if (c.weighted)
      for (i64 t = 0; t < c.window; ++t) weights.push_back(std::pow(0.8f, static_cast<float>(c.window - 1 - t)));

    p.group = c.group;
    p.window = c.window;
    p.dim = c.dim;
    p.tokens = c.tokens;
    p.candidates = c.tokens - c.protected_tail;
    p.query_positions = queries.positions.data();
    p.key_positions = rp.kpos.empty() ? nullptr : rp.kpos.data();
    p.key_positions_sorted = rp.kpos.empty();
    p.weights = weights.empty() ? nullptr : weights.data();
    p.max_over_window = c.max_window;

    ref::params rs;
    rs.protected_tail = c.protected_tail;
    want.assign(static_cast<std::size_t>(c.group * p.candidates), 0.0);
    for (i64 g = 0; g < c.group; ++g) {
      const auto a = ref::attention(rp, rs, g);  // [W][C]
      for (i64 t = 0; t < c.window; ++t)
        for (i64 j = 0; j < p.candidates; ++j) {
          double& w = want[static_cast<std::size_t>(g * p.candidates + j)];
          const double x = a[static_cast<std::size_t>(t)][static_cast<std::size_t>(j)];
          w = c.max_window ? std::max(w, x) : w + (weights.empty() ? 1.0 : weights[static_cast<std::size_t>(t)]) * x;
        }
    }
    if (c.lse) {  // the engine's LSE of each row, from the reference's logits
      lse.resize(static_cast<std::size_t>(c.group * c.window));
      for (i64 g = 0; g < c.group; ++g)
        for (i64 t = 0; t < c.window; ++t) {
          double m = -INFINITY, z = 0.0;
          for (i64 j = 0; j < c.tokens; ++j) {
            const i64 kp = rp.kpos.empty() ? j : rp.kpos[static_cast<std::size_t>(j)];
            if (kp > rp.qpos[static_cast<std::size_t>(t)]) continue;
            double dot = 0;
            for (i64 d = 0; d < c.dim; ++d)
              dot += rp.q[static_cast<std::size_t>((g * c.window + t) * c.dim + d)] *
                     rp.k[static_cast<std::size_t>(j * c.dim + d)];
            dot /= std::sqrt(static_cast<double>(c.dim));
            if (dot > m) {
              z *= std::exp(m - dot);
              m = dot;
            }
            z += std::exp(dot - m);
          }
          lse[static_cast<std::size_t>(g * c.window + t)] = static_cast<float>(m + std::log(z));
        }
      p.lse = lse.data();
      p.lse_head_stride = c.window;
    }
  }

  /// acc [G, C] of head 0 from one kernel set.
  std::vector<float> run(kernel_set k) const {
    detail::arena measure;
    detail::observation_scratch s;
    detail::carve_observation_scratch(measure, p, &s);
    std::vector<unsigned char> bytes(measure.used() + 64, 0xa5);  // stale bytes: kernels must not read them
    detail::arena a(kvevict::workspace_span{bytes.data(), bytes.size()});
    detail::carve_observation_scratch(a, p, &s);
    REQUIRE_FALSE(a.overflowed());
    const kvevict::query_view<const T> qv = queries.view;
    const kvevict::cache_view<const T> kv = keys.view;
    switch (k) {
      case kernel_set::scalar:
        detail::isa_scalar::observe_head(qv, kv, 0, p, s, detail::bf16_products::none);
        break;
#if KVEVICT_X86_DISPATCH
      case kernel_set::avx2:
        detail::isa_avx2::observe_head(qv, kv, 0, p, s, detail::bf16_products::none);
        break;
      case kernel_set::avx512:
        detail::isa_avx512::observe_head(qv, kv, 0, p, s, detail::bf16_products::none);
        break;
      case kernel_set::avx512_pairs:
        detail::isa_avx512::observe_head(qv, kv, 0, p, s, detail::bf16_products::vdpbf16ps);
        break;
#else
      default:
        FAIL("no SIMD kernel sets in this build");
#endif
    }
    return {s.acc, s.acc + c.group * p.candidates};
  }
};

/// |got - want| <= 1e-4 |want| + 1e-6 max|want row| (support/compare.hpp's tolerance).
template <class A, class B>
void require_close(const std::vector<A>& got, const std::vector<B>& want, i64 rows, i64 cols) {
  for (i64 g = 0; g < rows; ++g) {
    double scale = 0;
    for (i64 j = 0; j < cols; ++j)
      scale = std::max(scale, std::fabs(static_cast<double>(want[static_cast<std::size_t>(g * cols + j)])));
    for (i64 j = 0; j < cols; ++j) {
      const double x = static_cast<double>(got[static_cast<std::size_t>(g * cols + j)]);
      const double y = static_cast<double>(want[static_cast<std::size_t>(g * cols + j)]);
      INFO("row " << g << " key " << j << " got " << x << " want " << y);
      REQUIRE(std::fabs(x - y) <= 1e-4 * std::fabs(y) + 1e-6 * scale + 1e-30);
    }
  }
}

/// Keep-lists of the first acc row as scores (top `budget` of C): identical to the
/// reference's, except where the reference leaves the budget's edge a near-tie.
void require_same_keep(const std::vector<float>& got, const std::vector<double>& want, i64 cols, i64 budget) {
  const std::vector<double> row(want.begin(), want.begin() + cols);
  if (test::near_tie_at(row, cols, budget)) return;
  kvevict::keep_list keep(1, budget);
  kvevict::workspace ws(kvevict::select_workspace_size(cols));
  REQUIRE(kvevict::select(kvevict::const_score_view{got.data(), 1, cols, cols}, kvevict::budget::tokens(budget), {},
                          keep, ws)
              .ok());
  const auto expect = ref::top_k(row, budget);
  const kvevict::const_keep_list_view v = keep;
  REQUIRE(std::vector<i64>(v.indices, v.indices + v.offsets[1]) == expect);
}

template <class T>
void compare_sets(const head_case& c, std::uint64_t seed) {
  INFO(describe(c) << " " << dtype_name<T>());
  const head_problem<T> hp(c, seed);
  const i64 cols = hp.p.candidates;
  std::vector<float> fma;  // the float32 FMA result (AVX2 = AVX-512)
  if (runnable(kernel_set::avx2)) fma = hp.run(kernel_set::avx2);
  if (runnable(kernel_set::avx512)) {
    const auto wide = hp.run(kernel_set::avx512);
    if (!fma.empty()) {
      INFO("AVX2 and AVX-512 must agree bit for bit");
      REQUIRE(std::memcmp(fma.data(), wide.data(), fma.size() * sizeof(float)) == 0);
    }
    fma = wide;
  }
  std::vector<kernel_set> sets = {kernel_set::scalar};
  if (std::is_same<T, bf16>::value) sets.push_back(kernel_set::avx512_pairs);
  for (kernel_set k : sets) {
    if (!runnable(k)) continue;
    INFO("kernel set " << name(k));
    const auto got = hp.run(k);
    require_close(got, hp.want, c.group, cols);
    if (!fma.empty()) require_close(got, fma, c.group, cols);
    if (cols > 4) require_same_keep(got, hp.want, cols, cols / 3);
  }
  if (!fma.empty()) {
    require_close(fma, hp.want, c.group, cols);
    if (cols > 4) require_same_keep(fma, hp.want, cols, cols / 3);
  }
}

const head_case kHeadCases[] = {
    // Decode-sized (G*W <= 16: logits kept, keys read once), channel tails, strided channels.
    {4, 1, 128, 300, 1, test::layout::contiguous},
    {4, 1, 24, 77, 1, test::layout::paged_nhd},
    {3, 2, 100, 513, 2, test::layout::padded},
    {8, 2, 8, 40, 2, test::layout::transposed},
    {16, 1, 64, 129, 1, test::layout::contiguous, false, false, true},
    {2, 4, 32, 200, 4, test::layout::paged_hnd, false, true},
    // Prompt windows (two sweeps, panels and micro-kernels), row and key tails.
    {4, 16, 128, 700, 16, test::layout::contiguous},
    {4, 16, 64, 300, 16, test::layout::paged_nhd, false, true},
    {3, 7, 96, 257, 7, test::layout::token_major},
    {5, 9, 24, 130, 9, test::layout::transposed},
    {4, 8, 128, 600, 8, test::layout::contiguous, true},
    {2, 12, 40, 333, 12, test::layout::padded, false, false, true},
    {4, 8, 64, 260, 0, test::layout::contiguous, false, false, false, true},
    {1, 40, 128, 1100, 40, test::layout::paged_hnd},
};

TEST_CASE("observation kernels: AVX2 = AVX-512 bit for bit, the rest within tolerance", "[isa]") {
  std::uint64_t seed = 100;
  for (const head_case& c : kHeadCases) {
    compare_sets<float>(c, seed);
    compare_sets<fp16>(c, seed + 1);
    compare_sets<bf16>(c, seed + 2);
    seed += 10;
  }
}

TEST_CASE("exp: AVX2 and AVX-512 give the same bits, within 2 ulp of std::exp", "[isa]") {
#if KVEVICT_X86_DISPATCH
  if (!runnable(kernel_set::avx2) || !runnable(kernel_set::avx512)) return;
  // Every exponent, dense around 0 and through the subnormal range, and the special values.
  std::vector<float> x;
  for (float v = -110.0f; v <= 90.0f; v += 0.0371f) x.push_back(v);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-105.0f, 89.0f);
  for (int i = 0; i < 20000; ++i) x.push_back(u(rng));
  for (float v :
       {0.0f, -0.0f, 88.7f, 88.72f, -87.3f, -103.97f, -104.0f, -150.0f, std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()})
    x.push_back(v);
  const i64 n = static_cast<i64>(x.size());
  std::vector<float> a(x.size(), 0.0f), b(x.size(), 0.0f);
  // acc = 0 + 1 * exp(x - 0) for every x except -inf and NaN (exactly 0 by contract).
  detail::isa_avx2::accumulate_row(false, x.data(), n, 0.0f, 1.0f, a.data());
  detail::isa_avx512::accumulate_row(false, x.data(), n, 0.0f, 1.0f, b.data());
  for (i64 i = 0; i < n; ++i) {
    const float xi = x[static_cast<std::size_t>(i)], ai = a[static_cast<std::size_t>(i)],
                bi = b[static_cast<std::size_t>(i)];
    INFO("x = " << xi << " avx2 " << ai << " avx512 " << bi);
    if (std::isnan(xi)) {  // a NaN logit (NaN key or query) gets zero attention
      REQUIRE(ai == 0.0f);
      REQUIRE(bi == 0.0f);
      continue;
    }
    std::uint32_t ab, bb;
    std::memcpy(&ab, &ai, 4);
    std::memcpy(&bb, &bi, 4);
    REQUIRE(ab == bb);
    if (xi == -std::numeric_limits<float>::infinity() || xi < -104.0f) {
      REQUIRE(ai == 0.0f);
      continue;
    }
    const float want = std::exp(std::min(xi, 88.7f));
    if (want >= std::numeric_limits<float>::min()) {
      REQUIRE(std::fabs(ai - want) <= 2.5f * std::fabs(want) * std::numeric_limits<float>::epsilon());
    } else {  // subnormal results: within 2 units of the smallest subnormal
      REQUIRE(std::fabs(ai - want) <= 2.0f * std::numeric_limits<float>::denorm_min());
    }
  }
#endif
}

// ---- widening and the top-k sweep ---------------------------------------------------------

template <class T>
std::vector<T> random_bits(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<T> v(n);
  for (auto& x : v) {
    const auto b = static_cast<std::uint16_t>(rng());
    std::memcpy(&x, &b, sizeof(T));
  }
  return v;
}

template <class T>
void compare_widen(std::uint64_t seed) {
  for (i64 n : {0, 1, 7, 8, 15, 16, 17, 31, 100, 257}) {
    for (i64 stride : {1, 3}) {
      INFO(dtype_name<T>() << " n " << n << " stride " << stride);
      const auto src = random_bits<T>(static_cast<std::size_t>(n * stride + 1), seed + static_cast<std::uint64_t>(n));
      std::vector<float> want(static_cast<std::size_t>(n) + 1, -1.0f), got = want;
      detail::isa_scalar::widen_row(src.data(), stride, want.data(), n);
      std::vector<std::vector<float>> outs;
#if KVEVICT_X86_DISPATCH
      if (runnable(kernel_set::avx2)) {
        detail::isa_avx2::widen_row(src.data(), stride, got.data(), n);
        outs.push_back(got);
      }
      if (runnable(kernel_set::avx512)) {
        detail::isa_avx512::widen_row(src.data(), stride, got.data(), n);
        outs.push_back(got);
      }
#endif
      for (const auto& o : outs) {
        for (std::size_t i = 0; i < want.size(); ++i) {
          if (std::isnan(want[i])) {  // NaN stays NaN (F16C quiets signalling payloads)
            REQUIRE(std::isnan(o[i]));
          } else {
            REQUIRE(std::memcmp(&o[i], &want[i], sizeof(float)) == 0);  // exact, the guard past n untouched
          }
        }
      }
    }
  }
}

TEST_CASE("widening is exact on every path", "[isa]") {
  compare_widen<bf16>(1);
  compare_widen<fp16>(2);
  compare_widen<kvevict::fp8_e4m3>(3);  // F16C / AVX-512 conversions through fp16, every code
  compare_widen<kvevict::fp8_e5m2>(4);
}

TEST_CASE("the top-k survivor sweep keeps the same offsets on every path", "[isa]") {
  std::mt19937_64 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (i64 n : {0, 1, 7, 8, 9, 15, 16, 17, 64, 1000, 4099}) {
    std::vector<float> x(static_cast<std::size_t>(n));
    for (auto& v : x) {
      const auto r = rng() % 16;
      v = r == 0   ? std::numeric_limits<float>::quiet_NaN()
          : r == 1 ? -0.0f
          : r == 2 ? 0.0f
          : r == 3 ? 1.0f
                   : std::round(normal(rng) * 8.0f) / 4.0f;
    }
    for (float t : {-1e30f, -1.0f, -0.0f, 0.0f, 0.5f, 1.0f, 3.0f}) {
      const std::uint32_t threshold = detail::score_key(t);
      INFO("n " << n << " threshold " << t);
      std::vector<std::uint32_t> idx(static_cast<std::size_t>(n) + 1), key(idx.size());
      const i64 m = detail::isa_scalar::filter_at_least(x.data(), n, threshold, idx.data(), key.data());
      for (i64 i = 0; i < m; ++i) REQUIRE(key[static_cast<std::size_t>(i)] >= threshold);
      std::vector<std::uint32_t> idx2(idx.size()), key2(idx.size());
      auto check = [&](i64 m2) {
        REQUIRE(m2 == m);
        for (i64 i = 0; i < m; ++i) {
          REQUIRE(idx2[static_cast<std::size_t>(i)] == idx[static_cast<std::size_t>(i)]);
          REQUIRE(key2[static_cast<std::size_t>(i)] == key[static_cast<std::size_t>(i)]);
        }
      };
#if KVEVICT_X86_DISPATCH
      if (runnable(kernel_set::avx2))
        check(detail::isa_avx2::filter_at_least(x.data(), n, threshold, idx2.data(), key2.data()));
      if (runnable(kernel_set::avx512))
        check(detail::isa_avx512::filter_at_least(x.data(), n, threshold, idx2.data(), key2.data()));
#endif
      (void)check;
    }
  }
}

}  // namespace
