// DapQ as an engine calls it, for one layer of one sequence, in both variants:
//
//   pseudo tokens: append N pseudo tokens at positions Lp .. Lp+N-1, prefill them, score the
//                  prompt keys with their post-RoPE queries, evict every pseudo token;
//   re-rotation:   no extra forward pass -- rotate the last N prompt queries (post-RoPE, at
//                  Lp-N .. Lp-1) by N positions and score with those.
//
// Decoding resumes at position Lp either way. The model is simulated with random vectors;
// RoPE is applied with kvevict's helpers as the engine's attention would.
#include <kvevict/kvevict.hpp>

#include <cstdio>
#include <random>
#include <vector>

using kvevict::bf16;

int main() {
  const std::int64_t hq = 8, hkv = 2, d = 64, prompt = 1500;
  kvevict::dapq_config config;  // N = 32, first 8 + last 24 prompt tokens
  const std::int64_t n = config.pseudo_tokens;
  kvevict::rope_config rope;
  rope.head_dim = d;
  rope.theta = 500000.0;  // Llama-3 base
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);

  // Prompt ids and the pseudo content the engine will prefill.
  std::vector<std::int32_t> ids(prompt);
  for (auto& x : ids) x = static_cast<std::int32_t>(rng() % 32000);
  std::vector<std::int32_t> pseudo(n);
  std::vector<std::int64_t> pseudo_pos(n);
  if (!kvevict::dapq_pseudo_tokens_first_last(ids.data(), prompt, config.first, config.last, pseudo.data()).ok())
    return 1;
  kvevict::dapq_pseudo_positions(prompt, n, pseudo_pos.data());
  std::printf("pseudo tokens: %lld ids (first %lld + last %lld prompt tokens) at positions %lld..%lld\n",
              static_cast<long long>(n), static_cast<long long>(config.first), static_cast<long long>(config.last),
              static_cast<long long>(pseudo_pos.front()), static_cast<long long>(pseudo_pos.back()));

  // The cache after the pseudo prefill: Lp prompt tokens + N pseudo tokens.
  const std::int64_t total = prompt + n;
  std::vector<bf16> k(hkv * total * d), v(hkv * total * d);
  for (auto& x : k) x = bf16(normal(rng));
  for (auto& x : v) x = bf16(normal(rng));

  // The engine's pre-RoPE queries for the pseudo tokens, rotated to their positions as its
  // attention does (here with kvevict's helper).
  std::vector<float> pre(hq * n * d);
  for (auto& x : pre) x = normal(rng);
  std::vector<std::int64_t> unused(n, 0);
  const auto pre_view = kvevict::contiguous_queries(pre.data(), hq, n, d, unused.data());
  std::vector<bf16> pseudo_q(hq * n * d);
  std::vector<std::int64_t> qpos(n);
  kvevict::query_view<const bf16> pseudo_queries;
  if (!kvevict::dapq_rotate_to(pre_view, rope, prompt, pseudo_q.data(), qpos.data(), &pseudo_queries).ok()) return 1;

  kvevict::dapq<bf16> policy(config);
  kvevict::layer_inputs<bf16> in;
  in.keys = kvevict::hf_contiguous(k.data(), hkv, total, d);
  in.queries = pseudo_queries;
  std::vector<float> scores(hkv * prompt);  // prompt keys only: [Hkv, Lp]
  kvevict::workspace ws(policy.workspace_size({hq, hkv, d, prompt, n}));
  kvevict::status st = policy.score(in, {scores.data(), hkv, prompt, prompt}, ws);
  const auto budget = kvevict::budget::tokens(prompt / 10);
  kvevict::keep_list keep(hkv, kvevict::select_capacity(hkv, prompt, budget, policy.selection()));
  kvevict::workspace sws(kvevict::select_workspace_size(prompt));
  if (st.ok())
    st = kvevict::select(kvevict::const_score_view{scores.data(), hkv, prompt, prompt}, budget, policy.selection(),
                         keep, sws);
  kvevict::eviction_result result;
  if (st.ok())
    st = kvevict::evict(kvevict::hf_contiguous(k.data(), hkv, total, d),
                        kvevict::hf_contiguous(v.data(), hkv, total, d), keep, result);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
  std::printf(
      "pseudo-token variant: cache %lld -> %lld tokens per head (every pseudo token evicted); "
      "decoding resumes at position %lld\n",
      static_cast<long long>(total), static_cast<long long>(result.max_length),
      static_cast<long long>(kvevict::dapq<bf16>::next_position(prompt)));

  // Re-rotation variant: the SnapKV window's post-RoPE queries (positions Lp-N .. Lp-1),
  // moved by N positions. No pseudo prefill, so the cache holds only the prompt.
  std::vector<float> window(hq * n * d);
  std::vector<std::int64_t> wpos(n);
  kvevict::query_view<const float> window_queries;
  if (!kvevict::dapq_rotate_to(pre_view, rope, prompt - n, window.data(), wpos.data(), &window_queries).ok()) return 1;
  std::vector<bf16> moved(hq * n * d);
  std::vector<std::int64_t> mpos(n);
  kvevict::query_view<const bf16> rerotated;
  if (!kvevict::dapq_rerotate(window_queries, rope, n, moved.data(), mpos.data(), &rerotated).ok()) return 1;
  std::printf("re-rotation variant: window queries at %lld..%lld moved to %lld..%lld, no extra forward pass\n",
              static_cast<long long>(wpos.front()), static_cast<long long>(wpos.back()),
              static_cast<long long>(mpos.front()), static_cast<long long>(mpos.back()));
  return 0;
}
