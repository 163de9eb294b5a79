// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_DEFERKV_HPP
#define KVEVICT_POLICIES_DEFERKV_HPP

// DeferKV (Wang et al., "DeferKV: Rethinking Eviction Timing for One-Shot KV Cache
// Compression"): eviction moves from the end of prefill to the d-th real decode step, and
// the importance of a prompt key combines prompt-side and decode-side attention with a
// temporal discount. The paper does not publish a formula; this definition is
// kvevict's own (design.md §5):
//
//   observations in time order: the last W prompt queries, then the first d decode queries;
//   observation t weighs eta^(T - t) (T the newest), eta in (0, 1];
//   score = weighted mean of the observations' (GQA-reduced) attention rows, then pooled.
//
// It is kept as a running state per layer, S <- eta*S + A_t and Z <- eta*Z + 1, so between
// prefill and eviction a layer holds [Hkv, L] floats, never the window queries. eta = 1 is
// the uniform mean over all observations; with decode feedback off the state is ready at
// the end of prefill and its scores equal SnapKV's (window weights eta^(W-1-t), GQA
// reduced before pooling) bit for bit. Candidates are the prompt tokens before the window;
// the window and the decoded tokens are protected.
//
// Lifecycle per layer and sequence (engine-shaped):
//   reserve(Hkv, max_prompt_tokens)               once; the only allocation
//   observe_prefill(layer, {keys[Lp], queries[W]})  end of prefill
//   observe_decode(layer, step, {keys[Lp+step+1], queries[1]})   steps 0 .. d-1
//   ready() -> scores(out) -> select(out, budget, selection()) -> evict via mark_evicted()
//   reset()                                         before the next sequence

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <new>
#include <vector>

#include "kvevict/config.hpp"
#include "kvevict/detail/abi_std.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/detail/finalize.hpp"
#include "kvevict/detail/observe.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/policies/layer_inputs.hpp"
#include "kvevict/scoring/observation_scores.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

struct deferkv_config {
  std::int64_t window = 32;        ///< W prompt queries observed at the end of prefill (protected)
  std::int64_t delay = 1;          ///< d decode steps observed before eviction (the paper's 1..4)
  double eta = 0.9;                ///< temporal discount in (0, 1] (kvevict's default; see docs)
  bool decode_feedback = true;     ///< false: ready at the end of prefill (the paper's ablation)
  bool temporal_weighting = true;  ///< false: every observation weighs 1 (the paper's ablation)
  softmax_domain domain = softmax_domain::visible;
  gqa_reduction gqa = gqa_reduction::mean;  ///< mean or sum: the state is per KV head
  pooling pool = {pooling_kind::max, 7, true};
  protected_mode protect = protected_mode::on_top_of_budget;

  /// The scoring parameters the state applies (GQA is reduced per observation, i.e. before pooling).
  constexpr scoring_params params() const noexcept {
    scoring_params p;
    p.domain = domain;
    p.window = window_aggregation::weighted;
    p.gqa = gqa;
    p.order = gqa_order::before_pooling;
    p.pool = pool;
    p.protected_tail = window;
    return p;
  }
  constexpr double effective_eta() const noexcept { return temporal_weighting ? eta : 1.0; }
};

namespace detail {
/// v = n zeros, or false (v unchanged) when the memory cannot be allocated: no exception
/// leaves a status-returning call, with or without exceptions enabled.
inline bool assign_zeros(std::vector<float, detail::abi_allocator<float>>& v, std::size_t n) noexcept {
#if KVEVICT_HAS_EXCEPTIONS
  try {
    v.assign(n, 0.0f);  // strong guarantee: v is unchanged if this throws
  } catch (const std::exception&) {
    return false;
  }
#else
  // Without exceptions a failed allocation inside std::vector aborts: ask first, nothrow.
  if (n > v.capacity()) {
    void* probe = ::operator new(n * sizeof(float), std::nothrow);
    if (probe == nullptr) return false;
    ::operator delete(probe);
  }
  v.assign(n, 0.0f);
#endif
  return true;
}
}  // namespace detail

template <class T>
class deferkv_state {
 public:
  using storage_type = T;
  using config_type = deferkv_config;

  explicit deferkv_state(const deferkv_config& config = {}, std::int64_t layer = 0) : config_(config), layer_(layer) {}

  const deferkv_config& config() const noexcept { return config_; }
  std::int64_t layer() const noexcept { return layer_; }

  /// Allocates the running state: [num_kv_heads, max_prompt_tokens] floats. Call before the
  /// first prefill; observe_* never allocate. A state that does not fit or cannot be allocated
  /// is errc::overflow (`max_prompt_tokens`), never an exception; the old state is then kept.
  status reserve(std::int64_t num_kv_heads, std::int64_t max_prompt_tokens) {
    static constexpr const char* fn = "kvevict::deferkv_state::reserve";
    if (num_kv_heads < 1)
      return status::error(errc::invalid_argument, fn, "num_kv_heads", "expected >= 1, got %lld",
                           static_cast<long long>(num_kv_heads));
    if (max_prompt_tokens < 0)
      return status::error(errc::invalid_argument, fn, "max_prompt_tokens", "expected >= 0, got %lld",
                           static_cast<long long>(max_prompt_tokens));
    std::int64_t count = 0;
    if (!detail::checked_mul(num_kv_heads, max_prompt_tokens, &count) ||
        static_cast<std::uint64_t>(count) > sums_.max_size())
      return status::error(errc::overflow, fn, "max_prompt_tokens",
                           "a state of %lld x %lld floats does not fit in memory", static_cast<long long>(num_kv_heads),
                           static_cast<long long>(max_prompt_tokens));
    if (!detail::assign_zeros(sums_, static_cast<std::size_t>(count)))
      return status::error(errc::overflow, fn, "max_prompt_tokens", "could not allocate a state of %lld x %lld floats",
                           static_cast<long long>(num_kv_heads), static_cast<long long>(max_prompt_tokens));
    heads_capacity_ = num_kv_heads;
    tokens_capacity_ = max_prompt_tokens;
    reset();
    return status();
  }

  /// Workspace for observe_prefill / observe_decode / scores with caches of up to
  /// shape.num_tokens tokens (prompt + delay) and shape.num_queries = W.
  std::size_t workspace_size(const layer_shape& shape, const executor& exec = {}) const noexcept {
    layer_shape s = shape;
    s.num_queries = s.num_queries < 1 ? 1 : s.num_queries;
    return observation_scores_workspace_size(s, config_.params(), exec);
  }

  /// End of prefill. in.keys: [Hkv, Lp, d] the prompt's keys; in.queries: [Hq, W', d] the last
  /// W' <= W prompt queries in time order, with positions.
  status observe_prefill(std::int64_t layer, const layer_inputs<T>& in, workspace_span ws, const executor& exec = {}) {
    static constexpr const char* fn = "kvevict::deferkv_state::observe_prefill";
    KVEVICT_RETURN_IF_ERROR(check_config(fn));
    KVEVICT_RETURN_IF_ERROR(check_layer(fn, layer));
    if (phase_ != phase::empty)
      return status::error(errc::invalid_state, fn, "state",
                           "prefill was already observed for this sequence; call reset() first");
    if (in.queries.num_queries > config_.window)
      return status::error(errc::invalid_shape, fn, "queries.num_queries", "expected at most W = %lld, got %lld",
                           static_cast<long long>(config_.window), static_cast<long long>(in.queries.num_queries));
    const std::int64_t prompt = in.keys.num_tokens;
    // Window weights eta^(W'-1-t), newest last.
    float weights[max_window_weights];
    const std::int64_t w = in.queries.num_queries;
    if (w > max_window_weights)
      return status::error(errc::invalid_shape, fn, "queries.num_queries", "expected at most %lld, got %lld",
                           static_cast<long long>(max_window_weights), static_cast<long long>(w));
    double z = 0.0;
    for (std::int64_t t = 0; t < w; ++t) {
      weights[t] = static_cast<float>(std::pow(config_.effective_eta(), static_cast<double>(w - 1 - t)));
      z += static_cast<double>(weights[t]);
    }
    KVEVICT_RETURN_IF_ERROR(observe(fn, in, prompt, prompt, weights, /*first=*/true, ws, exec));
    prompt_tokens_ = prompt;
    z_ = z;
    steps_ = 0;
    phase_ = config_.decode_feedback && config_.delay > 0 ? phase::prefilled : phase::ready;
    return status();
  }

  /// Decode step `step` (0-based, observed in order, none skipped). in.keys: [Hkv, Lp+step+1, d]
  /// (the cache now holds the decoded tokens too); in.queries: [Hq, 1, d] this step's query.
  status observe_decode(std::int64_t layer, std::int64_t step, const layer_inputs<T>& in, workspace_span ws,
                        const executor& exec = {}) {
    static constexpr const char* fn = "kvevict::deferkv_state::observe_decode";
    KVEVICT_RETURN_IF_ERROR(check_layer(fn, layer));
    if (phase_ == phase::empty)
      return status::error(errc::invalid_state, fn, "state", "no prefill observed yet; call observe_prefill first");
    if (!config_.decode_feedback)
      return status::error(errc::invalid_state, fn, "state", "decode feedback is off: evict after prefill");
    if (phase_ == phase::ready || phase_ == phase::evicted)
      return status::error(errc::invalid_state, fn, "state", "already ready after %lld decode steps; evict now",
                           static_cast<long long>(steps_));
    if (step != steps_)
      return status::error(errc::invalid_state, fn, "step",
                           "expected decode step %lld (steps are observed in order, none skipped), got %lld",
                           static_cast<long long>(steps_), static_cast<long long>(step));
    if (in.queries.num_queries != 1)
      return status::error(errc::invalid_shape, fn, "queries.num_queries", "expected 1 query per head, got %lld",
                           static_cast<long long>(in.queries.num_queries));
    if (in.keys.num_tokens != prompt_tokens_ + step + 1)
      return status::error(errc::invalid_shape, fn, "keys.num_tokens",
                           "expected prompt + decoded tokens = %lld, got %lld (wrong layer or step?)",
                           static_cast<long long>(prompt_tokens_ + step + 1),
                           static_cast<long long>(in.keys.num_tokens));
    const float one = 1.0f;
    KVEVICT_RETURN_IF_ERROR(observe(fn, in, prompt_tokens_, prompt_tokens_, &one, /*first=*/false, ws, exec));
    z_ = config_.effective_eta() * z_ + 1.0;
    ++steps_;
    if (steps_ >= config_.delay) phase_ = phase::ready;
    return status();
  }

  bool ready() const noexcept { return phase_ == phase::ready; }
  std::int64_t steps_observed() const noexcept { return steps_; }
  std::int64_t prompt_tokens() const noexcept { return prompt_tokens_; }
  /// Tokens in the cache when eviction happens: prompt + observed decode steps.
  std::int64_t num_tokens() const noexcept { return prompt_tokens_ + steps_; }
  /// Protected tail at eviction: the window and every decoded token.
  selection_params selection() const noexcept {
    const std::int64_t window = config_.window < prompt_tokens_ ? config_.window : prompt_tokens_;
    return {window + steps_, config_.protect};
  }

  /// Scores [Hkv, num_tokens()]: prompt candidates scored, window and decoded tokens +inf.
  status scores(score_view out, workspace_span ws) const {
    static constexpr const char* fn = "kvevict::deferkv_state::scores";
    if (phase_ != phase::ready)
      return status::error(errc::invalid_state, fn, "state",
                           phase_ == phase::evicted ? "this sequence was already evicted; call reset()"
                                                    : "not ready: observe prefill and %lld decode step(s) first",
                           static_cast<long long>(config_.delay));
    KVEVICT_RETURN_IF_ERROR(detail::validate_matrix_view(out, heads_, num_tokens(), fn, "out"));
    detail::arena a(ws);
    float* row = a.take<float>(candidates());
    if (a.overflowed())
      return status::error(errc::workspace_too_small, fn, "ws", "expected at least %zu bytes, got %zu", a.used(),
                           ws.size);
    detail::window_normaliser norm;
    norm.scale = static_cast<float>(1.0 / z_);
    const scoring_params params = config_.params();
    for (std::int64_t h = 0; h < heads_; ++h) {
      const float* s = sums_.data() + h * tokens_capacity_;
      for (std::int64_t j = 0; j < candidates(); ++j) row[j] = s[j];
      detail::finalize_reduced_row(row, group_, candidates(), num_tokens(), params, norm, out.row(h));
    }
    return status();
  }

  /// Marks the sequence evicted (after the engine applied the keep-list); further
  /// observations or scores need reset().
  status mark_evicted() {
    if (phase_ != phase::ready)
      return status::error(errc::invalid_state, "kvevict::deferkv_state::mark_evicted", "state",
                           "evict only when ready()");
    phase_ = phase::evicted;
    return status();
  }

  /// Forgets the sequence; the reserved state is kept.
  void reset() noexcept {
    phase_ = phase::empty;
    prompt_tokens_ = 0;
    steps_ = 0;
    z_ = 0.0;
  }

  /// Read access to the running state S[h][j] (candidates of head h) and Z, for tests/tools.
  float state_sum(std::int64_t h, std::int64_t j) const noexcept {
    return sums_[static_cast<std::size_t>(h * tokens_capacity_ + j)];
  }
  double state_normaliser() const noexcept { return z_; }

 private:
  enum class phase { empty, prefilled, ready, evicted };
  static constexpr std::int64_t max_window_weights = 4096;

  std::int64_t candidates() const noexcept {
    const std::int64_t window = config_.window < prompt_tokens_ ? config_.window : prompt_tokens_;
    return prompt_tokens_ - window;
  }

  status check_config(const char* fn) const noexcept {
    if (config_.window < 0)
      return status::error(errc::invalid_argument, fn, "config.window", "expected >= 0, got %lld",
                           static_cast<long long>(config_.window));
    if (config_.delay < 0)
      return status::error(errc::invalid_argument, fn, "config.delay", "expected >= 0, got %lld",
                           static_cast<long long>(config_.delay));
    if (!(config_.eta > 0.0 && config_.eta <= 1.0))
      return status::error(errc::invalid_argument, fn, "config.eta", "expected eta in (0, 1], got %g", config_.eta);
    if (config_.gqa == gqa_reduction::max)
      return status::error(errc::unsupported, fn, "config.gqa",
                           "the running state is per KV head, so GQA must be reduced linearly (mean or sum)");
    return detail::validate_scoring_params(config_.params(), fn);
  }

  status check_layer(const char* fn, std::int64_t layer) const noexcept {
    if (layer != layer_)
      return status::error(errc::invalid_state, fn, "layer", "this state belongs to layer %lld, got layer %lld",
                           static_cast<long long>(layer_), static_cast<long long>(layer));
    return status();
  }

  /// Adds this observation batch into S (after discounting S unless first).
  status observe(const char* fn, const layer_inputs<T>& in, std::int64_t prompt, std::int64_t state_tokens,
                 const float* weights, bool first, workspace_span ws, const executor& exec) {
    KVEVICT_RETURN_IF_ERROR(detail::validate_query_view(in.queries, fn, "queries"));
    KVEVICT_RETURN_IF_ERROR(detail::validate_cache_view(in.keys, fn, "keys"));
    if (in.queries.head_dim != in.keys.head_dim)
      return status::error(errc::invalid_shape, fn, "queries.head_dim", "expected keys.head_dim = %lld, got %lld",
                           static_cast<long long>(in.keys.head_dim), static_cast<long long>(in.queries.head_dim));
    if (in.queries.num_heads % in.keys.num_heads != 0)
      return status::error(errc::invalid_shape, fn, "queries.num_heads",
                           "expected a multiple of keys.num_heads = %lld (GQA), got %lld",
                           static_cast<long long>(in.keys.num_heads), static_cast<long long>(in.queries.num_heads));
    if (first) {
      if (in.keys.num_heads > heads_capacity_ || state_tokens > tokens_capacity_)
        return status::error(errc::invalid_state, fn, "state",
                             "reserved for %lld heads x %lld prompt tokens, got %lld x %lld; call reserve()",
                             static_cast<long long>(heads_capacity_), static_cast<long long>(tokens_capacity_),
                             static_cast<long long>(in.keys.num_heads), static_cast<long long>(state_tokens));
    } else if (in.keys.num_heads != heads_ || in.queries.num_heads != heads_ * group_) {
      return status::error(errc::invalid_shape, fn, "keys.num_heads",
                           "expected the prefill's %lld KV heads and %lld query heads, got %lld and %lld",
                           static_cast<long long>(heads_), static_cast<long long>(heads_ * group_),
                           static_cast<long long>(in.keys.num_heads), static_cast<long long>(in.queries.num_heads));
    }
    if (in.observation.lse != nullptr || in.observation.weights != nullptr)
      return status::error(errc::unsupported, fn, "observation",
                           "DeferKV computes its own weights and normalisers; pass only key_positions");

    const std::int64_t window = config_.window < prompt ? config_.window : prompt;
    const layer_shape shape{in.queries.num_heads, in.keys.num_heads, in.keys.head_dim, in.keys.num_tokens,
                            in.queries.num_queries};
    scoring_params params = config_.params();
    params.protected_tail = in.keys.num_tokens - (prompt - window);  // candidates: prompt tokens before the window
    detail::observation_problem p = detail::make_problem(shape, params);
    p.query_positions = in.queries.positions;
    p.key_positions = in.observation.key_positions;
    p.key_positions_sorted =
        p.key_positions == nullptr || detail::is_non_decreasing(p.key_positions, in.keys.num_tokens);
    p.weights = weights;
    const int workers = exec.workers();
    detail::arena a(ws);
    detail::observation_layout layout;
    detail::carve_observation_layout(a, p, false, workers, &layout);
    if (a.overflowed())
      return status::error(errc::workspace_too_small, fn, "ws",
                           "expected at least %zu bytes (deferkv_state::workspace_size), got %zu", a.used(), ws.size);

    if (first) {
      heads_ = in.keys.num_heads;
      group_ = in.queries.num_heads / in.keys.num_heads;
    }
    struct task_context {
      const layer_inputs<T>* in;
      const detail::observation_problem* p;
      const detail::observation_layout* layout;
      float* sums;
      std::int64_t stride;
      float decay;
      bool first;
    } ctx{&in, &p, &layout, sums_.data(), tokens_capacity_, static_cast<float>(config_.effective_eta()), first};
    exec.run(
        in.keys.num_heads,
        [](void* arg, std::int64_t h, int worker) {
          const auto& c = *static_cast<const task_context*>(arg);
          const detail::observation_scratch& s = c.layout->workers[worker];
          detail::observe_head(c.in->queries, c.in->keys, h, *c.p, s);
          float* tmp = c.layout->tmp[worker];
          const std::int64_t n = c.p->candidates;
          for (std::int64_t g = 0; g < c.p->group; ++g)
            detail::reduce_into(tmp, s.acc + g * n, n, gqa_reduction::sum, g == 0);
          float* state = c.sums + h * c.stride;
          if (c.first) {
            for (std::int64_t j = 0; j < n; ++j) state[j] = tmp[j];
          } else {
            for (std::int64_t j = 0; j < n; ++j) state[j] = c.decay * state[j] + tmp[j];
          }
        },
        &ctx);
    return status();
  }

  deferkv_config config_;
  std::int64_t layer_ = 0;
  std::vector<float, detail::abi_allocator<float>> sums_;
  std::int64_t heads_capacity_ = 0, tokens_capacity_ = 0;
  std::int64_t heads_ = 0, group_ = 1;
  std::int64_t prompt_tokens_ = 0, steps_ = 0;
  double z_ = 0.0;
  phase phase_ = phase::empty;
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_DEFERKV_HPP
