// The Fidelity-2 bench (kvevict_tinylm --fidelity2, docs/fidelity/fidelity2.md): does DeferKV or
// DapQ deliver what its paper claims, on the 4-layer TinyLM and its long-answer tasks?
//
// Every policy runs through kvevict's compressor as an engine runs it (one run() per layer per
// model step, from the attention hook), at the same prompt-token budget B per KV head and layer,
// in three settings:
//   S1  the prompt (context + question) compressed at prefill_end, then the answer decoded
//       (the papers' setting);
//   S2  the context compressed without its question (kvpress's default), then the question
//       prefilled into the compressed cache as one multi-token step, then the answer decoded;
//   S3  S1, then the first answer fed (teacher-forced, one token per step), a second question
//       on the same context (one step), and the second answer decoded from the same cache.
// Per prompt, policy, budget and setting it writes one JSON line: exact match (whole answer,
// after the policy's eviction, and the common suffix answer[5:]), per-token accuracy over the
// suffix, the prompt tokens kept, and the attention recall of the kept set per layer: the
// share of the full-cache model's teacher-forced answer attention on the kept tokens, and the
// share of the B most attended tokens that were kept.
#pragma once

#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "model.hpp"
#include "policies.hpp"

namespace tinylm {

/// One held-out prompt of a two-question file (make_data.py --long-q2 / --fid2):
/// TASK|PROMPT_IDS|ANSWER_IDS|QUESTION2_IDS|ANSWER2_IDS (a three-field line has no second question).
struct fid2_case {
  std::string task;
  std::int64_t index = 0;                 // the prompt's index among its task's prompts
  std::vector<std::int32_t> ids, answer;  // BOS + context + question, the answer
  std::int64_t context_tokens = 0;        // BOS + context: where the question starts
  std::vector<std::int32_t> question2, answer2;
};

inline std::vector<std::int32_t> fid2_ids(const std::string& s) {
  std::vector<std::int32_t> v;
  std::istringstream in(s);
  long x = 0;
  while (in >> x) v.push_back(static_cast<std::int32_t>(x));
  return v;
}

/// The question's first token: the first question marker of the prompt ([Q] 3, [QM] 4, [TRK] 7,
/// [ALL] 12; MODEL.md's vocabulary). No context token is one of them.
inline std::int64_t fid2_question_start(const std::vector<std::int32_t>& ids) {
  for (std::size_t i = 1; i < ids.size(); ++i)
    if (ids[i] == 3 || ids[i] == 4 || ids[i] == 7 || ids[i] == 12) return static_cast<std::int64_t>(i);
  throw std::runtime_error("a prompt without a question marker");
}

/// Reads one or more files (comma-separated paths); prompt indices run on across the files.
inline std::vector<fid2_case> load_fid2_prompts(const std::string& paths) {
  std::vector<fid2_case> out;
  std::map<std::string, std::int64_t> count;
  std::stringstream list(paths);
  std::string path;
  while (std::getline(list, path, ',')) {
    std::ifstream f(path);
    if (!f) throw std::runtime_error("cannot open " + path);
    std::string line;
    while (std::getline(f, line)) {
      if (line.empty() || line[0] == '#') continue;
      std::vector<std::string> fields;
      std::stringstream in(line);
      std::string field;
      while (std::getline(in, field, '|')) fields.push_back(field);
      while (fields.size() < 5) fields.emplace_back();
      fid2_case c;
      c.task = fields[0];
      c.index = count[c.task]++;
      c.ids = fid2_ids(fields[1]);
      c.answer = fid2_ids(fields[2]);
      c.question2 = fid2_ids(fields[3]);
      c.answer2 = fid2_ids(fields[4]);
      c.context_tokens = fid2_question_start(c.ids);
      if (c.answer.size() < 6 || (c.question2.empty() != c.answer2.empty()))
        throw std::runtime_error(path + ": a line with an answer shorter than 6 tokens or half a second question");
      out.push_back(std::move(c));
    }
  }
  return out;
}

/// The answer tokens every policy generates from its compressed cache, DeferKV d <= 4 included:
/// answer[kSuffixStart:].
constexpr std::size_t kSuffixStart = 5;

/// DapQ's fixed-phrase ablation (its paper's Table 1, "position vs content"): the pseudo content
/// is this phrase repeated (filler words f0 f1 f2 f3), the same for every prompt, instead of the
/// prompt's own first and last tokens.
constexpr std::int32_t kFixedPhrase[] = {16, 17, 18, 19};

struct fid2_policy {
  enum class kind { full, snapkv, h2o, streaming, deferkv, delay_only, phase_avg, dapq, dapq_rerotate };
  std::string name;
  kind k = kind::full;
  std::int64_t window = kWindow;  // SnapKV's W
  std::int64_t delay = 1;         // DeferKV's d
  allocator alloc = allocator::uniform;
  std::int64_t pseudo = 32, first = 8, last = 24;  // DapQ's N = m + n
  bool fixed_phrase = false;
  /// The pseudo-token prefill this policy reads ("" for none).
  std::string pseudo_key() const {
    if (k != kind::dapq) return "";
    return (fixed_phrase ? "fixed" : "firstlast") + std::to_string(first) + "+" + std::to_string(last);
  }
};

inline std::vector<fid2_policy> fid2_policies() {
  using K = fid2_policy::kind;
  std::vector<fid2_policy> p;
  p.push_back({"full", K::full});
  p.push_back({"snapkv_w8", K::snapkv});
  {
    fid2_policy w32{"snapkv_w32", K::snapkv};
    w32.window = 32;
    p.push_back(w32);
  }
  p.push_back({"h2o", K::h2o});
  p.push_back({"streaming_llm", K::streaming});
  {
    fid2_policy s{"pyramidkv", K::snapkv};
    s.alloc = allocator::pyramid;
    p.push_back(s);
    s.name = "adakv";
    s.alloc = allocator::ada;
    p.push_back(s);
  }
  for (std::int64_t d = 1; d <= 4; ++d) {
    fid2_policy s{d == 1 ? "deferkv" : "deferkv_d" + std::to_string(d), K::deferkv};
    s.delay = d;
    p.push_back(s);
  }
  for (std::int64_t d : {1, 4}) {
    fid2_policy s{d == 1 ? "deferkv_delay_only" : "deferkv_delay_only_d4", K::delay_only};
    s.delay = d;
    p.push_back(s);
  }
  p.push_back({"deferkv_phase_avg", K::phase_avg});  // DeferKV's second weighting reading (d = 1)
  {
    fid2_policy s{"deferkv+pyramidkv", K::deferkv};
    s.alloc = allocator::pyramid;
    p.push_back(s);
  }
  p.push_back({"dapq", K::dapq});
  {
    fid2_policy s{"dapq_n8", K::dapq};
    s.pseudo = 8;  // the paper's Llama split, first : last = 1 : 3
    s.first = 2;
    s.last = 6;
    p.push_back(s);
    fid2_policy f{"dapq_fixed", K::dapq};
    f.fixed_phrase = true;
    p.push_back(f);
  }
  p.push_back({"dapq_rerotate", K::dapq_rerotate});
  return p;
}

/// What the compressed region holds in prompt tokens per KV head, as the docs state it.
/// `budget`: B region tokens per KV head. `decoded`: DeferKV's decoded tokens at its eviction
/// (d, or more when the step that reaches d carries several tokens: S2's question), all protected
/// inside its budget, so its budget is B + decoded rows.
inline kvevict::compressor_options fid2_options(const model& m, const fid2_policy& pol, std::int64_t budget,
                                                std::int64_t decoded, std::int64_t max_tokens) {
  using K = fid2_policy::kind;
  kvevict::compressor_options o = model_options(m, budget, max_tokens);
  switch (pol.k) {
    case K::full:
      throw std::logic_error("full KV evicts nothing");
    case K::phase_avg:
      throw std::logic_error("deferkv_phase_avg runs without a compressor (phase_avg_evict)");
    case K::snapkv: {
      kvevict::window_config c = snap_config();  // max-pool 7, sum over the window, W protected inside B
      c.window = pol.window;
      o.policy = kvevict::policy::snapkv(c);
      break;
    }
    case K::h2o:  // every prompt query observes; the last kWindow tokens protected inside B
      o.policy = kvevict::policy::h2o({kWindow, kvevict::protected_mode::inside_budget, kvevict::gqa_reduction::mean});
      break;
    case K::streaming:  // 4 sinks + the most recent tokens, B in all
      o.policy = kvevict::policy::streaming_llm({4});
      break;
    case K::deferkv:
    case K::delay_only: {
      kvevict::deferkv_config cfg;
      cfg.window = kWindow;
      cfg.delay = pol.delay;
      cfg.eta = 0.9;
      cfg.protect = kvevict::protected_mode::inside_budget;
      cfg.decode_feedback = pol.k == K::deferkv;
      o.policy = kvevict::policy::deferkv(cfg);
      if (pol.k == K::deferkv) {
        // The decoded rows are protected inside the budget: B + decoded rows keep B prompt tokens.
        o.per_head = kvevict::budget::tokens(budget + decoded);
      } else {
        // The control: the prompt-time (SnapKV-equal) keep set of B tokens, reported at
        // prefill_end without moving a row; the engine applies it at decode step d.
        o.compact = kvevict::compaction::keep_list_only;
      }
      break;
    }
    case K::dapq:
    case K::dapq_rerotate: {
      kvevict::dapq_config cfg;  // no prompt tail protected: B prompt tokens, the pseudo ones all dropped
      cfg.pseudo_tokens = pol.pseudo;
      cfg.first = pol.first;
      cfg.last = pol.last;
      if (pol.k == K::dapq_rerotate) {
        cfg.source = kvevict::dapq_source::rerotated_window;
        cfg.rope = m.rope;
      }
      o.policy = kvevict::policy::dapq(cfg);
      break;
    }
  }
  if (pol.alloc == allocator::pyramid) o.layers = kvevict::layer_allocation::pyramidkv;
  if (pol.alloc == allocator::ada) {
    o.heads = kvevict::head_allocation::adakv;
    o.adakv = {0.2, false};
  }
  return o;
}

/// The tokens a setting compresses (the prompt, or the context without its question), prefilled
/// once and shared by every policy and budget.
struct fid2_region {
  std::int64_t tokens = 0;  // L
  std::vector<std::int32_t> ids;
  kv_cache cache;                           // L rows per head (room for what follows)
  std::vector<std::vector<float>> queries;  // per layer [Hq, L, d] post-RoPE
  std::vector<std::int64_t> positions;      // 0 .. L-1
  std::int32_t first_token = 0;             // argmax of the region's last logits
  struct pseudo_prefill {
    kv_cache cache;                           // the region and the N pseudo tokens
    std::vector<std::vector<float>> queries;  // per layer [Hq, N, d]
    std::vector<std::int64_t> positions;      // L .. L+N-1
    std::int64_t tokens = 0;
  };
  std::map<std::string, pseudo_prefill> pseudo;  // by fid2_policy::pseudo_key()
  // Per layer and KV head: a key row's bits -> its position, so the rows a policy's cache holds
  // after its eviction name the region tokens it kept.
  std::vector<std::vector<std::unordered_map<std::uint64_t, std::int64_t>>> row_index;
};

inline std::uint64_t fid2_row_hash(const float* row, std::int64_t d) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::int64_t e = 0; e < d; ++e) {
    std::uint32_t bits = 0;
    std::memcpy(&bits, row + e, 4);
    h = (h ^ bits) * 1099511628211ull;
  }
  return h;
}

/// The region of the first `tokens` prompt tokens, from the prompt's prefill (causal: the rows
/// and queries of a prefix are the prefix's own), with the pseudo-token prefills `keys` need.
inline fid2_region make_region(const model& m, const kv_cache& prompt_cache,
                               const std::vector<std::vector<float>>& prompt_queries, std::int64_t prompt_tokens,
                               const std::vector<std::int32_t>& ids, std::int64_t tokens, std::int32_t first_token,
                               const std::vector<fid2_policy>& policies) {
  const std::int64_t hq = m.cfg.heads, hkv = m.cfg.kv_heads, d = m.cfg.head_dim;
  fid2_region r;
  r.tokens = tokens;
  r.ids.assign(ids.begin(), ids.begin() + tokens);
  r.cache = prompt_cache;
  for (auto& per_layer : r.cache.lengths) std::fill(per_layer.begin(), per_layer.end(), tokens);
  r.queries.resize(prompt_queries.size());
  for (std::size_t l = 0; l < prompt_queries.size(); ++l) {
    auto& q = r.queries[l];
    q.resize(static_cast<std::size_t>(hq * tokens * d));
    for (std::int64_t j = 0; j < hq; ++j)
      std::copy_n(prompt_queries[l].data() + j * prompt_tokens * d, tokens * d, q.data() + j * tokens * d);
  }
  for (std::int64_t t = 0; t < tokens; ++t) r.positions.push_back(t);
  r.first_token = first_token;
  for (const auto& pol : policies) {
    const std::string key = pol.pseudo_key();
    if (key.empty() || r.pseudo.count(key) != 0) continue;
    fid2_region::pseudo_prefill p;
    std::vector<std::int32_t> content(static_cast<std::size_t>(pol.pseudo));
    if (pol.fixed_phrase) {
      for (std::size_t i = 0; i < content.size(); ++i) content[i] = kFixedPhrase[i % 4];
    } else {
      check(kvevict::dapq_pseudo_tokens_first_last(r.ids.data(), tokens, pol.first, pol.last, content.data()));
    }
    p.tokens = pol.pseudo;
    p.positions.resize(static_cast<std::size_t>(pol.pseudo));
    kvevict::dapq_pseudo_positions(tokens, pol.pseudo, p.positions.data());
    p.cache = r.cache;
    forward(m, p.cache, content.data(), pol.pseudo, tokens, &p.queries);
    r.pseudo.emplace(key, std::move(p));
  }
  r.row_index.assign(static_cast<std::size_t>(m.cfg.layers),
                     std::vector<std::unordered_map<std::uint64_t, std::int64_t>>(static_cast<std::size_t>(hkv)));
  for (std::int64_t l = 0; l < m.cfg.layers; ++l)
    for (std::int64_t h = 0; h < hkv; ++h) {
      auto& index = r.row_index[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)];
      for (std::int64_t t = 0; t < tokens; ++t)
        if (!index.emplace(fid2_row_hash(r.cache.row(r.cache.k[static_cast<std::size_t>(l)], h, t), d), t).second)
          throw std::runtime_error("two region rows with one key hash: the kept sets cannot be read");
    }
  return r;
}

/// What a setting feeds after its region and which answer it decodes.
struct fid2_plan {
  std::string setting;                            // S1, S2, S3
  std::vector<std::vector<std::int32_t>> forced;  // steps before the answer (S2: the question;
                                                  // S3: answer 1 one token a step, then question 2)
  std::vector<std::int32_t> answer;
};

/// The full-cache model, teacher-forced: per layer and KV head, the attention mass on each region
/// position, summed over the queries that produce the answer's tokens (the region's last query
/// in S1, else the last forced token's; then answer[0 .. n-2]) and averaged over the KV head's
/// query heads (softmax over every visible key).
inline std::vector<std::vector<std::vector<double>>> answer_attention(const model& m, const fid2_region& r,
                                                                      const fid2_plan& plan) {
  const std::int64_t hq = m.cfg.heads, hkv = m.cfg.kv_heads, d = m.cfg.head_dim, g = m.cfg.group();
  const std::int64_t L = r.tokens;
  std::vector<std::vector<std::vector<double>>> att(
      static_cast<std::size_t>(m.cfg.layers),
      std::vector<std::vector<double>>(static_cast<std::size_t>(hkv),
                                       std::vector<double>(static_cast<std::size_t>(L))));
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> s;
  // One query (head j) over the first `visible` rows of KV head j / g of `cache`, layer l.
  auto add = [&](std::int64_t l, std::int64_t j, const float* q, kv_cache& cache, std::int64_t visible) {
    const std::int64_t i = j / g;
    s.assign(static_cast<std::size_t>(visible), 0.0);
    double mx = -1e300;
    for (std::int64_t u = 0; u < visible; ++u) {
      const float* k = cache.row(cache.k[static_cast<std::size_t>(l)], i, u);
      double dot = 0;
      for (std::int64_t e = 0; e < d; ++e) dot += static_cast<double>(q[e]) * static_cast<double>(k[e]);
      s[static_cast<std::size_t>(u)] = dot * scale;
      mx = std::max(mx, dot * scale);
    }
    double z = 0;
    for (auto& x : s) z += (x = std::exp(x - mx));
    auto& out = att[static_cast<std::size_t>(l)][static_cast<std::size_t>(i)];
    for (std::int64_t u = 0; u < L; ++u)
      out[static_cast<std::size_t>(u)] += s[static_cast<std::size_t>(u)] / z / static_cast<double>(g);
  };
  kv_cache cache = r.cache;
  std::vector<std::int32_t> tokens;
  for (const auto& step : plan.forced) tokens.insert(tokens.end(), step.begin(), step.end());
  const std::int64_t first_producing = plan.forced.empty() ? 0 : static_cast<std::int64_t>(tokens.size()) - 1;
  tokens.insert(tokens.end(), plan.answer.begin(), plan.answer.end() - 1);
  if (plan.forced.empty())  // S1: the region's last query produces answer[0]
    for (std::int64_t l = 0; l < m.cfg.layers; ++l)
      for (std::int64_t j = 0; j < hq; ++j)
        add(l, j, r.queries[static_cast<std::size_t>(l)].data() + (j * L + L - 1) * d, cache, L);
  const std::int64_t n = static_cast<std::int64_t>(tokens.size());
  forward(m, cache, tokens.data(), n, L, nullptr, [&](std::int64_t l, const float* q, std::int64_t) {
    const std::int64_t past = cache.length(l) - n;
    for (std::int64_t t = first_producing; t < n; ++t)
      for (std::int64_t j = 0; j < hq; ++j) add(l, j, q + (t * hq + j) * d, cache, past + t + 1);
  });
  return att;
}

/// One policy's run on one setting of one prompt.
struct fid2_run {
  std::vector<std::int32_t> generated;  // the answer's n tokens, greedy on the policy's cache
  std::size_t first_after = 0;          // the first answer token produced after the eviction
  // [layer][KV head]: the region positions the cache holds after the eviction (ascending)
  std::vector<std::vector<std::vector<std::int64_t>>> kept;
};

struct fid2_calls {
  std::int64_t calls = 0;
  static void on_run(void* ctx, const kvevict::run_trace&) { ++static_cast<fid2_calls*>(ctx)->calls; }
};

/// deferkv_phase_avg, DeferKV's second weighting reading (its paper's Fig. 1 caption: "the average over
/// the last 32 prefill queries and the attention from the first decode query", the decode side weighted
/// as a phase), at DeferKV's window W = kWindow and d = 1:
///   score[j] = 0.5 x (mean over the last W region queries of their softmax attention on j)
///            + 0.5 x (mean over the first decoded step's n queries of theirs)   (S1: n = 1)
/// per query head (softmax over every key the query sees), averaged over the KV head's query heads
/// (GQA mean, before pooling), then DeferKV's max-pool (kernel 7) over the candidates (the region's
/// tokens before the window); the window and the step's n tokens protected inside a budget of B + n,
/// so B region tokens stay, as with `deferkv`. Built from kvevict's public blocks: one
/// observation_scores call over the W + n queries (window_aggregation::weighted, weights 0.5 / W and
/// 0.5 / n: exactly the mean above), select, evict. Called in layer `layer`'s hook of the first step
/// after the region (where `deferkv` evicts); `cache` then holds the region and the step's rows.
inline void phase_avg_evict(const model& m, const fid2_region& r, kv_cache& cache, std::int64_t layer,
                            const float* step_queries /* token-major [n, Hq, d] */, std::int64_t n,
                            const std::int64_t* step_positions, std::int64_t budget) {
  const std::int64_t hq = m.cfg.heads, hkv = m.cfg.kv_heads, d = m.cfg.head_dim, L = r.tokens;
  const std::int64_t w = std::min<std::int64_t>(kWindow, L), nq = w + n, rows = cache.length(layer);
  if (rows != L + n) throw std::runtime_error("deferkv_phase_avg: the cache is not the region and the step");
  std::vector<float> queries(static_cast<std::size_t>(hq * nq * d)), weights(static_cast<std::size_t>(nq));
  std::vector<std::int64_t> positions(static_cast<std::size_t>(nq));
  const float* region_queries = r.queries[static_cast<std::size_t>(layer)].data();  // [Hq, L, d]
  for (std::int64_t j = 0; j < hq; ++j) {
    for (std::int64_t t = 0; t < w; ++t)
      std::copy_n(region_queries + (j * L + L - w + t) * d, d, queries.data() + (j * nq + t) * d);
    for (std::int64_t t = 0; t < n; ++t)
      std::copy_n(step_queries + (t * hq + j) * d, d, queries.data() + (j * nq + w + t) * d);
  }
  for (std::int64_t t = 0; t < nq; ++t) {
    positions[static_cast<std::size_t>(t)] = t < w ? L - w + t : step_positions[t - w];
    weights[static_cast<std::size_t>(t)] = t < w ? 0.5f / static_cast<float>(w) : 0.5f / static_cast<float>(n);
  }
  kvevict::deferkv_config deferkv;  // DeferKV's scoring choices: visible softmax, GQA mean, max-pool 7
  deferkv.window = kWindow;
  kvevict::scoring_params params = deferkv.params();
  params.protected_tail = w + n;  // the window and the step's tokens; candidates: the region before the window
  const kvevict::selection_params keep_rule{w + n, kvevict::protected_mode::inside_budget};
  const kvevict::cache_view<float> keys = cache.keys(layer, rows), values = cache.values(layer, rows);
  const kvevict::layer_shape shape{hq, hkv, d, rows, nq};
  kvevict::workspace ws(std::max({kvevict::observation_scores_workspace_size(shape, params),
                                  kvevict::select_workspace_size(rows), kvevict::evict_workspace_size(keys, values)}));
  std::vector<float> scores(static_cast<std::size_t>(hkv * rows));
  kvevict::observation_inputs in;
  in.weights = weights.data();
  check(
      kvevict::observation_scores(kvevict::contiguous_queries<const float>(queries.data(), hq, nq, d, positions.data()),
                                  keys, params, kvevict::score_view{scores.data(), hkv, rows, rows}, ws, in));
  const kvevict::budget b = kvevict::budget::tokens(budget + n);
  kvevict::keep_list keep(hkv, kvevict::select_capacity(hkv, rows, b, keep_rule));
  check(kvevict::select(kvevict::const_score_view{scores.data(), hkv, rows, rows}, b, keep_rule, keep, ws));
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(hkv));
  kvevict::eviction_result result;
  result.head_lengths = lengths.data();
  check(kvevict::evict(keys, values, kvevict::const_keep_list_view(keep.view()), result, ws.span(),
                       kvevict::eviction_options{}));
  cache.lengths[static_cast<std::size_t>(layer)] = lengths;
}

/// Runs `pol` at `budget` region tokens per KV head on the plan, as an engine does: the region's
/// step (prefill_end; DapQ: the region's step `idle`, then the pseudo tokens' step), each forced
/// step, then greedy decoding, with one compressor run() per layer per model step (throws when
/// the count differs, a call is refused or a report disagrees with the engine's cache).
/// deferkv_delay_only: its compressor (DeferKV, decode_feedback = false, keep_list_only) runs once
/// per layer at prefill_end and reports the keep set without moving a row; the engine compacts
/// each layer to those rows and the decoded rows in the hook of the step that brings the decoded
/// tokens to d -- where DeferKV evicts -- and the compressor is not called at later steps.
inline fid2_run run_fid2(const model& m, const fid2_region& r, const fid2_plan& plan, const fid2_policy& pol,
                         std::int64_t budget) {
  using K = fid2_policy::kind;
  const std::int64_t hq = m.cfg.heads, hkv = m.cfg.kv_heads, d = m.cfg.head_dim, layers = m.cfg.layers;
  const std::int64_t L = r.tokens;
  const std::size_t n = plan.answer.size();
  fid2_run out;
  const bool pseudo = pol.k == K::dapq;
  const fid2_region::pseudo_prefill* pp = pseudo ? &r.pseudo.at(pol.pseudo_key()) : nullptr;
  kv_cache cache = pseudo ? pp->cache : r.cache;
  std::int64_t position = L;  // the next fed token's RoPE position
  std::int64_t evicted_layers = 0;
  std::int64_t steps = 0, expected_steps = 0;
  fid2_calls counter;
  kvevict::compressor compressor;
  std::vector<std::uint64_t> state;
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(hkv));
  std::vector<std::int64_t> kept_positions;
  kvevict::workspace ws(0);
  // deferkv_delay_only: the keep set chosen at prefill_end, per layer [Hkv] lists of row indices
  std::vector<std::vector<std::vector<std::int64_t>>> pending(static_cast<std::size_t>(layers));
  std::int64_t fed = 0;  // tokens fed after the region (decoded or forced)

  auto run = [&](std::int64_t layer, kvevict::sequence_event event, kvevict::query_view<const float> queries) {
    kvevict::sequence_io<float> io =
        layer_io(cache, layer, event, queries, state.data(), lengths.data(), kept_positions.data());
    // (AdaKV: heads of one layer hold different lengths after eviction; the views' common
    // length is head 0's, and no call after the eviction reads them: a decode step after it
    // is `none`)
    kvevict::sequence_report report;
    check(compressor.run(layer, &io, 1, &report, ws));
    if (report.action != kvevict::sequence_action::evicted) return;
    if (pol.k == K::delay_only) {
      std::size_t offset = 0;
      auto& keep = pending[static_cast<std::size_t>(layer)];
      keep.assign(static_cast<std::size_t>(hkv), {});
      for (std::int64_t h = 0; h < hkv; ++h)
        for (std::int64_t j = 0; j < lengths[static_cast<std::size_t>(h)]; ++j)
          keep[static_cast<std::size_t>(h)].push_back(kept_positions[offset++]);
      if (static_cast<std::int64_t>(offset) != report.kept) throw std::runtime_error("keep list of another length");
      return;
    }
    cache.lengths[static_cast<std::size_t>(layer)] = lengths;
    if (report.next_position != position)
      throw std::runtime_error(pol.name + ": next_position " + std::to_string(report.next_position) + ", expected " +
                               std::to_string(position));
    ++evicted_layers;
  };

  if (pol.k == K::full) {
    evicted_layers = layers;  // full KV: its "eviction" is the region's step (nothing dropped)
  } else if (pol.k == K::phase_avg) {
    // no compressor: phase_avg_evict in each layer's hook of the first step after the region
  } else {
    // The tokens fed by the end of the step that brings them to d (DeferKV evicts there).
    std::int64_t decoded = 0;
    for (const auto& forced : plan.forced)
      if (decoded < pol.delay) decoded += static_cast<std::int64_t>(forced.size());
    decoded = std::max(decoded, pol.delay);
    kvevict::compressor_options o = fid2_options(m, pol, budget, decoded, cache.capacity);
    o.tracer = {&counter, &fid2_calls::on_run};
    check(kvevict::compressor::plan(o, &compressor));
    ws = kvevict::workspace(compressor.workspace_size());
    state.assign(compressor.sequence_state_size() / 8 + 1, 0);
    check(compressor.reset_sequence(state.data(), state.size() * 8));
    kept_positions.assign(static_cast<std::size_t>(compressor.keep_capacity()), -1);
    if (pseudo) {  // the region's step: nothing to do yet; then the pseudo tokens' step
      for (std::int64_t l = 0; l < layers; ++l) run(l, kvevict::sequence_event::idle, {});
      ++expected_steps;
      for (std::int64_t l = 0; l < layers; ++l)
        run(l, kvevict::sequence_event::prefill_end,
            kvevict::contiguous_queries<const float>(pp->queries[static_cast<std::size_t>(l)].data(), hq, pp->tokens, d,
                                                     pp->positions.data()));
    } else {
      for (std::int64_t l = 0; l < layers; ++l)
        run(l, kvevict::sequence_event::prefill_end,
            kvevict::contiguous_queries<const float>(r.queries[static_cast<std::size_t>(l)].data(), hq, L, d,
                                                     r.positions.data()));
    }
    ++expected_steps;
    if (pseudo && evicted_layers != layers) throw std::runtime_error(pol.name + ": no eviction at prefill_end");
  }

  // A model step of `tokens` at `position`: every layer's hook hands the step to the compressor
  // (or, for the control, applies its keep set at the d-th decoded token). Returns the logits.
  std::vector<std::int64_t> step_positions;
  auto step = [&](const std::int32_t* tokens, std::int64_t k) {
    step_positions.resize(static_cast<std::size_t>(k));
    for (std::int64_t t = 0; t < k; ++t) step_positions[static_cast<std::size_t>(t)] = position + t;
    const bool apply = pol.k == K::delay_only && evicted_layers == 0 && fed < pol.delay && fed + k >= pol.delay;
    const bool phase_now = pol.k == K::phase_avg && fed == 0;
    fed += k;
    position += k;
    const attention_hook hook = [&](std::int64_t layer, const float* q, std::int64_t) {
      if (pol.k == K::full) return;
      if (pol.k == K::phase_avg) {
        if (!phase_now) return;
        phase_avg_evict(m, r, cache, layer, q, k, step_positions.data(), budget);
        ++evicted_layers;
        return;
      }
      if (pol.k == K::delay_only) {
        if (!apply) return;
        auto& keep = pending[static_cast<std::size_t>(layer)];
        auto& kbuf = cache.k[static_cast<std::size_t>(layer)];
        auto& vbuf = cache.v[static_cast<std::size_t>(layer)];
        auto& lens = cache.lengths[static_cast<std::size_t>(layer)];
        for (std::int64_t h = 0; h < hkv; ++h) {  // kept region rows (ascending), then the decoded ones
          std::int64_t to = 0;
          auto move = [&](std::int64_t from) {
            if (from != to) {
              std::copy_n(cache.row(kbuf, h, from), d, cache.row(kbuf, h, to));
              std::copy_n(cache.row(vbuf, h, from), d, cache.row(vbuf, h, to));
            }
            ++to;
          };
          for (const std::int64_t j : keep.at(static_cast<std::size_t>(h))) move(j);
          for (std::int64_t j = L; j < lens[static_cast<std::size_t>(h)]; ++j) move(j);
          lens[static_cast<std::size_t>(h)] = to;
        }
        ++evicted_layers;
        return;
      }
      run(layer, kvevict::sequence_event::decode,
          kvevict::token_major_queries<const float>(q, hq, k, d, step_positions.data()));
    };
    ++expected_steps;
    ++steps;
    return forward(m, cache, tokens, k, position - k, nullptr, hook);
  };

  std::size_t first_after = n;
  if (plan.forced.empty()) {
    out.generated.push_back(r.first_token);  // from the region's prefill, before any eviction
  } else {
    for (std::size_t i = 0; i < plan.forced.size(); ++i) {
      const bool after = evicted_layers == layers;
      const matrix logits = step(plan.forced[i].data(), static_cast<std::int64_t>(plan.forced[i].size()));
      if (i + 1 == plan.forced.size()) {
        if (after) first_after = 0;
        out.generated.push_back(argmax(logits, static_cast<std::int64_t>(plan.forced[i].size()) - 1));
      }
    }
  }
  while (out.generated.size() < n) {
    const bool after = evicted_layers == layers;
    const matrix logits = step(&out.generated.back(), 1);
    if (after && first_after == n) first_after = out.generated.size();
    out.generated.push_back(argmax(logits, 0));
  }
  out.first_after = first_after;
  if (evicted_layers != layers) throw std::runtime_error(pol.name + ": a layer never evicted");
  if (pol.k != K::full && pol.k != K::phase_avg) {
    const std::int64_t calls = pol.k == K::delay_only ? layers : layers * expected_steps;
    if (counter.calls != calls)
      throw std::runtime_error(pol.name + ": " + std::to_string(counter.calls) + " compressor calls, expected " +
                               std::to_string(calls) + " (" + std::to_string(expected_steps) + " steps of " +
                               std::to_string(layers) + " layers)");
  }
  // The kept set: the region rows each head still holds (matched by their key bits).
  out.kept.assign(static_cast<std::size_t>(layers),
                  std::vector<std::vector<std::int64_t>>(static_cast<std::size_t>(hkv)));
  for (std::int64_t l = 0; l < layers; ++l)
    for (std::int64_t h = 0; h < hkv; ++h) {
      const auto& index = r.row_index[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)];
      auto& kept = out.kept[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)];
      const std::int64_t rows = cache.lengths[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)];
      for (std::int64_t j = 0; j < rows; ++j) {
        const float* row = cache.row(cache.k[static_cast<std::size_t>(l)], h, j);
        const auto it = index.find(fid2_row_hash(row, d));
        const float* original = r.cache.k[static_cast<std::size_t>(l)].data() +
                                (h * r.cache.capacity + (it == index.end() ? 0 : it->second)) * d;
        if (it != index.end() && std::memcmp(row, original, static_cast<std::size_t>(d) * sizeof(float)) == 0)
          kept.push_back(it->second);
      }
      if (rows - static_cast<std::int64_t>(kept.size()) != fed)  // every fed token's row stays
        throw std::runtime_error(pol.name + ": layer " + std::to_string(l) + " head " + std::to_string(h) + " holds " +
                                 std::to_string(rows) + " rows, " + std::to_string(kept.size()) +
                                 " of them region rows, after " + std::to_string(fed) + " fed tokens");
      if (!std::is_sorted(kept.begin(), kept.end()) || std::adjacent_find(kept.begin(), kept.end()) != kept.end())
        throw std::runtime_error(pol.name + ": the kept region rows are not in order");
    }
  return out;
}

struct fid2_settings {
  std::vector<std::string> tasks = {"longneedle", "gather", "longchain", "listall"};
  std::vector<std::string> settings = {"S1", "S2", "S3"};
  std::vector<double> budgets = {0.03, 0.0625, 0.125, 0.25};
  std::vector<std::string> policies;  // empty: all
  std::int64_t per_task = 100;
  std::int64_t skip_per_task = 0;  // the first prompts of each task left out (--skip-per-task)
  std::string prompts_name, weights_name;
};

struct fid2_summary {
  std::int64_t lines = 0;
  int failures = 0;  // the --quick checks that failed
};

/// The bench: per prompt and setting, the full-cache attention, then every policy at every budget
/// (full once, budget 1). Writes `jsonl` (one line per prompt x setting x policy x budget) and
/// prints mean exact match per setting. With `quick`, checks what must hold and counts failures.
inline fid2_summary fidelity2(const model& m, const std::vector<fid2_case>& all, const fid2_settings& s,
                              const std::string& jsonl, bool quick) {
  std::vector<fid2_policy> policies;
  for (const auto& p : fid2_policies())
    if (s.policies.empty() || std::find(s.policies.begin(), s.policies.end(), p.name) != s.policies.end())
      policies.push_back(p);
  if (policies.empty()) throw std::runtime_error("--policies: no known policy");
  std::map<std::string, std::int64_t> taken;
  std::vector<const fid2_case*> prompts;
  for (const auto& c : all)
    if (std::find(s.tasks.begin(), s.tasks.end(), c.task) != s.tasks.end()) {
      const std::int64_t n = taken[c.task]++;
      if (n >= s.skip_per_task && n < s.per_task) prompts.push_back(&c);
    }
  std::ofstream j(jsonl);
  if (!j) throw std::runtime_error("cannot write " + jsonl);
  fid2_summary summary;
  const auto t0 = std::chrono::steady_clock::now();
  const std::int64_t layers = m.cfg.layers, hkv = m.cfg.kv_heads;
  // mean EM (whole answer) per setting and policy/budget, printed at the end
  std::map<std::string, std::map<std::string, std::pair<double, double>>> table;
  std::map<std::string, double> seconds;
  bool recall_below_one = false;
  auto fail = [&](const std::string& what) {
    if (summary.failures++ < 20) std::fprintf(stderr, "fidelity2 check FAILED: %s\n", what.c_str());
  };
  for (std::size_t pi = 0; pi < prompts.size(); ++pi) {
    const fid2_case& pc = *prompts[pi];
    const std::int64_t lp = static_cast<std::int64_t>(pc.ids.size());
    const std::int64_t extra =
        64 + static_cast<std::int64_t>(pc.answer.size() + pc.question2.size() + pc.answer2.size());
    kv_cache cache(m.cfg, lp + extra);
    std::vector<std::vector<float>> queries;
    const matrix logits = forward(m, cache, pc.ids.data(), lp, 0, &queries);
    const std::int32_t first = argmax(logits, lp - 1);
    for (const auto& setting : s.settings) {
      const auto ts = std::chrono::steady_clock::now();
      fid2_plan plan;
      plan.setting = setting;
      std::int64_t region_tokens = lp;
      if (setting == "S1") {
        plan.answer = pc.answer;
      } else if (setting == "S2") {
        region_tokens = pc.context_tokens;
        plan.forced.emplace_back(pc.ids.begin() + pc.context_tokens, pc.ids.end());
        plan.answer = pc.answer;
      } else if (setting == "S3") {
        if (pc.question2.empty()) continue;  // listall: one question
        for (const std::int32_t t : pc.answer) plan.forced.push_back({t});
        plan.forced.push_back(pc.question2);
        plan.answer = pc.answer2;
      } else {
        throw std::runtime_error("--settings: expected S1, S2 or S3, got " + setting);
      }
      const fid2_region region = make_region(m, cache, queries, lp, pc.ids, region_tokens, first, policies);
      const auto att = answer_attention(m, region, plan);
      const std::int64_t L = region.tokens;
      // per layer and head: positions by attention mass, most first (ties: earlier first)
      std::vector<std::vector<std::vector<std::int64_t>>> order(static_cast<std::size_t>(layers));
      for (std::int64_t l = 0; l < layers; ++l)
        for (std::int64_t h = 0; h < hkv; ++h) {
          const auto& a = att[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)];
          std::vector<std::int64_t> o(static_cast<std::size_t>(L));
          std::iota(o.begin(), o.end(), 0);
          std::stable_sort(o.begin(), o.end(), [&](std::int64_t x, std::int64_t y) {
            return a[static_cast<std::size_t>(x)] > a[static_cast<std::size_t>(y)];
          });
          order[static_cast<std::size_t>(l)].push_back(std::move(o));
        }
      for (const auto& pol : policies) {
        const bool is_full = pol.k == fid2_policy::kind::full;
        const std::vector<double> budgets = is_full ? std::vector<double>{1.0} : s.budgets;
        for (const double fraction : budgets) {
          const std::int64_t B =
              std::max<std::int64_t>(1, static_cast<std::int64_t>(std::llround(fraction * static_cast<double>(L))));
          const fid2_run run = run_fid2(m, region, plan, pol, B);
          const auto& ans = plan.answer;
          const std::size_t n = ans.size();
          auto span_equal = [&](std::size_t from) {
            return std::equal(run.generated.begin() + static_cast<std::ptrdiff_t>(from), run.generated.end(),
                              ans.begin() + static_cast<std::ptrdiff_t>(from));
          };
          std::size_t right = 0;
          for (std::size_t i = kSuffixStart; i < n; ++i) right += run.generated[i] == ans[i] ? 1 : 0;
          const double tok_acc = static_cast<double>(right) / static_cast<double>(n - kSuffixStart);
          std::vector<double> mass(static_cast<std::size_t>(layers)), topb(static_cast<std::size_t>(layers));
          double kept_tokens = 0;
          const std::int64_t top = std::min(B, L);
          std::vector<char> is_kept(static_cast<std::size_t>(L));
          for (std::int64_t l = 0; l < layers; ++l) {
            double mass_sum = 0, topb_sum = 0;
            for (std::int64_t h = 0; h < hkv; ++h) {
              const auto& kept = run.kept[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)];
              const auto& a = att[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)];
              std::fill(is_kept.begin(), is_kept.end(), 0);
              for (const std::int64_t p : kept) is_kept[static_cast<std::size_t>(p)] = 1;
              double total = 0, on_kept = 0;
              for (std::int64_t p = 0; p < L; ++p) {
                total += a[static_cast<std::size_t>(p)];
                if (is_kept[static_cast<std::size_t>(p)]) on_kept += a[static_cast<std::size_t>(p)];
              }
              std::int64_t hits = 0;
              const auto& o = order[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)];
              for (std::int64_t i = 0; i < top; ++i)
                hits += is_kept[static_cast<std::size_t>(o[static_cast<std::size_t>(i)])];
              mass_sum += on_kept / total;
              topb_sum += static_cast<double>(hits) / static_cast<double>(top);
              kept_tokens += static_cast<double>(kept.size());
            }
            mass[static_cast<std::size_t>(l)] = mass_sum / static_cast<double>(hkv);
            recall_below_one |= mass[static_cast<std::size_t>(l)] < 1.0;
            topb[static_cast<std::size_t>(l)] = topb_sum / static_cast<double>(hkv);
          }
          kept_tokens /= static_cast<double>(layers * hkv);
          const bool em = span_equal(0), em_after = span_equal(run.first_after), em_suffix = span_equal(kSuffixStart);
          char buf[160];
          j << "{\"setting\": \"" << setting << "\", \"task\": \"" << pc.task << "\", \"prompt\": " << pc.index
            << ", \"policy\": \"" << pol.name << "\", \"budget\": " << fraction << ", \"budget_tokens\": " << B
            << ", \"region_tokens\": " << L;
          std::snprintf(buf, sizeof(buf), "%.4f", kept_tokens);
          j << ", \"kept_tokens\": " << buf << ", \"first_after_eviction\": " << run.first_after
            << ", \"answer_tokens\": " << n << ", \"em\": " << (em ? 1 : 0)
            << ", \"em_after_eviction\": " << (em_after ? 1 : 0) << ", \"em_suffix\": " << (em_suffix ? 1 : 0);
          std::snprintf(buf, sizeof(buf), "%.4g", tok_acc);
          j << ", \"tok_acc_suffix\": " << buf;
          for (const auto* name : {"recall_mass", "recall_topb"}) {
            const auto& v = std::string(name) == "recall_mass" ? mass : topb;
            j << ", \"" << name << "\": [";
            for (std::size_t l = 0; l < v.size(); ++l) {
              std::snprintf(buf, sizeof(buf), "%.4g", v[l]);
              j << (l ? ", " : "") << buf;
            }
            j << "]";
          }
          j << "}\n";
          ++summary.lines;
          auto& cell = table[setting][pol.name + (is_full ? "" : "@" + std::to_string(fraction))];
          cell.first += em_suffix ? 1 : 0;
          cell.second += 1;
          if (quick) {  // what must hold on any prompt
            for (std::int64_t l = 0; l < layers; ++l) {
              const double a = mass[static_cast<std::size_t>(l)], b = topb[static_cast<std::size_t>(l)];
              if (!(a >= 0 && a <= 1 && b >= 0 && b <= 1)) fail(pol.name + ": a recall outside [0, 1]");
              if (is_full && (a != 1.0 || b != 1.0)) fail("full KV's recall is not 1");
            }
            if (is_full && kept_tokens != static_cast<double>(L)) fail("full KV does not hold every region token");
            // Budget accounting: every uniform policy holds exactly B region tokens per head and
            // layer; the allocators B on average within one token (their rounding).
            const double want = static_cast<double>(B);
            if (!is_full && pol.alloc == allocator::uniform && kept_tokens != want)
              fail(pol.name + ": " + std::to_string(kept_tokens) + " region tokens per head, budget " +
                   std::to_string(B));
            if (!is_full && pol.alloc != allocator::uniform && std::fabs(kept_tokens - want) > 1.0)
              fail(pol.name + ": " + std::to_string(kept_tokens) + " region tokens per head on average, budget " +
                   std::to_string(B));
            const std::size_t expected_after =
                setting == "S1" ? (pol.k == fid2_policy::kind::deferkv || pol.k == fid2_policy::kind::delay_only ||
                                           pol.k == fid2_policy::kind::phase_avg
                                       ? static_cast<std::size_t>(pol.delay) + 1
                                       : 1)
                                : run.first_after;
            if (run.first_after != expected_after || run.first_after > kSuffixStart)
              fail(pol.name + ": the first answer token after eviction is " + std::to_string(run.first_after));
          }
        }
      }
      seconds[setting] += std::chrono::duration<double>(std::chrono::steady_clock::now() - ts).count();
    }
    if (!quick && (pi + 1) % 10 == 0)
      std::fprintf(stderr, "  %zu/%zu prompts (%.0f s)\n", pi + 1, prompts.size(),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  j.close();
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Print: suffix exact match per setting, policy and budget (over the prompts run).
  for (const auto& setting : s.settings) {
    if (table.count(setting) == 0) continue;
    std::printf("%s: exact match of answer[5:] %% (full KV:", setting.c_str());
    const auto& full = table[setting]["full"];
    std::printf(" %.1f%%, %.0f prompt-settings, %.1f s)\n%-22s", 100 * full.first / std::max(1.0, full.second),
                full.second, seconds[setting], "policy \\ budget");
    for (double b : s.budgets) std::printf(" %7.2f%%", 100 * b);
    std::printf("\n");
    for (const auto& pol : policies) {
      if (pol.k == fid2_policy::kind::full) continue;
      std::printf("%-22s", pol.name.c_str());
      for (double b : s.budgets) {
        const auto& c = table[setting][pol.name + "@" + std::to_string(b)];
        std::printf(" %7.1f%%", 100 * c.first / std::max(1.0, c.second));
      }
      std::printf("\n");
    }
  }
  std::printf("(%zu prompts, %lld lines, %.1f s)\n", prompts.size(), static_cast<long long>(summary.lines), total);
  if (quick) {
    // Full KV must answer (the bench means nothing otherwise): at least 3 in 4 whole answers in S1.
    if (table.count("S1") != 0) {
      const auto& full = table["S1"]["full"];
      if (full.second == 0 || full.first < 0.75 * full.second) fail("full KV's S1 exact match below 75%");
    }
    // The JSONL: one line per prompt x setting x policy x budget, every field present.
    std::ifstream in(jsonl);
    std::string line;
    std::int64_t lines = 0;
    const char* fields[] = {"\"setting\"",
                            "\"task\"",
                            "\"prompt\"",
                            "\"policy\"",
                            "\"budget\"",
                            "\"budget_tokens\"",
                            "\"kept_tokens\"",
                            "\"em\"",
                            "\"em_after_eviction\"",
                            "\"em_suffix\"",
                            "\"tok_acc_suffix\"",
                            "\"recall_mass\"",
                            "\"recall_topb\""};
    while (std::getline(in, line)) {
      ++lines;
      for (const char* f : fields)
        if (line.find(std::string(f) + ": ") == std::string::npos) fail(std::string("a JSONL line without ") + f);
    }
    std::int64_t expected = 0;
    for (const auto* pc : prompts)
      for (const auto& setting : s.settings)
        if (setting != "S3" || !pc->question2.empty())
          expected += 1 + static_cast<std::int64_t>((policies.size() - 1) * s.budgets.size());
    if (lines != expected || lines != summary.lines)
      fail(std::to_string(lines) + " JSONL lines, expected " + std::to_string(expected));
    // Eviction must matter somewhere: a policy's recall below 1.
    if (!recall_below_one) fail("every policy kept all of the answer's attention: the recall measures nothing");
  }
  return summary;
}

}  // namespace tinylm
