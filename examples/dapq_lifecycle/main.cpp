// DapQ as an engine calls it, through the compressor (one layer, one sequence), in both
// variants:
//
//   pseudo tokens: append N pseudo tokens at positions Lp .. Lp+N-1, prefill them, then one
//                  run() per layer at the end of that prefill: the pseudo queries score the
//                  prompt keys and every pseudo token is evicted;
//   re-rotation:   no extra forward pass -- at the end of the prompt's prefill, run() rotates
//                  the last N prompt queries (post-RoPE, at Lp-N .. Lp-1) by N positions and
//                  scores with those.
//
// Decoding resumes at position Lp either way (reported as next_position). The model is
// simulated with random vectors; RoPE is applied with kvevict's helpers as the engine's
// attention would.
#include <kvevict/kvevict.hpp>

#include <cstdio>
#include <random>
#include <vector>

using kvevict::bf16;

namespace {
kvevict::compressor plan(const kvevict::dapq_config& config, std::int64_t hq, std::int64_t hkv, std::int64_t d,
                         std::int64_t max_tokens, kvevict::status* st) {
  kvevict::compressor_options opt;
  opt.model = {1, hq, hkv, d, 0, kvevict::dtype::bf16};
  opt.policy = kvevict::policy::dapq(config);
  opt.per_head = kvevict::budget::ratio(0.9);  // keep int(Lp * 0.1) of the prompt per head
  opt.limits.max_tokens = max_tokens;
  kvevict::compressor c;
  *st = kvevict::compressor::plan(opt, &c);
  return c;
}
}  // namespace

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
  kvevict::status st =
      kvevict::dapq_pseudo_tokens_first_last(ids.data(), prompt, config.first, config.last, pseudo.data());
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
  kvevict::dapq_pseudo_positions(prompt, n, pseudo_pos.data());
  std::printf("pseudo tokens: %lld ids (first %lld + last %lld prompt tokens) at positions %lld..%lld\n",
              static_cast<long long>(n), static_cast<long long>(config.first), static_cast<long long>(config.last),
              static_cast<long long>(pseudo_pos.front()), static_cast<long long>(pseudo_pos.back()));

  // The cache after the pseudo prefill: Lp prompt tokens + N pseudo tokens.
  const std::int64_t total = prompt + n;
  std::vector<bf16> k(hkv * total * d), v(hkv * total * d);
  for (auto& x : k) x = bf16(normal(rng));
  for (auto& x : v) x = bf16(normal(rng));
  std::vector<bf16> k2 = k, v2 = v;  // the same prompt for the re-rotation variant

  // The engine's pre-RoPE queries for the pseudo tokens, rotated to their positions as its
  // attention does (here with kvevict's helper).
  std::vector<float> pre(hq * n * d);
  for (auto& x : pre) x = normal(rng);
  std::vector<std::int64_t> unused(n, 0);
  const auto pre_view = kvevict::contiguous_queries(pre.data(), hq, n, d, unused.data());
  std::vector<bf16> pseudo_q(hq * n * d);
  std::vector<std::int64_t> qpos(n);
  kvevict::query_view<const bf16> pseudo_queries;
  st = kvevict::dapq_rotate_to(pre_view, rope, prompt, pseudo_q.data(), qpos.data(), &pseudo_queries);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;

  // Variant 1: one run() at the end of the pseudo prefill.
  const kvevict::compressor with_pseudo = plan(config, hq, hkv, d, total, &st);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
  kvevict::workspace ws(with_pseudo.workspace_size());
  kvevict::sequence_io<bf16> seq;
  seq.event = kvevict::sequence_event::prefill_end;
  seq.keys = kvevict::hf_contiguous(k.data(), hkv, total, d);
  seq.values = kvevict::hf_contiguous(v.data(), hkv, total, d);
  seq.queries = pseudo_queries;
  kvevict::sequence_report report;
  st = with_pseudo.run(0, &seq, 1, &report, ws);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
  std::printf(
      "pseudo-token variant: cache %lld -> %lld tokens per head (every pseudo token evicted); "
      "decoding resumes at position %lld, K/V row %lld\n",
      static_cast<long long>(total), static_cast<long long>(report.length),
      static_cast<long long>(report.next_position), static_cast<long long>(report.next_slot));
  const bool pseudo_ok = report.next_position == prompt && report.length == kvevict::budget::ratio(0.9).resolve(prompt);

  // Variant 2: no pseudo prefill, so the cache holds only the prompt; the end-of-prefill hook
  // hands the prompt's last N post-RoPE queries (positions Lp-N .. Lp-1), which the
  // compressor moves by N positions itself.
  std::vector<bf16> window(hq * n * d);
  std::vector<std::int64_t> wpos(n);
  kvevict::query_view<const bf16> window_queries;
  st = kvevict::dapq_rotate_to(pre_view, rope, prompt - n, window.data(), wpos.data(), &window_queries);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
  kvevict::dapq_config rerotate = config;
  rerotate.source = kvevict::dapq_source::rerotated_window;
  rerotate.rope = rope;
  const kvevict::compressor rerotated = plan(rerotate, hq, hkv, d, total, &st);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
  kvevict::workspace ws2(rerotated.workspace_size());
  seq.keys = kvevict::hf_contiguous(k2.data(), hkv, prompt, d, total);
  seq.values = kvevict::hf_contiguous(v2.data(), hkv, prompt, d, total);
  seq.queries = window_queries;
  st = rerotated.run(0, &seq, 1, &report, ws2);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
  std::printf(
      "re-rotation variant: window queries at %lld..%lld moved to %lld..%lld inside run(), no extra forward "
      "pass; cache %lld -> %lld tokens per head, decoding resumes at position %lld\n",
      static_cast<long long>(wpos.front()), static_cast<long long>(wpos.back()),
      static_cast<long long>(wpos.front() + n), static_cast<long long>(wpos.back() + n), static_cast<long long>(prompt),
      static_cast<long long>(report.length), static_cast<long long>(report.next_position));
  return pseudo_ok && report.next_position == prompt ? 0 : 2;
}
