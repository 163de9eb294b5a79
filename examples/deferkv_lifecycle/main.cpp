// DeferKV as an engine calls it, for one layer of one sequence.
//
//   prefill  -> observe_prefill (last W prompt queries)         state: [Hkv, Lp] floats
//   decode 0 -> observe_decode (that step's query; the cache already holds the new token)
//   ...
//   decode d-1 -> ready(): scores -> select -> evict; decoding continues at position Lp + d
//
// The model is simulated: keys, values and queries are random, and one prompt token is made
// important to the decode queries only -- the situation DeferKV is for.
#include <kvevict/kvevict.hpp>

#include <cstdio>
#include <random>
#include <vector>

using kvevict::bf16;

int main() {
  const std::int64_t hq = 8, hkv = 2, d = 64, prompt = 2000, delay = 2;
  kvevict::deferkv_config config;
  config.window = 32;    // W prompt queries observed at the end of prefill
  config.delay = delay;  // evict at the 2nd decode step
  config.eta = 0.9;      // observation t weighs 0.9^(T - t)
  const std::int64_t layer = 0, capacity = prompt + delay;

  // The engine's cache for this layer: HF layout with room for the decoded tokens.
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<bf16> k(hkv * capacity * d), v(hkv * capacity * d);
  for (auto& x : k) x = bf16(normal(rng));
  for (auto& x : v) x = bf16(normal(rng));
  auto keys = [&](std::int64_t n) { return kvevict::hf_contiguous(k.data(), hkv, n, d, capacity); };
  auto values = [&](std::int64_t n) { return kvevict::hf_contiguous(v.data(), hkv, n, d, capacity); };

  // One state per layer, reserved up front: the only allocation of the lifecycle.
  kvevict::deferkv_state<bf16> state(config, layer);
  if (!state.reserve(hkv, prompt).ok()) return 1;
  kvevict::workspace ws(state.workspace_size({hq, hkv, d, capacity, config.window}));

  // --- End of prefill: the engine hands the last W prompt queries (post-RoPE) and the keys.
  std::vector<bf16> window_q(hq * config.window * d);
  for (auto& x : window_q) x = bf16(normal(rng));
  std::vector<std::int64_t> window_pos;
  for (std::int64_t t = 0; t < config.window; ++t) window_pos.push_back(prompt - config.window + t);
  kvevict::layer_inputs<bf16> prefill;
  prefill.keys = keys(prompt);
  prefill.queries = kvevict::contiguous_queries(window_q.data(), hq, config.window, d, window_pos.data());
  kvevict::status st = state.observe_prefill(layer, prefill, ws);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
  std::printf("prefill observed: %lld prompt tokens, W = %lld, state holds %lld x %lld floats\n",
              static_cast<long long>(prompt), static_cast<long long>(config.window), static_cast<long long>(hkv),
              static_cast<long long>(prompt));

  // --- Decode steps: the engine writes the new token's K/V, then hands this step's query.
  const std::int64_t needle = 1234;  // a prompt token only the decode queries look for
  for (std::int64_t step = 0; step < delay; ++step) {
    const std::int64_t position = prompt + step;  // the token being decoded
    for (std::int64_t c = 0; c < hkv * d; ++c) {  // its K/V land in the cache first
      k[(c / d) * capacity * d + position * d + c % d] = bf16(normal(rng));
      v[(c / d) * capacity * d + position * d + c % d] = bf16(normal(rng));
    }
    std::vector<bf16> q(hq * d);
    for (std::int64_t h = 0; h < hq; ++h)
      for (std::int64_t c = 0; c < d; ++c) q[h * d + c] = k[((h / (hq / hkv)) * capacity + needle) * d + c];
    std::vector<std::int64_t> pos = {position};
    kvevict::layer_inputs<bf16> decode;
    decode.keys = keys(position + 1);
    decode.queries = kvevict::contiguous_queries(q.data(), hq, 1, d, pos.data());
    st = state.observe_decode(layer, step, decode, ws);
    if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
    std::printf("decode step %lld observed (cache %lld tokens), ready: %s\n", static_cast<long long>(step),
                static_cast<long long>(position + 1), state.ready() ? "yes" : "no");
  }

  // --- Ready: score, select (window and decoded tokens are protected), evict.
  const std::int64_t l = state.num_tokens();
  std::vector<float> scores(hkv * l);
  kvevict::workspace select_ws(kvevict::select_workspace_size(l));
  const auto budget = kvevict::budget::tokens(128);  // candidates per head, window + decoded on top
  kvevict::keep_list keep(hkv, kvevict::select_capacity(hkv, l, budget, state.selection()));
  std::vector<std::int64_t> kept_pos(
      static_cast<std::size_t>(kvevict::select_capacity(hkv, l, budget, state.selection())));
  kvevict::eviction_result result;
  result.positions = kept_pos.data();
  st = state.scores({scores.data(), hkv, l, l}, ws);
  if (st.ok())
    st = kvevict::select(kvevict::const_score_view{scores.data(), hkv, l, l}, budget, state.selection(), keep,
                         select_ws);
  if (st.ok()) st = kvevict::evict(keys(l), values(l), keep, result);
  if (st.ok()) st = state.mark_evicted();
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
  bool needle_kept = false;
  for (std::int64_t i = 0; i < keep.size(0); ++i) needle_kept |= kept_pos[static_cast<std::size_t>(i)] == needle;
  std::printf("evicted: %lld -> %lld tokens per head (128 + W %lld + %lld decoded); needle %lld kept: %s\n",
              static_cast<long long>(l), static_cast<long long>(result.max_length),
              static_cast<long long>(config.window), static_cast<long long>(delay), static_cast<long long>(needle),
              needle_kept ? "yes" : "no");
  std::printf("next decode position: %lld (RoPE positions are unchanged by eviction)\n", static_cast<long long>(l));
  state.reset();  // ready for the next sequence
  return needle_kept ? 0 : 2;
}
