// Built with -fno-exceptions: the whole API works through status values, errors included.
#include <kvevict/kvevict.hpp>

#include <cstdio>
#include <cstring>
#include <vector>

#if KVEVICT_HAS_EXCEPTIONS
#error "this program must be compiled with -fno-exceptions"
#endif

#define CHECK(cond)                                                 \
  do {                                                              \
    if (!(cond)) {                                                  \
      std::printf("FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      return 1;                                                     \
    }                                                               \
  } while (0)

int main() {
  const std::int64_t hkv = 2, hq = 4, d = 16, l = 64, w = 8;
  std::vector<kvevict::fp16> k(hkv * l * d), v(hkv * l * d), q(hq * w * d);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = kvevict::fp16(static_cast<float>((i * 29) % 23) / 23.0f - 0.5f);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = kvevict::fp16(static_cast<float>(i % 13));
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = kvevict::fp16(static_cast<float>((i * 7) % 5) / 5.0f);
  std::vector<std::int64_t> pos;
  for (std::int64_t t = 0; t < w; ++t) pos.push_back(l - w + t);

  kvevict::scoring_params params = kvevict::presets::kvpress_snapkv().params();
  params.protected_tail = w;
  auto keys = kvevict::hf_contiguous(k.data(), hkv, l, d);
  auto values = kvevict::hf_contiguous(v.data(), hkv, l, d);
  auto queries = kvevict::contiguous_queries(q.data(), hq, w, d, pos.data());
  std::vector<float> scores(hkv * l);
  kvevict::workspace ws(kvevict::observation_scores_workspace_size({hq, hkv, d, l, w}, params));

  // Errors come back as values naming the argument, with nothing written.
  std::vector<float> before = scores;
  auto bad = queries;
  bad.num_heads = 3;
  kvevict::status st = kvevict::observation_scores(bad, keys, params, {scores.data(), hkv, l, l}, ws);
  CHECK(st.code() == kvevict::errc::invalid_shape);
  CHECK(std::strcmp(st.argument(), "queries.num_heads") == 0);
  CHECK(scores == before);

  st = kvevict::observation_scores(queries, keys, params, {scores.data(), hkv, l, l}, ws);
  CHECK(st.ok());
  kvevict::keep_list keep(
      hkv, kvevict::select_capacity(hkv, l, kvevict::budget::tokens(20), {w, kvevict::protected_mode::inside_budget}));
  kvevict::workspace sws(kvevict::select_workspace_size(l));
  CHECK(kvevict::select(kvevict::const_score_view{scores.data(), hkv, l, l}, kvevict::budget::tokens(20),
                        {w, kvevict::protected_mode::inside_budget}, keep, sws)
            .ok());

  // A keep-list that is not ascending is rejected before anything moves.
  std::vector<kvevict::fp16> k_before = k;
  std::vector<std::int64_t> offsets = {0, 2, 4}, indices = {5, 3, 1, 2};
  kvevict::const_keep_list_view broken{hkv, offsets.data(), indices.data(), 4};
  kvevict::eviction_result result;
  st = kvevict::evict(keys, values, broken, result);
  CHECK(st.code() == kvevict::errc::invalid_keep_list);
  CHECK(std::memcmp(k.data(), k_before.data(), k.size() * sizeof(kvevict::fp16)) == 0);

  st = kvevict::evict(keys, values, keep, result);
  CHECK(st.ok());
  CHECK(result.max_length == 20);

  // The DeferKV lifecycle reports misuse as values too, and leaves the state alone.
  kvevict::deferkv_config dcfg;
  dcfg.window = w;
  dcfg.delay = 1;
  kvevict::deferkv_state<kvevict::fp16> state(dcfg, 3);
  CHECK(state.reserve(hkv, l).ok());
  kvevict::workspace dws(state.workspace_size({hq, hkv, d, l, w}));
  kvevict::layer_inputs<kvevict::fp16> in;
  in.keys = kvevict::hf_contiguous<const kvevict::fp16>(k.data(), hkv, l - 1, d);
  in.queries = queries;
  st = state.observe_decode(3, 0, in, dws);
  CHECK(st.code() == kvevict::errc::invalid_state && std::strcmp(st.argument(), "state") == 0);
  st = state.observe_prefill(2, in, dws);
  CHECK(st.code() == kvevict::errc::invalid_state && std::strcmp(st.argument(), "layer") == 0);
  CHECK(state.observe_prefill(3, in, dws).ok());
  CHECK(!state.ready() && state.prompt_tokens() == l - 1);

  // NaN scores select deterministically (NaN last, ties to the smaller index).
  std::vector<float> nan_scores(hkv * 8, 1.0f);
  nan_scores[0] = nan_scores[8] = __builtin_nanf("");
  kvevict::keep_list nan_keep(hkv, hkv * 7);
  CHECK(kvevict::select(kvevict::const_score_view{nan_scores.data(), hkv, 8, 8}, kvevict::budget::tokens(7), {},
                        nan_keep, sws)
            .ok());
  CHECK(nan_keep.head(0) == (std::vector<std::int64_t>{1, 2, 3, 4, 5, 6, 7}));
  std::printf("no-exceptions build: all checks passed (%s)\n", kvevict::to_string(kvevict::errc::invalid_keep_list));
  return 0;
}
