// SPDX-License-Identifier: Apache-2.0
// kvevict_bench: Google Benchmark microbenchmarks of kvevict's CPU path (design.md section
// 10; methodology in docs/benchmarks.md). One thread; times are CPU time.
//
//   roofline/*          this machine's fp32 FMA peak, DRAM read and memcpy bandwidth, measured
//                       at start-up in the same process (also in the JSON context)
//   score_prompt/*      prompt-window observation scoring (SnapKV's), without (window) or with
//                       an engine LSE: GFLOP/s executed (the sweeps the CPU path takes) and
//                       useful (one sweep), fraction of FMA peak
//   score_decode/*      one decode observation (DeferKV's decode step): GB/s of K read, fraction
//                       of read bandwidth
//   select/*            top-B selection of [Hkv, L] scores vs std::nth_element/partial_sort
//   compact/*           in-place compaction of K and V: GB/s copied, fraction of memcpy
//   snapkv|deferkv|dapq/*  whole per-layer pipelines: scoring (+ decode steps), select, evict
//   long_generation/*   decode-time budgets: one period of N + 1 decode steps (N = 16, 64, 256)
//                       whose last compresses, for three decode scorers; µs per token and the
//                       attention bound to set it against
//
// Counters (per iteration, CPU time): GFLOP and GB are rates (Google Benchmark prints them
// as ".../s"), ns_per_elem is CPU time per element (K element for scoring and pipelines,
// score for selection, copied element for compaction; printed with an "s" suffix),
// scratch_bytes the workspace the call needs, peak/read/memcpy the run's rooflines.
//
// Shape: Hq = 32, Hkv = 8, d = 128 (Llama-3.1-8B, Qwen3-8B and Mistral-7B share it), W = 32,
// B = 2048, L in {4K, 32K, 128K}, every storage type. Extra flags (before Google
// Benchmark's own): --kvevict_quick (L in {4K, 32K}, shorter rooflines).
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cases.hpp"
#include "common.hpp"
#include "long_generation.hpp"
#include "roofline.hpp"

namespace {

kb::rooflines g_roof;

// ---- fixtures ------------------------------------------------------------------------------
// Building a layer (and an LSE) at L = 128K takes seconds and a GiB, and Google Benchmark may
// call a benchmark function more than once. Benchmarks run in registration order, grouped by
// (dtype, L), so one cached layer and one cached case object at a time is enough.

struct slot {
  std::string key;
  std::shared_ptr<void> value;
};
slot g_layer, g_case;

template <class T>
std::shared_ptr<kb::layer<T>> shared_layer(std::int64_t tokens) {
  const std::string key = std::string(kb::dtype_name<T>()) + "/" + std::to_string(tokens);
  if (g_layer.key != key) {
    g_case = {};
    g_layer = {};
    // Room for DeferKV's decode steps after the prompt.
    g_layer = {key, std::make_shared<kb::layer<T>>(kb::reference_model, tokens, kb::reference_window, 8)};
  }
  return std::static_pointer_cast<kb::layer<T>>(g_layer.value);
}

/// The case object for this benchmark, made (and run once, untimed: first-touch page faults
/// and cold code are not what a benchmark of a hot path should time) on first use.
template <class Case>
Case& cached_case(const std::string& key, const std::function<std::shared_ptr<Case>()>& make) {
  if (g_case.key != key) {
    g_case = {};
    auto c = make();
    c->run();
    g_case = {key, c};
  }
  return *std::static_pointer_cast<Case>(g_case.value);
}

void drop_layer() {
  g_case = {};
  g_layer = {};
}

// ---- benchmarks ----------------------------------------------------------------------------

void set_common(benchmark::State& state, double elements, std::size_t scratch) {
  state.counters["ns_per_elem"] =
      benchmark::Counter(elements * 1e-9, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.counters["scratch_bytes"] = static_cast<double>(scratch);
}

template <class T>
void bm_score_prompt(benchmark::State& state, const std::string& key, std::int64_t tokens, bool lse) {
  auto& c = cached_case<kb::prompt_scoring<T>>(
      key, [&] { return std::make_shared<kb::prompt_scoring<T>>(shared_layer<T>(tokens), lse); });
  for (auto _ : state) c.run();
  state.counters["GFLOP"] =
      benchmark::Counter(c.executed_flops() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["useful_GFLOP"] =
      benchmark::Counter(c.useful_flops() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["sweeps"] = c.sweeps();
  state.counters["peak_GFLOP/s"] = g_roof.fma_gflops();
  const std::string products = c.products();
  state.counters["amx"] = products == "AMX" ? 1.0 : 0.0;
  state.counters["vdpbf16ps"] = products == "VDPBF16PS" ? 1.0 : 0.0;
  set_common(state, static_cast<double>(c.lay->shape.hkv * tokens * c.lay->shape.d), c.scratch_bytes());
}

template <class T>
void bm_score_decode(benchmark::State& state, const std::string& key, std::int64_t tokens) {
  auto& c = cached_case<kb::decode_observation<T>>(key, [&] {
    drop_layer();  // the decode case owns its (rotated) cache
    return std::make_shared<kb::decode_observation<T>>(kb::reference_model, tokens, kb::roofline_buffer_bytes);
  });
  for (auto _ : state) {
    if (c.needs_restart()) {
      state.PauseTiming();
      c.restart();
      state.ResumeTiming();
    }
    c.run();
  }
  state.counters["GB"] = benchmark::Counter(c.bytes() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP"] = benchmark::Counter(c.flops() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["read_GB/s"] = g_roof.read_gbs;
  set_common(state, static_cast<double>(kb::reference_model.hkv * tokens * kb::reference_model.d), c.scratch_bytes());
}

template <class T>
void bm_compact(benchmark::State& state, const std::string& key, std::int64_t tokens) {
  auto& c = cached_case<kb::compaction<T>>(key, [&] {
    drop_layer();
    return std::make_shared<kb::compaction<T>>(kb::reference_model, tokens, kb::roofline_buffer_bytes);
  });
  for (auto _ : state) c.run();
  state.counters["GB"] = benchmark::Counter(c.bytes() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["memcpy_GB/s"] = g_roof.memcpy_gbs;
  set_common(state, c.bytes() / sizeof(T), 0);
}

enum class std_baseline { none, nth_element, partial_sort };

void bm_select(benchmark::State& state, std::int64_t tokens, std_baseline which) {
  auto& c = cached_case<kb::selection>("select/" + std::to_string(tokens), [&] {
    drop_layer();
    return std::make_shared<kb::selection>(kb::reference_model.hkv, tokens);
  });
  for (auto _ : state) {
    if (which == std_baseline::none)
      c.run();
    else if (which == std_baseline::nth_element)
      c.run_std<false>();
    else
      c.run_std<true>();
    benchmark::ClobberMemory();
  }
  if (which != std_baseline::none) {
    c.run();
    if (!c.agrees()) state.SkipWithError("kvevict::select and the std:: baseline kept different tokens");
  }
  set_common(state, c.elements(), which == std_baseline::none ? c.scratch_bytes() : 0);
}

template <class Pipeline>
void bm_pipeline(benchmark::State& state, const std::string& key,
                 const std::function<std::shared_ptr<Pipeline>()>& make, double k_elements) {
  auto& c = cached_case<Pipeline>(key, make);
  for (auto _ : state) c.run();
  set_common(state, k_elements, c.scratch_bytes());
}

template <class T>
void register_dtype(std::int64_t tokens) {
  const std::string suffix = std::string("/") + kb::dtype_name<T>() + "/L:" + std::to_string(tokens);
  const double k_elements = static_cast<double>(kb::reference_model.hkv * tokens * kb::reference_model.d);
  auto reg = [](const std::string& name, auto fn) {
    return benchmark::RegisterBenchmark(name.c_str(), [name, fn](benchmark::State& s) { fn(s, name); })
        ->Unit(benchmark::kMillisecond);
  };
  using state = benchmark::State;
  using key = const std::string&;
  reg("score_prompt/window" + suffix, [tokens](state& s, key k) { bm_score_prompt<T>(s, k, tokens, false); });
  reg("score_prompt/engine_lse" + suffix, [tokens](state& s, key k) { bm_score_prompt<T>(s, k, tokens, true); });
  reg("snapkv/layer" + suffix, [tokens, k_elements](state& s, key k) {
    bm_pipeline<kb::snapkv_layer<T>>(
        s, k, [tokens] { return std::make_shared<kb::snapkv_layer<T>>(shared_layer<T>(tokens)); }, k_elements);
  });
  reg("deferkv/layer_d1" + suffix, [tokens, k_elements](state& s, key k) {
    bm_pipeline<kb::deferkv_layer<T>>(
        s, k, [tokens] { return std::make_shared<kb::deferkv_layer<T>>(shared_layer<T>(tokens), 1); }, k_elements);
  });
  reg("deferkv/layer_d4" + suffix, [tokens, k_elements](state& s, key k) {
    bm_pipeline<kb::deferkv_layer<T>>(
        s, k, [tokens] { return std::make_shared<kb::deferkv_layer<T>>(shared_layer<T>(tokens), 4); }, k_elements);
  });
  reg("dapq/layer_rerotate" + suffix, [tokens, k_elements](state& s, key k) {
    bm_pipeline<kb::dapq_layer<T>>(
        s, k, [tokens] { return std::make_shared<kb::dapq_layer<T>>(shared_layer<T>(tokens)); }, k_elements);
  });
  reg("score_decode/step" + suffix, [tokens](state& s, key k) { bm_score_decode<T>(s, k, tokens); });
  reg("compact/kv" + suffix, [tokens](state& s, key k) { bm_compact<T>(s, k, tokens); });
}

void register_all(bool quick) {
  std::vector<std::int64_t> lengths = {4096, 32768};
  if (!quick) lengths.push_back(131072);
  for (std::int64_t l : lengths) {
    register_dtype<kb::bf16>(l);
    register_dtype<kb::fp16>(l);
    register_dtype<float>(l);
  }
  for (std::int64_t l : lengths) {
    const std::string suffix = "/L:" + std::to_string(l);
    benchmark::RegisterBenchmark(("select/kvevict" + suffix).c_str(), [l](benchmark::State& s) {
      bm_select(s, l, std_baseline::none);
    })->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("select/std_nth_element" + suffix).c_str(), [l](benchmark::State& s) {
      bm_select(s, l, std_baseline::nth_element);
    })->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("select/std_partial_sort" + suffix).c_str(), [l](benchmark::State& s) {
      bm_select(s, l, std_baseline::partial_sort);
    })->Unit(benchmark::kMicrosecond);
  }
  // A batch of 8 paged sequences through the compressor in place, and the sharing check that
  // run() makes across them (its cost as a share of the call).
  for (std::int64_t l : {std::int64_t{4096}}) {
    const std::string suffix = "/bf16/seqs:8/L:" + std::to_string(l);
    const std::string key = "paged_batch" + suffix;
    const auto make = [l] { return std::make_shared<kb::paged_batch<kb::bf16>>(kb::reference_model, 8, l); };
    benchmark::RegisterBenchmark(("compressor/snapkv_paged_in_place" + suffix).c_str(), [key,
                                                                                         make](benchmark::State& s) {
      auto& c = cached_case<kb::paged_batch<kb::bf16>>(key, make);
      for (auto _ : s) c.run();
    })->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("compressor/sharing_check" + suffix).c_str(), [key, make](benchmark::State& s) {
      auto& c = cached_case<kb::paged_batch<kb::bf16>>(key, make);
      for (auto _ : s) c.sharing_check();
    })->Unit(benchmark::kMicrosecond);
  }
  // A long generation under decode-time budgets: one period of N + 1 decode steps of one layer
  // (B = 2048 rows per head, SnapKV over the last 8 decode queries), its cost per decoded token
  // against the least time that step's attention needs (K and V read once at read bandwidth).
  // The scorers: SnapKV over 8 decode queries, TOVA (the newest query), KNorm (keys alone).
  const std::pair<const char*, kvevict::policy_config> scorers[] = {
      {"snapkv_w8", kvevict::policy::snapkv(kb::reference_snapkv(8))},
      {"tova", kvevict::policy::tova()},
      {"knorm", kvevict::policy::knorm()}};
  for (const auto& scorer : scorers)
    for (std::int64_t n : {std::int64_t{16}, std::int64_t{64}, std::int64_t{256}}) {
      const std::string name = std::string("long_generation/") + scorer.first + "/bf16/B:2048/N:" + std::to_string(n);
      const kvevict::policy_config policy = scorer.second;
      benchmark::RegisterBenchmark(name.c_str(), [name, n, policy](benchmark::State& s) {
        auto& c = cached_case<kb::decode_period<kb::bf16>>(name, [n, &policy] {
          drop_layer();
          return std::make_shared<kb::decode_period<kb::bf16>>(kb::reference_model, kb::reference_budget, n, &policy);
        });
        double seconds = 0.0;  // the periods' own CPU time (one thread, as every row), for the ratio
        std::int64_t periods = 0;
        for (auto _ : s) {
          s.PauseTiming();
          c.restart();
          s.ResumeTiming();
          const double t0 = kb::thread_seconds();
          c.run();
          seconds += kb::thread_seconds() - t0;
          ++periods;
        }
        const double per_token_us =
            seconds / static_cast<double>(periods > 0 ? periods : 1) / static_cast<double>(n + 1) * 1e6;
        const double bound_us = c.attention_bytes() / (g_roof.read_gbs * 1e9) * 1e6;
        s.counters["per_token_us"] = per_token_us;
        s.counters["attention_bound_us"] = bound_us;
        s.counters["of_attention_bound"] = per_token_us / bound_us;
      })->Unit(benchmark::kMicrosecond);
    }
  // The rooflines as benchmarks too, so every report carries them next to the kernels.
  benchmark::RegisterBenchmark("roofline/fma_peak", [](benchmark::State& s) {
    volatile float seed = 1.0f;  // read per call: the kernel is pure and would be hoisted
    const kvevict::cpu_isa isa = kvevict::active_cpu_isa();
    double flops = 12.0 * 16 * 2;
    for (auto _ : s) {
#if KVEVICT_X86_DISPATCH
      if (isa == kvevict::cpu_isa::avx2) {
        benchmark::DoNotOptimize(kb::fma_kernel_avx2(1 << 16, seed));
        flops = 12.0 * 8 * 2;
        continue;
      }
      if (isa != kvevict::cpu_isa::scalar) {
        benchmark::DoNotOptimize(kb::fma_kernel_avx512(1 << 16, seed));
        continue;
      }
#endif
      benchmark::DoNotOptimize(kb::fma_kernel_portable(1 << 16, seed));
    }
    (void)isa;
    s.counters["GFLOP"] = benchmark::Counter((1 << 16) * flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  });
  benchmark::RegisterBenchmark("roofline/read_bw", [](benchmark::State& s) {
    kb::big_buffer b(kb::roofline_buffer_bytes);
    float* volatile data = b.data();
    for (auto _ : s) benchmark::DoNotOptimize(kb::read_kernel_portable(data, b.floats()));
    s.counters["GB"] =
        benchmark::Counter(static_cast<double>(b.bytes()) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  })->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("roofline/memcpy_bw", [](benchmark::State& s) {
    kb::big_buffer src(kb::roofline_buffer_bytes), dst(kb::roofline_buffer_bytes);
    for (auto _ : s) {
      std::memcpy(dst.data(), src.data(), src.bytes());
      benchmark::ClobberMemory();
    }
    s.counters["GB"] =
        benchmark::Counter(static_cast<double>(src.bytes()) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  })->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--kvevict_quick") == 0)
      quick = true;
    else
      args.push_back(argv[i]);
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;

  g_roof = kb::measure_rooflines(quick ? (std::size_t{256} << 20) : kb::roofline_buffer_bytes, quick ? 0.1 : 0.3);
  char buf[64];
  benchmark::AddCustomContext("kvevict_cpu_isa", kvevict::to_string(kvevict::active_cpu_isa()));
  benchmark::AddCustomContext("kvevict_cpu_isa_supported", kvevict::to_string(kvevict::supported_cpu_isa()));
  std::snprintf(buf, sizeof(buf), "%.2f", g_roof.fma_gflops());
  benchmark::AddCustomContext("kvevict_fma_peak_gflops", buf);
  std::snprintf(buf, sizeof(buf), "%.2f", g_roof.scalar_gflops);
  benchmark::AddCustomContext("kvevict_scalar_peak_gflops", buf);
  std::snprintf(buf, sizeof(buf), "%.2f", g_roof.avx2_gflops);
  benchmark::AddCustomContext("kvevict_avx2_fma_peak_gflops", buf);
  std::snprintf(buf, sizeof(buf), "%.2f", g_roof.avx512_gflops);
  benchmark::AddCustomContext("kvevict_avx512_fma_peak_gflops", buf);
  std::snprintf(buf, sizeof(buf), "%.2f", g_roof.bf16_dot_gflops);
  benchmark::AddCustomContext("kvevict_vdpbf16ps_peak_gflops", buf);
  std::snprintf(buf, sizeof(buf), "%.2f", g_roof.amx_gflops);
  benchmark::AddCustomContext("kvevict_amx_bf16_peak_gflops", buf);
  std::snprintf(buf, sizeof(buf), "%.2f", g_roof.read_gbs);
  benchmark::AddCustomContext("kvevict_read_gbs", buf);
  std::snprintf(buf, sizeof(buf), "%.2f", g_roof.memcpy_gbs);
  benchmark::AddCustomContext("kvevict_memcpy_gbs", buf);
  benchmark::AddCustomContext("kvevict_build", kb::build_line());
  benchmark::AddCustomContext("kvevict_shape", "Hq=32 Hkv=8 d=128 W=32 B=2048 (Llama-3.1-8B, Qwen3-8B, Mistral-7B)");
  std::fprintf(stderr,
               "CPU path %s; rooflines: fp32 FMA %.1f GFLOP/s (scalar %.1f, AVX2 %.1f, AVX-512 %.1f), VDPBF16PS %.1f, "
               "AMX bf16 %.1f GFLOP/s, read %.1f GB/s, memcpy %.1f GB/s (CPU time, one thread)\n",
               kvevict::to_string(kvevict::active_cpu_isa()), g_roof.fma_gflops(), g_roof.scalar_gflops,
               g_roof.avx2_gflops, g_roof.avx512_gflops, g_roof.bf16_dot_gflops, g_roof.amx_gflops, g_roof.read_gbs,
               g_roof.memcpy_gbs);

  register_all(quick);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  drop_layer();
  return 0;
}
