// SPDX-License-Identifier: Apache-2.0
// The benchmarked operations, each a small object that owns its buffers and workspaces
// (sized once, up front, as an engine would) and exposes run(): what one timed iteration
// does. kvevict_bench (Google Benchmark), kvevict_bench_summary and kvevict_bench_vs_torch
// time the same objects, so their numbers are comparable.
//
// Bandwidth-bound cases (decode observation, compaction) rotate over copies of the cache
// whose total exceeds the last-level cache, so every iteration reads its data from DRAM as
// an engine's would (a cache this size was not just read by someone else); the roofline
// they are compared with is measured on buffers of the same total size.
#ifndef KVEVICT_BENCH_CASES_HPP
#define KVEVICT_BENCH_CASES_HPP

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "common.hpp"
#include "roofline.hpp"

namespace kb {

/// Copies of one buffer whose total is at least `total_bytes` (at least one copy).
template <class T>
struct rotation {
  std::vector<buffer<T>> copies;
  std::size_t next = 0;
  rotation(const buffer<T>& src, std::size_t total_bytes) {
    const std::size_t one = std::max<std::size_t>(1, src.size() * sizeof(T));
    const std::size_t n = std::max<std::size_t>(1, (total_bytes + one - 1) / one);
    copies.assign(n, src);
  }
  buffer<T>& advance() {
    buffer<T>& c = copies[next];
    next = (next + 1) % copies.size();
    return c;
  }
};

/// Natural-log LSE [Hq, W] of each window query's scaled logits over every key it sees, as
/// flash attention would hand it over (float32 logits, double sums; outside any timing).
template <class T>
std::vector<float> window_lse(const layer<T>& lay) {
  const auto& s = lay.shape;
  const std::int64_t g = s.hq / s.hkv, w = lay.window, rows = g * w;
  std::vector<float> out(static_cast<std::size_t>(s.hq * w));
  // Queries transposed [d][rows], so the logits of one key for every row are one loop over
  // rows that the compiler vectorises (no reassociation needed).
  std::vector<float> qt(static_cast<std::size_t>(s.d * rows)), logits(static_cast<std::size_t>(rows));
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.d));
  for (std::int64_t h = 0; h < s.hkv; ++h) {
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < s.d; ++c)
        qt[static_cast<std::size_t>(c * rows + r)] =
            scale * kvevict::to_float(lay.q[static_cast<std::size_t>(((h * g) * w + r) * s.d + c)]);
    std::vector<double> mx(static_cast<std::size_t>(rows), -INFINITY), sum(static_cast<std::size_t>(rows), 0.0);
    for (std::int64_t j = 0; j < lay.tokens; ++j) {
      std::fill(logits.begin(), logits.end(), 0.0f);
      const T* key = lay.k.data() + (h * lay.capacity + j) * s.d;
      for (std::int64_t c = 0; c < s.d; ++c) {
        const float kc = kvevict::to_float(key[c]);
        const float* q = qt.data() + c * rows;
        for (std::int64_t r = 0; r < rows; ++r) logits[static_cast<std::size_t>(r)] += q[r] * kc;
      }
      for (std::int64_t r = 0; r < rows; ++r) {
        if (j > lay.positions[static_cast<std::size_t>(r % w)]) continue;  // not visible to this query
        const double x = logits[static_cast<std::size_t>(r)];
        auto& m = mx[static_cast<std::size_t>(r)];
        auto& z = sum[static_cast<std::size_t>(r)];
        if (x > m) {
          z = z * std::exp(m - x);
          m = x;
        }
        z += std::exp(x - m);
      }
    }
    for (std::int64_t r = 0; r < rows; ++r)
      out[static_cast<std::size_t>(h * rows + r)] =
          static_cast<float>(mx[static_cast<std::size_t>(r)] + std::log(sum[static_cast<std::size_t>(r)]));
  }
  return out;
}

template <class T>
const char* logit_products(std::int64_t d) {
  if (!std::is_same<T, bf16>::value || d % 32 != 0) return "FMA";
  switch (kvevict::active_cpu_isa()) {
    case kvevict::cpu_isa::amx:
      return "AMX";
    case kvevict::cpu_isa::avx512bf16:
      return "VDPBF16PS";
    default:
      return "FMA";
  }
}

/// Prompt-window observation scoring of one layer (SnapKV's scoring at the reference
/// conventions), with or without an engine-provided LSE.
template <class T>
struct prompt_scoring {
  std::shared_ptr<layer<T>> lay;
  kvevict::window_config config = reference_snapkv();
  kvevict::workspace ws;
  std::vector<float> scores, lse;
  bool with_lse;

  prompt_scoring(std::shared_ptr<layer<T>> l, bool use_lse) : lay(std::move(l)), with_lse(use_lse) {
    const auto& s = lay->shape;
    config.window = lay->window;
    ws.reserve(
        kvevict::observation_scores_workspace_size({s.hq, s.hkv, s.d, lay->tokens, lay->window}, config.params()));
    scores.resize(static_cast<std::size_t>(s.hkv * lay->tokens));
    if (with_lse) lse = window_lse(*lay);
  }
  void run() {
    kvevict::observation_inputs oi;
    if (with_lse) oi.lse = lse.data();
    die("observation_scores",
        kvevict::observation_scores(lay->queries(), lay->keys(), config.params(), score_view(), ws, oi));
  }
  kvevict::score_view score_view() { return {scores.data(), lay->shape.hkv, lay->tokens, lay->tokens}; }
  /// Sweeps over the keys the process's CPU path takes for these logits: one with an engine
  /// LSE; without, one on the AVX2/AVX-512 float32 FMA paths (16 cached rows at a time,
  /// detail/isa/observe_head.inl: contiguous channels, G <= 16, as here), two elsewhere (the
  /// portable path; bf16 pair products on avx512bf16 and amx).
  int sweeps() const {
    if (with_lse) return 1;
    if (kvevict::active_cpu_isa() == kvevict::cpu_isa::scalar) return 2;
    return std::string(products()) == "FMA" && lay->shape.hq / lay->shape.hkv <= 16 ? 1 : 2;
  }
  /// The logit FLOPs the path executes (useful_flops() times its sweeps).
  double executed_flops() const { return useful_flops() * sweeps(); }
  double useful_flops() const { return scoring_flops_one_sweep(lay->shape, lay->window, lay->tokens); }
  /// What computes these logits on the process's CPU path: float32 FMA chains, or for
  /// bf16 x bf16 (d a multiple of 32) VDPBF16PS pair products (avx512bf16) or AMX tiles (amx).
  const char* products() const { return logit_products<T>(lay->shape.d); }
  std::size_t scratch_bytes() const { return ws.size(); }
};

/// One DeferKV decode observation (one query per query head over the prompt and the tokens
/// decoded so far): K read once, G dot products per key row. Each run() is the next decode
/// step, on the next copy of the cache.
template <class T>
struct decode_observation {
  model_shape shape;
  std::int64_t prompt, extra = 256;
  buffer<T> q;
  std::vector<std::int64_t> qpos, first_pos;
  std::unique_ptr<rotation<T>> keys;
  kvevict::deferkv_state<T> state;
  kvevict::workspace ws;
  std::int64_t step = 0;

  static kvevict::deferkv_config config() {
    kvevict::deferkv_config c;
    c.window = reference_window;
    c.delay = std::int64_t{1} << 40;  // never "ready": every run() observes another step
    return c;
  }
  decode_observation(const model_shape& s, std::int64_t l, std::size_t rotate_bytes)
      : shape(s), prompt(l), state(config()) {
    layer<T> lay(s, l, 1, extra, 11);
    keys = std::make_unique<rotation<T>>(lay.k, rotate_bytes);
    q = lay.q;
    qpos = {l};
    first_pos = {l - 1};
    die("reserve", state.reserve(s.hkv, l));
    ws.reserve(state.workspace_size({s.hq, s.hkv, s.d, l + extra, reference_window}));
    restart();
  }
  kvevict::layer_inputs<T> inputs(buffer<T>& k, std::int64_t tokens, const std::int64_t* pos) {
    kvevict::layer_inputs<T> in;
    in.keys = kvevict::hf_contiguous<const T>(k.data(), shape.hkv, tokens, shape.d, prompt + extra);
    in.queries = kvevict::contiguous_queries<const T>(q.data(), shape.hq, 1, shape.d, pos);
    return in;
  }
  /// A cheap prefill (one prompt query) puts the state in its decode phase.
  void restart() {
    state.reset();
    die("observe_prefill", state.observe_prefill(0, inputs(keys->copies[0], prompt, first_pos.data()), ws));
    step = 0;
  }
  bool needs_restart() const { return step >= extra; }
  void run() {
    qpos[0] = prompt + step;
    die("observe_decode", state.observe_decode(0, step, inputs(keys->advance(), prompt + step + 1, qpos.data()), ws));
    ++step;
  }
  double bytes() const { return cache_bytes<T>(shape, prompt); }
  double flops() const { return scoring_flops_one_sweep(shape, 1, prompt); }
  std::size_t scratch_bytes() const { return ws.size(); }
};

/// Selection of one layer's scores [Hkv, L] with budget B (window inside), and the two
/// std:: baselines producing the same ascending keep-lists: index arrays ordered by
/// (score desc, index asc, NaN last) with std::nth_element or std::partial_sort, then the
/// kept indices sorted ascending.
struct selection {
  std::int64_t heads, tokens, budget, window;
  std::vector<float> scores;
  kvevict::keep_list keep;
  kvevict::workspace ws;
  std::vector<std::uint32_t> idx;
  std::vector<std::int64_t> baseline_out;

  selection(std::int64_t h, std::int64_t l, std::int64_t b = reference_budget, std::int64_t w = reference_window)
      : heads(h), tokens(l), budget(b), window(w), scores(score_rows(h, l, 5)) {
    for (std::int64_t r = 0; r < h; ++r)  // the protected window scores +inf, as scoring writes it
      for (std::int64_t j = l - w; j < l; ++j) scores[static_cast<std::size_t>(r * l + j)] = INFINITY;
    keep = kvevict::keep_list(h, kvevict::select_capacity(h, l, kvevict::budget::tokens(b), params()));
    ws.reserve(kvevict::select_workspace_size(l));
    idx.resize(static_cast<std::size_t>(l));
    baseline_out.resize(static_cast<std::size_t>(h * b));
  }
  kvevict::selection_params params() const { return {window, kvevict::protected_mode::inside_budget}; }
  void run() {
    die("select", kvevict::select(kvevict::const_score_view{scores.data(), heads, tokens, tokens},
                                  kvevict::budget::tokens(budget), params(), keep, ws));
  }
  template <bool partial>
  void run_std() {
    const std::int64_t cand = tokens - window, k = budget - window;
    for (std::int64_t h = 0; h < heads; ++h) {
      const float* s = scores.data() + h * tokens;
      std::iota(idx.begin(), idx.begin() + cand, 0u);
      const auto before = [s](std::uint32_t a, std::uint32_t b) {
        const float x = s[a], y = s[b];
        if (x != x || y != y) return (y != y) && (x == x ? true : a < b);
        return x > y || (x == y && a < b);
      };
      if (partial)
        std::partial_sort(idx.begin(), idx.begin() + k, idx.begin() + cand, before);
      else
        std::nth_element(idx.begin(), idx.begin() + (k - 1), idx.begin() + cand, before);
      std::sort(idx.begin(), idx.begin() + k);
      std::int64_t* out = baseline_out.data() + h * budget;
      for (std::int64_t i = 0; i < k; ++i) out[i] = idx[static_cast<std::size_t>(i)];
      for (std::int64_t i = 0; i < window; ++i) out[k + i] = cand + i;
    }
  }
  /// Whether the last run() and run_std() kept the same tokens.
  bool agrees() const {
    const kvevict::const_keep_list_view v = keep.view();
    for (std::int64_t i = 0; i < heads * budget; ++i)
      if (v.indices[i] != baseline_out[static_cast<std::size_t>(i)]) return false;
    return true;
  }
  double elements() const { return static_cast<double>(heads * (tokens - window)); }
  std::size_t scratch_bytes() const { return ws.size(); }
};

/// In-place compaction of one layer's K and V by a keep-list of B tokens per head (a random
/// subset plus the window). Each run() takes the next copy of the cache and the next of
/// several keep-lists, so the rows it reads were not read by the runs just before it.
template <class T>
struct compaction {
  model_shape shape;
  std::int64_t tokens, budget;
  std::unique_ptr<rotation<T>> k, v;
  std::vector<kvevict::keep_list> keeps;
  std::size_t next_keep = 0;

  compaction(const model_shape& s, std::int64_t l, std::size_t rotate_bytes, std::int64_t b = reference_budget)
      : shape(s), tokens(l), budget(b) {
    layer<T> lay(s, l, 1, 0, 21);
    k = std::make_unique<rotation<T>>(lay.k, rotate_bytes / 2);
    v = std::make_unique<rotation<T>>(lay.v, rotate_bytes / 2);
    for (std::uint64_t i = 0; i < 16; ++i) keeps.push_back(random_keep_list(s.hkv, l, b, reference_window, 9 + i));
  }
  void run() {
    kvevict::eviction_result r;
    auto& kk = k->advance();
    auto& vv = v->advance();
    const kvevict::keep_list& keep = keeps[next_keep];
    next_keep = (next_keep + 1) % keeps.size();
    die("evict", kvevict::evict(kvevict::hf_contiguous(kk.data(), shape.hkv, tokens, shape.d),
                                kvevict::hf_contiguous(vv.data(), shape.hkv, tokens, shape.d), keep.view(), r));
  }
  /// Bytes copied (K and V rows of every kept token that moves; all but the few at the front).
  double bytes() const { return 2.0 * static_cast<double>(shape.hkv * budget * shape.d) * sizeof(T); }
};

/// SnapKV on one layer: score, select B per head (window inside), evict in place.
template <class T>
struct snapkv_layer {
  std::shared_ptr<layer<T>> lay;
  kvevict::snapkv<T> policy;
  kvevict::workspace ws, sws;
  std::vector<float> scores;
  kvevict::keep_list keep;
  std::int64_t budget;

  snapkv_layer(std::shared_ptr<layer<T>> l, std::int64_t b = reference_budget)
      : lay(std::move(l)), policy(reference_snapkv(lay->window)), budget(b) {
    const auto& s = lay->shape;
    ws.reserve(policy.workspace_size({s.hq, s.hkv, s.d, lay->tokens, lay->window}));
    sws.reserve(kvevict::select_workspace_size(lay->tokens));
    scores.resize(static_cast<std::size_t>(s.hkv * lay->tokens));
    keep = kvevict::keep_list(
        s.hkv, kvevict::select_capacity(s.hkv, lay->tokens, kvevict::budget::tokens(b), policy.selection()));
  }
  /// The timed pipeline. Eviction compacts the buffers in place; repeated runs compact the
  /// already compacted cache again (the same number of rows moves each time).
  void run() {
    const auto& s = lay->shape;
    die("snapkv::score", policy.score(lay->inputs(), {scores.data(), s.hkv, lay->tokens, lay->tokens}, ws));
    die("select", kvevict::select(kvevict::const_score_view{scores.data(), s.hkv, lay->tokens, lay->tokens},
                                  kvevict::budget::tokens(budget), policy.selection(), keep, sws));
    kvevict::eviction_result r;
    die("evict", kvevict::evict(lay->keys(), lay->values(), keep.view(), r));
  }
  std::size_t scratch_bytes() const { return ws.size() + sws.size(); }
};

/// DeferKV on one layer: prefill observation (W prompt queries), d decode observations,
/// scores, select, evict (design.md §5).
template <class T>
struct deferkv_layer {
  std::shared_ptr<layer<T>> lay;  ///< capacity >= L + d
  kvevict::deferkv_state<T> state;
  kvevict::workspace ws, sws;
  buffer<T> dq;  ///< decode queries [d][Hq, 1, d]
  std::vector<std::int64_t> dpos;
  std::vector<float> scores;
  kvevict::keep_list keep;
  std::int64_t delay, budget;

  static kvevict::deferkv_config config(std::int64_t window, std::int64_t d) {
    kvevict::deferkv_config c;
    c.window = window;
    c.delay = d;
    return c;
  }
  deferkv_layer(std::shared_ptr<layer<T>> l, std::int64_t d = 1, std::int64_t b = reference_budget)
      : lay(std::move(l)), state(config(lay->window, d)), delay(d), budget(b) {
    const auto& s = lay->shape;
    die("reserve", state.reserve(s.hkv, lay->tokens));
    ws.reserve(state.workspace_size({s.hq, s.hkv, s.d, lay->tokens + d, lay->window}));
    sws.reserve(kvevict::select_workspace_size(lay->tokens + d));
    dq.resize(static_cast<std::size_t>(d * s.hq * s.d));
    fill_normal(dq, 31, 2.0f);
    for (std::int64_t i = 0; i < d; ++i) dpos.push_back(lay->tokens + i);
    scores.resize(static_cast<std::size_t>(s.hkv * (lay->tokens + d)));
    keep = kvevict::keep_list(s.hkv,
                              kvevict::select_capacity(s.hkv, lay->tokens + d, kvevict::budget::tokens(b),
                                                       {lay->window + d, kvevict::protected_mode::on_top_of_budget}));
  }
  void run() {
    const auto& s = lay->shape;
    const std::int64_t lp = lay->tokens;
    state.reset();
    die("observe_prefill", state.observe_prefill(0, lay->inputs(), ws));
    for (std::int64_t i = 0; i < delay; ++i) {
      kvevict::layer_inputs<T> in;
      in.keys = lay->keys(lp + i + 1);
      in.queries = kvevict::contiguous_queries<const T>(dq.data() + i * s.hq * s.d, s.hq, 1, s.d, dpos.data() + i);
      die("observe_decode", state.observe_decode(0, i, in, ws));
    }
    const std::int64_t n = state.num_tokens();
    die("deferkv scores", state.scores({scores.data(), s.hkv, n, n}, ws));
    die("select", kvevict::select(kvevict::const_score_view{scores.data(), s.hkv, n, n},
                                  kvevict::budget::tokens(budget), state.selection(), keep, sws));
    kvevict::eviction_result r;
    die("evict", kvevict::evict(lay->keys(n), lay->values(n), keep.view(), r));
    die("mark_evicted", state.mark_evicted());
  }
  std::size_t scratch_bytes() const {
    return ws.size() + sws.size() + static_cast<std::size_t>(lay->shape.hkv * lay->tokens) * sizeof(float);
  }
};

/// DapQ on one layer, re-rotation variant (no extra forward pass): the window's post-RoPE
/// queries rotated N positions ahead become the pseudo queries; score the prompt keys,
/// select, evict.
template <class T>
struct dapq_layer {
  std::shared_ptr<layer<T>> lay;
  kvevict::dapq<T> policy;
  kvevict::rope_config rope;
  kvevict::workspace ws, sws;
  buffer<T> pseudo;
  std::vector<std::int64_t> pseudo_pos;
  std::vector<float> scores;
  kvevict::keep_list keep;
  std::int64_t budget;

  static kvevict::dapq_config config(std::int64_t n) {
    kvevict::dapq_config c;
    c.pseudo_tokens = n;
    return c;
  }
  dapq_layer(std::shared_ptr<layer<T>> l, std::int64_t b = reference_budget)
      : lay(std::move(l)), policy(config(lay->window)), budget(b) {
    const auto& s = lay->shape;
    rope.head_dim = s.d;
    rope.theta = 500000.0;  // Llama-3
    ws.reserve(policy.workspace_size({s.hq, s.hkv, s.d, lay->tokens, lay->window}));
    sws.reserve(kvevict::select_workspace_size(lay->tokens));
    pseudo.resize(lay->q.size());
    pseudo_pos.resize(static_cast<std::size_t>(lay->window));
    scores.resize(static_cast<std::size_t>(s.hkv * lay->tokens));
    keep = kvevict::keep_list(
        s.hkv, kvevict::select_capacity(s.hkv, lay->tokens, kvevict::budget::tokens(b), policy.selection()));
  }
  void run() {
    const auto& s = lay->shape;
    kvevict::layer_inputs<T> in;
    in.keys = lay->keys();
    die("dapq_rerotate",
        kvevict::dapq_rerotate(lay->queries(), rope, lay->window, pseudo.data(), pseudo_pos.data(), &in.queries));
    die("dapq::score", policy.score(in, {scores.data(), s.hkv, lay->tokens, lay->tokens}, ws));
    die("select", kvevict::select(kvevict::const_score_view{scores.data(), s.hkv, lay->tokens, lay->tokens},
                                  kvevict::budget::tokens(budget), policy.selection(), keep, sws));
    kvevict::eviction_result r;
    die("evict", kvevict::evict(lay->keys(), lay->values(), keep.view(), r));
  }
  std::size_t scratch_bytes() const { return ws.size() + sws.size(); }
};

/// A batch of `seqs` sequences of L tokens in one vLLM paged pool (blocks of 16, sequences'
/// blocks interleaved as an allocator hands them out), SnapKV through the compressor at
/// prefill_end, compacted in place with block_sharing::marked (every block's reference count
/// is 1). run() is the engine's one call per layer; sharing_check() is the part of it that
/// keeps two sequences of the call from reaching one block (issue "sharing is never silent").
template <class T>
struct paged_batch {
  static constexpr std::int64_t block = 16;
  model_shape shape;
  std::int64_t seqs, tokens, window, blocks_per_seq;
  buffer<T> kpool, vpool, q;
  std::vector<std::int64_t> positions;
  std::vector<std::vector<std::int32_t>> tables;
  std::vector<std::int32_t> refcounts, scratch;
  kvevict::compressor compressor;
  kvevict::workspace ws;
  std::vector<kvevict::sequence_io<T>> io;
  std::vector<kvevict::sequence_report> reports;

  paged_batch(const model_shape& s, std::int64_t n, std::int64_t l, std::int64_t w = reference_window)
      : shape(s), seqs(n), tokens(l), window(w), blocks_per_seq((l + block - 1) / block) {
    const std::int64_t num_blocks = seqs * blocks_per_seq;
    kpool.resize(static_cast<std::size_t>(num_blocks * block * s.hkv * s.d));
    vpool.resize(kpool.size());
    q.resize(static_cast<std::size_t>(s.hq * w * s.d));
    fill_normal(kpool, 1, 1.0f);
    fill_normal(vpool, 2, 1.0f);
    fill_normal(q, 3, 2.0f);
    for (std::int64_t t = 0; t < w; ++t) positions.push_back(l - w + t);
    tables.assign(static_cast<std::size_t>(seqs), std::vector<std::int32_t>(static_cast<std::size_t>(blocks_per_seq)));
    for (std::int64_t b = 0; b < blocks_per_seq; ++b)
      for (std::int64_t q_seq = 0; q_seq < seqs; ++q_seq)
        tables[static_cast<std::size_t>(q_seq)][static_cast<std::size_t>(b)] =
            static_cast<std::int32_t>(b * seqs + q_seq);
    refcounts.assign(static_cast<std::size_t>(num_blocks), 1);
    scratch.resize(static_cast<std::size_t>(2 * blocks_per_seq));

    kvevict::compressor_options opt;
    opt.model = {1, s.hq, s.hkv, s.d, 0, kvevict::dtype_of<T>::value};
    opt.policy = kvevict::policy::snapkv(reference_snapkv(w));
    opt.per_head = kvevict::budget::tokens(std::min(reference_budget, l / 2));
    opt.compact = kvevict::compaction::in_place;
    opt.sharing = kvevict::block_sharing::marked;
    opt.limits.max_sequences = seqs;
    opt.limits.max_tokens = l;
    die("compressor::plan", kvevict::compressor::plan(opt, &compressor));
    ws.reserve(compressor.workspace_size());
    io.resize(static_cast<std::size_t>(seqs));
    reports.resize(static_cast<std::size_t>(seqs));
    for (std::int64_t i = 0; i < seqs; ++i) {
      auto& e = io[static_cast<std::size_t>(i)];
      e.event = kvevict::sequence_event::prefill_end;
      e.keys = view(kpool, i);
      e.values = view(vpool, i);
      e.queries = kvevict::contiguous_queries<const T>(q.data(), s.hq, w, s.d, positions.data());
      e.block_refcounts = refcounts.data();
    }
  }
  kvevict::cache_view<T> view(buffer<T>& pool, std::int64_t seq) {
    return kvevict::vllm_paged(pool.data(), seqs * blocks_per_seq, block, shape.hkv, shape.d,
                               tables[static_cast<std::size_t>(seq)].data(), tokens);
  }
  /// The timed pipeline. Compaction moves rows in place; repeated runs compact the compacted
  /// cache again (the same number of rows moves each time).
  void run() { die("compressor::run", compressor.run(0, io.data(), seqs, reports.data(), ws)); }
  /// run()'s check that no block a compacted sequence uses is reached by another sequence of
  /// the call: every pair of sequences' block ids (what a batch of `seqs` adds to run()).
  void sharing_check() {
    const auto kseq = [this](std::int64_t i) { return io[static_cast<std::size_t>(i)].keys; };
    const auto vseq = [this](std::int64_t i) { return io[static_cast<std::size_t>(i)].values; };
    die("check_blocks_not_reached", kvevict::detail::check_blocks_not_reached(
                                        seqs, kseq, vseq, [](std::int64_t) { return true; }, scratch.data(), "bench",
                                        kvevict::detail::block_naming::seqs));
  }
  std::size_t scratch_bytes() const { return ws.size(); }
};

}  // namespace kb

#endif  // KVEVICT_BENCH_CASES_HPP
