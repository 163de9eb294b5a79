// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_DEFERKV_STATE_HPP
#define KVEVICT_POLICIES_DEFERKV_STATE_HPP

// DeferKV with its state inside: for callers that do not manage a state block themselves
// (the compressor keeps one per sequence in caller memory; deferkv<T> works over any).

#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <new>
#include <vector>

#include "kvevict/config.hpp"
#include "kvevict/detail/abi_std.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policies/deferkv.hpp"

KVEVICT_NAMESPACE_BEGIN

namespace detail {
/// v = n bytes of zeros, or false (v unchanged) when the memory cannot be allocated: no
/// exception leaves a status-returning call, with or without exceptions enabled.
inline bool assign_zeros(std::vector<std::uint64_t, abi_allocator<std::uint64_t>>& v, std::size_t n) noexcept {
#if KVEVICT_HAS_EXCEPTIONS
  try {
    v.assign(n, 0);  // strong guarantee: v is unchanged if this throws
  } catch (const std::exception&) {
    return false;
  }
#else
  // Without exceptions a failed allocation inside std::vector aborts: ask first, nothrow.
  if (n > v.capacity()) {
    void* probe = ::operator new(n * sizeof(std::uint64_t), std::nothrow);
    if (probe == nullptr) return false;
    ::operator delete(probe);
  }
  v.assign(n, 0);
#endif
  return true;
}
}  // namespace detail

/// An owning DeferKV state for one layer (allocated by reserve()), for callers that do not
/// manage the memory themselves: the lifecycle of deferkv<T> with the state inside and the
/// layer it belongs to checked on every call. Engines use the compressor (one state block
/// per sequence for all layers) or deferkv<T> over their own memory instead.
template <class T, class Q = default_query_type_t<T>>
class deferkv_state {
 public:
  using storage_type = T;
  using query_type = Q;
  using config_type = deferkv_config;

  explicit deferkv_state(const deferkv_config& config = {}, std::int64_t layer = 0) : policy_(config), layer_(layer) {}

  const deferkv_config& config() const noexcept { return policy_.config(); }
  std::int64_t layer() const noexcept { return layer_; }
  const deferkv<T, Q>& policy() const noexcept { return policy_; }
  /// The state memory, as deferkv<T> takes it.
  policy_state memory() noexcept { return {words_.data(), words_.size() * sizeof(std::uint64_t)}; }

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
    const std::size_t bytes = deferkv<T, Q>::state_size(num_kv_heads, max_prompt_tokens);
    const std::size_t words = bytes / sizeof(std::uint64_t) + 1;
    if (bytes == std::numeric_limits<std::size_t>::max() || words > words_.max_size())
      return status::error(errc::overflow, fn, "max_prompt_tokens",
                           "a state of %lld x %lld floats does not fit in memory", static_cast<long long>(num_kv_heads),
                           static_cast<long long>(max_prompt_tokens));
    if (!detail::assign_zeros(words_, words))
      return status::error(errc::overflow, fn, "max_prompt_tokens", "could not allocate a state of %lld x %lld floats",
                           static_cast<long long>(num_kv_heads), static_cast<long long>(max_prompt_tokens));
    return policy_.init_state(memory(), num_kv_heads, max_prompt_tokens);
  }

  std::size_t workspace_size(const layer_shape& shape, const executor& exec = {}) const noexcept {
    return policy_.workspace_size(shape, exec);
  }

  status observe_prefill(std::int64_t layer, const layer_inputs<T, Q>& in, workspace_span ws,
                         const executor& exec = {}) {
    static constexpr const char* fn = "kvevict::deferkv_state::observe_prefill";
    KVEVICT_RETURN_IF_ERROR(policy_.check_config(fn));
    KVEVICT_RETURN_IF_ERROR(check_layer(fn, layer));
    return policy_.observe_prefill(with_state(in), ws, exec);
  }

  /// A decode step of in.queries.num_queries >= 1 tokens; `step`: the decoded tokens observed
  /// before it (steps are observed in order, none skipped).
  status observe_decode(std::int64_t layer, std::int64_t step, const layer_inputs<T, Q>& in, workspace_span ws,
                        const executor& exec = {}) {
    static constexpr const char* fn = "kvevict::deferkv_state::observe_decode";
    KVEVICT_RETURN_IF_ERROR(check_layer(fn, layer));
    const layer_inputs<T, Q> s = with_state(in);
    KVEVICT_RETURN_IF_ERROR(policy_.check_decode_phase(s.state, fn));
    if (step != steps_observed())
      return status::error(errc::invalid_state, fn, "step",
                           "expected decode step %lld (steps are observed in order, none skipped), got %lld",
                           static_cast<long long>(steps_observed()), static_cast<long long>(step));
    return policy_.observe_decode(s, ws, exec);
  }

  bool ready() const noexcept { return policy_.ready(view()); }
  std::int64_t steps_observed() const noexcept { return policy_.steps_observed(view()); }
  std::int64_t prompt_tokens() const noexcept { return policy_.prompt_tokens(view()); }
  std::int64_t num_tokens() const noexcept { return policy_.num_tokens(view()); }
  selection_params selection() const noexcept { return policy_.selection(view()); }

  /// Scores [Hkv, num_tokens()]: prompt candidates scored, window and decoded tokens +inf.
  status scores(score_view out, workspace_span ws) const {
    if (words_.empty())
      return status::error(errc::invalid_state, "kvevict::deferkv_state::scores", "state",
                           "not ready: call reserve() and observe first");
    layer_inputs<T, Q> in;
    in.state = view();
    return policy_.score(in, out, ws);
  }

  status mark_evicted() {
    if (!ready())
      return status::error(errc::invalid_state, "kvevict::deferkv_state::mark_evicted", "state",
                           "evict only when ready()");
    return policy_.mark_evicted(memory());
  }

  /// Forgets the sequence; the reserved state is kept.
  void reset() noexcept {
    if (!words_.empty()) (void)policy_.reset_state(memory());
  }

  float state_sum(std::int64_t h, std::int64_t j) const noexcept { return policy_.state_sum(view(), h, j); }
  double state_normaliser() const noexcept { return policy_.state_normaliser(view()); }

 private:
  policy_state view() const noexcept {
    return {const_cast<std::uint64_t*>(words_.data()), words_.size() * sizeof(std::uint64_t)};
  }
  layer_inputs<T, Q> with_state(const layer_inputs<T, Q>& in) noexcept {
    layer_inputs<T, Q> s = in;
    s.state = memory();
    return s;
  }
  status check_layer(const char* fn, std::int64_t layer) const noexcept {
    if (layer != layer_)
      return status::error(errc::invalid_state, fn, "layer", "this state belongs to layer %lld, got layer %lld",
                           static_cast<long long>(layer_), static_cast<long long>(layer));
    if (words_.empty())
      return status::error(errc::invalid_state, fn, "state", "reserved for 0 heads x 0 prompt tokens; call reserve()");
    return status();
  }

  deferkv<T, Q> policy_;
  std::int64_t layer_ = 0;
  std::vector<std::uint64_t, detail::abi_allocator<std::uint64_t>> words_;  // detail/abi_std.hpp says why
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_DEFERKV_STATE_HPP
