// How tinylm applies each policy to its cache, through kvevict's public API only, exactly as
// an engine would: views over its own buffers, score -> select -> evict per layer, the
// DeferKV lifecycle at the first decode steps, DapQ's pseudo-token prefill or re-rotation.
#pragma once

#include <kvevict/kvevict.hpp>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "model.hpp"

namespace tinylm {

enum class policy_kind { full, streaming, knorm, h2o, snapkv, pyramidkv, adakv, deferkv, dapq, dapq_rerotate };
enum class allocator { uniform, pyramid, ada };

struct policy_spec {
  std::string name;
  policy_kind kind = policy_kind::full;
  double eta = 0.9;        // DeferKV
  std::int64_t delay = 1;  // DeferKV
  allocator alloc = allocator::uniform;
};

/// The bench's policy list (design.md §11 / issue: every policy, DeferKV's eta and d
/// sweeps and its combinations with PyramidKV and AdaKV, DapQ both ways).
inline std::vector<policy_spec> all_policies() {
  std::vector<policy_spec> p = {{"full", policy_kind::full},     {"streaming_llm", policy_kind::streaming},
                                {"knorm", policy_kind::knorm},   {"h2o", policy_kind::h2o},
                                {"snapkv", policy_kind::snapkv}, {"pyramidkv", policy_kind::pyramidkv},
                                {"adakv", policy_kind::adakv}};
  for (double eta : {1.0, 0.9, 0.7, 0.5}) {
    char name[64];
    std::snprintf(name, sizeof(name), "deferkv_eta%.1f_d1", eta);
    p.push_back({name, policy_kind::deferkv, eta, 1});
  }
  for (std::int64_t d = 2; d <= 4; ++d)
    p.push_back({"deferkv_eta0.9_d" + std::to_string(d), policy_kind::deferkv, 0.9, d});
  p.push_back({"deferkv+pyramidkv", policy_kind::deferkv, 0.9, 1, allocator::pyramid});
  p.push_back({"deferkv+adakv", policy_kind::deferkv, 0.9, 1, allocator::ada});
  p.push_back({"dapq", policy_kind::dapq});
  p.push_back({"dapq_rerotate", policy_kind::dapq_rerotate});
  return p;
}

/// Everything one prompt's prefill leaves behind that the policies read.
struct prefill_state {
  std::int64_t prompt_tokens = 0;
  kv_cache cache;                           // after the prompt
  std::vector<std::vector<float>> queries;  // per layer [Hq, Lp, d] post-RoPE
  std::vector<std::int64_t> positions;      // 0 .. Lp-1
  std::int32_t first_token = 0;             // argmax of the prompt's last logits
  // DapQ: the cache after the pseudo-token prefill and the pseudo queries.
  kv_cache pseudo_cache;
  std::vector<std::vector<float>> pseudo_queries;  // per layer [Hq, N, d]
  std::vector<std::int64_t> pseudo_positions;
};

constexpr std::int64_t kWindow = 8;         // SnapKV-family observation window (KVCache-Factory's LongBench W)
constexpr std::int64_t kPseudoTokens = 32;  // DapQ's N

inline void check(const kvevict::status& st) {
  if (!st.ok()) throw std::runtime_error(st.message());
}

/// One layer: scores [Hkv, L] -> keep-list -> eviction of that layer's K and V.
struct layer_evictor {
  const model& m;
  kvevict::workspace ws, select_ws, evict_ws;

  explicit layer_evictor(const model& mm) : m(mm) {}

  void apply(kv_cache& cache, std::int64_t layer, std::int64_t tokens, const std::vector<float>& scores,
             const kvevict::selection_params& sp, std::int64_t budget, const std::int64_t* head_budgets = nullptr) {
    const std::int64_t hkv = m.cfg.kv_heads;
    const kvevict::const_score_view view{scores.data(), hkv, tokens, tokens};
    std::int64_t capacity = 0;
    if (head_budgets != nullptr) {
      for (std::int64_t h = 0; h < hkv; ++h) capacity += kvevict::tokens_kept(head_budgets[h], tokens, sp);
    } else {
      capacity = kvevict::select_capacity(hkv, tokens, kvevict::budget::tokens(budget), sp);
    }
    kvevict::keep_list keep(hkv, capacity);
    select_ws.reserve(kvevict::select_workspace_size(tokens));
    if (head_budgets != nullptr)
      check(kvevict::select(view, head_budgets, sp, keep, select_ws));
    else
      check(kvevict::select(view, kvevict::budget::tokens(budget), sp, keep, select_ws));
    std::vector<std::int64_t> lengths(static_cast<std::size_t>(hkv));
    kvevict::eviction_result result;
    result.head_lengths = lengths.data();
    auto k = cache.keys(layer, tokens);
    auto v = cache.values(layer, tokens);
    evict_ws.reserve(kvevict::evict_workspace_size(k, v));
    check(kvevict::evict(k, v, keep, result, evict_ws));
    cache.lengths[static_cast<std::size_t>(layer)] = lengths;
  }
};

inline kvevict::query_view<const float> window_queries(const prefill_state& p, const model& m, std::int64_t layer,
                                                       std::int64_t window) {
  const std::int64_t lp = p.prompt_tokens, d = m.cfg.head_dim;
  kvevict::query_view<const float> q;
  q.data = p.queries[static_cast<std::size_t>(layer)].data() + (lp - window) * d;
  q.num_heads = m.cfg.heads;
  q.num_queries = window;
  q.head_dim = d;
  q.head_stride = lp * d;
  q.query_stride = d;
  q.positions = p.positions.data() + (lp - window);
  return q;
}

inline kvevict::window_config snap_config() {
  kvevict::window_config cfg = kvevict::presets::kvcache_factory_longbench();  // W = 8, max-pool 7, sum
  cfg.window = kWindow;
  cfg.protect = kvevict::protected_mode::inside_budget;  // every policy keeps the same token count
  return cfg;
}

/// Scores of a query-free or prompt-window policy for one layer of the prefilled cache.
inline std::vector<float> prompt_scores(const model& m, const prefill_state& p, kv_cache& cache, std::int64_t layer,
                                        policy_kind kind, kvevict::selection_params* sp) {
  const std::int64_t hkv = m.cfg.kv_heads, lp = p.prompt_tokens, d = m.cfg.head_dim;
  std::vector<float> scores(static_cast<std::size_t>(hkv * lp));
  const kvevict::score_view out{scores.data(), hkv, lp, lp};
  kvevict::layer_inputs<float> in;
  in.keys = cache.keys(layer, lp);
  kvevict::workspace ws;
  if (kind == policy_kind::streaming) {
    kvevict::streaming_llm<float> policy({4});
    check(policy.score(in, out, ws));
    *sp = policy.selection();
  } else if (kind == policy_kind::knorm) {
    // The question sits at the end of the prompt; like every other policy here, KNorm keeps
    // the last kWindow prompt tokens (its paper's pipelines never compress the question).
    kvevict::knorm<float> policy({kWindow, kvevict::protected_mode::inside_budget});
    ws.reserve(policy.workspace_size({m.cfg.heads, hkv, d, lp, 0}));
    check(policy.score(in, out, ws));
    *sp = policy.selection();
  } else if (kind == policy_kind::h2o) {
    kvevict::h2o<float> policy({kWindow, kvevict::protected_mode::inside_budget, kvevict::gqa_reduction::mean});
    in.queries = window_queries(p, m, layer, lp);  // every prompt query observes
    ws.reserve(policy.workspace_size({m.cfg.heads, hkv, d, lp, lp}));
    check(policy.score(in, out, ws));
    *sp = policy.selection();
  } else {  // snapkv / pyramidkv / adakv share SnapKV scores
    kvevict::snapkv<float> policy(snap_config());
    in.queries = window_queries(p, m, layer, kWindow);
    ws.reserve(policy.workspace_size({m.cfg.heads, hkv, d, lp, kWindow}));
    check(policy.score(in, out, ws));
    *sp = policy.selection();
  }
  return scores;
}

}  // namespace tinylm
