// A long generation through the compressor: one sequence decodes 4,096 tokens after its
// prompt, and decode-time budgets (compressor_options::decoding) hold every layer's cache at
// target + N rows per head with the same one call per layer per step.
//
//   prefill_end -> the prompt is compressed once (SnapKV, 1,024 -> 512 rows per head)
//   decode      -> each step's query joins the layer's window of decode queries; the step that
//                  leaves the layer holding more than target + N rows compresses it back to
//                  target (SnapKV over the last 8 decode queries)
//
// The model is simulated (random keys, values and queries). Exit 0 when the cache never held
// more than target + N rows and the rounds came every N + 1 tokens.
#include <kvevict/kvevict.hpp>

#include <cstdio>
#include <random>
#include <vector>

using kvevict::bf16;

int main() {
  const std::int64_t layers = 2, hq = 8, hkv = 2, d = 64, prompt = 1024, steps = 4096;
  const std::int64_t target = 512, interval = 64;
  const std::int64_t capacity = prompt;  // rows the engine reserves: the prompt; decoding stays below

  kvevict::compressor_options opt;
  opt.model = {layers, hq, hkv, d, 0, kvevict::dtype::bf16};
  opt.policy = kvevict::policy::snapkv();  // kvpress's SnapKV at the end of prefill
  opt.per_head = kvevict::budget::tokens(target);
  opt.limits.max_tokens = capacity;
  kvevict::window_config scorer = kvevict::presets::kvpress_snapkv();
  scorer.window = 8;  // the last 8 decode queries observe (and the newest 8 tokens are kept)
  opt.decoding.policy = kvevict::policy::snapkv(scorer);
  opt.decoding.target = kvevict::budget::tokens(target);
  opt.decoding.interval = interval;
  kvevict::compressor compressor;
  kvevict::status st = kvevict::compressor::plan(opt, &compressor);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
  kvevict::workspace ws(compressor.workspace_size());
  // The sequence's state: each layer's window of the last decode queries ([Hq, 8, d] bf16).
  std::vector<std::uint64_t> state(compressor.sequence_state_size() / 8 + 1);
  st = compressor.reset_sequence(state.data(), state.size() * 8);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
  std::printf("planned: target %lld + N %lld rows per head; state %.1f KiB per sequence, workspace %.1f KiB\n",
              static_cast<long long>(target), static_cast<long long>(interval),
              static_cast<double>(compressor.sequence_state_size()) / 1024.0,
              static_cast<double>(compressor.workspace_size()) / 1024.0);

  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<bf16>> k(layers, std::vector<bf16>(hkv * capacity * d)), v = k;
  for (std::int64_t l = 0; l < layers; ++l)
    for (std::int64_t i = 0; i < hkv * prompt * d; ++i) {
      k[l][i] = bf16(normal(rng));
      v[l][i] = bf16(normal(rng));
    }
  std::vector<std::int64_t> length(layers, prompt);  // rows each layer's cache holds
  std::int64_t position = prompt;                    // RoPE position of the next token
  auto io = [&](std::int64_t l, kvevict::sequence_event e, const std::vector<bf16>& q, const std::int64_t* pos,
                std::int64_t n) {
    kvevict::sequence_io<bf16> s;
    s.event = e;
    s.keys = kvevict::hf_contiguous(k[l].data(), hkv, length[l], d, capacity);
    s.values = kvevict::hf_contiguous(v[l].data(), hkv, length[l], d, capacity);
    s.queries = kvevict::contiguous_queries<const bf16>(q.data(), hq, n, d, pos);
    s.state = state.data();
    return s;
  };

  // End of prefill: the last 64 prompt queries (kvpress's SnapKV window), one call per layer.
  const std::int64_t w = compressor.observation_window();
  std::vector<bf16> window_q(hq * w * d);
  for (auto& x : window_q) x = bf16(normal(rng));
  std::vector<std::int64_t> window_pos;
  for (std::int64_t t = 0; t < w; ++t) window_pos.push_back(prompt - w + t);
  kvevict::sequence_report report;
  for (std::int64_t l = 0; l < layers; ++l) {
    const auto s = io(l, kvevict::sequence_event::prefill_end, window_q, window_pos.data(), w);
    st = compressor.run(l, &s, 1, &report, ws);
    if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
    length[l] = report.next_slot;
  }
  std::printf("prefill_end: %lld prompt tokens -> %lld rows per head\n", static_cast<long long>(prompt),
              static_cast<long long>(length[0]));

  std::int64_t rounds = 0, longest = 0;
  bool within = true;
  std::vector<bf16> q(hq * d);
  for (std::int64_t step = 1; step <= steps; ++step) {
    for (std::int64_t l = 0; l < layers; ++l) {
      // The engine writes the token's K/V at the next row, runs attention, then the hook.
      for (std::int64_t c = 0; c < hkv * d; ++c) {
        k[l][(c / d) * capacity * d + length[l] * d + c % d] = bf16(normal(rng));
        v[l][(c / d) * capacity * d + length[l] * d + c % d] = bf16(normal(rng));
      }
      ++length[l];
      longest = length[l] > longest ? length[l] : longest;
      for (auto& x : q) x = bf16(normal(rng));
      const auto s = io(l, kvevict::sequence_event::decode, q, &position, 1);
      st = compressor.run(l, &s, 1, &report, ws);
      if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
      rounds += report.action == kvevict::sequence_action::evicted ? 1 : 0;
      length[l] = report.next_slot;
      within = within && length[l] <= target + interval;
    }
    position = report.next_position;
    if (step % 256 == 0)
      std::printf("step %4lld: position %5lld, cache %lld rows per head (at most %lld), %lld rounds so far\n",
                  static_cast<long long>(step), static_cast<long long>(position), static_cast<long long>(length[0]),
                  static_cast<long long>(target + interval), static_cast<long long>(rounds / layers));
  }
  // Memory: what the cache holds at its longest against what the whole generation would.
  const double bytes_per_row = static_cast<double>(layers * hkv * 2 * d) * sizeof(bf16);
  const double full = static_cast<double>(prompt + steps) * bytes_per_row,
               held = static_cast<double>(longest) * bytes_per_row;
  std::printf("longest cache %lld rows per head: %.1f KiB of K and V against %.1f KiB uncompressed (%.1f%% saved)\n",
              static_cast<long long>(longest), held / 1024.0, full / 1024.0, 100.0 * (1.0 - held / full));
  const std::int64_t expected = (steps / (interval + 1)) * layers;
  std::printf("%lld rounds per layer (every %lld tokens)\n", static_cast<long long>(rounds / layers),
              static_cast<long long>(interval + 1));
  return within && longest == target + interval + 1 && rounds == expected ? 0 : 2;
}
