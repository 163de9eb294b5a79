// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DECODE_OBSERVATION_CUH
#define KVEVICT_CUDA_DECODE_OBSERVATION_CUH

// DeferKV's decode observation on the GPU: one query per query head (W = 1) folded into the
// running state of a layer,
//
//   state[h, j] <- eta * state[h, j] + reduce_g A[g, j]          for candidates j < C
//
// where A[g, .] is query head (h, g)'s softmax over its domain and reduce is the sum over
// the G heads (gqa_reduction::mean and ::sum; mean's 1/G is applied at finalisation) or
// their NaN-propagating max. eta == 0 overwrites the state (it may hold anything then).
// Scores come from the state with finalize_state_scores (scale 1/Z). This is the library's
// own definition of DeferKV's running state (design.md §5).
//
// One query per head makes this bandwidth-bound: the kernels stream K once, built to keep
// HBM busy (docs/cuda.md, "Decode observation").
//   1. logits: grid (key tiles of 256, Hkv). Half a warp per key, 4 keys in flight per
//      half-warp; a lane owns 8 channels per 128-channel panel (one 16-byte load of 16-bit
//      keys, two of float, one 8-byte load of fp8, or 8 scalar loads; tiling.hpp
//      vector_width) and keeps its slice of the group's scaled queries in registers. G is a
//      compile-time bucket (1, 2, 4, 8; chunks of 8 beyond): no FMA or shuffle is spent past
//      the bucket (G = 3, 5..7 and a last partial chunk pad it with zero queries); the 4 x GB
//      partial dots of a lane are
//      transpose-reduced (each step sends half of the remaining values), leaving each lane
//      with finished logits. With an engine LSE this kernel also applies the softmax and
//      updates the state: one pass. Without it, it writes the masked logits [Hq, L] (4 bytes
//      per query head and key, against 2*d bytes of K per KV head and key) and per-tile
//      softmax partials, folded once per block per query head.
//   2. row LSE (two-pass only, detail/row_lse.cuh): one warp per query head folds its tile
//      partials into its LSE (fixed order), once.
//   3. update (two-pass only): each block turns its keys' logits into probabilities with the
//      G LSEs of its KV head and updates the state.

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/detail/decode_kernels.cuh"
#include "kvevict/cuda/detail/row_lse.cuh"
#include "kvevict/cuda/detail/score_logic.hpp"
#include "kvevict/cuda/detail/tiling.hpp"
#include "kvevict/cuda/detail/workspace_plan.hpp"
#include "kvevict/cuda/finalize.cuh"
#include "kvevict/error.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/index_ptr.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/views/query_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {

/// Parameters of one decode observation step.
struct decode_params {
  float eta = 1.0f;  ///< decay of the state, in [0, 1]; 0 overwrites it
  gqa_reduction gqa = gqa_reduction::mean;
  softmax_domain domain = softmax_domain::visible;
  std::int64_t protected_tail = 0;  ///< P: the state covers candidates [0, L - P)
};

/// Optional device inputs of a decode step.
struct decode_inputs {
  index_ptr key_positions = nullptr;  ///< [L], or null: key j at position j
  /// [Hq] natural-log LSE of each query head's decode query (flash-decoding returns it);
  /// softmax_domain::visible only. Makes the step a single pass over K.
  const float* lse = nullptr;
  std::int64_t lse_head_stride = 0;  ///< elements between query heads; 0 means 1
};

/// Bytes of device workspace `decode_observation` needs (0 with an engine LSE): the masked
/// logits [Hq, L'], tile partials [Hq, ceil(L' / 256)] and LSEs [Hq], L' = L (visible
/// domain) or C.
inline std::size_t decode_observation_workspace_size(const layer_shape& shape, const decode_params& p,
                                                     bool engine_lse = false) noexcept {
  scoring_params sp;
  sp.domain = p.domain;
  sp.protected_tail = p.protected_tail;
  const detail::obs_dims d = detail::make_obs_dims(shape.num_kv_heads, shape.num_query_heads, 1, shape.num_tokens, sp);
  if (engine_lse) return 0;
  kvevict::detail::arena a;
  detail::decode_workspace w;
  detail::carve_decode_workspace(a, d, false, &w);
  return a.used();
}

namespace detail {

/// A validated decode step: kernel arguments, pass count and vector width.
template <class Q, class K>
struct decode_launch {
  decode_args<Q, K> args;
  bool one_pass = false;
  bool vectorised = false;
};

template <class Q, class K>
status launch_step(const decode_launch<Q, K>& l, cudaStream_t stream, const char* fn) {
  const unsigned hkv = static_cast<unsigned>(l.args.k.num_heads);
  // A lane owns 8 channels of a key per panel: one 16-byte load of 16-bit keys, two of float
  // keys, one 8-byte load of fp8 keys, or eight scalar loads when the rows do not allow vectors.
  constexpr int vec = 16 / sizeof(K) < 8 ? static_cast<int>(16 / sizeof(K)) : 8;
  if (l.vectorised) return launch_decode_group<Q, K, vec>(l.args, l.one_pass, hkv, stream, fn);
  return launch_decode_group<Q, K, 1>(l.args, l.one_pass, hkv, stream, fn);
}

/// Host validation of a decode step (or of a plan at its capacity) and its kernel arguments.
template <class Q, class K>
status decode_prepare(const query_view<const Q>& queries, const cache_view<const K>& keys, const decode_params& p,
                      score_view state, workspace_span ws, const decode_inputs& in, const launch_options& opt,
                      const char* fn, decode_launch<Q, K>* out) {
  KVEVICT_RETURN_IF_ERROR(validate_device_query_view(queries, opt, fn, "queries"));
  KVEVICT_RETURN_IF_ERROR(validate_device_cache_view(keys, opt, fn, "keys"));
  if (queries.num_queries != 1)
    return status::error(errc::invalid_shape, fn, "queries.num_queries", "expected 1 decode query per head, got %lld",
                         static_cast<long long>(queries.num_queries));
  if (queries.head_dim != keys.head_dim)
    return status::error(errc::invalid_shape, fn, "queries.head_dim", "expected keys.head_dim = %lld, got %lld",
                         static_cast<long long>(keys.head_dim), static_cast<long long>(queries.head_dim));
  if (queries.num_heads % keys.num_heads != 0)
    return status::error(errc::invalid_shape, fn, "queries.num_heads",
                         "expected a multiple of keys.num_heads = %lld (GQA), got %lld",
                         static_cast<long long>(keys.num_heads), static_cast<long long>(queries.num_heads));
  if (!(p.eta >= 0.0f && p.eta <= 1.0f))
    return status::error(errc::invalid_argument, fn, "p.eta", "expected eta in [0, 1], got %g",
                         static_cast<double>(p.eta));
  if (static_cast<unsigned>(p.gqa) > 2u)
    return status::error(errc::invalid_argument, fn, "p.gqa", "expected a gqa_reduction value, got %d",
                         static_cast<int>(p.gqa));
  if (static_cast<unsigned>(p.domain) > 1u)
    return status::error(errc::invalid_argument, fn, "p.domain", "expected a softmax_domain value, got %d",
                         static_cast<int>(p.domain));
  if (p.protected_tail < 0)
    return status::error(errc::invalid_argument, fn, "p.protected_tail", "expected >= 0, got %lld",
                         static_cast<long long>(p.protected_tail));
  scoring_params sp;
  sp.domain = p.domain;
  sp.protected_tail = p.protected_tail;
  const obs_dims dims = make_obs_dims(keys.num_heads, queries.num_heads, 1, keys.num_tokens, sp);
  KVEVICT_RETURN_IF_ERROR(kvevict::detail::validate_matrix_view(state, keys.num_heads, dims.candidates, fn, "state"));
  KVEVICT_RETURN_IF_ERROR(check_device_pointer(state.data, opt, fn, "state.data"));
  KVEVICT_RETURN_IF_ERROR(check_device_pointer(in.key_positions, opt, fn, "inputs.key_positions"));
  const std::int64_t lse_stride = in.lse_head_stride != 0 ? in.lse_head_stride : 1;
  if (in.lse != nullptr) {
    if (p.domain != softmax_domain::visible)
      return status::error(errc::unsupported, fn, "inputs.lse",
                           "an engine log-sum-exp covers every visible key; it cannot be used with "
                           "softmax_domain::candidates");
    if (lse_stride < 1)
      return status::error(errc::invalid_stride, fn, "inputs.lse_head_stride", "expected >= 1, got %lld",
                           static_cast<long long>(lse_stride));
    KVEVICT_RETURN_IF_ERROR(check_device_pointer(in.lse, opt, fn, "inputs.lse"));
  }
  if (!fits_int32(dims.tokens, 2 * decode_tile_keys) ||
      !fits_int32(kvevict::detail::saturating_mul(queries.num_heads, dims.softmax_end())))
    return status::error(errc::overflow, fn, "keys.num_tokens",
                         "expected L < 2^31 - 512 and Hq * L < 2^31 on the GPU, got L = %lld",
                         static_cast<long long>(dims.tokens));
  if (!grid_fits(1, keys.num_heads))
    return status::error(errc::overflow, fn, "keys.num_heads", "expected Hkv <= 65535 on the GPU, got %lld",
                         static_cast<long long>(keys.num_heads));
  if (keys.head_dim > 8192)
    return status::error(errc::unsupported, fn, "keys.head_dim", "expected head_dim <= 8192 on the GPU, got %lld",
                         static_cast<long long>(keys.head_dim));

  out->one_pass = in.lse != nullptr;
  kvevict::detail::arena arena(ws);
  decode_workspace w;
  carve_decode_workspace(arena, dims, out->one_pass, &w);
  if (!out->one_pass) KVEVICT_RETURN_IF_ERROR(check_workspace(arena, ws, opt, fn, "decode_observation_workspace_size"));

  decode_args<Q, K>& a = out->args;
  a.q = queries;
  a.k = keys;
  a.key_positions = in.key_positions;
  a.engine_lse = in.lse;
  a.engine_lse_stride = lse_stride;
  a.logits = w.logits;
  a.partials = w.partials;
  a.row_lse = w.row_lse;
  a.state = state.data;
  a.state_stride = state.row_stride;
  a.eta = p.eta;
  a.gqa = p.gqa;
  a.flags = opt.device_flags;
  a.scale = (1.0f / std::sqrt(static_cast<float>(keys.head_dim))) * keys.scale;  // as the CPU's logit_scale()
  a.group = static_cast<int>(dims.group);
  a.dim = static_cast<int>(keys.head_dim);
  a.tokens = static_cast<int>(dims.tokens);
  a.candidates = static_cast<int>(dims.candidates);
  a.softmax_end = static_cast<int>(dims.softmax_end());
  a.tiles = static_cast<int>(decode_tiles(dims));
  // A tail longer than the capacity protects everything; clamped so that it fits an int.
  a.protected_tail = static_cast<int>(p.protected_tail < dims.tokens ? p.protected_tail : dims.tokens);
  a.visible_domain = dims.visible_domain;
  // The kernel's loads: 16 bytes of 16-bit or float keys, 8 bytes (8 channels) of fp8 keys.
  const std::int64_t load = sizeof(K) == 1 ? 8 : 16;
  const std::int64_t vec =
      vector_width(reinterpret_cast<std::uintptr_t>(keys.data), static_cast<std::int64_t>(sizeof(K)), keys.head_dim,
                   keys.dim_stride, keys.head_stride, keys.token_stride, keys.is_paged() ? keys.block_stride : 0, load);
  out->vectorised = vec == load / static_cast<std::int64_t>(sizeof(K));
  return status();
}

}  // namespace detail

/// Folds one decode step's attention into a layer's DeferKV running state.
///
///   queries: [Hq, 1, d] post-RoPE decode queries (device; positions[0] is the step's position)
///   keys:    [Hkv, L, d] (device cache_view, any layout)
///   p:       eta in [0, 1], GQA reduction, softmax domain, protected tail P
///   state:   [Hkv, C] float32 device, C = max(0, L - P), updated in place
///   ws:      device memory, >= decode_observation_workspace_size(shape, p, in.lse != null)
///   in:      optional device key positions and engine LSE [Hq]
///
/// Enqueues one or three kernels on opt.stream; no synchronisation, no allocation. The
/// shapes and pointers are checked on every call: inside a captured CUDA graph, use
/// decode_plan instead.
template <class QT, class KT>
status decode_observation(query_view<QT> queries_in, cache_view<KT> keys_in, const decode_params& p, score_view state,
                          workspace_span ws, const decode_inputs& in = {}, const launch_options& opt = {}) {
  static constexpr const char* fn = "kvevict::cuda::decode_observation";
  using Q = std::remove_cv_t<QT>;
  using K = std::remove_cv_t<KT>;
  const query_view<const Q> queries = queries_in;
  const cache_view<const K> keys = keys_in;
  detail::decode_launch<Q, K> l;
  KVEVICT_RETURN_IF_ERROR(detail::decode_prepare(queries, keys, p, state, ws, in, opt, fn, &l));
  return detail::launch_step(l, opt.stream, fn);
}

/// A decode observation planned once and run every step without host checks, so that an
/// engine can capture the step in a CUDA graph (vLLM, SGLang and TensorRT-LLM capture decode)
/// and replay it while the cache grows.
///
/// `init` validates everything decode_observation would, at the plan's capacity: `keys`
/// describes the cache with num_tokens = the most tokens any step will see (its block table,
/// key positions, the state [Hkv, capacity - P] and the workspace sized for it). Per step the
/// engine writes, on the device, the current token count to `*num_tokens` (in [0, capacity];
/// outside it the step changes nothing and raises flag_length_out_of_range), the step's
/// position to queries.positions[0], the query, the engine LSE if any, and the new keys and
/// table entries; none of the pointers may change (a graph replays the same ones). `run`
/// enqueues the same kernels with the same launch shapes every time (sized for the capacity;
/// blocks past the current length return at once) and touches nothing on the host but the
/// launches. A step folds the keys [0, n) exactly as decode_observation over a view of n
/// tokens would, bit for bit.
///
/// `steps`, when given, is a device int32 incremented once per step whose token count was
/// valid: the engine (or a later kernel) knows how many decode observations the state holds
/// without host bookkeeping, e.g. for DeferKV's normaliser Z at finalisation.
template <class Q, class K>
class decode_plan {
 public:
  /// Validates and records the step (see the class comment). Nothing is launched. On an
  /// error the plan is left unusable (run refuses it).
  status init(query_view<const Q> queries, cache_view<const K> keys, const decode_params& p, score_view state,
              workspace_span ws, const std::int32_t* num_tokens, const decode_inputs& in = {},
              std::int32_t* steps = nullptr, const launch_options& opt = {}) {
    static constexpr const char* fn = "kvevict::cuda::decode_plan::init";
    ready_ = false;
    if (num_tokens == nullptr)
      return status::error(errc::null_pointer, fn, "num_tokens", "a plan reads the step's token count on the device");
    KVEVICT_RETURN_IF_ERROR(detail::check_device_pointer(num_tokens, opt, fn, "num_tokens"));
    KVEVICT_RETURN_IF_ERROR(detail::check_device_pointer(steps, opt, fn, "steps"));
    detail::decode_launch<Q, K> l;
    KVEVICT_RETURN_IF_ERROR(detail::decode_prepare(queries, keys, p, state, ws, in, opt, fn, &l));
    if (l.args.candidates == 0)
      return status::error(errc::invalid_shape, fn, "keys.num_tokens",
                           "the capacity (%lld tokens) leaves no candidate past the protected tail (%lld)",
                           static_cast<long long>(keys.num_tokens), static_cast<long long>(p.protected_tail));
    l.args.device_tokens = num_tokens;
    l.args.steps = steps;
    launch_ = l;
    ready_ = true;
    return status();
  }

  /// Enqueues one step on `stream` (capturable). Fails only for a plan that init did not
  /// accept, or when a launch fails.
  status run(cudaStream_t stream) const {
    static constexpr const char* fn = "kvevict::cuda::decode_plan::run";
    if (!ready_) return status::error(errc::invalid_argument, fn, "plan", "init has not succeeded on this plan");
    return detail::launch_step(launch_, stream, fn);
  }

  bool ready() const noexcept { return ready_; }

 private:
  detail::decode_launch<Q, K> launch_;
  bool ready_ = false;
};

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_DECODE_OBSERVATION_CUH
