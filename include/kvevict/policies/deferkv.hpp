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
// Two forms of the lifecycle: deferkv<T>, a policy whose state lives in caller memory (what the
// compressor uses: one block per sequence for all layers), and deferkv_state<T>, an owning
// convenience for one layer. Both run the same code.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvevict/config.hpp"

#include "kvevict/detail/checked.hpp"
#include "kvevict/detail/finalize.hpp"
#include "kvevict/detail/observe.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/policies/configs.hpp"
#include "kvevict/policies/layer_inputs.hpp"
#include "kvevict/policies/scoring_policy.hpp"
#include "kvevict/scoring/observation_scores.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

namespace detail {

/// The scalar part of one layer's running state, at the start of its caller memory; the
/// sums S[h][j] follow at deferkv_sums_offset. Plain data: the engine may move the block.
struct deferkv_header {
  std::uint64_t magic = 0;  ///< deferkv_magic once initialised
  std::int64_t heads_capacity = 0, tokens_capacity = 0;
  std::int64_t heads = 0, group = 1;
  std::int64_t prompt_tokens = 0, steps = 0;
  double z = 0.0;  ///< Z, the sum of the observations' weights
  std::int32_t phase = 0;
  std::int32_t reserved = 0;
};
constexpr std::uint64_t deferkv_magic = 0x6b76657672644b56ull;  // "VKdrvevk"
constexpr std::size_t deferkv_sums_offset = (sizeof(deferkv_header) + 63) / 64 * 64;
enum deferkv_phase : std::int32_t { deferkv_empty = 0, deferkv_prefilled = 1, deferkv_ready = 2, deferkv_evicted = 3 };

}  // namespace detail

/// DeferKV as a policy: score() and evict() like every other policy, plus the lifecycle hooks
/// observe_prefill() and observe_decode() that fold observations into the layer's running
/// state. The state is caller memory passed in layer_observations::state (state_size() bytes
/// per layer and sequence, 8-byte aligned, set up by init_state()); this object holds only the
/// configuration, so one instance serves every layer and sequence.
///
/// Per layer and sequence:
///   init_state(state, Hkv, max_prompt)       once per sequence (or reset_state to reuse)
///   observe_prefill({keys [Lp], queries [W'], state})   end of prefill
///   observe_decode({keys [Lp+k+n], queries [n], state})  each decode step of n >= 1 tokens
///                                                        (k before it) until k + n >= d
///   ready(state) -> evict(cache, {state}, budget, ...)  or score() + your own selection
template <class T, class Q = default_query_type_t<T>>
class deferkv {
 public:
  using storage_type = T;
  using query_type = Q;
  using config_type = deferkv_config;
  static constexpr const char* evict_name = "kvevict::deferkv::evict";

  explicit deferkv(const deferkv_config& config = {}) noexcept : config_(config) {}
  const deferkv_config& config() const noexcept { return config_; }

  /// Bytes of state for one layer of one sequence: Hkv x max_prompt_tokens floats plus a
  /// header. SIZE_MAX when that does not fit (init_state then reports overflow).
  static std::size_t state_size(std::int64_t num_kv_heads, std::int64_t max_prompt_tokens) noexcept {
    if (num_kv_heads < 0 || max_prompt_tokens < 0) return std::numeric_limits<std::size_t>::max();
    const std::size_t floats =
        detail::saturating_mul(static_cast<std::size_t>(num_kv_heads), static_cast<std::size_t>(max_prompt_tokens));
    return detail::saturating_add(detail::deferkv_sums_offset, detail::saturating_mul(floats, sizeof(float)));
  }

  /// Makes `state` an empty state for up to num_kv_heads x max_prompt_tokens (a new sequence).
  status init_state(policy_state state, std::int64_t num_kv_heads, std::int64_t max_prompt_tokens) const noexcept {
    static constexpr const char* fn = "kvevict::deferkv::init_state";
    if (num_kv_heads < 1)
      return status::error(errc::invalid_argument, fn, "num_kv_heads", "expected >= 1, got %lld",
                           static_cast<long long>(num_kv_heads));
    if (max_prompt_tokens < 0)
      return status::error(errc::invalid_argument, fn, "max_prompt_tokens", "expected >= 0, got %lld",
                           static_cast<long long>(max_prompt_tokens));
    const std::size_t need = state_size(num_kv_heads, max_prompt_tokens);
    if (need == std::numeric_limits<std::size_t>::max())
      return status::error(errc::overflow, fn, "max_prompt_tokens",
                           "a state of %lld x %lld floats does not fit in memory", static_cast<long long>(num_kv_heads),
                           static_cast<long long>(max_prompt_tokens));
    KVEVICT_RETURN_IF_ERROR(check_memory(state, need, fn));
    detail::deferkv_header h;
    h.magic = detail::deferkv_magic;
    h.heads_capacity = num_kv_heads;
    h.tokens_capacity = max_prompt_tokens;
    std::memcpy(state.data, &h, sizeof(h));
    return status();
  }

  /// Forgets the sequence, keeping the state's capacity (same as init_state with it).
  status reset_state(policy_state state) const noexcept {
    detail::deferkv_header* h = nullptr;
    KVEVICT_RETURN_IF_ERROR(header(state, "kvevict::deferkv::reset_state", &h));
    h->heads = 0;
    h->group = 1;
    h->prompt_tokens = 0;
    h->steps = 0;
    h->z = 0.0;
    h->phase = detail::deferkv_empty;
    return status();
  }

  /// Scoring workspace for observe_prefill / observe_decode / score with caches of up to
  /// shape.num_tokens tokens (prompt + delay) and shape.num_queries = W.
  std::size_t workspace_size(const layer_shape& shape, const executor& exec = {}) const noexcept {
    layer_shape s = shape;
    s.num_queries = s.num_queries < 1 ? 1 : s.num_queries;
    return observation_scores_workspace_size(s, config_.params(), exec);
  }
  /// evict()'s workspace for caches of up to shape.num_tokens tokens; the protected tail may
  /// grow past W + d by a step of up to shape.num_queries tokens that crossed d.
  std::size_t evict_workspace_size(const layer_shape& shape, const layer_budget& b,
                                   const executor& exec = {}) const noexcept {
    const std::int64_t step = shape.num_queries > 1 ? shape.num_queries - 1 : 0;
    const selection_params largest{config_.window + (config_.delay > 0 ? config_.delay : 0) + step, config_.protect};
    return detail::evict_layer_workspace_size(shape, shape.num_tokens, largest, workspace_size(shape, exec), b, exec);
  }

  /// End of prefill. in.keys: [Hkv, Lp, d] the prompt's keys; in.queries: [Hq, W', d] the last
  /// W' <= W prompt queries in time order, with positions; in.state: an empty state.
  status observe_prefill(const layer_inputs<T, Q>& in, workspace_span ws, const executor& exec = {}) const {
    static constexpr const char* fn = "kvevict::deferkv::observe_prefill";
    KVEVICT_RETURN_IF_ERROR(check_config(fn));
    detail::deferkv_header* h = nullptr;
    KVEVICT_RETURN_IF_ERROR(header(in.state, fn, &h));
    if (h->phase != detail::deferkv_empty)
      return status::error(errc::invalid_state, fn, "state",
                           "prefill was already observed for this sequence; call reset_state() first");
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
    KVEVICT_RETURN_IF_ERROR(observe(fn, *h, sums(in.state), in, prompt, prompt, weights, /*first=*/true, ws, exec));
    h->prompt_tokens = prompt;
    h->z = z;
    h->steps = 0;
    h->phase = config_.decode_feedback && config_.delay > 0 ? detail::deferkv_prefilled : detail::deferkv_ready;
    return status();
  }

  /// The next decode step (observed in order, none skipped) of n >= 1 tokens (speculative
  /// verification's accepted tokens, multi-token prediction). in.keys: [Hkv, Lp+k+n, d] (the
  /// cache now holds the step's tokens too; k tokens were decoded before); in.queries:
  /// [Hq, n, d] the step's queries in time order. The tokens are observed one after another,
  /// each with the cache as it stood after it, exactly as n one-token steps. d counts decoded
  /// tokens: the state is ready once at least d were observed (a step may carry it past d;
  /// every token of the step is observed and protected).
  status observe_decode(const layer_inputs<T, Q>& in, workspace_span ws, const executor& exec = {}) const {
    static constexpr const char* fn = "kvevict::deferkv::observe_decode";
    detail::deferkv_header* h = nullptr;
    KVEVICT_RETURN_IF_ERROR(header(in.state, fn, &h));
    KVEVICT_RETURN_IF_ERROR(check_decode(*h, in, fn));
    KVEVICT_RETURN_IF_ERROR(detail::validate_query_view(in.queries, fn, "queries"));
    KVEVICT_RETURN_IF_ERROR(detail::validate_cache_view(in.keys, fn, "keys"));
    // The last token sees the most keys: checked first, so no token of the step is observed
    // unless all are.
    const std::size_t need =
        workspace_size({in.queries.num_heads, in.keys.num_heads, in.keys.head_dim, in.keys.num_tokens, 1}, exec);
    if (ws.size < need)
      return status::error(errc::workspace_too_small, fn, "ws",
                           "expected at least workspace_size() = %zu bytes for the step's %lld keys, got %zu", need,
                           static_cast<long long>(in.keys.num_tokens), ws.size);
    const float one = 1.0f;
    for (std::int64_t t = 0; t < in.queries.num_queries; ++t) {  // (valid views: no step below fails)
      layer_inputs<T, Q> token = in;
      token.keys = in.keys.first_tokens(h->prompt_tokens + h->steps + 1);
      token.queries.data += t * in.queries.query_stride;
      token.queries.positions += t;
      token.queries.num_queries = 1;
      KVEVICT_RETURN_IF_ERROR(observe(fn, *h, sums(in.state), token, h->prompt_tokens, h->prompt_tokens, &one,
                                      /*first=*/false, ws, exec));
      h->z = config_.effective_eta() * h->z + 1.0;
      ++h->steps;
    }
    if (h->steps >= config_.delay) h->phase = detail::deferkv_ready;
    return status();
  }

  /// Whether the state is ready for score() / evict().
  bool ready(policy_state state) const noexcept { return phase_of(state) == detail::deferkv_ready; }
  /// Whether `state` holds an initialised DeferKV state whose memory covers its capacity.
  bool intact(policy_state state) const noexcept {
    const detail::deferkv_header* h = nullptr;
    return header(state, "kvevict::deferkv", &h).ok();
  }
  /// Whether the prefill was observed (the state is past empty).
  bool started(policy_state state) const noexcept { return phase_of(state) > detail::deferkv_empty; }
  /// Whether evict() already ran for this sequence.
  bool evicted(policy_state state) const noexcept { return phase_of(state) == detail::deferkv_evicted; }
  /// Decoded tokens observed so far.
  std::int64_t steps_observed(policy_state state) const noexcept {
    const detail::deferkv_header* h = peek(state);
    return h != nullptr ? h->steps : 0;
  }
  /// Prompt tokens of the observed prefill.
  std::int64_t prompt_tokens(policy_state state) const noexcept {
    const detail::deferkv_header* h = peek(state);
    return h != nullptr ? h->prompt_tokens : 0;
  }
  /// Tokens in the cache when eviction happens: prompt + observed decoded tokens.
  std::int64_t num_tokens(policy_state state) const noexcept { return prompt_tokens(state) + steps_observed(state); }
  /// Protected tail at eviction: the window and every decoded token.
  selection_params selection(policy_state state) const noexcept {
    const std::int64_t prompt = prompt_tokens(state);
    const std::int64_t window = config_.window < prompt ? config_.window : prompt;
    return {window + steps_observed(state), config_.protect};
  }

  /// Scores [Hkv, num_tokens(state)] from the ready state in in.state: prompt candidates
  /// scored, window and decoded tokens +inf. The keys are not read (the observations were).
  status score(const layer_inputs<T, Q>& in, score_view out, workspace_span ws, const executor& = {}) const {
    static constexpr const char* fn = "kvevict::deferkv::score";
    const detail::deferkv_header* h = nullptr;
    KVEVICT_RETURN_IF_ERROR(ready_header(in.state, fn, &h));
    return finalize(*h, sums(in.state), out, ws, fn);
  }

  /// score -> budgets -> select -> compact, then marks the state evicted. cache: K and V with
  /// num_tokens(state) tokens; observed.state: the ready state (observed.observation's key
  /// positions, if any, give result.positions).
  status evict(const layer_cache<T>& cache, const layer_observations<Q>& observed, const layer_budget& b,
               eviction_result& result, workspace_span ws, const executor& exec = {}) const {
    static constexpr const char* fn = evict_name;
    detail::deferkv_header* h = nullptr;
    // Sharded (b.shard), errors before the selection still reach the group (design.md §15).
    KVEVICT_RETURN_IF_ERROR(detail::fail_before_selection(b, ready_header(observed.state, fn, &h), fn));
    if (cache.keys.num_tokens != h->prompt_tokens + h->steps)
      return detail::fail_before_selection(b,
                                           status::error(errc::invalid_shape, fn, "cache.keys.num_tokens",
                                                         "expected prompt + decoded tokens = %lld, got %lld",
                                                         static_cast<long long>(h->prompt_tokens + h->steps),
                                                         static_cast<long long>(cache.keys.num_tokens)),
                                           fn);
    if (cache.keys.num_heads != h->heads)
      return detail::fail_before_selection(
          b,
          status::error(errc::invalid_shape, fn, "cache.keys.num_heads",
                        "expected the observed %lld KV heads, got %lld", static_cast<long long>(h->heads),
                        static_cast<long long>(cache.keys.num_heads)),
          fn);
    const float* s = sums(observed.state);
    KVEVICT_RETURN_IF_ERROR(detail::evict_layer(
        fn, cache, observed, cache.keys.num_tokens, finalize_workspace_size(*h), selection(observed.state), b, result,
        ws, exec, [&](score_view scores, workspace_span sws) { return finalize(*h, s, scores, sws, fn); }));
    h->phase = detail::deferkv_evicted;
    return status();
  }

  /// Marks a ready state evicted, for engines that evicted through score() and their own
  /// selection and compaction.
  status mark_evicted(policy_state state) const noexcept {
    detail::deferkv_header* h = nullptr;
    KVEVICT_RETURN_IF_ERROR(header(state, "kvevict::deferkv::mark_evicted", &h));
    if (h->phase != detail::deferkv_ready)
      return status::error(errc::invalid_state, "kvevict::deferkv::mark_evicted", "state", "evict only when ready()");
    h->phase = detail::deferkv_evicted;
    return status();
  }

  /// Read access to S[h][j] and Z of a state, for tests and tools (0 outside the state).
  float state_sum(policy_state state, std::int64_t h, std::int64_t j) const noexcept {
    const detail::deferkv_header* hd = peek(state);
    if (hd == nullptr || h < 0 || h >= hd->heads_capacity || j < 0 || j >= hd->tokens_capacity) return 0.0f;
    return sums(state)[h * hd->tokens_capacity + j];
  }
  double state_normaliser(policy_state state) const noexcept {
    const detail::deferkv_header* hd = peek(state);
    return hd != nullptr ? hd->z : 0.0;
  }

  /// Checks of the configuration (also run by every observation).
  status check_config(const char* fn) const noexcept { return detail::check_deferkv_config(config_, fn); }

  /// The checks observe_decode runs before it touches the state, for callers that must
  /// validate a whole batch first (the compressor): the state's phase, then the inputs.
  status check_decode(const policy_state state, const layer_inputs<T, Q>& in, const char* fn) const noexcept {
    const detail::deferkv_header* h = nullptr;
    KVEVICT_RETURN_IF_ERROR(header(state, fn, &h));
    return check_decode(*h, in, fn);
  }
  status check_decode_phase(const policy_state state, const char* fn) const noexcept {
    const detail::deferkv_header* h = nullptr;
    KVEVICT_RETURN_IF_ERROR(header(state, fn, &h));
    return check_decode_phase(*h, fn);
  }

 private:
  static constexpr std::int64_t max_window_weights = deferkv_max_window;

  static status check_memory(policy_state state, std::size_t need, const char* fn) noexcept {
    if (state.data == nullptr) return status::error(errc::null_pointer, fn, "state.data", "expected non-null");
    if (reinterpret_cast<std::uintptr_t>(state.data) % alignof(detail::deferkv_header) != 0)
      return status::error(errc::invalid_argument, fn, "state.data", "expected %zu-byte alignment",
                           alignof(detail::deferkv_header));
    if (state.size < need)
      return status::error(errc::invalid_shape, fn, "state.size", "expected at least %zu bytes (state_size), got %zu",
                           need, state.size);
    return status();
  }

  /// The header of an initialised state that is as large as it claims.
  static status header(policy_state state, const char* fn, detail::deferkv_header** out) noexcept {
    KVEVICT_RETURN_IF_ERROR(check_memory(state, sizeof(detail::deferkv_header), fn));
    auto* h = static_cast<detail::deferkv_header*>(state.data);
    if (h->magic != detail::deferkv_magic)
      return status::error(errc::invalid_state, fn, "state",
                           "not an initialised DeferKV state: call init_state() (or reserve()) first");
    if (state.size < state_size(h->heads_capacity, h->tokens_capacity))
      return status::error(errc::invalid_shape, fn, "state.size",
                           "expected at least %zu bytes for a %lld x %lld state, got %zu",
                           state_size(h->heads_capacity, h->tokens_capacity), static_cast<long long>(h->heads_capacity),
                           static_cast<long long>(h->tokens_capacity), state.size);
    // What the prefill wrote must still fit the memory: a state the engine overwrote is refused
    // before its sums are read or written.
    if (h->heads_capacity < 0 || h->tokens_capacity < 0 || h->heads < 0 || h->heads > h->heads_capacity ||
        h->group < 1 || h->prompt_tokens < 0 || h->prompt_tokens > h->tokens_capacity || h->steps < 0 ||
        h->phase < detail::deferkv_empty || h->phase > detail::deferkv_evicted)
      return status::error(errc::invalid_state, fn, "state",
                           "the state's header was overwritten (%lld heads of %lld, %lld prompt tokens of %lld, "
                           "phase %d)",
                           static_cast<long long>(h->heads), static_cast<long long>(h->heads_capacity),
                           static_cast<long long>(h->prompt_tokens), static_cast<long long>(h->tokens_capacity),
                           static_cast<int>(h->phase));
    *out = h;
    return status();
  }
  template <class H>
  static status header(policy_state state, const char* fn, const H** out) noexcept {
    detail::deferkv_header* h = nullptr;
    KVEVICT_RETURN_IF_ERROR(header(state, fn, &h));
    *out = h;
    return status();
  }

  status ready_header(policy_state state, const char* fn, detail::deferkv_header** out) const noexcept {
    KVEVICT_RETURN_IF_ERROR(header(state, fn, out));
    if ((*out)->phase != detail::deferkv_ready)
      return status::error(errc::invalid_state, fn, "state",
                           (*out)->phase == detail::deferkv_evicted
                               ? "this sequence was already evicted; call reset_state()"
                               : "not ready: observe prefill and %lld decode step(s) first",
                           static_cast<long long>(config_.delay));
    return status();
  }
  status ready_header(policy_state state, const char* fn, const detail::deferkv_header** out) const noexcept {
    detail::deferkv_header* h = nullptr;
    KVEVICT_RETURN_IF_ERROR(ready_header(state, fn, &h));
    *out = h;
    return status();
  }

  static const detail::deferkv_header* peek(policy_state state) noexcept {
    if (state.data == nullptr || state.size < sizeof(detail::deferkv_header)) return nullptr;
    const auto* h = static_cast<const detail::deferkv_header*>(state.data);
    return h->magic == detail::deferkv_magic ? h : nullptr;
  }
  static std::int32_t phase_of(policy_state state) noexcept {
    const detail::deferkv_header* h = peek(state);
    return h != nullptr ? h->phase : -1;
  }
  static float* sums(policy_state state) noexcept {
    return reinterpret_cast<float*>(static_cast<unsigned char*>(state.data) + detail::deferkv_sums_offset);
  }

  static std::int64_t candidates(const detail::deferkv_header& h, std::int64_t window) noexcept {
    const std::int64_t w = window < h.prompt_tokens ? window : h.prompt_tokens;
    return h.prompt_tokens - w;
  }
  std::size_t finalize_workspace_size(const detail::deferkv_header& h) const noexcept {
    detail::arena a;
    (void)a.take<float>(candidates(h, config_.window));
    return a.used();
  }

  /// Scores [heads, prompt + steps] from S / Z.
  status finalize(const detail::deferkv_header& h, const float* state_sums, score_view out, workspace_span ws,
                  const char* fn) const {
    const std::int64_t tokens = h.prompt_tokens + h.steps, cand = candidates(h, config_.window);
    KVEVICT_RETURN_IF_ERROR(detail::validate_matrix_view(out, h.heads, tokens, fn, "out"));
    detail::arena a(ws);
    float* row = a.take<float>(cand);
    if (a.overflowed())
      return status::error(errc::workspace_too_small, fn, "ws", "expected at least %zu bytes, got %zu", a.used(),
                           ws.size);
    detail::window_normaliser norm;
    norm.scale = static_cast<float>(1.0 / h.z);
    const scoring_params params = config_.params();
    for (std::int64_t head = 0; head < h.heads; ++head) {
      const float* s = state_sums + head * h.tokens_capacity;
      for (std::int64_t j = 0; j < cand; ++j) row[j] = s[j];
      detail::finalize_reduced_row(row, h.group, cand, tokens, params, norm, out.row(head));
    }
    return status();
  }

  status check_decode(const detail::deferkv_header& h, const layer_inputs<T, Q>& in, const char* fn) const noexcept {
    KVEVICT_RETURN_IF_ERROR(check_decode_phase(h, fn));
    if (in.keys.num_heads != h.heads || in.queries.num_heads != h.heads * h.group)
      return status::error(errc::invalid_shape, fn, "keys.num_heads",
                           "expected the prefill's %lld KV heads and %lld query heads, got %lld and %lld",
                           static_cast<long long>(h.heads), static_cast<long long>(h.heads * h.group),
                           static_cast<long long>(in.keys.num_heads), static_cast<long long>(in.queries.num_heads));
    if (in.queries.num_queries < 1)
      return status::error(errc::invalid_shape, fn, "queries.num_queries",
                           "expected the step's queries (>= 1 per head), got %lld",
                           static_cast<long long>(in.queries.num_queries));
    if (in.keys.num_tokens != h.prompt_tokens + h.steps + in.queries.num_queries)
      return status::error(errc::invalid_shape, fn, "keys.num_tokens",
                           "expected prompt + decoded tokens = %lld, got %lld (wrong layer or step?)",
                           static_cast<long long>(h.prompt_tokens + h.steps + in.queries.num_queries),
                           static_cast<long long>(in.keys.num_tokens));
    return status();
  }
  status check_decode_phase(const detail::deferkv_header& h, const char* fn) const noexcept {
    if (h.phase == detail::deferkv_empty)
      return status::error(errc::invalid_state, fn, "state", "no prefill observed yet; call observe_prefill first");
    if (!config_.decode_feedback)
      return status::error(errc::invalid_state, fn, "state", "decode feedback is off: evict after prefill");
    if (h.phase == detail::deferkv_ready || h.phase == detail::deferkv_evicted)
      return status::error(errc::invalid_state, fn, "state", "already ready after %lld decode steps; evict now",
                           static_cast<long long>(h.steps));
    return status();
  }

  /// Adds this observation batch into S (after discounting S unless first).
  status observe(const char* fn, detail::deferkv_header& h, float* state_sums, const layer_inputs<T, Q>& in,
                 std::int64_t prompt, std::int64_t state_tokens, const float* weights, bool first, workspace_span ws,
                 const executor& exec) const {
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
      if (in.keys.num_heads > h.heads_capacity || state_tokens > h.tokens_capacity)
        return status::error(errc::invalid_state, fn, "state",
                             "sized for %lld heads x %lld prompt tokens, got %lld x %lld; use a larger state",
                             static_cast<long long>(h.heads_capacity), static_cast<long long>(h.tokens_capacity),
                             static_cast<long long>(in.keys.num_heads), static_cast<long long>(state_tokens));
    } else if (in.keys.num_heads != h.heads || in.queries.num_heads != h.heads * h.group) {
      return status::error(errc::invalid_shape, fn, "keys.num_heads",
                           "expected the prefill's %lld KV heads and %lld query heads, got %lld and %lld",
                           static_cast<long long>(h.heads), static_cast<long long>(h.heads * h.group),
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
    p.key_scale = in.keys.scale;
    p.key_positions_sorted =
        p.key_positions == nullptr || detail::is_non_decreasing(p.key_positions, in.keys.num_tokens);
    p.weights = weights;
    const int workers = exec.workers();
    detail::arena a(ws);
    detail::observation_layout layout;
    detail::carve_observation_layout(a, p, false, workers, &layout);
    if (a.overflowed())
      return status::error(errc::workspace_too_small, fn, "ws",
                           "expected at least %zu bytes (deferkv::workspace_size), got %zu", a.used(), ws.size);

    if (first) {
      h.heads = in.keys.num_heads;
      h.group = in.queries.num_heads / in.keys.num_heads;
    }
    struct task_context {
      const layer_inputs<T, Q>* in;
      const detail::observation_problem* p;
      const detail::observation_layout* layout;
      float* sums;
      std::int64_t stride;
      float decay;
      bool first;
    } ctx{&in, &p, &layout, state_sums, h.tokens_capacity, static_cast<float>(config_.effective_eta()), first};
    exec.run(
        in.keys.num_heads,
        [](void* arg, std::int64_t head, int worker) {
          const auto& c = *static_cast<const task_context*>(arg);
          const detail::observation_scratch& s = c.layout->workers[worker];
          detail::observe_head(c.in->queries, c.in->keys, head, *c.p, s);
          float* tmp = c.layout->tmp[worker];
          const std::int64_t n = c.p->candidates;
          for (std::int64_t g = 0; g < c.p->group; ++g)
            detail::reduce_into(tmp, s.acc + g * n, n, gqa_reduction::sum, g == 0);
          float* state = c.sums + head * c.stride;
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
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_DEFERKV_HPP
