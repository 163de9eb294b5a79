// DeferKV as an engine calls it, through the compressor: one run() per layer per step.
//
//   prefill_end -> every layer observes the last W prompt queries   state: [layers, Hkv, Lp]
//   decode 0    -> every layer observes that step's query (the cache already holds the token)
//   decode 1    -> observes, and with d = 2 evicts; decoding continues at position Lp + 2
//   decode 2..  -> nothing more to do
//
// The model is simulated: keys, values and queries are random, and one prompt token is made
// important to the decode queries only -- the situation DeferKV is for.
#include <kvevict/kvevict.hpp>

#include <cstdio>
#include <random>
#include <vector>

using kvevict::bf16;

int main() {
  const std::int64_t layers = 2, hq = 8, hkv = 2, d = 64, prompt = 2000, steps = 3;
  kvevict::deferkv_config config;
  config.window = 32;  // W prompt queries observed at the end of prefill
  config.delay = 2;    // evict at the 2nd decode step
  config.eta = 0.9;    // observation t weighs 0.9^(T - t)
  const std::int64_t capacity = prompt + steps;

  kvevict::compressor_options opt;
  opt.model = {layers, hq, hkv, d, 0, kvevict::dtype::bf16};
  opt.policy = kvevict::policy::deferkv(config);
  opt.per_head = kvevict::budget::tokens(128);  // candidates per head; window and decoded tokens on top
  opt.limits.max_tokens = capacity;
  kvevict::compressor compressor;
  kvevict::status st = kvevict::compressor::plan(opt, &compressor);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
  kvevict::workspace ws(compressor.workspace_size());
  // The sequence's state lives in the engine's memory: [layers, Hkv, max_tokens] floats.
  std::vector<std::uint64_t> state(compressor.sequence_state_size() / 8 + 1);
  st = compressor.reset_sequence(state.data(), state.size() * 8);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
  std::printf("planned: state %.1f KiB per sequence, workspace %.1f KiB\n",
              static_cast<double>(compressor.sequence_state_size()) / 1024.0,
              static_cast<double>(compressor.workspace_size()) / 1024.0);

  // The engine's cache: per layer, HF layout with room for the decoded tokens.
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<bf16>> k(layers, std::vector<bf16>(hkv * capacity * d)), v = k;
  for (auto& layer : k)
    for (auto& x : layer) x = bf16(normal(rng));
  for (auto& layer : v)
    for (auto& x : layer) x = bf16(normal(rng));
  std::int64_t length = prompt;    // rows the cache holds (what attention reads)
  std::int64_t position = prompt;  // RoPE position of the next token
  auto io = [&](std::int64_t l, kvevict::sequence_event e, const std::vector<bf16>& q, const std::int64_t* pos,
                std::int64_t n) {
    kvevict::sequence_io<bf16> s;
    s.event = e;
    s.keys = kvevict::hf_contiguous(k[l].data(), hkv, length, d, capacity);
    s.values = kvevict::hf_contiguous(v[l].data(), hkv, length, d, capacity);
    s.queries = kvevict::contiguous_queries<const bf16>(q.data(), hq, n, d, pos);
    s.state = state.data();
    return s;
  };
  const char* actions[] = {"none", "observed", "evicted"};

  // --- End of prefill: the last W prompt queries (post-RoPE), one call per layer.
  std::vector<bf16> window_q(hq * config.window * d);
  for (auto& x : window_q) x = bf16(normal(rng));
  std::vector<std::int64_t> window_pos;
  for (std::int64_t t = 0; t < config.window; ++t) window_pos.push_back(prompt - config.window + t);
  kvevict::sequence_report report;
  for (std::int64_t l = 0; l < layers; ++l) {
    const auto s = io(l, kvevict::sequence_event::prefill_end, window_q, window_pos.data(), config.window);
    st = compressor.run(l, &s, 1, &report, ws);
    if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
  }
  std::printf("prefill_end: %lld prompt tokens, W = %lld -> %s\n", static_cast<long long>(prompt),
              static_cast<long long>(config.window), actions[static_cast<int>(report.action)]);

  // --- Decode steps: the engine writes the new token's K/V, runs attention, then the hook.
  const std::int64_t needle = 1234;  // a prompt token only the decode queries look for
  bool needle_kept = false;
  for (std::int64_t step = 0; step < steps; ++step) {
    for (std::int64_t l = 0; l < layers; ++l)
      for (std::int64_t c = 0; c < hkv * d; ++c) {  // the token's K/V land at the next slot
        k[l][(c / d) * capacity * d + length * d + c % d] = bf16(normal(rng));
        v[l][(c / d) * capacity * d + length * d + c % d] = bf16(normal(rng));
      }
    ++length;
    std::vector<bf16> q(hq * d);
    std::vector<std::int64_t> kept(static_cast<std::size_t>(compressor.keep_capacity()));
    for (std::int64_t l = 0; l < layers; ++l) {
      for (std::int64_t h = 0; h < hq; ++h)
        for (std::int64_t c = 0; c < d; ++c) q[h * d + c] = k[l][((h / (hq / hkv)) * capacity + needle) * d + c];
      auto s = io(l, kvevict::sequence_event::decode, q, &position, 1);
      s.kept_positions = kept.data();
      st = compressor.run(l, &s, 1, &report, ws);
      if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
      if (report.action == kvevict::sequence_action::evicted)
        for (std::int64_t i = 0; i < report.length; ++i) needle_kept |= kept[static_cast<std::size_t>(i)] == needle;
    }
    std::printf("decode step %lld (position %lld, cache %lld rows) -> %s", static_cast<long long>(step),
                static_cast<long long>(position), static_cast<long long>(length),
                actions[static_cast<int>(report.action)]);
    if (report.action == kvevict::sequence_action::evicted) {
      std::printf(": %lld -> %lld rows per head (128 + W %lld + %lld decoded), needle %lld kept: %s",
                  static_cast<long long>(length), static_cast<long long>(report.length),
                  static_cast<long long>(config.window), static_cast<long long>(step + 1),
                  static_cast<long long>(needle), needle_kept ? "yes" : "no");
      length = report.next_slot;  // the next token's row
    }
    position = report.next_position;  // NOT the row count after eviction
    std::printf("\n");
  }
  std::printf("next decode: K/V row %lld, RoPE position %lld (positions are unchanged by eviction)\n",
              static_cast<long long>(length), static_cast<long long>(position));
  return needle_kept && length == 128 + config.window + config.delay + 1 ? 0 : 2;
}
