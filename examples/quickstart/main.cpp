// kvevict quickstart: a synthetic Llama-3.1-8B-shaped model (32 query heads, 8 KV heads,
// d = 128, GQA; 4 layers here) with an HF-style contiguous bf16 cache, compressed to 25% with
// SnapKV (kvpress conventions) at the end of an 8K-token prefill: a compressor planned once,
// then one run() per layer, printing memory before and after. The compressor serves SnapKV
// only, so only SnapKV is compiled (kvevict::compressor, from <kvevict/kvevict.hpp>, serves
// every policy). Usage: kvevict_quickstart [prompt tokens, default 8192] (the sanitizer test
// runs take a shorter prompt).
#include <kvevict/compressor/basic_compressor.hpp>
#include <kvevict/policies/snapkv.hpp>
#include <kvevict/views/layouts.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

using kvevict::bf16;
using snapkv_compressor = kvevict::basic_compressor<kvevict::policy_list<kvevict::snapkv_traits>>;

int main(int argc, char** argv) {
  const std::int64_t layers = 4, hq = 32, hkv = 8, d = 128;
  const std::int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 8192;
  if (tokens < 1024) return std::fprintf(stderr, "usage: %s [prompt tokens >= 1024]\n", argv[0]), 1;
  const std::int64_t needles[] = {tokens / 80, tokens / 4, tokens * 5 / 8};  // 102, 2048, 5120 at 8K

  // Once per model: the plan, and every size from shapes alone.
  kvevict::compressor_options opt;
  opt.model = {layers, hq, hkv, d, 0, kvevict::dtype::bf16};
  opt.policy = kvevict::policy::snapkv(kvevict::presets::kvpress_snapkv());  // W = 64
  opt.per_head = kvevict::budget::ratio(0.75);                               // keep int(L * 0.25) per head
  opt.limits.max_tokens = tokens;
  snapkv_compressor compressor;
  kvevict::status st = snapkv_compressor::plan(opt, &compressor);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
  const std::int64_t w = compressor.observation_window();
  kvevict::workspace ws(compressor.workspace_size());
  std::vector<std::int64_t> kept_positions(static_cast<std::size_t>(compressor.keep_capacity()));

  // The engine's buffers per layer: K and V [Hkv, L, d] and the last W prompt queries [Hq, W, d].
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<bf16>> k(layers), v(layers), q(layers);
  for (std::int64_t l = 0; l < layers; ++l) {
    k[l].resize(hkv * tokens * d);
    v[l].resize(hkv * tokens * d);
    q[l].resize(hq * w * d);
    for (auto& x : k[l]) x = bf16(normal(rng));
    for (auto& x : v[l]) x = bf16(normal(rng));
    for (auto& x : q[l]) x = bf16(normal(rng));
    // Plant a few "needle" keys that the window's queries attend to strongly.
    for (std::int64_t h = 0; h < hkv; ++h)
      for (std::int64_t j : needles)
        for (std::int64_t c = 0; c < d; ++c) k[l][(h * tokens + j) * d + c] = q[l][((h * 4) * w + w - 1) * d + c];
  }
  std::vector<std::int64_t> positions;
  for (std::int64_t t = 0; t < w; ++t) positions.push_back(tokens - w + t);

  // End of prefill: one call per layer (a batch of one sequence here).
  int found = 0;
  kvevict::sequence_report report;
  const auto t0 = std::chrono::steady_clock::now();
  for (std::int64_t l = 0; l < layers; ++l) {
    kvevict::sequence_io<bf16> seq;
    seq.event = kvevict::sequence_event::prefill_end;
    seq.keys = kvevict::hf_contiguous(k[l].data(), hkv, tokens, d);
    seq.values = kvevict::hf_contiguous(v[l].data(), hkv, tokens, d);
    seq.queries = kvevict::contiguous_queries<const bf16>(q[l].data(), hq, w, d, positions.data());
    seq.kept_positions = kept_positions.data();
    st = compressor.run(l, &seq, 1, &report, ws);
    if (!st.ok()) return std::fprintf(stderr, "layer %lld: %s\n", static_cast<long long>(l), st.message()), 1;
    for (std::int64_t i = 0; i < report.length; ++i)  // head 0's kept tokens come first
      for (std::int64_t needle : needles) found += kept_positions[static_cast<std::size_t>(i)] == needle;
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

  const double mib = 1024.0 * 1024.0;
  const double before = 2.0 * static_cast<double>(layers * hkv * tokens * d) * sizeof(bf16) / mib;
  const double after = 2.0 * static_cast<double>(layers * hkv * report.length * d) * sizeof(bf16) / mib;
  std::printf("kvevict quickstart: %lld layers, Hq=%lld Hkv=%lld d=%lld, L=%lld bf16, SnapKV (kvpress preset)\n",
              static_cast<long long>(layers), static_cast<long long>(hq), static_cast<long long>(hkv),
              static_cast<long long>(d), static_cast<long long>(tokens));
  std::printf("  compressor: workspace %.1f MiB, %lld keep-list entries per layer, one run() per layer\n",
              static_cast<double>(compressor.workspace_size()) / mib,
              static_cast<long long>(compressor.keep_capacity()));
  std::printf("  K+V before: %8.2f MiB (%lld tokens per head)\n", before, static_cast<long long>(tokens));
  std::printf("  K+V after:  %8.2f MiB (%lld tokens per head, window of %lld kept)\n", after,
              static_cast<long long>(report.length), static_cast<long long>(w));
  std::printf("  planted needles kept in head 0: %d of %lld; next K/V slot %lld, next RoPE position %lld\n", found,
              static_cast<long long>(3 * layers), static_cast<long long>(report.next_slot),
              static_cast<long long>(report.next_position));
  std::printf("  %lld layers scored, selected and compacted: %.1f ms on one thread\n", static_cast<long long>(layers),
              ms);
  return found == 3 * layers ? 0 : 2;
}
