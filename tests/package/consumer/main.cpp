// Scores, selects and evicts a tiny HF-layout layer through the installed/added kvevict.
#include <kvevict/kvevict.hpp>

#include <cstdio>
#include <vector>

int main() {
  const std::int64_t hkv = 2, hq = 4, d = 8, l = 40, w = 4;
  std::vector<kvevict::bf16> k(hkv * l * d), v(hkv * l * d), q(hq * w * d);
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = kvevict::bf16(static_cast<float>((i * 37) % 17) / 17.0f - 0.5f);
    v[i] = kvevict::bf16(static_cast<float>(i % 11));
  }
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = kvevict::bf16(static_cast<float>((i * 13) % 7) / 7.0f);
  std::vector<std::int64_t> pos = {36, 37, 38, 39};

  kvevict::snapkv<kvevict::bf16> policy(kvevict::presets::kvpress_snapkv());
  kvevict::window_config cfg = policy.config();
  cfg.window = w;
  policy = kvevict::snapkv<kvevict::bf16>(cfg);
  kvevict::layer_inputs<kvevict::bf16> in;
  in.keys = kvevict::hf_contiguous(k.data(), hkv, l, d);
  in.queries = kvevict::contiguous_queries(q.data(), hq, w, d, pos.data());

  std::vector<float> scores(hkv * l);
  kvevict::workspace ws(policy.workspace_size({hq, hkv, d, l, w}));
  if (!policy.score(in, {scores.data(), hkv, l, l}, ws).ok()) return 1;
  const auto budget = kvevict::budget::tokens(12);
  kvevict::keep_list keep(hkv, kvevict::select_capacity(hkv, l, budget, policy.selection()));
  kvevict::workspace sws(kvevict::select_workspace_size(l));
  if (!kvevict::select(kvevict::const_score_view{scores.data(), hkv, l, l}, budget, policy.selection(), keep, sws).ok())
    return 2;
  kvevict::eviction_result result;
  auto kv = kvevict::hf_contiguous(k.data(), hkv, l, d);
  auto vv = kvevict::hf_contiguous(v.data(), hkv, l, d);
  const kvevict::status st = kvevict::evict(kv, vv, keep, result);
  if (!st.ok()) {
    std::printf("%s\n", st.message());
    return 3;
  }
  std::printf("kvevict %d: kept %lld of %lld tokens per head\n", KVEVICT_VERSION,
              static_cast<long long>(result.max_length), static_cast<long long>(l));
  return result.max_length == 12 ? 0 : 4;
}
