// SPDX-License-Identifier: Apache-2.0
// Shared by kvevict's CPU benchmarks (kvevict_bench, kvevict_bench_summary,
// kvevict_bench_vs_torch): the benchmarked shapes, deterministic synthetic layers, the
// FLOP and byte counts every report uses, and a CPU-time clock.
//
// Counting conventions (docs/benchmarks.md):
//   - scoring FLOPs are the logit GEMM's multiply-adds, 2 FLOP each; the softmax's exp and
//     the pooling are not counted. "executed" counts every sweep over the keys (2 without an
//     engine LSE, 1 with it); "useful" counts one sweep (design.md §10's ~256 FLOP
//     per K element at G*W = 128).
//   - bytes are the bytes the kernel must move at least once: K read once for a decode
//     observation; kept K and V rows copied once (read + write of the same bytes counted
//     once, like memcpy's "bytes copied") for compaction.
#ifndef KVEVICT_BENCH_COMMON_HPP
#define KVEVICT_BENCH_COMMON_HPP

#include <kvevict/kvevict.hpp>

#include <time.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

namespace kb {

/// 64-byte aligned storage, as engines allocate their caches (torch, vLLM, llama.cpp all do):
/// unaligned rows would make every 512-bit access straddle two cache lines.
template <class T>
struct aligned_allocator {
  using value_type = T;
  aligned_allocator() = default;
  template <class U>
  aligned_allocator(const aligned_allocator<U>&) noexcept {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const aligned_allocator<U>&) const noexcept {
    return true;
  }
  template <class U>
  bool operator!=(const aligned_allocator<U>&) const noexcept {
    return false;
  }
};
template <class T>
using buffer = std::vector<T, aligned_allocator<T>>;

using kvevict::bf16;
using kvevict::fp16;

/// Llama-3.1-8B, Qwen3-8B and Mistral-7B share one attention shape per layer (32 query heads,
/// 8 KV heads, d = 128), so one set of numbers covers all three.
struct model_shape {
  const char* name;
  std::int64_t hq, hkv, d;
};
constexpr model_shape reference_model{"Llama-3.1-8B / Qwen3-8B / Mistral-7B", 32, 8, 128};
constexpr std::int64_t reference_window = 32;    ///< W
constexpr std::int64_t reference_budget = 2048;  ///< B per KV head (window inside)

template <class T>
const char* dtype_name();
template <>
inline const char* dtype_name<float>() {
  return "f32";
}
template <>
inline const char* dtype_name<fp16>() {
  return "fp16";
}
template <>
inline const char* dtype_name<bf16>() {
  return "bf16";
}

inline void die(const char* what, const kvevict::status& st) {
  if (st.ok()) return;
  std::fprintf(stderr, "%s: %s\n", what, st.message());
  std::exit(1);
}

/// CPU time of this process, seconds. The machine these run on is shared; CPU time excludes
/// the time another process holds our core (memory contention still shows).
inline double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

/// Median CPU seconds of fn() over at least `min_reps` runs and `min_seconds` in total
/// (after one warm-up run), capped at `max_reps`.
template <class F>
double median_seconds(F&& fn, int min_reps = 3, double min_seconds = 0.2, int max_reps = 50) {
  fn();
  std::vector<double> t;
  double total = 0.0;
  while (static_cast<int>(t.size()) < max_reps && (static_cast<int>(t.size()) < min_reps || total < min_seconds)) {
    const double t0 = cpu_seconds();
    fn();
    const double dt = cpu_seconds() - t0;
    t.push_back(dt);
    total += dt;
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// Deterministic, fast pseudo-normal values (sum of four uniforms, variance 1).
class rng {
 public:
  explicit rng(std::uint64_t seed) : s_(seed * 0x9e3779b97f4a7c15ull + 1) {}
  std::uint64_t next() {
    s_ ^= s_ << 13;
    s_ ^= s_ >> 7;
    s_ ^= s_ << 17;
    return s_;
  }
  float normal() {
    const std::uint64_t r = next();
    float sum = 0.0f;
    for (int i = 0; i < 4; ++i) sum += static_cast<float>((r >> (16 * i)) & 0xffff) * (1.0f / 65536.0f);
    return (sum - 2.0f) * 1.7320508f;  // Irwin-Hall(4): mean 2, variance 1/3
  }

 private:
  std::uint64_t s_;
};

template <class V>
void fill_normal(V& v, std::uint64_t seed, float scale) {
  using T = typename V::value_type;
  rng r(seed);
  for (auto& x : v) x = kvevict::from_float<T>(scale * r.normal());
}

/// One layer's buffers: K and V [Hkv, capacity, d] (HF contiguous), observation queries
/// [Hq, W, d] at positions L-W .. L-1, for `tokens` tokens of prompt.
template <class T>
struct layer {
  model_shape shape;
  std::int64_t tokens = 0, capacity = 0, window = 0;
  buffer<T> k, v, q;
  std::vector<std::int64_t> positions;

  layer(const model_shape& s, std::int64_t l, std::int64_t w, std::int64_t extra = 0, std::uint64_t seed = 1)
      : shape(s), tokens(l), capacity(l + extra), window(w) {
    k.resize(static_cast<std::size_t>(s.hkv * capacity * s.d));
    v.resize(k.size());
    q.resize(static_cast<std::size_t>(s.hq * w * s.d));
    fill_normal(k, seed, 1.0f);
    fill_normal(v, seed + 1, 1.0f);
    // Queries twice the keys' scale: logits ~ N(0, 4), attention peaked like a trained model's.
    fill_normal(q, seed + 2, 2.0f);
    for (std::int64_t t = 0; t < w; ++t) positions.push_back(l - w + t);
  }
  kvevict::cache_view<T> keys(std::int64_t n = -1) {
    return kvevict::hf_contiguous(k.data(), shape.hkv, n < 0 ? tokens : n, shape.d, capacity);
  }
  kvevict::cache_view<T> values(std::int64_t n = -1) {
    return kvevict::hf_contiguous(v.data(), shape.hkv, n < 0 ? tokens : n, shape.d, capacity);
  }
  kvevict::cache_view<const T> keys_const() const {
    return kvevict::hf_contiguous<const T>(k.data(), shape.hkv, tokens, shape.d, capacity);
  }
  kvevict::query_view<const T> queries() const {
    return kvevict::contiguous_queries<const T>(q.data(), shape.hq, window, shape.d, positions.data());
  }
  kvevict::layer_inputs<T> inputs(std::int64_t n = -1) {
    kvevict::layer_inputs<T> in;
    in.keys = keys(n);
    in.queries = queries();
    return in;
  }
};

/// SnapKV at the reference conventions: kvpress's (avg pool 5 counting padding, window mean,
/// GQA mean after pooling, window inside the budget) with W = 32.
inline kvevict::window_config reference_snapkv(std::int64_t window = reference_window) {
  kvevict::window_config c = kvevict::presets::kvpress_snapkv();
  c.window = window;
  return c;
}

// ---- counts ---------------------------------------------------------------------------------

/// GEMM FLOPs of one sweep of observation scoring: 2 * Hq * W * L * d.
inline double scoring_flops_one_sweep(const model_shape& s, std::int64_t w, std::int64_t l) {
  return 2.0 * static_cast<double>(s.hq) * static_cast<double>(w) * static_cast<double>(l) * static_cast<double>(s.d);
}
/// Bytes of one layer's K (or V): Hkv * L * d elements.
template <class T>
double cache_bytes(const model_shape& s, std::int64_t l) {
  return static_cast<double>(s.hkv) * static_cast<double>(l) * static_cast<double>(s.d) * sizeof(T);
}

/// A deterministic ascending keep-list of `keep` tokens out of `tokens` per head: the last
/// `tail` tokens plus a uniform random subset of the rest (a SnapKV keep-list's shape).
inline kvevict::keep_list random_keep_list(std::int64_t heads, std::int64_t tokens, std::int64_t keep,
                                           std::int64_t tail, std::uint64_t seed) {
  kvevict::keep_list out(heads, heads * keep);
  kvevict::keep_list_view v = out.view();
  rng r(seed);
  std::vector<std::int64_t> idx(static_cast<std::size_t>(tokens - tail));
  v.offsets[0] = 0;
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<std::int64_t>(i);
    const std::int64_t pick = keep - tail;
    for (std::int64_t i = 0; i < pick; ++i) {  // partial Fisher-Yates
      const auto j = static_cast<std::size_t>(i) + static_cast<std::size_t>(r.next() % (idx.size() - i));
      std::swap(idx[static_cast<std::size_t>(i)], idx[j]);
    }
    std::sort(idx.begin(), idx.begin() + pick);
    std::int64_t* dst = v.indices + h * keep;
    std::copy(idx.begin(), idx.begin() + pick, dst);
    for (std::int64_t i = 0; i < tail; ++i) dst[pick + i] = tokens - tail + i;
    v.offsets[h + 1] = (h + 1) * keep;
  }
  return out;
}

/// Attention-like score rows [rows, n]: log-normal, positive, a few large (what SnapKV hands
/// to selection), without ties.
inline std::vector<float> score_rows(std::int64_t rows, std::int64_t n, std::uint64_t seed) {
  std::vector<float> s(static_cast<std::size_t>(rows * n));
  rng r(seed);
  for (auto& x : s) x = std::exp(1.5f * r.normal()) * 1e-4f;
  return s;
}

/// How this binary was built and which CPU path it runs: the compiler, the translation
/// units' instruction-set baseline (kvevict's ABI namespace, detail/abi.hpp) and the path the
/// process chose (cpu_isa.hpp; KVEVICT_ISA lowers it).
inline std::string build_line() {
  std::string s;
#if defined(__clang__)
  s += "clang " __clang_version__;
#elif defined(__GNUC__)
  s += "GCC " __VERSION__;
#endif
#if defined(__OPTIMIZE__)
  s += ", optimised";
#endif
#if defined(__AVX512F__)
  s += ", baseline with AVX-512";
#elif defined(__AVX2__)
  s += ", baseline with AVX2";
#else
  s += ", generic x86-64 baseline";
#endif
  s += " (kvevict::" KVEVICT_ABI_NAMESPACE_NAME "), CPU path ";
  s += kvevict::to_string(kvevict::active_cpu_isa());
  return s;
}

}  // namespace kb

#endif  // KVEVICT_BENCH_COMMON_HPP
