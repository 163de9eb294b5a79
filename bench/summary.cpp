// SPDX-License-Identifier: Apache-2.0
// kvevict_bench_summary: a few seconds of benchmarks. Measures this machine's rooflines
// (fp32 FMA peak, DRAM read and memcpy bandwidth), then the reference shape of design.md
// section 10 (Llama-3.1-8B layer: Hq = 32, Hkv = 8, d = 128, W = 32, B = 2048, bf16, one
// thread) at a smaller L, and prints each result as a fraction of its roofline.
// scripts/bench runs the full set (kvevict_bench, the PyTorch comparison, the report).
//
// Usage: kvevict_bench_summary [--quick] [--tokens L] | --supported-paths
//   --quick    L = 8192 and shorter measurements (a few seconds; scripts/demo runs this)
//   --tokens   the prompt length of the reference-shape rows (default 32768)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "cases.hpp"
#include "common.hpp"
#include "roofline.hpp"

int main(int argc, char** argv) {
  bool quick = false;
  std::int64_t tokens = 32768;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
      tokens = 8192;
    } else if (std::strcmp(argv[i], "--supported-paths") == 0) {  // for scripts/bench
      for (int p = 0; p <= static_cast<int>(kvevict::supported_cpu_isa()); ++p)
        std::printf("%s%s", p > 0 ? " " : "", kvevict::to_string(static_cast<kvevict::cpu_isa>(p)));
      std::printf("\n");
      return 0;
    } else if (std::strcmp(argv[i], "--tokens") == 0 && i + 1 < argc) {
      tokens = std::atoll(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--quick] [--tokens L] | --supported-paths\n", argv[0]);
      return 2;
    }
  }
  if (tokens < 2 * kb::reference_budget) {
    std::fprintf(stderr, "--tokens must be at least %lld\n", static_cast<long long>(2 * kb::reference_budget));
    return 2;
  }
  using T = kb::bf16;
  const kb::model_shape s = kb::reference_model;
  const double min_time = quick ? 0.1 : 0.5;
  const std::size_t bw_bytes = quick ? (std::size_t{256} << 20) : kb::roofline_buffer_bytes;

  std::printf("kvevict benchmark summary (%s; one thread, CPU time)\n", kb::build_line().c_str());
  const kb::rooflines roof = kb::measure_rooflines(bw_bytes, quick ? 0.1 : 0.3);
  std::printf(
      "  this machine: fp32 FMA peak of the %s path %.1f GFLOP/s, read %.1f GB/s, memcpy %.1f GB/s (bytes "
      "copied)\n",
      kvevict::to_string(kvevict::active_cpu_isa()), roof.fma_gflops(), roof.read_gbs, roof.memcpy_gbs);
  if (roof.amx_gflops > 0.0)
    std::printf("  AMX bf16 peak %.1f GFLOP/s: bf16 x bf16 scoring runs its logit GEMM on AMX tiles\n",
                roof.amx_gflops);
  else if (roof.bf16_dot_gflops > 0.0 && kvevict::active_cpu_isa() == kvevict::cpu_isa::avx512bf16)
    std::printf("  VDPBF16PS peak %.1f GFLOP/s: bf16 x bf16 scoring runs its logit GEMM on bf16 pair products\n",
                roof.bf16_dot_gflops);
  std::printf("  reference shape: %s layer, Hq=%lld Hkv=%lld d=%lld, L=%lld, W=%lld, B=%lld, %s\n\n", s.name,
              static_cast<long long>(s.hq), static_cast<long long>(s.hkv), static_cast<long long>(s.d),
              static_cast<long long>(tokens), static_cast<long long>(kb::reference_window),
              static_cast<long long>(kb::reference_budget), kb::dtype_name<T>());
  std::printf("  %-44s %10s  %-22s %s\n", "operation", "time", "achieved", "of roofline");

  auto row = [](const char* what, double seconds, const char* unit, double value, double roof_value,
                const char* target) {
    std::printf("  %-44s %8.2f ms  %8.1f %-13s %5.1f%%  %s\n", what, seconds * 1e3, value, unit,
                100.0 * value / roof_value, target);
  };

  auto lay = std::make_shared<kb::layer<T>>(s, tokens, kb::reference_window);
  {
    kb::prompt_scoring<T> two(lay, false);
    const double t = kb::median_seconds([&] { two.run(); }, 3, min_time);
    const std::string products = two.products();
    const std::string note =
        products == "FMA" ? "(target >= 60% of FMA peak)" : "(target >= 60% of FMA peak; on " + products + ")";
    const std::string what = "prompt scoring, " + std::to_string(two.sweeps()) + " sweep(s) (GEMM FLOPs)";
    row(what.c_str(), t, "GFLOP/s", two.executed_flops() / t * 1e-9, roof.fma_gflops(), note.c_str());
    kb::prompt_scoring<T> one(lay, true);
    const double t1 = kb::median_seconds([&] { one.run(); }, 3, min_time);
    row("prompt scoring, engine LSE, one sweep", t1, "GFLOP/s", one.executed_flops() / t1 * 1e-9, roof.fma_gflops(),
        "");
  }
  {
    kb::decode_observation<T> dec(s, tokens, bw_bytes);
    const double t = kb::median_seconds(
        [&] {
          if (dec.needs_restart()) dec.restart();
          dec.run();
        },
        5, min_time, 200);
    row("decode observation (K read once)", t, "GB/s", dec.bytes() / t * 1e-9, roof.read_gbs,
        "(target >= 50% of read)");
  }
  {
    kb::compaction<T> c(s, tokens, bw_bytes);
    const double t = kb::median_seconds([&] { c.run(); }, 5, min_time, 200);
    row("compaction of K and V (bytes copied)", t, "GB/s", c.bytes() / t * 1e-9, roof.memcpy_gbs,
        "(target >= 50% of memcpy)");
  }
  {
    const std::int64_t sel_tokens = 131072;
    kb::selection sel(s.hkv, sel_tokens);
    const double t = kb::median_seconds([&] { sel.run(); }, 5, min_time);
    const double tn = kb::median_seconds([&] { sel.run_std<false>(); }, 3, min_time);
    std::printf("  %-44s %8.2f ms  %8.2f ns/elem     %5.1fx faster than std::nth_element (%.2f ms)%s\n",
                "selection at L=131072 (8 rows)", t * 1e3, t / sel.elements() * 1e9, tn / t, tn * 1e3,
                sel.agrees() ? "" : "  KEEP-LISTS DIFFER");
  }
  {
    kb::snapkv_layer<T> p(lay);
    const double t = kb::median_seconds([&] { p.run(); }, 3, min_time);
    std::printf("  %-44s %8.2f ms  (scripts/bench compares it with PyTorch)\n", "SnapKV layer: score+select+evict",
                t * 1e3);
  }
  return 0;
}
