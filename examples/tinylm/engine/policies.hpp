// How tinylm applies each policy to its cache: through kvevict's compressor only, exactly as
// an engine would -- a plan per policy and budget, and one run() per layer per model step
// from the attention hook (the prompt's prefill, DapQ's pseudo-token prefill, every decode
// step), with views over tinylm's own cache.
#pragma once

#include <kvevict/kvevict.hpp>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
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
  kvevict::selection_scope scope = kvevict::selection_scope::per_head;  // SnapKV rows only
  kvevict::scope_combine combine = kvevict::scope_combine::normalized_max;
};

/// The bench's policy list (design.md §11: every policy, DeferKV's eta and d sweeps and its
/// combinations with PyramidKV and AdaKV, DapQ both ways).
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
  // SnapKV with keep sets shared by a layer's heads and by the whole sequence, under the four
  // combining rules (the first of each is the default, normalised max).
  const std::pair<const char*, kvevict::scope_combine> rules[] = {{"", kvevict::scope_combine::normalized_max},
                                                                  {"_nmean", kvevict::scope_combine::normalized_mean},
                                                                  {"_max", kvevict::scope_combine::max},
                                                                  {"_mean", kvevict::scope_combine::mean}};
  for (auto scope : {kvevict::selection_scope::per_layer, kvevict::selection_scope::per_sequence})
    for (const auto& r : rules) {
      policy_spec spec{
          std::string(scope == kvevict::selection_scope::per_layer ? "snapkv_layer_shared" : "snapkv_seq_shared") +
              r.first,
          policy_kind::snapkv};
      spec.scope = scope;
      spec.combine = r.second;
      p.push_back(spec);
    }
  return p;
}

/// Everything one prompt's prefill leaves behind, shared by every policy and budget.
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

inline kvevict::window_config snap_config() {
  kvevict::window_config cfg = kvevict::presets::kvcache_factory_longbench();  // W = 8, max-pool 7, sum
  cfg.window = kWindow;
  cfg.protect = kvevict::protected_mode::inside_budget;  // every policy keeps the same token count
  return cfg;
}

/// One compressor call's view of a layer of tinylm's cache (its batch is one sequence): the rows
/// the layer holds, the step's queries, the sequence state and where a report's outputs go.
inline kvevict::sequence_io<float> layer_io(kv_cache& cache, std::int64_t layer, kvevict::sequence_event event,
                                            kvevict::query_view<const float> queries, void* state,
                                            std::int64_t* head_lengths, std::int64_t* kept_positions = nullptr) {
  kvevict::sequence_io<float> io;
  io.event = event;
  io.keys = cache.keys(layer, cache.length(layer));
  io.values = cache.values(layer, cache.length(layer));
  io.queries = queries;
  io.state = state;
  io.head_lengths = head_lengths;
  io.kept_positions = kept_positions;
  return io;
}

/// TinyLM's model (float32 cache) at `budget` tokens per KV head, for caches of up to
/// `max_tokens` rows; the benches add the policy.
inline kvevict::compressor_options model_options(const model& m, std::int64_t budget, std::int64_t max_tokens) {
  kvevict::compressor_options o;
  o.model = {m.cfg.layers, m.cfg.heads, m.cfg.kv_heads, m.cfg.head_dim, 0, kvevict::dtype::f32};
  o.per_head = kvevict::budget::tokens(budget);
  o.limits.max_tokens = max_tokens;
  return o;
}

/// The compressor options of a policy at `budget` tokens per head. Every policy keeps the
/// last kWindow prompt tokens (the question) inside the budget. Allocators move prompt
/// candidates between layers or heads; DeferKV's decoded tokens then come on top of the
/// budget, so its allocator rows get `delay` more tokens (the compressor counts decoded
/// tokens as protected, inside the budget).
inline kvevict::compressor_options compressor_for(const model& m, const policy_spec& spec, std::int64_t budget,
                                                  std::int64_t max_tokens) {
  kvevict::compressor_options o = model_options(m, budget, max_tokens);
  switch (spec.kind) {
    case policy_kind::full:
      throw std::logic_error("full KV evicts nothing");
    case policy_kind::streaming:
      o.policy = kvevict::policy::streaming_llm({4});
      break;
    case policy_kind::knorm:
      // The question sits at the end of the prompt; like every other policy here, KNorm keeps
      // the last kWindow prompt tokens (its paper's pipelines never compress the question).
      o.policy = kvevict::policy::knorm({kWindow, kvevict::protected_mode::inside_budget});
      break;
    case policy_kind::h2o:  // every prompt query observes
      o.policy = kvevict::policy::h2o({kWindow, kvevict::protected_mode::inside_budget, kvevict::gqa_reduction::mean});
      break;
    case policy_kind::snapkv:
    case policy_kind::pyramidkv:
    case policy_kind::adakv:
      o.policy = kvevict::policy::snapkv(snap_config());
      break;
    case policy_kind::deferkv: {
      kvevict::deferkv_config cfg;
      cfg.window = kWindow;
      cfg.delay = spec.delay;
      cfg.eta = spec.eta;
      cfg.protect = kvevict::protected_mode::inside_budget;
      o.policy = kvevict::policy::deferkv(cfg);
      if (spec.alloc != allocator::uniform) o.per_head = kvevict::budget::tokens(budget + spec.delay);
      break;
    }
    case policy_kind::dapq:
    case policy_kind::dapq_rerotate: {
      kvevict::dapq_config cfg;  // N = 32: the first 8 + last 24 prompt tokens
      if (spec.kind == policy_kind::dapq_rerotate) {
        cfg.source = kvevict::dapq_source::rerotated_window;
        cfg.rope = m.rope;
      }
      o.policy = kvevict::policy::dapq(cfg);
      break;
    }
  }
  o.scope = spec.scope;
  o.combine = spec.combine;
  if (spec.kind == policy_kind::pyramidkv || spec.alloc == allocator::pyramid)
    o.layers = kvevict::layer_allocation::pyramidkv;
  if (spec.kind == policy_kind::adakv || spec.alloc == allocator::ada) {
    o.heads = kvevict::head_allocation::adakv;
    o.adakv = {0.2, false};
  }
  return o;
}

}  // namespace tinylm
