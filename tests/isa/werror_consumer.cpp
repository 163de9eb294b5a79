// An engine's translation unit as docs/cpu-dispatch.md describes it: includes the umbrella header and
// instantiates every policy, budget allocator, selection and eviction entry point for every
// storage type. scripts/test compiles it with g++ and clang++ at -O2 and -O3, -march=native,
// -Wall -Wextra -Wpedantic -Werror and nothing else (no -isystem, no -Wno-*): kvevict's
// headers must be warning-free under an engine's strictest flags, including the warnings
// GCC reports only after inlining (-Wmaybe-uninitialized). It also runs: every call must
// succeed and the layer must keep what was asked.
#include <kvevict/kvevict.hpp>

#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

using i64 = std::int64_t;

#define CONSUMER_CHECK(cond)                                                           \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      std::fprintf(stderr, "consumer: FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      return 1;                                                                        \
    }                                                                                  \
  } while (0)

constexpr i64 hq = 8, hkv = 2, d = 64, l = 300, w = 16, budget = 48;

template <class T>
std::vector<T> filled(std::size_t n, unsigned seed, float scale) {
  std::vector<T> v(n);
  unsigned s = seed * 2654435761u + 1u;
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    x = kvevict::from_float<T>(scale * (static_cast<float>(s >> 8) / 16777216.0f - 0.5f));
  }
  return v;
}

/// Scores with `policy`, selects `budget` tokens per head and compacts K and V in place.
template <class Policy, class T>
int run_policy(const char* name, const Policy& policy, const kvevict::layer_inputs<T>& in,
               kvevict::selection_params sel, std::vector<T>& k, std::vector<T>& v) {
  std::vector<float> scores(static_cast<std::size_t>(hkv * l));
  kvevict::workspace ws(policy.workspace_size({hq, hkv, d, l, w}));
  kvevict::status st = policy.score(in, {scores.data(), hkv, l, l}, ws);
  if (!st.ok()) {
    std::fprintf(stderr, "consumer: %s: %s\n", name, st.message());
    return 1;
  }
  const auto b = kvevict::budget::tokens(budget);
  kvevict::keep_list keep(hkv, kvevict::select_capacity(hkv, l, b, sel));
  kvevict::workspace sws(kvevict::select_workspace_size(l));
  CONSUMER_CHECK(kvevict::select(kvevict::const_score_view{scores.data(), hkv, l, l}, b, sel, keep, sws).ok());
  std::vector<T> kc = k, vc = v;
  kvevict::eviction_result result;
  CONSUMER_CHECK(kvevict::evict(kvevict::hf_contiguous(kc.data(), hkv, l, d),
                                kvevict::hf_contiguous(vc.data(), hkv, l, d), keep, result)
                     .ok());
  CONSUMER_CHECK(result.max_length >= budget);
  return 0;
}

template <class T>
int run_dtype() {
  std::vector<T> k = filled<T>(static_cast<std::size_t>(hkv * l * d), 1, 2.0f);
  std::vector<T> v = filled<T>(k.size(), 2, 2.0f);
  std::vector<T> q = filled<T>(static_cast<std::size_t>(hq * w * d), 3, 6.0f);
  std::vector<i64> pos;
  for (i64 t = 0; t < w; ++t) pos.push_back(l - w + t);
  kvevict::layer_inputs<T> in;
  in.keys = kvevict::hf_contiguous<const T>(k.data(), hkv, l, d);
  in.queries = kvevict::contiguous_queries<const T>(q.data(), hq, w, d, pos.data());
  const kvevict::selection_params sel{w, kvevict::protected_mode::inside_budget};

  kvevict::window_config snap = kvevict::presets::kvpress_snapkv();
  snap.window = w;
  int failed = 0;
  failed += run_policy("snapkv", kvevict::snapkv<T>(snap), in, sel, k, v);
  failed += run_policy("streaming_llm", kvevict::streaming_llm<T>(), in, sel, k, v);
  failed += run_policy("knorm", kvevict::knorm<T>({w, kvevict::protected_mode::inside_budget}), in, sel, k, v);
  kvevict::h2o_config h2o;
  h2o.recent_window = w;
  failed += run_policy("h2o", kvevict::h2o<T>(h2o), in, sel, k, v);
  failed += run_policy("chunkkv", kvevict::chunkkv<kvevict::snapkv<T>>(kvevict::snapkv<T>(snap)), in, sel, k, v);

  // DapQ: pseudo queries re-rotated from the window (no extra forward pass).
  kvevict::dapq_config dc;
  dc.pseudo_tokens = w;
  dc.first = 4;
  dc.last = w - 4;
  kvevict::rope_config rope;
  rope.head_dim = d;
  std::vector<T> pseudo(q.size());
  std::vector<i64> pseudo_pos(static_cast<std::size_t>(w));
  kvevict::layer_inputs<T> pin;
  pin.keys = in.keys;
  CONSUMER_CHECK(kvevict::dapq_rerotate(in.queries, rope, w, pseudo.data(), pseudo_pos.data(), &pin.queries).ok());
  failed += run_policy("dapq", kvevict::dapq<T>(dc), pin, {0, kvevict::protected_mode::inside_budget}, k, v);

  // DeferKV: prefill window, one decode step on the grown cache, scores.
  kvevict::deferkv_config dk;
  dk.window = w;
  kvevict::deferkv_state<T> state(dk);
  CONSUMER_CHECK(state.reserve(hkv, l).ok());
  kvevict::workspace dws(state.workspace_size({hq, hkv, d, l, w}));
  kvevict::layer_inputs<T> prefill = in;
  prefill.keys = kvevict::hf_contiguous<const T>(k.data(), hkv, l - 1, d, l);
  std::vector<i64> prefill_pos(pos.begin(), pos.end());
  for (auto& p : prefill_pos) --p;
  prefill.queries = kvevict::contiguous_queries<const T>(q.data(), hq, w, d, prefill_pos.data());
  CONSUMER_CHECK(state.observe_prefill(0, prefill, dws).ok());
  kvevict::layer_inputs<T> step;
  step.keys = in.keys;
  const i64 step_pos = l - 1;
  step.queries = kvevict::contiguous_queries<const T>(q.data(), hq, 1, d, &step_pos);
  CONSUMER_CHECK(state.observe_decode(0, 0, step, dws).ok());
  std::vector<float> dscores(static_cast<std::size_t>(hkv * l));
  CONSUMER_CHECK(state.scores({dscores.data(), hkv, l, l}, dws).ok());

  // Budgets: PyramidKV across layers, AdaKV across heads, then per-head selection.
  std::vector<i64> layer_budgets(4);
  CONSUMER_CHECK(kvevict::pyramidkv_layer_budgets(budget, w, 4, l, layer_budgets.data()).ok());
  std::vector<i64> head_budgets(static_cast<std::size_t>(hkv));
  kvevict::workspace aws(kvevict::adakv_workspace_size(hkv, l));
  CONSUMER_CHECK(kvevict::adakv_head_budgets(kvevict::const_score_view{dscores.data(), hkv, l, l}, w + 1, budget - w,
                                             {}, head_budgets.data(), aws)
                     .ok());
  const kvevict::selection_params on_top{w + 1, kvevict::protected_mode::on_top_of_budget};
  i64 capacity = 0;
  for (i64 b : head_budgets) capacity += b + w + 1;
  kvevict::keep_list keep(hkv, capacity);
  kvevict::workspace sws(kvevict::select_workspace_size(l));
  CONSUMER_CHECK(
      kvevict::select(kvevict::const_score_view{dscores.data(), hkv, l, l}, head_budgets.data(), on_top, keep, sws)
          .ok());

  // Ragged batch of two sequences, flattened varlen output, positions of the kept tokens.
  std::vector<i64> lens = {l, l};
  std::vector<T> kb(static_cast<std::size_t>(2 * hkv * l * d)), vb(kb.size());
  for (std::size_t i = 0; i < kb.size(); ++i) {
    kb[i] = k[i % k.size()];
    vb[i] = v[i % v.size()];
  }
  const kvevict::const_keep_list_view keeps[2] = {keep, keep};
  kvevict::eviction_result results[2];
  auto kbatch = kvevict::hf_contiguous_batch(kb.data(), 2, hkv, l, d, lens.data());
  auto vbatch = kvevict::hf_contiguous_batch(vb.data(), 2, hkv, l, d, lens.data());
  kvevict::workspace ews(kvevict::evict_batch_workspace_size(kbatch, vbatch));
  CONSUMER_CHECK(kvevict::evict_batch(kbatch, vbatch, keeps, results, ews).ok());
  const kvevict::const_keep_list_view kv = keep;
  std::vector<T> flat(static_cast<std::size_t>(kv.total() * d));
  std::vector<i64> cu(static_cast<std::size_t>(hkv + 1));
  CONSUMER_CHECK(kvevict::flatten_varlen(kvevict::hf_contiguous<const T>(k.data(), hkv, l, d), kv, flat.data(),
                                         kv.total(), d, cu.data())
                     .ok());
  std::vector<i64> kept_positions(static_cast<std::size_t>(kv.total()));
  CONSUMER_CHECK(kvevict::keep_list_positions(kv, l, nullptr, kept_positions.data()).ok());
  return failed;
}

}  // namespace

int main() {
  const int failed = run_dtype<float>() + run_dtype<kvevict::fp16>() + run_dtype<kvevict::bf16>();
  if (failed != 0) return 1;
  std::printf("consumer: every policy ran on f32, fp16 and bf16 (kvevict CPU path: %s)\n",
              kvevict::to_string(kvevict::active_cpu_isa()));
  return 0;
}
