// kvevict quickstart: one synthetic Llama-3.1-8B-shaped layer (32 query heads, 8 KV heads,
// d = 128, GQA) in an HF-style contiguous bf16 cache, compressed to 25% with SnapKV
// (kvpress conventions): score -> select -> evict, printing memory before and after.
#include <kvevict/kvevict.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

using kvevict::bf16;

int main() {
  const std::int64_t hq = 32, hkv = 8, d = 128, tokens = 8192;
  const kvevict::window_config cfg = kvevict::presets::kvpress_snapkv();  // W = 64
  const std::int64_t w = cfg.window;

  // The engine's buffers: K and V [Hkv, L, d] and the last W prompt queries [Hq, W, d].
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<bf16> k(hkv * tokens * d), v(hkv * tokens * d), q(hq * w * d);
  for (auto& x : k) x = bf16(normal(rng));
  for (auto& x : v) x = bf16(normal(rng));
  for (auto& x : q) x = bf16(normal(rng));
  // Plant a few "needle" keys that the window's queries attend to strongly.
  for (std::int64_t h = 0; h < hkv; ++h)
    for (std::int64_t j : {100, 2000, 5000})
      for (std::int64_t c = 0; c < d; ++c) k[(h * tokens + j) * d + c] = q[((h * 4) * w + w - 1) * d + c];
  std::vector<std::int64_t> positions;
  for (std::int64_t t = 0; t < w; ++t) positions.push_back(tokens - w + t);

  kvevict::snapkv<bf16> policy(cfg);
  kvevict::layer_inputs<bf16> in;
  in.keys = kvevict::hf_contiguous(k.data(), hkv, tokens, d);
  in.queries = kvevict::contiguous_queries(q.data(), hq, w, d, positions.data());

  // Size everything once, before the hot path.
  const kvevict::layer_shape shape{hq, hkv, d, tokens, w};
  const auto budget = kvevict::budget::ratio(0.75);  // keep int(L * 0.25) per head
  kvevict::workspace score_ws(policy.workspace_size(shape));
  kvevict::workspace select_ws(kvevict::select_workspace_size(tokens));
  std::vector<float> scores(hkv * tokens);
  kvevict::keep_list keep(hkv, kvevict::select_capacity(hkv, tokens, budget, policy.selection()));
  std::vector<std::int64_t> kept_positions(
      static_cast<std::size_t>(kvevict::select_capacity(hkv, tokens, budget, policy.selection())));

  const auto t0 = std::chrono::steady_clock::now();
  kvevict::status st = policy.score(in, {scores.data(), hkv, tokens, tokens}, score_ws);
  if (st.ok())
    st = kvevict::select(kvevict::const_score_view{scores.data(), hkv, tokens, tokens}, budget, policy.selection(),
                         keep, select_ws);
  kvevict::eviction_result result;
  result.positions = kept_positions.data();
  if (st.ok())
    st = kvevict::evict(kvevict::hf_contiguous(k.data(), hkv, tokens, d),
                        kvevict::hf_contiguous(v.data(), hkv, tokens, d), keep, result);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!st.ok()) {
    std::fprintf(stderr, "kvevict error: %s\n", st.message());
    return 1;
  }

  const double mib = 1024.0 * 1024.0;
  const double before = 2.0 * static_cast<double>(hkv * tokens * d) * sizeof(bf16) / mib;
  const double after = 2.0 * static_cast<double>(hkv * result.max_length * d) * sizeof(bf16) / mib;
  std::printf("kvevict quickstart: one layer, Hq=%lld Hkv=%lld d=%lld, L=%lld bf16, SnapKV (kvpress preset)\n",
              static_cast<long long>(hq), static_cast<long long>(hkv), static_cast<long long>(d),
              static_cast<long long>(tokens));
  std::printf("  K+V before: %8.2f MiB (%lld tokens per head)\n", before, static_cast<long long>(tokens));
  std::printf("  K+V after:  %8.2f MiB (%lld tokens per head, window of %lld kept)\n", after,
              static_cast<long long>(result.max_length), static_cast<long long>(w));
  int found = 0;
  for (std::int64_t i = 0; i < keep.size(0); ++i)
    for (std::int64_t needle : {100, 2000, 5000}) found += kept_positions[static_cast<std::size_t>(i)] == needle;
  std::printf("  planted needles kept in head 0: %d of 3; next decode position stays %lld\n", found,
              static_cast<long long>(tokens));
  std::printf("  score + select + evict: %.1f ms on one thread\n", ms);
  return found == 3 ? 0 : 2;
}
